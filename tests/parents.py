"""Parent processes for the no-orphan tests, started together.

A no-orphan test starts a program that builds a multi-process engine, prints its children's
pids, and waits to be killed; the test kills it one way (SIGKILL, SIGTERM, Ctrl-C) and checks
that every child is gone. Most of each program's start-up is importing torch, in it and in its
children. Started one test at a time those imports run back to back; `ParentProcesses` starts
the program once per way of killing it, all at once, the first time a test asks, so that the
imports overlap (the machine has more than one core, and a child's start waits on pipes), and
each test then kills its own. Whatever a test did not kill is killed at the module's end.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 120.0


@dataclass
class Parent:
    process: subprocess.Popen
    child_pids: list[int]


@dataclass
class ParentProcesses:
    """started(key, {way: script})[way] -> that way's Parent (see the module's docstring)."""

    _started: dict[tuple[str, str], Parent] = field(default_factory=dict)

    def started(self, key: str, scripts: Mapping[str, str]) -> dict[str, Parent]:
        if not all((key, way) in self._started for way in scripts):
            launched = {way: _launch(script) for way, script in scripts.items()}
            for way, process in launched.items():
                self._started[(key, way)] = Parent(process, _first_line_pids(process))
        return {way: self._started[(key, way)] for way in scripts}

    def kill_all(self) -> None:
        for parent in self._started.values():
            if parent.process.poll() is None:
                parent.process.kill()
                parent.process.wait(timeout=30)
            if parent.process.stdout:
                parent.process.stdout.close()
        self._started.clear()


def _launch(script: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group, as a terminal would give it
    )


def _first_line_pids(process: subprocess.Popen) -> list[int]:
    """The pids the program prints once its engine is up; [] if it died or never printed."""
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            return [int(p) for p in process.stdout.readline().split()]
        if process.poll() is not None:
            return []
    return []


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (say, a replica's tensor-parallel workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found
