"""A batch's input file read into lines, and the output and error lines OpenAI's format has."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# What a line may hold besides its body (OpenAI's input format).
_LINE_KEYS = {"custom_id", "method", "url", "body"}


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class FileError(ValueError):
    """The input file as a whole cannot run (the batch fails): OpenAI's errors.data entry."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 line: int | None = None) -> None:
        super().__init__(message)
        self.code, self.param, self.line = code, param, line


def request_id(batch_id: str, line: int) -> str:
    """A line's output id: the same across restarts."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


def parse_line(text: str, endpoint: str) -> tuple[str | None, str]:
    """A line's custom_id and body (JSON text); LineError (with its custom_id as a note) when
    the line is not a request this batch can run."""
    try:
        line = json.loads(text)
    except ValueError as e:
        raise LineError("invalid_json", f"the line is not valid JSON: {e}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_json", "the line is not a JSON object")
    custom_id = line.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        raise LineError("invalid_custom_id", f"custom_id must be a string, not "
                                             f"{json.dumps(custom_id)}")
    if not custom_id:
        raise LineError("missing_custom_id", "custom_id must be a non-empty string")
    try:
        if unknown := sorted(set(line) - _LINE_KEYS):
            raise LineError("invalid_request", f"unknown field(s) {', '.join(unknown)}; a line "
                                               f"has custom_id, method, url and body")
        if line.get("method") != "POST":
            raise LineError("invalid_method", "method must be POST")
        if line.get("url") != endpoint:
            raise LineError("invalid_url", f"url {line.get('url')!r} is not this batch's "
                                           f"endpoint {endpoint!r}")
        if not isinstance(line.get("body"), dict):
            raise LineError("invalid_body", "body must be a JSON object")
    except LineError as e:
        e.add_note(custom_id)
        raise
    return custom_id, json.dumps(line["body"])


def read_lines(path: Path, batch_id: str, endpoint: str, limit: int
               ) -> list[tuple[int, str | None, str, str | None, str | None]]:
    """Rows for BatchStore.add_lines: a good line pending with its body, a bad one failed with
    its error line. FileError when the file has more than `limit` lines, or a custom_id twice
    (as OpenAI refuses it: an answer must name its request)."""
    rows: list[tuple[int, str | None, str, str | None, str | None]] = []
    seen: dict[str, int] = {}  # custom_id -> its line
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # -sig: a leading BOM
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            if len(rows) == limit:
                raise FileError("too_many_lines", f"the input file has more than {limit} lines "
                                f"(batch_max_lines)", line=number)
            try:
                custom_id, body = parse_line(text, endpoint)
                row = (number, custom_id, "pending", body, None)
            except LineError as e:
                custom_id = getattr(e, "__notes__", [None])[0]
                error = {"code": e.code, "message": str(e), "line": number}
                row = (number, custom_id, "failed", None,
                       json.dumps(output_line(batch_id, number, custom_id, None, error)))
            if custom_id is not None and custom_id in seen:
                raise FileError("duplicate_custom_id", f"custom_id {custom_id!r} of line "
                                f"{number} is used by line {seen[custom_id]} too; each line "
                                "needs its own", param="custom_id", line=number)
            if custom_id is not None:
                seen[custom_id] = number
            rows.append(row)
    return rows


def output_line(batch_id: str, line: int, custom_id: str | None, response: dict | None,
                error: dict | None) -> dict:
    return {"id": request_id(batch_id, line), "custom_id": custom_id, "response": response,
            "error": error}
