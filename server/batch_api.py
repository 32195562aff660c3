"""OpenAI's Files and Batches endpoints (purpose=batch), each tenant seeing only its own."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from aiohttp import BodyPartReader, web
from msgspec import Meta, Struct

from server.app import Frontend
from server.batch_runner import ENDPOINTS, BatchRunner
from server.batch_store import TERMINAL, BatchStore
from server.context_keys import TENANT
from server.errors import ApiError
from server.request_body import check_query
from server.webhooks import Webhooks
from surge.config import BatchConfig

_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smh])")
_SECONDS = {"s": 1, "m": 60, "h": 3600}
_CHUNK = 1 << 16


class ExpiresAfter(Struct, forbid_unknown_fields=True):
    """OpenAI's expiry of a file (files.create's expires_after, batches.create's
    output_expires_after for the files it writes), within its bounds of an hour to 30 days."""
    anchor: Literal["created_at"]
    seconds: Annotated[int, Meta(ge=3600, le=2592000)]


class BatchRequest(Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    output_expires_after: ExpiresAfter | None = None
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: Annotated[dict[Annotated[str, Meta(max_length=64)],
                             Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None


class BatchApi:
    def __init__(self, store: BatchStore, runner: BatchRunner, webhooks: Webhooks,
                 frontend: Frontend, cfg: BatchConfig) -> None:
        self.store = store
        self.runner = runner
        self.webhooks = webhooks
        self.frontend = frontend
        self.cfg = cfg

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{id}", self.get_file)
        app.router.add_delete("/v1/files/{id}", self.delete_file)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{id}", self.get_batch)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    # ---- files ----

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "upload the file as multipart/form-data with fields file and "
                                "purpose")
        file_id = "file-" + secrets.token_hex(12)
        path = self.store.path(file_id)
        purpose, filename, size = None, None, 0
        expiry: dict[str, object] = {}  # expires_after[anchor], expires_after[seconds]
        seen: set[str | None] = set()
        try:
            async for part in await request.multipart():
                if not isinstance(part, BodyPartReader):
                    raise ApiError(400, "nested multipart bodies are not accepted")
                if part.name in seen:
                    raise ApiError(400, f"the form has two {part.name!r} fields; send one of "
                                        "each an upload", param=part.name)
                seen.add(part.name)
                if part.name == "purpose":
                    purpose = (await part.read(decode=True)).decode(errors="replace")
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    if len(filename) > 255:
                        raise ApiError(400, f"the file's name is {len(filename)} characters; "
                                            "at most 255", param="file")
                    size = await self._save(part, path)
                elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):
                    value = (await part.read(decode=True)).decode(errors="replace")
                    field = part.name[len("expires_after["):-1]
                    expiry[field] = int(value) if field == "seconds" and \
                        value.lstrip("-").isdigit() else value
                else:
                    raise ApiError(400, f"unknown form field {part.name!r}; send file and "
                                        "purpose", param=part.name)
            if purpose != "batch":
                got = "none was given" if purpose is None else f"got {purpose!r}"
                raise ApiError(400, f"purpose must be 'batch' ({got}); surge keeps files for "
                                    "the Batch API only", param="purpose")
            if filename is None:
                raise ApiError(400, "no file in the upload (form field 'file')", param="file")
            expires = _expiry(expiry) if expiry else None
            await asyncio.to_thread(_check_jsonl, path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return _json(self.store.add_file(request[TENANT], file_id, purpose, filename, size,
                                         None if expires is None else expires.seconds))

    async def _save(self, part: BodyPartReader, path: Path) -> int:
        limit = self.cfg.batch_max_file_bytes
        size = 0
        with open(path, "wb") as f:
            while chunk := await part.read_chunk(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise ApiError(400, f"the file is larger than the limit of {limit} bytes "
                                        "(batch_max_file_bytes)", param="file",
                                   code="file_too_large")
                f.write(chunk)
        return size

    def _file(self, request: web.Request) -> dict:
        found = self.store.file(request[TENANT], request.match_info["id"])
        if found is None:
            raise ApiError(404, f"no file {request.match_info['id']!r}", param="file_id")
        return found

    async def list_files(self, request: web.Request) -> web.Response:
        check_query(request, {"purpose", "limit", "after", "order"})
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be asc or desc (by creation)", param="order")
        tenant = request[TENANT]
        after, limit = _page(request, 10000, 10000, lambda i: self.store.file(tenant, i))
        return _list(*self.store.files(tenant, request.query.get("purpose"), after, limit,
                                       order == "asc"))

    async def get_file(self, request: web.Request) -> web.Response:
        return _json(self._file(request))

    async def delete_file(self, request: web.Request) -> web.Response:
        file = self._file(request)
        self.store.delete_file(file["id"])
        return _json({"id": file["id"], "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.StreamResponse:
        file = self._file(request)
        return web.FileResponse(self.store.path(file["id"]),
                                headers={"Content-Type": "application/octet-stream"})

    # ---- batches ----

    async def create(self, request: web.Request) -> web.Response:
        body = await self.frontend.body_of(request, BatchRequest)
        tenant = request[TENANT]
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}",
                           param="endpoint")
        window = _WINDOW.fullmatch(body.completion_window)
        if window is None:
            raise ApiError(400, "completion_window must be a duration such as 24h (also "
                                "accepted: minutes as 30m, seconds as 90s)",
                           param="completion_window")
        file = self.store.file(tenant, body.input_file_id)
        if file is None:
            raise ApiError(404, f"no file {body.input_file_id!r}", param="input_file_id")
        if file["purpose"] != "batch":
            raise ApiError(400, f"file {body.input_file_id!r} has purpose {file['purpose']!r}, "
                                "not 'batch'", param="input_file_id")
        self.webhooks.check_metadata(tenant, body.metadata)
        now = int(time.time())
        batch = {"id": "batch_" + secrets.token_hex(12), "object": "batch",
                 "endpoint": body.endpoint, "errors": None,
                 "input_file_id": body.input_file_id,
                 "completion_window": body.completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": None,
                 "expires_at": now + int(window[1]) * _SECONDS[window[2]],
                 "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": body.metadata, "model": self.frontend.translator.model_name,
                 "usage": None}
        expires = body.output_expires_after
        self.store.add_batch(tenant, batch, None if expires is None else expires.seconds)
        self.runner.wake.set()
        return _json(batch)

    def _batch(self, request: web.Request) -> dict:
        found = self.store.batch(request[TENANT], request.match_info["id"])
        if found is None:
            raise ApiError(404, f"no batch {request.match_info['id']!r}", param="batch_id")
        return found

    async def get_batch(self, request: web.Request) -> web.Response:
        return _json(self._batch(request))

    async def list_batches(self, request: web.Request) -> web.Response:
        check_query(request, {"limit", "after"})
        tenant = request[TENANT]
        after, limit = _page(request, 20, 100, lambda i: self.store.batch(tenant, i))
        return _list(*self.store.batches(tenant, after, limit))

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self._batch(request)
        if batch["status"] in TERMINAL:
            raise ApiError(409, f"batch {batch['id']} has already ended ({batch['status']})",
                           param="batch_id")
        # Once finalizing, the answers are all in: the batch completes.
        cancelled = self.store.update(batch["id"], ("validating", "in_progress"),
                                      status="cancelling", cancelling_at=int(time.time()))
        self.runner.wake.set()
        return _json(cancelled or batch)


def _expiry(fields: dict[str, object]) -> ExpiresAfter:
    """An upload form's expires_after[...] fields, checked as batches' JSON field is."""
    try:
        return msgspec.convert(fields, ExpiresAfter)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"expires_after: {e} (anchor must be created_at, seconds a whole "
                            "number from 3600 to 2592000)", param="expires_after") from None


def add_off_routes(app: web.Application, why: str) -> None:
    """Without its state directory the Batch API answers every call with why."""
    async def off(request: web.Request) -> web.Response:
        raise ApiError(503, f"the Batch API is off on this server: {why}")

    for path in ("/v1/files", "/v1/batches"):
        app.router.add_route("*", path, off)
        app.router.add_route("*", path + "/{tail:.*}", off)


def _check_jsonl(path: Path) -> None:
    """Refuse an upload that is not JSON lines at all: not UTF-8 text, or no line a JSON
    object. Single bad lines pass: they go to the batch's error file."""
    found = False
    with open(path, "rb") as f:
        for raw in f:
            try:
                text = raw.decode("utf-8-sig")  # an editor's byte order mark is no content
            except UnicodeDecodeError:
                raise ApiError(400, "the file is not UTF-8 text; a batch file is JSON lines",
                               param="file") from None
            if not found and text.strip():
                try:
                    found = isinstance(json.loads(text), dict)
                except ValueError:
                    continue
    if not found:
        raise ApiError(400, "the file holds no JSON object lines; a batch file is JSONL, one "
                            "request per line", param="file")


def _page(request: web.Request, default: int, most: int,
          find: Callable[[str], dict | None]) -> tuple[str | None, int]:
    """A list's cursor (an id `find` knows: an unknown one would silently start over) and
    page size from the query."""
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}", param="limit")
    after = request.query.get("after")
    if after is not None and find(after) is None:
        raise ApiError(400, f"after: no {after!r} to list after (it is an id from this list)",
                       param="after")
    return after, int(raw)


def _list(data: list[dict], more: bool) -> web.Response:
    return _json({"object": "list", "data": data, "has_more": more,
                  "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None})


def _json(payload: dict) -> web.Response:
    return web.json_response(payload)
