"""Execute the walkthrough notebooks cheaply: each in a child forked from one process that has
already imported the heavy libraries.

A Jupyter kernel per notebook pays a Python start and the imports of torch, transformers and
IPython, 3-4 s, before its first cell runs; fifteen notebooks pay it fifteen times. Here one
runner process per pytest worker imports them once (`PRELOAD`), and each notebook runs in a
child forked from it, in a fresh IPython shell: the cell semantics of a kernel (top-level
`await`, `display`), and nothing shared with another notebook but those imports, which no
notebook changes. What a notebook sets (its variables, environment, torch's settings, engines
and their processes) dies with its child. Triton is not preloaded: notebook 03 sets
`TRITON_INTERPRET` before anything imports it.

The runner speaks JSON lines: it reads {"path", "cwd", "log", "timeout"} on stdin and answers
{"ok", "cell", "source", "error", "seconds"} on stdout. A child writes its cells' output to
"log"; one that runs past "timeout" is killed with its process group; one whose runner dies
is killed by the kernel (PR_SET_PDEATHSIG), as is a runner whose test process dies; a runner
also ends when its stdin closes.

    python tests/notebook_runner.py      # the runner; tests/test_notebooks.py starts it
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# What every notebook imports and none changes; triton is left out on purpose (see above).
PRELOAD = ("torch", "transformers", "numpy", "httpx", "IPython", "jupytext")


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the one that forked it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_cells(path: str) -> dict[str, Any]:
    """Every code cell of `path`, in order, in a fresh IPython shell; stops at the first error."""
    import jupytext
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    notebook = jupytext.read(path)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        result = shell.run_cell(cell.source, store_history=False, silent=False)
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            return {"ok": False, "cell": index, "source": cell.source, "error": text}
    return {"ok": True}


def _child(request: dict[str, Any], reply_fd: int) -> None:
    """In the forked child: its own process group, its output to the log, then the cells."""
    os.setpgid(0, 0)
    _die_with_parent()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # the repository, not tests/ (this file's folder)
    try:
        outcome = _run_cells(request["path"])
    except BaseException as exc:  # the shell itself failed: report it, never hang the runner
        outcome = {"ok": False, "cell": None, "source": "", "error": repr(exc)}
    with os.fdopen(reply_fd, "w") as reply:
        reply.write(json.dumps(outcome))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_one(request: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(request, write_fd)
    os.close(write_fd)
    deadline = started + float(request["timeout"])
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return {"ok": False, "cell": None, "source": "",
                    "error": f"timed out after {request['timeout']} s (killed)"}  # fmt: skip
        time.sleep(0.05)
    with os.fdopen(read_fd) as reply:
        text = reply.read()
    with contextlib.suppress(ProcessLookupError):  # whatever the notebook left running
        os.killpg(pid, signal.SIGKILL)  # in its process group goes with it
    outcome = json.loads(text) if text else {
        "ok": False, "cell": None, "source": "",
        "error": f"the notebook's process ended without a report (status {status})"}  # fmt: skip
    outcome["seconds"] = time.monotonic() - started
    return outcome


def main() -> None:
    _die_with_parent()  # a killed test process takes its runner, and the runner its child
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in PRELOAD:
        __import__(name)
    assert "triton" not in sys.modules, "a preloaded library imported triton"
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_run_one(json.loads(line))), flush=True)


class NotebookRunner:
    """The test side: starts the runner once, then `run(path)` executes one notebook."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root, self.scratch = root, scratch
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
        )  # fmt: skip
        ready = self._answer(within=120.0)
        assert ready, "the notebook runner did not start within 120 s"

    def _answer(self, within: float) -> str:
        """The runner's next line, or "" (the runner killed) if none comes `within` seconds:
        a runner that hangs fails its test instead of holding the suite."""
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], within)
        if not readable:
            self.process.kill()
            self.process.wait(timeout=10)
            return ""
        return self.process.stdout.readline()

    def run(self, source: Path, timeout: float) -> tuple[dict[str, Any], str]:
        """(the runner's answer, the notebook's output) for one notebook."""
        assert self.process.stdin is not None
        log = self.scratch / f"{source.stem}.log"
        request = {"path": str(source), "cwd": str(self.root), "log": str(log),
                   "timeout": timeout}  # fmt: skip
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._answer(within=timeout + 30)  # the runner kills a notebook at `timeout`
        assert answer, f"the notebook runner died or hung while running {source.name}"
        return json.loads(answer), log.read_text() if log.exists() else ""

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


if __name__ == "__main__":
    main()
