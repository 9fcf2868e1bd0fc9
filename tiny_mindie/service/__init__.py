"""The running server process: the app that wires the API families, engine and listeners
(:mod:`.app`), the serve loop from start to stop (:mod:`.lifecycle`), the stop control
(:mod:`.shutdown`) and logging (:mod:`.logs`)."""
