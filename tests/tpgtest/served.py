"""An engine served as tpgraph.serve serves it, in one process: its service's loop on a thread, the bridge's pipe to
the front end's EngineClient, and the app, whose requests run on an event loop of their own (the client reads the
pipe for that one loop, as uvicorn's)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

from tpgraph import TPEngine
from tpgraph.engine.control import ControlPlane
from tpgraph.engine.service import EngineService
from tpgraph.server.app import create_app
from tpgraph.server.bridge import EngineBridge, EngineClient
from tpgraph.server.metrics import ServerMetrics
from tpgtest.server_stubs import httpx_module


class Served:
    def __init__(self, engine: TPEngine) -> None:
        self.engine = engine
        self.service = EngineService(engine.core, ControlPlane(engine.state))
        engine_end, frontend_end = mp.Pipe(duplex=True)
        self.bridge = EngineBridge(self.service, [engine_end], lambda: b"", on_closed=lambda: None)
        self.client = EngineClient(frontend_end, engine.core.limits)
        self.metrics = ServerMetrics()
        self.app = create_app(self.client, engine.prompts, self.metrics, "m", engine.runner.max_model_len)
        self.service.start()
        self.bridge.start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def attach() -> None:  # (the app's lifespan does this; the ASGI transport runs none)
            self.client.attach(asyncio.get_running_loop())

        self.call(attach())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def post(self, path: str, body: dict):
        httpx = httpx_module()

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t",
                                         timeout=300) as http:
                return await http.post(path, json=body)

        return self.call(go())

    def close(self) -> None:
        self.service.shutdown()
        self.bridge.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.engine.close()
