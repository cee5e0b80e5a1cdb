"""Waiting for a step without blocking on it: poll, and give up when told to or too late.

A rank whose collective waits on a dead peer waits for ever on NCCL: the kernel spins on the GPU
and `Event.synchronize()` never returns on the host, and nothing another thread does wakes it.
(gloo is kinder: its socket closes and the collective raises.) vLLM's executor never blocks
without a bound either: it takes each worker's reply with a deadline
(`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`) and a cancel event that its worker monitor sets.

Here the engine's thread polls whether the step is done (a CUDA event's `query`, or the CPU
runner's future), pausing a little between looks, and between looks asks whether the executor
has failed (its monitor thread says so when a worker exits or reports an error). The function
knows nothing of devices, so the tests drive it with plain callables and a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST_PAUSE_SECONDS = 20e-6  # a decode step on a GPU takes milliseconds: look again soon
LONGEST_PAUSE_SECONDS = 200e-6  # ... and notice its end within a fifth of a millisecond


class StepAbortedError(RuntimeError):
    """A wait given up because something else failed; the message is the failure."""


def wait_until(
    done: Callable[[], bool],
    failed: Callable[[], str | None],
    deadline_seconds: float | None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once `done()`. Raise StepAbortedError naming the failure as soon as `failed()`
    returns one, and TimeoutError once `deadline_seconds` have passed (None: no deadline).
    Pauses start short and double up to LONGEST_PAUSE_SECONDS: a short step costs little
    waiting, a long one few wake-ups."""
    deadline = None if deadline_seconds is None else clock() + deadline_seconds
    pause = FIRST_PAUSE_SECONDS
    while not done():
        reason = failed()
        if reason is not None:
            raise StepAbortedError(reason)
        if deadline is not None and clock() >= deadline:
            raise TimeoutError(f"the step was not done within {deadline_seconds:g} s")
        sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE_SECONDS)
