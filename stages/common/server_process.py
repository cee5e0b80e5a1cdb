"""Run a stage's server as a real subprocess, for benchmarks that measure what clients see.

A server in its own process keeps the benchmark client from competing with it for the GIL, as a
real deployment would.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`with ServerProcess("02", model=...) as server:` -> server.url is ready to use."""

    def __init__(
        self,
        stage: str,
        *,
        model: str | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "stages",
            stage,
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *extra_args,
        ]
        if model is not None:
            self.command += ["--model", model]
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.process = subprocess.Popen(
            self.command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"server exited during start-up: {err[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server did not answer /health within {self.startup_timeout} s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
