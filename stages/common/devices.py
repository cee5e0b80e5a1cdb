"""Device and dtype choice: the code is GPU code that also runs on a CPU.

`cuda` when available, else `cpu`; bf16 on GPU, fp32 on CPU (on CPUs without bf16 units, such as
the AVX2 machine the committed plots ran on, bf16 matmuls are slower than fp32).

Two environment variables change what "auto" means, for a whole process and the worker
processes it starts (they inherit the environment): `STAGES_DEVICE` (`cpu`, `cuda`, `cuda:1`)
and `STAGES_DTYPE` (`float32`, `bfloat16`, ...). The test suite sets them from `pytest --device`
(stages/pytest_plugin.py), so that one suite runs on the CPU or on a GPU; a user can force the
CPU on a GPU machine with `STAGES_DEVICE=cpu`. An explicit `device=` or `dtype=` always wins.

A third, `STAGES_DIST_BACKEND` (`nccl` or `gloo`), says what a config's
`distributed_backend="auto"` means: the process-group backend of the tensor-parallel ranks
(stage 09 on). Unset, auto is NCCL on CUDA and gloo on a CPU. Gloo takes CUDA tensors too (its
all-reduce, all-gather, broadcast and all-to-all copy them through pinned host memory; its
send and recv do not), so with gloo several ranks may share one GPU, which NCCL refuses.
`pytest --device cuda` sets it to gloo on a machine with fewer than two GPUs, so that the
multi-process tests run there instead of skipping (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os

import torch

DEVICE_VARIABLE = "STAGES_DEVICE"  # what device "auto" means, when set
DTYPE_VARIABLE = "STAGES_DTYPE"  # what dtype "auto" means, when set
DIST_BACKEND_VARIABLE = "STAGES_DIST_BACKEND"  # what distributed_backend "auto" means, when set
DIST_BACKENDS = ("nccl", "gloo")
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")  # the code's two paths (DESIGN: devices)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def requested_device(name: str | None = None, has_gpu: bool | None = None) -> torch.device:
    """What a device setting means, without checking that it exists: None or "auto" read
    $STAGES_DEVICE (what `pytest --device` sets), then cuda when a GPU is visible (`has_gpu`;
    None: ask CUDA), else cpu. The one rule every "auto" follows (an engine, a DP plan, a
    preset's defaults)."""
    if name in (None, "auto"):
        name = os.environ.get(DEVICE_VARIABLE) or None
    if name in (None, "auto"):
        gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
        return torch.device("cuda" if gpu else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"device {name!r} is not supported: use auto, cpu, cuda or cuda:N")
    return torch.device("cpu") if device.type == "cpu" else device  # "cpu:0": one CPU device


def resolve_device(name: str | None = None) -> torch.device:
    """`requested_device`, refused when it names CUDA and there is none."""
    device = requested_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"device {name!r} requested but this machine has {count} GPU(s)")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        name = os.environ.get(DTYPE_VARIABLE) or None
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_distributed_backend(name: str | None, device_type: str) -> str:
    """The process-group backend of ranks on `device_type` ("cuda" or "cpu"). "auto" (or None):
    `STAGES_DIST_BACKEND` when set, else NCCL on CUDA and gloo on a CPU. NCCL needs CUDA and one
    GPU per rank; gloo runs anywhere, and on CUDA lets ranks share a GPU (the executor then
    places them modulo the GPUs). ValueError for an unknown name, or NCCL off CUDA."""
    if name in (None, "auto"):
        name = os.environ.get(DIST_BACKEND_VARIABLE) or "auto"
    if name == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if name not in DIST_BACKENDS:
        raise ValueError(
            f"distributed backend {name!r} unknown; choose 'auto' or one of {list(DIST_BACKENDS)}"
        )
    if name == "nccl" and device_type != "cuda":
        raise ValueError(
            f"distributed backend 'nccl' needs CUDA devices, but the ranks run on {device_type!r}: "
            "use 'gloo' (or 'auto')"
        )
    return name


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Make `device` current while a Triton kernel launches: Triton launches on the current
    CUDA device, not on its arguments' (a PyTorch op guards itself), so a kernel for tensors
    on cuda:1 in a process whose current device is cuda:0 would run on the wrong GPU. Nothing
    to do elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def kernel_device(**tensors: torch.Tensor) -> torch.device:
    """The one device of every tensor handed to a Triton kernel, named by argument. Triton
    reads raw pointers: on a GPU a host tensor in the launch fails deep in the launcher
    ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)") without saying
    which, and the CPU interpreter (TRITON_INTERPRET=1) does not look at devices at all. So
    a launch checks here first, on either machine: a test on the CPU hands one argument on
    `meta` and sees its name."""
    devices = {name: tensor.device for name, tensor in tensors.items()}
    first, device = next(iter(devices.items()))
    wrong = [f"{name} is on {d}" for name, d in devices.items() if d != device]
    if wrong:
        raise ValueError(
            f"a Triton kernel needs every tensor on one device: {first} is on {device}, but "
            + ", ".join(wrong)
        )
    return device


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings mean something on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


CPU_KV_BUDGET_CAP = 1 << 30  # on a CPU the pool shares RAM with everything else: 1 GiB at most


