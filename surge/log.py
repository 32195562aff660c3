"""Logging set-up shared by every process: plain or JSON lines, with the request id when known."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "process": record.processName,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        stamp = f"{stamp}.{int(record.msecs):03d}"
        line = f"{stamp} {record.levelname[0]} [{record.processName}] {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str, as_json: bool, process_name: str) -> None:
    import multiprocessing

    multiprocessing.current_process().name = process_name
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is replaced by our own per-request line.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _json_mode() -> bool:
    return any(isinstance(h.formatter, _JsonFormatter) for h in logging.getLogger().handlers)


def show_progress() -> bool:
    """Progress bars are for a person at a terminal, never among JSON lines."""
    return sys.stderr.isatty() and not _json_mode()


def announce(message: str, **fields: Any) -> None:
    """A line the operator sees whatever the log level (the ready line): as it is, or as a
    JSON record when logs are JSON."""
    if _json_mode():
        message = _JsonFormatter().format(logging.makeLogRecord(
            {"name": "surge", "levelname": "INFO", "levelno": logging.INFO, "msg": message,
             **fields}))
    print(message, file=sys.stderr, flush=True)
