"""API keys: with --api-key or a keys file, every /v1/ request must carry a valid key, which
names its tenant; without either, every request belongs to the default tenant. /metrics and
/stats, which name tenants, take the metrics key or a key of the admin tenant (see
_check_operator)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from server.context_keys import TENANT
from server.errors import ApiError
from surge.config import ServerConfig
from surge.keys import Keys

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

_OPERATOR_PATHS = ("/metrics", "/stats")


def _bearer(request: web.Request) -> str:
    """The request's Bearer token (401 if it has none)."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "no API key: send one as the header 'Authorization: Bearer "
                            "KEY' (an operator creates keys with `surge admin keys add`)",
                       code="missing_api_key")
    return key


def _tenant(keys: Keys, key: str) -> str:
    tenant = keys.tenant_for(key)
    if tenant is None:
        raise ApiError(401, "the API key is not valid on this server (it may have been "
                            "removed); ask the operator for one", code="invalid_api_key")
    return tenant


def _check_operator(request: web.Request, keys: Keys | None, cfg: ServerConfig) -> None:
    """For /metrics and /stats: with metrics_auth=keys and a keys file or a metrics key, only
    the metrics key or a key of the admin tenant passes."""
    metrics_key = (cfg.metrics_key or "").encode()
    if cfg.metrics_auth == "public" or (keys is None and not metrics_key):
        return
    key = _bearer(request)
    if metrics_key and hmac.compare_digest(key.encode(errors="surrogatepass"), metrics_key):
        return
    if keys is None:
        raise ApiError(401, "this is not the metrics key (metrics_key)", code="invalid_api_key")
    if _tenant(keys, key) != cfg.admin_tenant:  # never "": tenant names are not empty
        raise ApiError(403, f"{request.path} is only for the metrics key (metrics_key) or a key "
                            f"of the admin tenant (admin_tenant)", code="not_admin_tenant")


def auth_middleware(keys: Keys | None, cfg: ServerConfig) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[TENANT] = "default"
        # By the route matched, not the path as written, so no spelling of it slips past.
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in _OPERATOR_PATHS:
            _check_operator(request, keys, cfg)
        elif keys is not None and request.path.startswith("/v1/"):
            request[TENANT] = _tenant(keys, _bearer(request))
        return await handler(request)

    return middleware
