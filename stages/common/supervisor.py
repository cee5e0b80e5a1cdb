"""One process supervisor: start children, wait until they are ready, read them, stop them.

    owner --start--> child process (stages.common.spawn: a fresh interpreter, one pipe each)
          <--"started"/"ready"-- every child, waited for at once (`wait_for`)
          <--messages-- one reader thread per child --> owner's callbacks (a weakref only)
          --"shutdown"--> every child; then wait, then kill (`stop`, also a weakref.finalize)

Three owners use it the same way: the executor's tensor-parallel workers (stage 09), the
data-parallel front end's engine replicas (stage 10) and the disaggregated pair's prefill and
decode cores (stage 13). What differs is theirs: what a message means, and what a death does.

Start-up waits for every child at once and fails on the first that dies or reports an error,
with that child's own error: a child that cannot start must not wait behind another that never
will (waiting for them in turn blamed the first, after the whole timeout, for a later one's
death). A reader holds its owner only while handing it a message, so an owner nobody uses can
be collected, and then the finalizer stops its children: none outlives its owner (each child
also exits by itself when its parent vanishes: `exit_when_orphaned`, which worker.py and
engine_core.py start first thing).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

from stages.common.spawn import start_stage_process

START_TIMEOUT_SECONDS = 300.0  # a child imports torch and loads its model within this
STOP_TIMEOUT_SECONDS = 5.0  # a child asked to stop exits within this, or is killed
WATCH_SECONDS = 0.2  # how often a reader looks at its child's process between messages
EXIT_WAIT_SECONDS = 2.0  # a child whose pipe closed has its exit code within this
PARENT_POLL_SECONDS = 0.5  # how often a child looks whether its parent is still there


@dataclass(eq=False)
class Child:
    """One child process, our end of its pipe, and what its owner knows of its health."""

    name: str  # in every error about it: "engine replica 1 (pid 4242)"
    process: subprocess.Popen
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)  # many threads send
    alive: bool = True  # False once its owner has seen it end
    error: str | None = None  # how it ended, in words (its owner's)
    ended_at: float | None = None  # when its reader saw its last word, its pipe close or its exit
    last_word: str | None = None  # the error it reported, if it did

    def ended(self) -> bool:
        return self.ended_at is not None or self.process.poll() is not None

    def send(self, message: Any) -> str | None:
        """Send `message`; why the child cannot be reached, if it cannot."""
        try:
            with self.send_lock:
                self.conn.send(message)
        except OSError as exc:
            return f"cannot be reached: {exc}"
        return None


C = TypeVar("C", bound=Child)
Owner = Any  # whatever started the children: its callbacks take it first


class Supervisor(Generic[C]):
    """The children of one owner. `record` builds each child's record (a `Child` subclass
    holds what the owner tracks per child)."""

    def __init__(self, record: Callable[..., C] = Child) -> None:  # type: ignore[assignment]
        self.children: list[C] = []
        self.stopped = threading.Event()  # set once `stop` has begun: an end is then expected
        self._record = record
        # Stop the children when the supervisor goes away, however it goes (no reference to it).
        self._finalizer = weakref.finalize(self, _stop, self.children, self.stopped)

    def start(self, function: Any, args: tuple[Any, ...], process: str, label: str) -> C:
        """Run `function(*args, conn)` in a new child process named `process` (for `ps`);
        `label` names it in errors, with its pid."""
        # A fresh interpreter (not fork: it would copy this process's threads and locks).
        popen, conn = start_stage_process(function, args, name=process)
        child = self._record(f"{label} (pid {popen.pid})", popen, conn)
        self.children.append(child)
        return child

    def wait_for(self, kind: str = "ready", error: type[Exception] = RuntimeError) -> list[Any]:
        """Every child's next message, which must be `kind`: the payloads, in order. Waits for
        all at once; the first child that dies or says anything else raises `error` with its
        own words, and so does the deadline (`START_TIMEOUT_SECONDS`), naming the slow."""
        timeout = START_TIMEOUT_SECONDS  # read now: a test may shorten it
        deadline = time.monotonic() + timeout
        pending = {child.conn: index for index, child in enumerate(self.children)}
        payloads: dict[int, Any] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                slow = ", ".join(self.children[index].name for index in pending.values())
                raise error(f"{slow} not {kind} in {timeout:.0f} s")
            for conn in wait(list(pending), timeout=min(left, 1.0)):
                index = pending.pop(conn)  # type: ignore[call-overload]
                child = self.children[index]
                try:
                    said, payload = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):  # it died without a word: its exit code says more
                    how = ending(child.process, None, EXIT_WAIT_SECONDS)
                    raise error(f"{child.name} {how} before it was {kind}") from None
                if said != kind:
                    raise error(f"{child.name} failed to start: {payload}")
                payloads[index] = payload
            for conn, index in pending.items():  # an exit whose pipe someone else holds open
                child = self.children[index]
                if child.process.poll() is not None and not conn.poll():
                    raise error(f"{child.name} {ending(child.process, None)} before it was {kind}")
        return [payloads[index] for index in range(len(self.children))]

    def reported_error(self, last_words: Collection[str], seconds: float = 2.0) -> str | None:
        """The first error a child reports within `seconds` (a message of a kind in
        `last_words`), in words, if one does: why the owner's own start-up failed."""
        deadline = time.monotonic() + seconds
        for child in self.children:
            with contextlib.suppress(EOFError, OSError):
                while child.conn.poll(max(0.0, deadline - time.monotonic())):
                    kind, payload = child.conn.recv()
                    if kind in last_words:
                        return f"{child.name} failed: {payload}"
        return None

    def watch(
        self,
        owner: Owner,
        messages: Collection[str],
        on_message: Callable[[Owner, int, str, Any], None],
        on_end: Callable[[Owner, int, str], None],
        thread_name: Callable[[int], str],
    ) -> None:
        """Start one reader thread per child. A message of a kind in `messages` goes to
        `on_message(owner, index, kind, payload)`; any other is the child's last word (an
        error), which ends its reader: `on_end(owner, index, how)`, `how` in words (`ending`),
        as does its pipe closing or its process ending. Nothing is handed on once `stop` has
        begun."""
        owner_ref, kinds = weakref.ref(owner), frozenset(messages)
        for index, child in enumerate(self.children):
            threading.Thread(
                target=_read,
                args=(owner_ref, index, child, self.stopped, kinds, on_message, on_end),
                name=thread_name(index), daemon=True,
            ).start()  # fmt: skip

    def stop(self) -> None:
        """Stop every child (ask, wait a little, then kill). Safe to call twice."""
        self._finalizer()


