"""Typed keys of what the server attaches to its application and to each request (a plain
string key makes aiohttp warn)."""

from __future__ import annotations

from aiohttp import web

# The largest request body the application takes, in bytes (--max-body-bytes).
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
# The tenant a request's API key names (auth_middleware; "default" without keys).
TENANT = web.RequestKey("tenant", str)
# The request's id: its client's X-Request-Id, else a new one (error_middleware); the answer's
# id is it with the endpoint's prefix (cmpl-, chatcmpl-).
REQUEST_ID = web.RequestKey("request_id", str)
