"""Running a stage's app under uvicorn, as `python -m stages NN serve` does: a shutdown with a
bound, and cross-origin access as an opt-in.

Shutdown. uvicorn on its own, after SIGTERM, waits for every open connection to finish: a
client that sent half a body keeps the process alive for as long as it stays connected, and a
second SIGTERM changes nothing (uvicorn forces an exit only on a second SIGINT). Here the first
SIGTERM or Ctrl-C starts the stage's drain (refuse new requests, give running ones the grace
period, end the rest with an error frame and [DONE]: `AsyncLLM.drain`), then uvicorn's own
shutdown gets `CONNECTION_GRACE_S` more for connections, after which their tasks are cancelled;
a second signal stops at once (connections are cut; the app's shutdown hooks, which stop the
engine and its processes, still run). So the process ends within the grace period plus a few seconds
(plus at most one engine step), whatever clients do.

CORS. Off by default: a browser page from another origin cannot call the server. Each
`--cors-origin` lets one origin in (`*` lets any in), for a browser chat client, say.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI

# After the drain, how long uvicorn waits for open connections before it cancels their tasks.
CONNECTION_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded shutdown (see the module docstring). Without a drain
    (stage 01's blocking server has none) the first signal starts uvicorn's shutdown at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[float], Any] | None,
        grace_seconds: float,
    ) -> None:
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = int(CONNECTION_GRACE_S)
        super().__init__(config)
        self.drain, self.grace_seconds = drain, grace_seconds
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining or self.should_exit:  # a second signal: stop now
            self.force_exit = self.should_exit = True
            return
        if self.drain is None:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        print(
            f"[stages] shutting down: {self.grace_seconds:.0f} s for requests in flight "
            "(signal again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        drain = self.drain

        def drain_then_exit() -> None:
            try:
                drain(self.grace_seconds)
            finally:  # even a failed drain must not keep the process up
                super(DrainingServer, self).handle_exit(sig, frame)

        threading.Thread(target=drain_then_exit, name="drain", daemon=True).start()

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown; after a second signal (`force_exit`) it skips the app's shutdown
        hooks, which stop the engine, and the interpreter's exit then cancels the waiting
        lifespan task with a logged traceback. Run them anyway: stopping the engine is quick
        (each wait on another process is bounded) and ends its processes cleanly."""
        await super().shutdown(sockets)
        done = getattr(self.lifespan, "shutdown_event", None)  # None: lifespan off
        if self.force_exit and done is not None and not done.is_set():
            await self.lifespan.shutdown()


def allow_cors(app: FastAPI, origins: Sequence[str]) -> None:
    """Let browser pages from `origins` call the API (nothing when empty: the default). Any
    method and header is allowed; credentials (cookies) are not, as the API does not use them."""
    if not origins:
        return
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"]
    )
