"""API keys: with --api-key or a keys file, every /v1/ request must carry a valid key, which
names its tenant; without either, every request belongs to the default tenant."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from server.errors import ApiError
from surge.keys import Keys

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(keys: Keys | None) -> Callable[[web.Request, Handler],
                                                       Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request["tenant"] = "default"
        if keys is None or not request.path.startswith("/v1/"):
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "no API key: send one as the header 'Authorization: Bearer "
                                "KEY' (an operator creates keys with `surge admin keys add`)",
                           code="missing_api_key")
        tenant = keys.tenant_for(key)
        if tenant is None:
            raise ApiError(401, "the API key is not valid on this server (it may have been "
                                "removed); ask the operator for one", code="invalid_api_key")
        request["tenant"] = tenant
        return await handler(request)

    return middleware