def ending(process: subprocess.Popen, error: str | None, wait: float = 0.0) -> str:
    """How a child ended, in words: its own error (unless a signal killed it: then that), else
    its exit code, waited for up to `wait` seconds, else that its pipe closed."""
    code = process.poll()
    if code is None and error is None and wait > 0:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=wait)
    if error is not None and (code is None or code >= 0):
        return f"failed: {error}"
    if code is None:
        return "closed its pipe"
    reason = f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            reason += f" (killed by {signal.Signals(-code).name})"
    return reason


def first_failed(ended: list[C]) -> C:
    """Of children that fail together (the ranks of one collective group), the one that
    failed first. A killed rank breaks its neighbours' collectives: they report errors and exit
    too, often before the kill shows, so the first sign may be an innocent rank's. The blame
    goes to a child killed by a signal (from outside: nobody's echo), else to one that ended
    without a word, else to the first that reported an error."""

    def suspicion(index: int) -> tuple[float, ...]:
        child = ended[index]
        code = child.process.poll()
        if code is not None and code < 0:
            return (0, index)
        if child.last_word is None:
            return (1, index)
        return (2, child.ended_at or 0.0, index)

    return ended[min(range(len(ended)), key=suspicion)]


def _read(
    owner_ref: weakref.ref[Owner],
    index: int,
    child: Child,
    stopped: threading.Event,
    messages: frozenset[str],
    on_message: Callable[[Owner, int, str, Any], None],
    on_end: Callable[[Owner, int, str], None],
) -> None:
    """A child's reader: hand each message to the owner, then its end. Holds the owner only
    while handing it something."""
    while not stopped.is_set():
        try:
            if child.conn.poll(WATCH_SECONDS):
                kind, payload = child.conn.recv()
            elif child.process.poll() is None or child.conn.poll():
                continue  # still running, or it spoke as it exited: read that first
            else:  # it exited, and someone else holds its pipe open
                kind, payload = None, None
        except (EOFError, OSError, ValueError):  # its pipe closed: it died (or we stopped it)
            kind, payload = None, None
        if kind not in messages:
            child.last_word = None if kind is None else str(payload)
            child.ended_at = time.monotonic()
        owner = owner_ref()
        if owner is None or stopped.is_set():
            return
        if kind in messages:
            on_message(owner, index, kind, payload)
        else:
            on_end(owner, index, ending(child.process, child.last_word, EXIT_WAIT_SECONDS))
            return
        del owner


def _stop(children: list[Child], stopped: threading.Event) -> None:
    stopped.set()
    for child in children:
        child.send(("shutdown", ()))
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        child.conn.close()


def exit_when_orphaned(parent_pid: int) -> None:
    """In a child: a daemon thread that ends the process once its parent is gone (it was
    reparented), so that a child whose owner was killed, and never ran `stop`, exits too."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
