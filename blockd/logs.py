"""Structured logging for the daemon: logfmt (``kv``, the default) or JSON lines.

A call site keeps a short, constant message and passes the variable parts as fields::

    log.info("session attached", extra=logs.fields(tenant=t, worker=w, lease_ms=n))

Every record is exactly one line. ``kv`` is logfmt: ``ts=... level=info logger=blockd.sessions
msg="session attached" tenant=acme worker=w1 lease_ms=10000``; a value with a space, a quote,
``=``, a backslash or a control character is quoted with backslash escapes (``\\"``, ``\\\\``,
``\\n``, ``\\r``, ``\\t``, ``\\u00XX``), so no value (a worker's name, an exception's text) can
end the line or forge a pair. ``json`` puts ``ts`` (RFC 3339, UTC, milliseconds), ``level``,
``logger``, ``msg``, then every field, then ``exc`` (the traceback) as top-level keys.

Never log token ids, salts, credentials or pool handles: fields are for ids, counts, names and
reasons.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

#: The attribute of a LogRecord that carries the fields (one name: no clash with LogRecord's own).
_ATTR = "blockd_fields"
#: Keys every record has; a field with one of these names is written as ``<name>_``.
RESERVED = ("ts", "level", "logger", "msg", "exc")
#: What a value may hold unquoted: no space, quote, ``=``, backslash or control character.
_BARE = re.compile(r'[^\s"=\\\x00-\x1f\x7f-\x9f\u2028\u2029]+')
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: Escaped inside quotes: the quote, the backslash, and every character some reader takes for
#: a line break or a control (C0, DEL, C1, U+2028, U+2029; ``str.splitlines`` splits at many).
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f-\x9f\u2028\u2029]')
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def fields(**kw: Any) -> dict[str, Any]:
    """The ``extra=`` of a logging call: each keyword becomes one field of the record.

    Values are written as they are: numbers and booleans as such, anything else as
    ``str(value)``; a field whose value is ``None`` is left out.
    """
    return {_ATTR: {(f"{k}_" if k in RESERVED else k): v for k, v in kw.items()
                    if v is not None}}


def rfc3339(created: float) -> str:
    """``2026-01-31T12:00:00.123Z``: a record's time, UTC, milliseconds."""
    ms = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


def _record_fields(record: logging.LogRecord) -> dict[str, Any]:
    got = getattr(record, _ATTR, None)
    return got if isinstance(got, dict) else {}


def _items(record: logging.LogRecord, fmt: logging.Formatter) -> Iterator[tuple[str, Any]]:
    """A record as ordered (key, value) pairs: the fixed keys, the fields, the exception."""
    yield "ts", rfc3339(record.created)
    yield "level", record.levelname.lower()
    yield "logger", record.name
    yield "msg", record.getMessage()
    yield from _record_fields(record).items()
    if record.exc_info:
        yield "exc", fmt.formatException(record.exc_info)
    if record.stack_info:
        yield "stack", fmt.formatStack(record.stack_info)


def _escape(ch: re.Match[str]) -> str:
    c = ch.group()
    return _ESCAPES.get(c) or f"\\u{ord(c):04x}"


def logfmt_value(value: Any) -> str:
    """One logfmt value: bare when it can be, else quoted and escaped."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else str(value)
    if _BARE.fullmatch(text):
        return text
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'


def logfmt_key(key: str) -> str:
    """A key as logfmt allows it (letters, digits, ``_ . -``); anything else becomes ``_``."""
    return _KEY_BAD.sub("_", key) or "_"


class KvFormatter(logging.Formatter):
    """logfmt, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{logfmt_key(k)}={logfmt_value(v)}" for k, v in _items(record, self))


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; every field a top-level key."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {k: _json_value(v) for k, v in _items(record, self)}
        # ASCII only: no character some reader takes for a line break (U+2028...) gets out.
        return json.dumps(doc, allow_nan=False)


FORMATS = ("kv", "json")


def setup(level: str = "INFO", fmt: str = "kv") -> None:
    """Every logger (the daemon's, grpc's, asyncio's, ``warnings``) to stderr in ``fmt``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KvFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
