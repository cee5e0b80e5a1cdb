"""Where an engine step's time goes when the model costs nothing: the engine's own work.

A decode step is the model's forward plus everything around it: scheduling, packing the
inputs, copying them to the device, sampling, copying the tokens back, appending them, checking
stops, detokenizing, streaming. On a GPU the forward of a small batch takes a few hundred
microseconds; if the host needs more than that, the GPU waits and throughput stops growing with
the model's speed (the H100 runs in `plots/gpu/` plateau at the same tok/s for a 135M and a 1B
model). This tool makes that host cost visible on any machine: it runs a stage's `LLM.generate`
on a tiny random checkpoint (2 layers, hidden 64: the forward is nearly free) with one torch
thread, N requests of 64 greedy tokens each, and times each phase by wrapping the methods that
carry it (nothing in the engine changes; a phase a stage lacks is simply absent):

- schedule: `Scheduler.schedule`
- prepare inputs: `ModelRunner.prepare_inputs` (Python lists to tensors, attention metadata)
- host-to-device: the staged inputs' copy (`InputBuffers.copy_to_device`, stage 05 on)
- forward: the model's `forward` (the decoder layers)
- LM head and sampling: `compute_logits` and `sample`
- wait for the step: `StepHandle.result` (stage 05 on: the engine thread waiting for the
  runner's thread; with async scheduling the host's work of step t+1 hides here)
- update, stop, detokenize: `LLMEngine.update_from_output`

It reports the median step's wall time, that time per running request, and each phase's mean
per step. On stages 05-15 two threads share one interpreter lock, so a phase's wall time also
holds the time its thread waited for the lock while the other ran Python: the sum of the
phases exceeds the step. So it also reports CPU time, which a thread waiting for the lock does
not spend: the process's CPU per step (every thread), each phase's (its thread's), and the
engine's own CPU per step, everything but the model (the forward, the LM head and sampling).
That last number is the one that shrinks only when the engine does less. The last column shows
what two threads cost each other: the voluntary context switches per step (every thread's),
each one a thread put to sleep (waiting for the other, or for the interpreter lock) and woken
again, in the kernel, on the process's CPU time. Stage 04 has one thread and makes none. (The
kernel's share of the CPU is not shown: Linux samples it at the timer tick, too coarse here.)

`python -m stages.common.tooling.step_profile --stages 04 15 --requests 1 8 64 256` prints a
table; with `--out F.json` it also writes the profiles there and their plot beside (`F.png`).
`--repeat N` runs the whole sweep N times and reports each cell's median (`median_profile`).
`--config KEY=VALUE` (repeatable) sets an `EngineConfig` field in every engine profiled: stage
15 with `async_scheduling=true` runs its steps on the runner's thread on a CPU too.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from stages import load, stage_info
from stages.common.tooling.embedded_throughput import config_values
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

PHASES = (
    "schedule",
    "prepare inputs",
    "host-to-device",
    "forward",
    "LM head and sampling",
    "wait for the step",
    "update, stop, detokenize",
)
MODEL_PHASES = ("forward", "LM head and sampling")  # the model's work; the rest is the engine's
OUTPUT_TOKENS = 64
PROMPT_TOKENS = 16


@dataclass(slots=True)
class StepProfile:
    """One stage at one number of running requests."""

    stage: str
    requests: int
    steps: int
    median_step_us: float
    per_request_us: float  # the median step over the requests it ran
    tokens_per_second: float
    phases_us: dict[str, float] = field(default_factory=dict)  # mean per step, each phase
    cpu_per_step_us: float = 0.0  # the process's CPU time (every thread), mean per step
    own_cpu_per_step_us: float = 0.0  # the same less the model's phases: the engine's own work
    phases_cpu_us: dict[str, float] = field(default_factory=dict)  # CPU, mean per step
    threads: dict[str, str] = field(default_factory=dict)  # phase -> the thread it ran on
    switches_per_step: float = 0.0  # voluntary context switches, every thread, mean per step


class _Clock:
    """Per-phase time, summed over the calls of every wrapped method (any thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)  # the calling thread's CPU
        self.threads: dict[str, str] = {}
        self._lock = threading.Lock()

    def wrap(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                cpu = time.thread_time() - cpu_start
                with self._lock:
                    self.seconds[phase] += spent
                    self.cpu_seconds[phase] += cpu
                    self.threads.setdefault(phase, threading.current_thread().name)

        return timed


def _resolve(root: Any, path: str) -> Any:
    for name in path.split(".") if path else ():
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


@contextmanager
def _patched(engine: Any, clock: _Clock) -> Iterator[None]:
    """Wrap the methods that carry each phase, on the instances (and the runner module's
    `sample` and `StepHandle.result`), and put them back after."""
    runner = engine.runner
    instance_methods = [
        ("schedule", "scheduler", "schedule"),
        ("prepare inputs", "runner", "prepare_inputs"),
        ("host-to-device", "runner.buffers", "copy_to_device"),
        ("forward", "runner.model", "forward"),
        ("LM head and sampling", "runner.model", "compute_logits"),
        ("update, stop, detokenize", "", "update_from_output"),
    ]
    undo: list[Callable[[], None]] = []
    for phase, path, name in instance_methods:
        owner = _resolve(engine, path)
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, clock.wrap(phase, getattr(owner, name)))
        undo.append(functools.partial(delattr, owner, name))
    module = sys.modules[type(runner).__module__]
    for phase, owner, name in (
        ("LM head and sampling", module, "sample"),
        ("wait for the step", getattr(module, "StepHandle", None), "result"),
    ):
        if owner is not None and hasattr(owner, name):
            original = getattr(owner, name)
            setattr(owner, name, clock.wrap(phase, original))
            undo.append(functools.partial(setattr, owner, name, original))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _engine(
    stage: str,
    requests: int,
    checkpoint: Path,
    output_tokens: int,
    device: str,
    config: dict[str, Any] | None = None,
) -> Any:
    """Stage `stage`'s `LLM` on the tiny checkpoint, sized for `requests` at once; `config`
    adds (or overrides) `EngineConfig` fields."""
    if int(stage_info(stage).number) < 4:
        raise ValueError(f"the step profile needs a batching engine (stage 04 on), not {stage}")
    kv_tokens = requests * (PROMPT_TOKENS + output_tokens + 32)
    settings = {
        "device": device,
        "dtype": "float32",
        "max_num_seqs": requests,
        "max_num_batched_tokens": max(2048, requests * PROMPT_TOKENS),
        "kv_cache_bytes": kv_tokens * 2 * 2 * 2 * 32 * 4 + (1 << 20),  # layers x K,V x heads x dim
    }
    return load(stage).LLM(str(checkpoint), **settings | (config or {}))