def kv_memory_budget(device: torch.device) -> int:
    """Default bytes for the KV block pool: half of what is free on a GPU once the weights are
    loaded (vLLM reserves a fraction the same way); on a CPU, a tenth of available RAM, at most
    `CPU_KV_BUDGET_CAP`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        with open("/proc/meminfo") as handle:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return min(CPU_KV_BUDGET_CAP, available // 10)


# Scheduling defaults per device. On a GPU, vLLM V1's serving defaults. On a CPU, measured with
# the default model (SmolLM2-135M, fp32) on a 2-core AMD EPYC (`python -m stages 06 bench`,
# plots/06_chunked.json, "defaults"):
GPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 256
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64


def default_max_num_batched_tokens(
    device: torch.device, *, chunked_prefill: bool, max_model_len: int
) -> int:
    """The step's token budget when the config gives none.

    Without chunked prefill a whole prompt runs in one forward, so the budget must cover the
    context: max(2048, max_model_len) on every device. With chunking, the budget bounds how long
    one step takes, which is how long every running stream waits for its next token. On a GPU a
    2,048-token step costs little more than a decode (vLLM V1's serving default). On a CPU the
    step's cost grows with its tokens (the linear layers) and with tokens x cached context (the
    attention of a chunk late in a long prompt). Measured while a 3,000-token prompt arrived
    (medians of 3): the longest gap a running stream saw was 1.75 s with 512-token chunks and
    1.02 s with 256, and the prompt's time to first token 8.2 vs 8.6 s (the attention over its
    context is the same work in any chunk size; only the ~30 ms fixed cost of a step, a batch-1
    decode's, is paid more often).
    """
    if not chunked_prefill:
        return max(2048, max_model_len)
    return GPU_MAX_NUM_BATCHED_TOKENS if device.type == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


def default_long_prefill_token_threshold(device: torch.device) -> int:
    """The most tokens one request gets per step where a config caps it (stage 15's
    long-context preset): one default chunked step's worth, 256 on a CPU and 2,048 on a GPU.

    A lone long prompt then takes as many steps as the budget allows, on either device (a cap
    of 256 on a GPU, whose budget is 2,048, made it take 8x the steps to its first token); the
    cap matters when the budget is raised above the default, where it keeps one prompt from
    taking a whole step and shutting a second out."""
    return GPU_MAX_NUM_BATCHED_TOKENS if device.type == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


def default_async_scheduling(device: torch.device) -> bool:
    """Whether steps overlap (stage 05's async scheduling) when the config does not say: stage
    15's default, on with CUDA and off on a CPU.

    On a GPU the forward runs on the device while the host schedules and prepares the next
    step, so the host's work hides (vLLM and SGLang turn their overlap on by default there).
    On the H100 runs (docs/devices.md, 'What has run where') it gained 1.22-1.67x at batch
    1 for the 135M shape without CUDA graphs and 1.38-1.55x with them.
    On a CPU the forward is host work too, on the same cores, and there is nothing to hide it
    under. Measured on this course's 2-core CPU (an Intel Xeon with AMX, 2026-11-29), stage 15
    on the embedded model, each setting in a process of its own, alternating
    (`plots/step_profile/async_on_off_embedded*_2026-11-29.log`): at one stream 24.3, 24.3,
    23.7, 23.7, 23.5 tok/s with the overlap and 24.2, 24.3, 24.4, 23.7, 23.5 without; at 64
    streams 299, 299, 296 with it and 325, 312, 303 without. The runner's thread (stage 05)
    costs the engine its hand-offs instead: 8 to 10 context switches a step, and its own CPU
    time per step (docs/step_cost.md).
    """
    return device.type != "cpu"


# torch's own default, read once at import: the physical cores it would use (hyperthreads left
# out), or OMP_NUM_THREADS when set.
_DEFAULT_CPU_THREADS = torch.get_num_threads()


def cpu_threads_per_process(processes: int = 1) -> int:
    """Intra-op threads for each of `processes` processes that run a model on this host's CPU
    at once (data-parallel engine cores, stage 10): each takes its share of torch's default.

    One engine takes every core, offline and served: its matmuls split across them, and the
    front end's work is a short burst per step. Data-parallel cores that each took every core
    would run 2x the threads on the cores, and OpenMP threads that spin-wait for each other
    lose their time slices to the other replica's. Measured on a 2-core AMD EPYC (stage 10,
    `python tools/serve_compare.py --stage 10 --config data_parallel_size=2 --no-llama`,
    128 tokens per answer, one run): two replicas of two threads each served 30.3 tok/s at 8
    streams and 78.7 at 32; with a thread each, 120.7 and 247.0 (one stream alone: 23.2 ->
    18.6 tok/s, the cost of a replica using half the machine). A user's OMP_NUM_THREADS wins.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    return max(1, _DEFAULT_CPU_THREADS // processes)


def place_cpu_threads(device: torch.device, processes: int) -> None:
    """In a process that runs a model on `device`: on a CPU, take this process's share of the
    cores (`cpu_threads_per_process`), unless OMP_NUM_THREADS says otherwise."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_process(processes))


def default_max_num_seqs(device: torch.device) -> int:
    """The most requests decoded together when the config gives none.

    More seats let more requests start at once (a request beyond the limit waits for a whole
    earlier one to finish: 64 streams at 32 seats came in two waves, TTFT p50 29 s), but every
    running stream's step grows with the batch. On a GPU, vLLM's 256. On the CPU a decode step
    took 32, 51, 79, 137 and 266 ms at batch 1, 8, 32, 64 and 128: 31, 157, 405, 467 and 481
    tokens/s. Throughput stops rising near 64, so more seats would only slow every stream. 64
    seats also fit the default CPU KV pool (1 GiB holds ~23,000 SmolLM2 tokens: ~360 per seat).
    A pool too small for its seats is not an error: the scheduler preempts, as it always has.
    """
    return GPU_MAX_NUM_SEQS if device.type == "cuda" else CPU_MAX_NUM_SEQS
