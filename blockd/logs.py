"""Structured logging: key=value (default) or JSON lines, one setup for the daemon.

Never log token ids, salts, credentials or pool handles.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class _KvFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        msg = record.getMessage()
        out = f"ts={ts}Z level={record.levelname.lower()} logger={record.name} msg=\"{msg}\""
        if record.exc_info:
            out += "\n" + self.formatException(record.exc_info)
        return out


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(level: str = "INFO", fmt: str = "kv") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _KvFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