def _prompts(requests: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 10 for j in range(PROMPT_TOKENS)] for i in range(requests)]


def profile_stage(
    stage: str,
    requests: int,
    checkpoint: Path,
    *,
    output_tokens: int = OUTPUT_TOKENS,
    device: str = "cpu",
    config: dict[str, Any] | None = None,
) -> StepProfile:
    """Run `requests` greedy requests of `output_tokens` tokens through stage `stage`'s
    `LLM.generate` on `checkpoint` and time its steps and their phases (on CUDA the phases
    are the host's time: what the engine spends launching, not what the GPU spends)."""
    module = load(stage)
    llm = _engine(stage, requests, checkpoint, output_tokens, device, config)
    try:
        params = module.SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        prompts = _prompts(requests)
        llm.generate(prompts[:1], params)  # warm-up: first-call costs out of the numbers
        clock, step_seconds = _Clock(), []
        step = llm.step

        def timed_step() -> Any:
            start = time.perf_counter()
            try:
                return step()
            finally:
                step_seconds.append(time.perf_counter() - start)

        llm.step = timed_step
        with _patched(llm, clock):
            start, cpu_start, switches = time.perf_counter(), time.process_time(), _switches()
            outputs = llm.generate(prompts, params)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            switches = _switches() - switches
        del llm.step
        tokens = sum(len(o.token_ids) for o in outputs)
        median = statistics.median(step_seconds)
        steps = len(step_seconds)
        return StepProfile(
            stage=stage_info(stage).folder,
            requests=requests,
            steps=steps,
            median_step_us=median * 1e6,
            per_request_us=median * 1e6 / requests,
            tokens_per_second=tokens / wall,
            phases_us={p: clock.seconds[p] * 1e6 / steps for p in PHASES if p in clock.seconds},
            cpu_per_step_us=cpu * 1e6 / steps,
            own_cpu_per_step_us=(cpu - sum(clock.cpu_seconds[p] for p in MODEL_PHASES))
            * 1e6
            / steps,
            phases_cpu_us={
                p: clock.cpu_seconds[p] * 1e6 / steps for p in PHASES if p in clock.cpu_seconds
            },
            threads=dict(clock.threads),
            switches_per_step=switches / steps,
        )
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _switches() -> float:
    """The process's voluntary context switches so far, every thread (an ended one included);
    0 where the OS does not count them."""
    try:
        import resource
    except ImportError:  # not on Unix
        return 0.0
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw)


