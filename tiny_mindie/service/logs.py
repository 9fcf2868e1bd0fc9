"""The server's log: ``--log-format text`` (one human line per record) or ``json``
(one JSON object per line), and ``--log-requests`` (request bodies and generated text in the
access records; off by default: prompts and outputs may hold personal data).

A JSON record holds ``timestamp`` (ISO 8601, UTC, milliseconds), ``level`` (``INFO``, ...),
``logger``, ``message``, then the record's structured fields (a dict passed as
``extra={"fields": {...}}``, as the access log ``tiny_mindie.access`` does), and
``exception`` (the traceback text) when there is one. A text line is the message, followed,
for the fields the message does not show (:data:`TEXT_FIELDS`: ``--log-requests``' request body
and output), by `` name=<the value as JSON>`` -- one line still, whatever the text holds.
Records go to standard error; in JSON mode the start-up banner and progress lines (:func:`say`)
become records too, so that every line the process writes is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Structured fields a text line adds after its message, when a record has them.
TEXT_FIELDS = ("request_body", "output")
#: What JSON leaves unescaped but a reader may take for a line break.
_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})

_json_handler: logging.Handler | None = None    # set by setup() in JSON mode


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-requests`` on ``parser`` (``serve``'s)."""
    parser.add_argument("--log-format", choices=FORMATS, default="text",
                        help="text: one line per record; json: one JSON object per line "
                             "(timestamp, level, logger, message and the record's fields)")
    parser.add_argument("--log-requests", action="store_true",
                        help="debugging: also log each request's body and the generated text "
                             "in its access record, in either format (they may hold personal "
                             "data)")


class JSONFormatter(logging.Formatter):
    """One JSON object per record (see the module doc); never raises on odd field values
    (they are written with ``str``)."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {"timestamp": datetime.fromtimestamp(record.created, UTC)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            obj.update((k, v) for k, v in fields.items() if k not in obj)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exception"] = record.exc_text
        return json.dumps(obj, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, then each of the record's fields named in :data:`TEXT_FIELDS` as
    `` name=<JSON>`` (escaped: the record stays one line)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if not isinstance(fields, dict):
            return line
        extra = "".join(f" {name}={json.dumps(fields[name], ensure_ascii=False, default=str)}"
                        for name in TEXT_FIELDS if name in fields)
        return line + extra.translate(_BREAKS)


def setup(level: str, fmt: str = "text") -> None:
    """Configure the root logger: ``level`` (``info``, ...) and ``fmt`` (:data:`FORMATS`), to
    standard error.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    global _json_handler
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    _json_handler = handler if fmt == "json" else None


def fail(msg: str) -> None:
    """The one line a command ends with on an error: ``tiny_mindie: error: <msg>`` on stderr;
    in JSON mode an ERROR record of the logger ``tiny_mindie`` instead (every line the process
    writes stays JSON)."""
    if _json_handler is not None:
        _json_handler.handle(logging.getLogger("tiny_mindie").makeRecord(
            "tiny_mindie", logging.ERROR, __file__, 0, msg, (), None))
    else:
        print(f"tiny_mindie: error: {msg}", file=sys.stderr)


def say(msg: str) -> None:
    """A line for the person starting the server (banner, progress): printed to standard
    output; in JSON mode an INFO record of the logger ``tiny_mindie`` instead, written
    whatever the log level (as the printed line would be)."""
    if _json_handler is not None:
        _json_handler.handle(logging.getLogger("tiny_mindie").makeRecord(
            "tiny_mindie", logging.INFO, __file__, 0, msg, (), None))
    else:
        print(msg, flush=True)
