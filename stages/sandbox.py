"""A throw-away sandbox per student, for the gradebook (stages/gradebook.py), with bubblewrap.

A student's tests run in a filesystem view of their own (`bwrap`: a fresh mount namespace whose
root is an empty tmpfs), which holds, read-only, the interpreter and its packages, the grader's
modules, the stages before this one (a student repository has them too), the student's
modules in place of this stage, the course's tests and the run's sentinel test; and nothing
else: no reference copy of this stage, no other student, no output folder, no home. /tmp is an
empty tmpfs (the grader's scratch lives and dies there), there is no network (a namespace of
its own), no capability, and a PID namespace: when the sandbox's first process ends, the kernel
kills every process left in it, a `start_new_session=True` child included. The process runs as
uid 65534 inside a user namespace; where a pids cgroup can be made (stages-grade-*), it caps
the processes and kills what is left at the end; RLIMIT_AS caps memory, RLIMIT_NPROC processes
(for a grader that is not root: the kernel exempts root from it), RLIMIT_FSIZE output.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from stages import list_stages
from stages.lesson import Lesson
from stages.student_repo import TOOLS

ROOT = Path(__file__).resolve().parents[1]
INSIDE = Path("/grade")  # where the view's course folder sits in the sandbox
# the grader's modules the view holds: those a student repository carries (not the gradebook,
# its checks or this sandbox: the trusted side stays out)
GRADER = TOOLS
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf",
       "localtime", "hosts")  # fmt: skip
CGROUP = Path("/sys/fs/cgroup/pids")
MAX_PROCESSES = 512


def why_not() -> str:
    """'' where a sandbox can be made here, else a one-line reason."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    probe = [
        "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
        "--proc", "/proc", "--uid", "65534", "--gid", "65534", "true",
    ]  # fmt: skip
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap cannot start: {exc}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        return f"bwrap cannot make a sandbox here (user namespaces off?): {lines[-1]}"
    return ""


def _python_dirs() -> list[Path]:
    """The interpreter's folders: the virtual environment and the installation it points at."""
    dirs = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent}
    dirs |= {Path(os.path.realpath(sys.executable)).parents[1]}
    return sorted(d for d in dirs if d.is_dir())


def bwrap_command(lesson: Lesson, modules: Path, sentinel: Path) -> list[str]:
    """bwrap's arguments for a student's view (see the module docstring); the command to run
    in it follows. `modules`: the student's modules (a scratch copy), `sentinel` its folder."""
    command = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    command += ["--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
    command += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for folder in SYSTEM:
        if os.path.islink(folder):
            command += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            command += ["--ro-bind", folder, folder]
    for name in ETC:
        command += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for folder in _python_dirs():
        command += ["--ro-bind", str(folder), str(folder)]
    view = INSIDE / "stages"
    for name in GRADER:
        command += ["--ro-bind", str(ROOT / "stages" / name), str(view / name)]
    command += ["--ro-bind", str(ROOT / "stages" / "common"), str(view / "common")]
    for info in list_stages():
        if info.number < lesson.stage:
            command += ["--ro-bind", str(info.path), str(view / info.folder)]
    command += ["--ro-bind", str(modules), str(view / lesson.path.name)]
    command += ["--ro-bind", str(ROOT / "tests"), str(INSIDE / "tests")]
    command += ["--ro-bind", str(ROOT / "pyproject.toml"), str(INSIDE / "pyproject.toml")]
    command += ["--ro-bind", str(sentinel), str(INSIDE / "sentinel")]
    cache = os.environ.get("LLM_STAGES_CACHE") or str(Path.home() / ".cache" / "llm-stages")
    if Path(cache).is_dir():  # the converted embedded model (stages/common/weights.py)
        command += ["--ro-bind", cache, "/cache", "--setenv", "LLM_STAGES_CACHE", "/cache"]
    command += ["--chdir", str(INSIDE), "--clearenv"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}  # fmt: skip
    for key, value in env.items():
        command += ["--setenv", key, value]
    return [*command, "--", sys.executable]


@contextlib.contextmanager
def process_group() -> Iterator[Path | None]:
    """A pids cgroup for one student (None where none can be made): capped at MAX_PROCESSES;
    at the end every process still in it is killed and the group removed."""
    group = CGROUP / f"stages-grade-{secrets.token_hex(6)}"
    try:
        group.mkdir()
        (group / "pids.max").write_text(str(MAX_PROCESSES))
    except OSError:
        yield None
        return
    try:
        yield group
    finally:
        for _ in range(50):
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.02)
        with contextlib.suppress(OSError):
            group.rmdir()
