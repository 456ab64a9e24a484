"""A real ``kvstream index`` web application (:func:`stream_apps.index.server.build_web_app`) served in a thread of
the test process, with no broker: an in-memory index, and writes recorded instead of produced to Kafka. Tests
talk to it over real HTTP (HTTPS), from this process or from a second one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

from aiohttp import web

from kvstream.broker import free_port
from stream_apps.index.api import IndexAPI
from stream_apps.index.fleet_index import FleetIndex
from stream_apps.index.server import IndexMetrics, build_web_app


class _Feed:
    """The little of a changelog feed the web application asks: always caught up."""

    topic = "test-residency-changelog"
    records = undecodable = 0
    caught_up = True

    def not_ready(self) -> list[str]:
        return []

    def lag(self) -> int:
        return 0


class _Registrations:
    """A registration writer that records instead of producing to ``kv-instances``."""

    def __init__(self, writes: list) -> None:
        self.writes = writes

    def write(self, info) -> None:
        self.writes.append(("register", info.instance_id))

    def remove(self, instance: str) -> None:
        self.writes.append(("remove", instance))


@dataclass
class Served:
    """A served application: its base URL, the index, the writes it made (what would have gone to Kafka)."""

    url: str
    index: FleetIndex
    api: IndexAPI
    writes: list = field(default_factory=list)


@contextlib.contextmanager
def serve_index(policy=None, ssl_context=None, host: str = "0.0.0.0"):
    """Serve the index's web application on ``host`` and a free port until the block ends; yields :class:`Served`
    (its URL names 127.0.0.1, or localhost with TLS, whose test certificate names both)."""
    index = FleetIndex()
    writes: list = []
    api = IndexAPI(index, _Feed().not_ready, registrations=_Registrations(writes),
                   on_unregister=lambda instance, rank, reason: writes.append(("unregister", instance, rank)))
    app = build_web_app(api, _Feed(), IndexMetrics(index, _Feed()), policy)
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    if not started.wait(30):
        raise TimeoutError("the test index did not start")
    scheme = "https" if ssl_context is not None else "http"
    try:
        yield Served(f"{scheme}://{'localhost' if ssl_context else '127.0.0.1'}:{port}", index, api, writes)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
