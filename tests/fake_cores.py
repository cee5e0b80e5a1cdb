"""Stand-ins for an engine core's start, for the tests of a front end that waits for its cores
(supervisor.py's `Supervisor.wait_for`). Each runs in a child process started by
`start_stage_process`, as a real core does, and does what the test's plan says for its index:
"hang" (a load that never ends: it waits to be told to stop), "fatal" (reports an error, as a
core whose engine raised does, then exits) or "exit" (ends without a word)."""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection

FATAL_ERROR = "RuntimeError: no room for the KV cache"


def fake_core(index: int, plan: dict[int, str], conn: Connection) -> None:
    what = plan.get(index, "hang")
    if what == "fatal":
        conn.send(("fatal", f"engine replica {index}: {FATAL_ERROR}"))
        os._exit(1)
    if what == "exit":
        os._exit(3)
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # "shutdown", or the front end is gone
