"""The OpenAI family: its routes (:mod:`.routes`), the chat completions request (:mod:`.request`,
:mod:`.fields`), its preparation (:mod:`.chat`), answers and streams (:mod:`.answer`,
:mod:`.stream`), the Responses API (:mod:`.responses`) and the chat pipeline driven by another
family's request (:mod:`.bridge`)."""
