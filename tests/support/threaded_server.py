"""Run an ASGI app with uvicorn in a background thread (the benchmark and tests use it)."""

from __future__ import annotations

import threading
import time

import uvicorn


class ThreadedServer:
    def __init__(self, app, port: int, host: str = "127.0.0.1") -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
