"""Run a stage's server for a client on the same machine: in a subprocess or in a thread.

- `ServerProcess`: the server in its own process, for benchmarks that measure what clients see
  (the client then does not compete with the server for the GIL, as in a real deployment).
- `ThreadedServer`: uvicorn on a background thread of this process, for tests and notebooks
  that want to hold the engine object while they drive it over HTTP.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from stages.common.tooling.latency import peak_memory

REPO_ROOT = Path(__file__).resolve().parents[3]


SERVING_LINE = re.compile(r"\[stages\] serving .* on http://(\S+):(\d+) ")  # cli.serving_message


class ServerProcess:
    """`with ServerProcess("02", model=...) as server:` -> server.url is ready to use.

    The server binds port 0, so the OS picks a free port as it binds it (a port probed free
    here and bound by the server later could be taken in between); the port is read from the
    server's "serving on" line. A thread keeps reading the server's stderr, so that a chatty
    server never blocks on a full pipe; `log` holds its last lines."""

    def __init__(
        self,
        stage: str,
        *,
        model: str | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 300.0,
    ) -> None:
        self.port = 0  # known once the server says where it listens
        self.url = ""
        self.command = [
            sys.executable,
            "-m",
            "stages",
            stage,
            "serve",
            "--port",
            "0",
            "--log-level",
            "warning",
            *extra_args,
        ]
        if model is not None:
            self.command += ["--model", model]
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.log: deque[str] = deque(maxlen=200)
        self._stderr_closed = threading.Event()

    def __enter__(self) -> ServerProcess:
        self.process = subprocess.Popen(
            self.command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        threading.Thread(target=self._read_stderr, name="server-stderr", daemon=True).start()
        try:
            self._wait_until_ready()
        except BaseException:  # our timeout, Ctrl-C, a test's timeout: no server left behind
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._stderr_closed.wait(timeout=1.0)  # let the reader take the last lines
                raise RuntimeError(f"server exited during start-up: {self._tail()}")
            try:
                if self.url and httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"server did not answer /health within {self.startup_timeout} s: {self._tail()}"
        )

    def _read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            found = SERVING_LINE.search(line)
            if found and not self.url:
                self.port = int(found.group(2))
                self.url = f"http://127.0.0.1:{self.port}"
        self._stderr_closed.set()  # the pipe closed: the process ended

    def _tail(self) -> str:
        return "\n".join(self.log)[-2000:]

    def peak_memory(self) -> dict[str, float | None]:
        """The server process's peak resident memory so far (Linux), in GiB."""
        return peak_memory(self.process.pid) if self.process is not None else {}

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate a server process, and kill it if it has not left within 15 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


class ThreadedServer:
    """`with ThreadedServer(app) as server:` -> a uvicorn server on 127.0.0.1:server.port."""

    def __init__(self, app: Any, startup_timeout: float = 30.0) -> None:
        import uvicorn

        self.port = 0  # the OS picks a free one as uvicorn binds it; read back in `start`
        self.url = ""
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.startup_timeout = startup_timeout

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ThreadedServer:
        """Start serving and wait until uvicorn accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start: its thread ended (see its log)")
            if time.monotonic() > deadline:
                frame = sys._current_frames().get(self.thread.ident or -1)
                where = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
                raise RuntimeError(
                    f"the server did not start within {self.startup_timeout:.0f} s; "
                    f"its thread is at:\n{where}"
                )
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        """Stop serving; the app's shutdown handlers stop its engine thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
