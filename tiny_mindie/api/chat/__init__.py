"""What every chat route shares: the chat template (:mod:`.template`), tools and their calls in
a model's answer (:mod:`.tool_request`, :mod:`.tool_calls`) and constrained output
(:mod:`.structured`, and other servers' constraint fields in :mod:`.guided`)."""
