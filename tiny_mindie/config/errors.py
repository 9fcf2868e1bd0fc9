"""The error of a bad configuration, raised by the settings table's checks and the loader."""

from __future__ import annotations


class ConfigError(Exception):
    """The configuration is invalid; the message is one line for the user. ``key``: the
    setting's full ``config.json`` key when the message is about one setting's value (what
    :func:`.settings.with_flags` names the flag or variable of), else ``None``."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key
