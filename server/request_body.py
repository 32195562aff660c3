"""What a request may carry beside its JSON body: the checks made before a body is read (its
query, Content-Type, Content-Encoding and declared length), then the read within its time."""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from server.context_keys import MAX_BODY_BYTES
from server.errors import ENCODINGS, ApiError, unsupported_encoding

_JSON = re.compile(r"application/(?:[\w.+-]+\+)?json")  # application/json, .../x+json


def check_query(request: web.Request, known: set[str]) -> None:
    """Refuse query parameters the endpoint does not take (it would ignore them)."""
    if unknown := sorted(set(request.query) - known):
        takes = (f"this list takes {', '.join(sorted(known))}" if known
                 else "this endpoint takes its parameters in the JSON body")
        raise ApiError(400, f"unknown query parameter(s) {', '.join(unknown)}; {takes}",
                       param=unknown[0])


async def read_json(request: web.Request, timeout_s: float) -> bytes:
    """A JSON endpoint's body, refused before it is read where the request says what surge
    would misread or ignore."""
    check_query(request, set())
    # Only JSON (or no Content-Type): a browser sends text/plain and form bodies to another
    # site without asking it first, which would let any web page run requests here.
    if "Content-Type" in request.headers and not _JSON.fullmatch(request.content_type):
        raise ApiError(415, f"Content-Type must be application/json, not "
                            f"{request.content_type!r}")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ENCODINGS:  # aiohttp passes an unknown one's bytes on undecoded
        raise ApiError(415, unsupported_encoding(encoding))
    # A declared length over the limit is refused at once, not after the body's timeout.
    limit = request.app[MAX_BODY_BYTES]
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s") from None
