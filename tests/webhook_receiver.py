"""A real HTTP webhook receiver for tests: aiohttp on a free port, in a thread; it verifies
every delivery's signature with the openai client (400 when it fails), keeps every delivery,
and answers 500 to the first `failures` deliveries of each event."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
from aiohttp import web

from tests.server import free_port


class Receiver:
    def __init__(self, secret: str, failures: int = 0) -> None:
        self.secret = secret
        self.failures = failures
        self.client = openai.OpenAI(api_key="none", base_url="http://127.0.0.1:9")  # unwrap only
        # (type, batch id, status answered) of each delivery whose signature verified
        self.events: list[tuple[str, str, int]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.deliveries: list[tuple[bytes, dict[str, str], int]] = []  # payload, headers, status
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/hook", self._hook)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()

    async def _hook(self, request: web.Request) -> web.Response:
        payload = await request.read()
        headers = dict(request.headers)
        try:
            event = self.client.webhooks.unwrap(payload, headers, secret=self.secret)
        except openai.InvalidWebhookSignatureError:
            event = None
        with self.lock:
            seen = sum(1 for _, h, _ in self.deliveries
                       if h.get("webhook-id") == headers.get("webhook-id"))
            status = 400 if event is None else 500 if seen < self.failures else 200
            self.deliveries.append((payload, headers, status))
            if event is not None:
                self.events.append((event.type, event.data.id, status))  # type: ignore[union-attr]
        return web.Response(status=status)

    def wait_event(self, kind: str, batch_id: str, timeout: float = 60) -> None:
        """Block until the event was delivered (verified and answered 200)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if (kind, batch_id, 200) in self.events:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"no {kind} for {batch_id}: {self.events}")

    def of(self, event_id: str) -> list[tuple[bytes, dict[str, str], int]]:
        with self.lock:
            return [d for d in self.deliveries if d[1].get("webhook-id") == event_id]

    def wait_for(self, ok: int, timeout: float = 60) -> list[tuple[bytes, dict[str, str], int]]:
        """Block until `ok` deliveries were answered 200; all deliveries so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if sum(1 for d in self.deliveries if d[2] == 200) >= ok:
                    return list(self.deliveries)
            time.sleep(0.1)
        raise TimeoutError(f"{ok} successful deliveries did not arrive: {self.deliveries}")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