def kernels_per_step(
    stage: str, requests: int, checkpoint: Path, trace: Path | None, *, steps: int = 20
) -> float:
    """CUDA only: the kernels one decode step launches, counted by `torch.profiler` over
    `steps` steps of `requests` running requests (the trace written to `trace` for a
    viewer such as Perfetto). A CPU has no kernels to count: a ValueError says so."""
    if not torch.cuda.is_available():
        raise ValueError("kernels per step are counted on CUDA only (no GPU here)")
    from torch.profiler import ProfilerActivity, profile

    module = load(stage)
    llm = _engine(stage, requests, checkpoint, steps + 8, "cuda")
    try:
        params = module.SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for prompt in _prompts(requests):
            llm.add_request(llm.make_request(prompt, params))
        for _ in range(4):  # prefill and the first decodes: out of the count
            llm.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                llm.step()
            torch.cuda.synchronize()
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(kernels) / steps
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


def machine() -> dict[str, Any]:
    """What the numbers came from: CPU, torch and its kernel class."""
    from stages.common.tooling.hardware import hardware_info

    return {
        **hardware_info(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def table(profiles: list[StepProfile]) -> str:
    """The profiles as a text table: microseconds per step, per request, per phase."""
    head = ["stage", "reqs", "step us", "us/req", "tok/s", "CPU/step", "own CPU/step", *PHASES,
            "switches/step"]  # fmt: skip
    rows = [
        [
            p.stage,
            str(p.requests),
            f"{p.median_step_us:,.0f}",
            f"{p.per_request_us:,.1f}",
            f"{p.tokens_per_second:,.0f}",
            f"{p.cpu_per_step_us:,.0f}",
            f"{p.own_cpu_per_step_us:,.0f}",
            *(f"{p.phases_us[ph]:,.0f}" if ph in p.phases_us else "-" for ph in PHASES),
            f"{p.switches_per_step:.1f}",
        ]
        for p in profiles
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
    )


def plot(profiles: list[StepProfile], path: Path) -> None:
    """Left: the median step against the running requests, one line per stage (log-log).
    Middle: the engine's own CPU per step (everything but the model) against the running
    requests: the number the step-cost issue asks to cut. Right: where that own CPU goes at
    the largest batch, phase by phase (each phase's CPU on its thread; "the rest" is what no
    phase holds: the engine's loop, the runner's glue around the model, the threads'
    hand-offs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(p.stage for p in profiles))
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 4.8))
    for axis, value, label in (
        (left, lambda p: p.median_step_us, "median step (us)"),
        (middle, lambda p: p.own_cpu_per_step_us, "engine's own CPU per step (us)"),
    ):
        for stage in stages:
            mine = [p for p in profiles if p.stage == stage]
            axis.plot([p.requests for p in mine], [value(p) for p in mine], marker="o", label=stage)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("running requests")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    left.set_title("One step, tiny model, 1 torch thread")
    middle.set_title("The engine's own work (CPU time, the model's left out)")
    largest = max(p.requests for p in profiles)
    rows = [p for p in profiles if p.requests == largest]
    colors = plt.get_cmap("tab10").colors
    engine_phases = [phase for phase in PHASES if phase not in MODEL_PHASES]
    for index, profile in enumerate(rows):
        start = 0.0
        parts = [(phase, profile.phases_cpu_us.get(phase, 0.0)) for phase in engine_phases]
        rest = max(0.0, profile.own_cpu_per_step_us - sum(width for _, width in parts))
        for number, (phase, width) in enumerate([*parts, ("the rest", rest)]):
            label = phase if index == 0 else None
            right.barh(index, width, left=start, color=colors[number], label=label)
            start += width
    right.set_yticks(range(len(rows)), [p.stage for p in rows])
    right.invert_yaxis()
    right.set_xlabel(f"own CPU us per step at {largest} requests")
    right.set_title("Where the engine's own CPU goes")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_profile(runs: list[StepProfile]) -> StepProfile:
    """One profile from several runs of the same stage and number of requests: every number
    (and every phase's) the median of the runs'. A machine that drifts within minutes (this
    project's CPUs do) moves one run's table by tens of percent; the median of a few, taken in
    alternation, moves far less."""
    first = runs[0]
    if any((r.stage, r.requests) != (first.stage, first.requests) for r in runs):
        raise ValueError("the runs to combine must be of one stage at one number of requests")

    def median(read: Callable[[StepProfile], float]) -> float:
        return statistics.median(read(r) for r in runs)

    def phases(field_name: str) -> dict[str, float]:
        names = [p for p in PHASES if all(p in getattr(r, field_name) for r in runs)]
        return {p: median(lambda r, p=p: getattr(r, field_name)[p]) for p in names}

    return StepProfile(
        stage=first.stage,
        requests=first.requests,
        steps=first.steps,
        median_step_us=median(lambda r: r.median_step_us),
        per_request_us=median(lambda r: r.per_request_us),
        tokens_per_second=median(lambda r: r.tokens_per_second),
        phases_us=phases("phases_us"),
        cpu_per_step_us=median(lambda r: r.cpu_per_step_us),
        own_cpu_per_step_us=median(lambda r: r.own_cpu_per_step_us),
        phases_cpu_us=phases("phases_cpu_us"),
        threads=dict(first.threads),
        switches_per_step=median(lambda r: r.switches_per_step),
    )


def run(
    stages: list[str],
    requests: list[int],
    *,
    output_tokens: int = OUTPUT_TOKENS,
    device: str = "cpu",
    out: Path | None = None,
    with_plot: bool = True,
    repeat: int = 1,
    config: dict[str, Any] | None = None,
) -> list[StepProfile]:
    """Profile each stage at each number of requests (one torch thread), print the table and
    write `out` (JSON, the plot beside it); on CUDA also count kernels per decode step and
    keep the trace beside the JSON. With `repeat` > 1 the whole sweep runs that many times,
    one after the other, and each cell is the median of its runs (`median_profile`). `config`
    adds `EngineConfig` fields to every engine (say, `{"async_scheduling": True}`)."""
    if any(n < 1 for n in requests) or output_tokens < 2:
        raise ValueError("requests must be positive and output tokens at least 2")
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: dict[tuple[str, int], list[StepProfile]] = defaultdict(list)
    kernels: dict[str, float] = {}
    errors: list[dict[str, Any]] = []  # a cell that failed, with why: the others still run

    def report() -> None:  # after every cell: a run stopped at its limit keeps what it measured
        if out is not None:
            write_report(out, device, output_tokens, repeat, config, runs, kernels, errors)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny", TinySpec())
            for sweep in range(1, repeat + 1):
                for stage in stages:
                    for n in requests:
                        print(
                            f"[step_profile] stage {stage}, {n} requests (run {sweep} of {repeat})",
                            file=sys.stderr,
                        )
                        try:
                            profile = profile_stage(
                                stage,
                                n,
                                checkpoint,
                                output_tokens=output_tokens,
                                device=device,
                                config=config,
                            )
                        except ValueError:  # a usage error (this stage cannot be profiled)
                            raise
                        except Exception as exc:  # one engine failing loses no other cell
                            errors.append(_error(stage, n, exc))
                        else:
                            runs[(stage, n)].append(profile)
                        report()
                    if device.startswith("cuda") and sweep == 1:
                        trace = out.with_name(f"{out.stem}_{stage}_trace.json") if out else None
                        try:
                            kernels[stage] = kernels_per_step(stage, 1, checkpoint, trace)
                        except ValueError:
                            raise
                        except Exception as exc:
                            errors.append(_error(stage, 1, exc, "kernels per decode step"))
                        report()
    finally:
        torch.set_num_threads(threads)
    profiles = [median_profile(cell) for cell in runs.values()]
    print(table(profiles))
    for stage, count in kernels.items():
        print(f"stage {stage}: {count:.0f} kernels per decode step (batch 1)")
    for error in errors:
        print(f"[step_profile] FAILED: {error}", file=sys.stderr)
    if out is not None and with_plot and profiles:
        plot(profiles, out.with_suffix(".png"))
    if errors:
        raise ProfileFailed(f"{len(errors)} cell(s) failed: {errors}")
    return profiles


class ProfileFailed(RuntimeError):
    """Some cells failed (the report written holds the others and each failure)."""


def _error(stage: str, requests: int, exc: BaseException, what: str = "profile") -> dict[str, Any]:
    return {"stage": stage, "requests": requests, "what": what,
            "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip


def write_report(
    out: Path,
    device: str,
    output_tokens: int,
    repeat: int,
    config: dict[str, Any] | None,
    runs: dict[tuple[str, int], list[StepProfile]],
    kernels: dict[str, float],
    errors: list[dict[str, Any]],
) -> None:
    """The JSON of every cell measured so far (each the median of its runs so far)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(),
        "device": device,
        "output_tokens": output_tokens,
        "repeat": repeat,  # each profile the median of this many runs
        "config": config or {},  # EngineConfig fields beyond the profile's own
        "profiles": [asdict(median_profile(cell)) for cell in runs.values() if cell],
        "kernels_per_decode_step": kernels,
        "errors": errors,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=["04", "15"])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--tokens", type=int, default=OUTPUT_TOKENS, help="output tokens a request")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds kernel counts)")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (the plot beside)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the sweep N times; each cell their median"
    )
    parser.add_argument("--config", action="append", metavar="KEY=VALUE",
                        help="an EngineConfig field for every engine profiled (repeatable), "
                        "e.g. async_scheduling=true")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        run(
            args.stages, args.requests, output_tokens=args.tokens, device=args.device,
            out=args.out, repeat=args.repeat, config=config_values(args.config),
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    except ProfileFailed as exc:
        print(f"step_profile: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
