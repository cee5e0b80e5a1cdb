"""Start a stage's function in a fresh Python process, connected to this one by a pipe.

Why not `multiprocessing`'s spawn: it re-runs the parent's main script in the child, so a user's
`python my_script.py` that builds a multi-process engine without an `if __name__ == "__main__":`
guard would start engines recursively (vLLM users meet this). Here the child is a plain
`python -m stages.common.spawn`, which imports only what it is told to run.

Why not import the function by name in the child: a stage from the repository is `stages.09_tp`,
which any process can import, but a student's copy loaded with `--stage-path` is
`stages._external.<alias>`, a name only the parent knows. So the child gets the package's name
and folder, loads the package (by name, else from its folder under the same name), and only then
unpickles the arguments, whose classes live in that package.

    process, conn = start_stage_process(worker_main, (spec,), name="tp-rank-1")
    # the child runs worker_main(spec, its_end_of_the_pipe)
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_stage_process(
    function: Any, args: tuple[Any, ...], name: str
) -> tuple[subprocess.Popen, Connection]:
    """Run `function(*args, conn)` in a new process; returns (process, our end of the pipe)."""
    package, folder = _stage_package(sys.modules[function.__module__])
    where = (package, folder, function.__module__, function.__qualname__)
    ours, theirs = Pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "stages.common.spawn", str(theirs.fileno()), name],
        pass_fds=[theirs.fileno()],
        env=env,
    )
    theirs.close()
    ours.send_bytes(pickle.dumps((where, pickle.dumps(args, pickle.HIGHEST_PROTOCOL))))
    return process, ours


def _stage_package(module: Any) -> tuple[str, str]:
    """The stage package a module belongs to, and its folder. A function of a stage's
    sub-package (its harness/) needs its whole stage in the child: a copy loaded from a path is
    loaded again from its top folder, under its alias (stages._external.<alias>)."""
    package = module.__package__ or module.__name__
    depth = 3 if package.startswith("stages._external.") else 2
    top = sys.modules.get(".".join(package.split(".")[:depth]))
    if top is not None and getattr(top, "__file__", None):
        return top.__name__, str(Path(top.__file__).parent)
    return package, str(Path(module.__file__ or "").parent)


def _main(fd: int) -> None:
    conn = Connection(fd)
    (package, folder, module_name, qualname), payload = pickle.loads(conn.recv_bytes())
    import importlib

    import stages

    stages.import_stage(package, folder)  # a copy loaded from a path: again, under its name
    function = getattr(importlib.import_module(module_name), qualname)
    function(*pickle.loads(payload), conn)


if __name__ == "__main__":
    # Ctrl-C reaches the whole terminal group: a child leaves it to its parent, which stops it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _main(int(sys.argv[1]))  # argv[2] is a name, for `ps`
