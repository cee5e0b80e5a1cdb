"""The model runner: the only part of the engine that touches the model and its KV cache.

    SchedulerOutput (plain data) --prepare_inputs--> flat tensors + AttentionMetadata
                                 --execute_model---> forward, logits, sampling --> token ids

The split is nano-vllm's and vLLM V1's (`ModelRunner`, `GPUModelRunner`): the scheduler decides
*what* runs, the runner decides *how*. Everything the runner needs comes in the scheduler's
output, so a later stage can run it in another process (a tensor-parallel worker) or overlap it
with the scheduling of the next step (async scheduling) without touching the scheduler.

Here the cache is one pool of blocks, sized from a memory budget when the runner starts. The
scheduler sends each request's block table; the runner turns it into the batch's block-table
tensor and the slot mapping that says where each new token's K/V go.

Async scheduling splits a step in two: `launch` starts it and returns at once, `StepHandle.result`
waits for its sampled tokens. Meanwhile the engine resolves the previous step and schedules the
next. A step may be launched before the previous step's tokens reach the host: those inputs are
`PLACEHOLDER`s, filled on the device from the previous step's sampled ids. On CUDA the step runs
on a side stream and its tokens come back by a non-blocking copy into pinned memory; on a CPU it
runs on one worker thread (PyTorch releases the GIL inside its kernels). Steps run in launch
order either way, which is what makes freeing a finished request's blocks early safe. With
`async_scheduling` off nothing overlaps, and a CPU runner has no worker thread at all: a step
runs on the engine's thread inside `launch`, as stage 04's did (a thread that runs nothing
beside the engine would only cost it the hand-offs).

On a CPU that worker thread also builds the runner: the model, its KV pool and the buffers
(`built_on_step_thread`). PyTorch's CPU kernels run on OpenMP, and each thread that runs a
parallel kernel gets its own OpenMP team. Built on the engine's thread, the runner left a
second, idle team there, and with more OpenMP threads than cores libgomp stops spinning
between parallel regions: every kernel of the forward then waited for its sleeping helpers to
wake. On this course's 2-core CPU the embedded model at one stream went from 20.1 to 25.5
tok/s when built on the worker (`python tools/step_profile_ab.py 12374c5 --embedded`, the log
in plots/step_profile/embedded_throughput_omp_2026-11-29.log).

The inputs live in persistent device buffers (`input_buffers.py`): `prepare_inputs` writes a
step's values into host staging memory, and the step itself starts by copying them over, in
launch order. Nothing in a step waits for the device, and no step's input tensor is freed while
a forward may still read it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stages.common.devices import kv_memory_budget
from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig

from .config import EngineConfig
from .input_batch import InputBatch, PackedStep
from .input_buffers import InputBuffers, PinnedOutputs, Staged, to_device
from .kernels import resolve_attention_backend
from .kv_cache import PagedKVCache, num_blocks_for_budget
from .model import AttentionMetadata, CausalLM
from .model_loader import load_model
from .sampling import SamplingTensors, sample
from .scheduler_output import PLACEHOLDER, SchedulerOutput

# Where a step's inputs are staged first: the step copies them over without waiting (one
# object: building a torch.device costs microseconds every step).
HOST = torch.device("cpu")
NO_ROWS = np.zeros(0, dtype=np.int64)  # an empty index array (read, never written)


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """One forward's inputs, flat over the step's new tokens. The tensors are views of the
    runner's persistent device buffers: they hold this step's values once `staged` has been
    copied in, at the start of the step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are sampled (a sequence's last new token)
    sampling: SamplingTensors  # on the host (pinned on CUDA) until the step copies it over
    sampled_request_ids: tuple[str, ...]  # whose token each sampled row is
    staged: Staged  # where the host values wait for the step's copy
    placeholder_rows: torch.Tensor | None = None  # input rows whose token the last step sampled
    placeholder_sources: torch.Tensor | None = None  # ... and that token's row in its output
    every_row_samples: bool = False  # logits_indices is every row (0..n-1): no gather needed


class StepHandle:
    """A launched step. `result()` waits for it: request id -> sampled token. `done()` says,
    without waiting, whether the step has finished, so a caller can wait with a deadline and
    give up early (stage 09's executor does, when a tensor-parallel peer dies)."""

    def __init__(
        self,
        request_ids: tuple[str, ...],
        wait: Callable[[], list[int]],
        done: Callable[[], bool] = lambda: True,
    ) -> None:
        self.request_ids, self._wait, self.done = request_ids, wait, done

    def result(self) -> dict[str, int]:
        return dict(zip(self.request_ids, self._wait(), strict=True))


def built_on_step_thread(init: Callable[..., None]) -> Callable[..., None]:
    """Run a runner's `__init__` on the worker thread that will run its steps, when its device
    is a CPU and its steps overlap the engine's work (`async_scheduling`; the module docstring
    says why: one OpenMP team per process, not two), and keep that thread as the runner's
    worker. Without the overlap a CPU runner has no worker: a step runs on the thread that
    launches it, as in stage 04, and the runner is built there. On CUDA nothing changes: the
    steps go to a stream."""

    signature = inspect.signature(init)

    @functools.wraps(init)
    def build(self: ModelRunner, *args: object, **kwargs: object) -> None:
        arguments = signature.bind(self, *args, **kwargs).arguments
        on_cpu = torch.device(arguments["device"]).type == "cpu"
        if not (on_cpu and arguments["config"].async_scheduling):
            init(self, *args, **kwargs)
            return
        worker = ThreadPoolExecutor(1, thread_name_prefix="model-runner")
        try:
            worker.submit(init, self, *args, **kwargs).result()
        except BaseException:
            worker.shutdown(wait=False)
            raise
        self._worker = worker

    return build


class ModelRunner:
    """Owns the model and the paged KV pool; runs one scheduled step at a time."""

    @built_on_step_thread
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.device, self.dtype, self.model_config = device, dtype, model_config
        self.linear_backend = resolve_linear_backend(config.linear_backend, device, dtype)
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        assert config.max_model_len is not None  # the engine resolves it
        self.model: CausalLM = load_model(
            model_path, model_config, device, dtype, config.max_model_len, self.linear_backend
        )
        self.kv_cache = self._allocate_kv_cache(config, config.max_model_len)
        self.num_blocks, self.block_size = self.kv_cache.num_blocks, self.kv_cache.block_size
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CPU with async scheduling: runs launched steps in order (None: each runs in `launch`)
        self._worker: ThreadPoolExecutor | None = None
        self.buffers = self._allocate_input_buffers(config)
        self._outputs = PinnedOutputs()  # CUDA: where the sampled ids come back
        self._last_sampled: torch.Tensor | None = None  # the previous step's ids, on the device
        # The last step packed: where its sampled tokens sit, for the placeholders of the next
        self._last_step: PackedStep | None = None
        self.batch = InputBatch(
            config.max_num_seqs, -(-config.max_model_len // self.block_size), self.block_size
        )

    def _allocate_kv_cache(self, config: EngineConfig, max_model_len: int) -> PagedKVCache:
        """Size the block pool from the memory budget, not from requests' maximum lengths."""
        mc = self.model_config
        # A contiguous reservation is one block of max_model_len tokens per request.
        block_size = max_model_len if config.kv_layout == "contiguous" else config.block_size
        per_block = PagedKVCache.bytes_per_block(
            mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        budget = config.kv_cache_bytes or kv_memory_budget(self.device)
        useful = config.max_num_seqs * -(-max_model_len // block_size)  # more would sit idle
        num_blocks = num_blocks_for_budget(budget, per_block, useful)
        return PagedKVCache(
            mc.num_layers, num_blocks, block_size, mc.num_kv_heads, mc.head_dim,
            self.dtype, self.device,
        )  # fmt: skip

    def _allocate_input_buffers(self, config: EngineConfig) -> InputBuffers:
        """One persistent device buffer per input, sized for the largest step the config
        allows (the token budget, max_num_seqs requests, a full context of blocks each)."""
        assert config.max_model_len is not None
        tokens = config.max_num_batched_tokens or max(2048, config.max_model_len)
        seqs, blocks = config.max_num_seqs, -(-config.max_model_len // self.block_size)
        long, int32 = torch.long, torch.int32
        sizes = {
            "input_ids": (tokens, long),
            "positions": (tokens, long),
            "slot_mapping": (tokens, long),
            "logits_indices": (tokens, long),
            "query_start_loc": (seqs + 1, int32),
            "seq_lens": (seqs, int32),
            "block_tables": (seqs * blocks, int32),  # [requests, width], stored flat
            "placeholder_rows": (seqs, long),
            "placeholder_sources": (seqs, long),
        }
        # A CPU without the overlap runs each step before staging the next: one copy of the
        # inputs is enough, and the step reads it where the host wrote it.
        direct = self.device.type == "cpu" and not config.async_scheduling
        return InputBuffers(sizes, self.device, self._stream, direct)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Pack every scheduled request's new tokens end to end, with the metadata attention
        needs to find each sequence's cached K/V through its block table. The persistent batch
        (`input_batch.py`) keeps the tables from step to step and computes the per-token
        inputs with array operations. The values go to the host staging buffers; the step
        copies them to the device when it runs. Called once per launched step, in launch order
        (a placeholder's source is the previous step's row)."""
        requests = scheduler_output.requests
        step = self.batch.pack(requests)
        placeholders = sources = NO_ROWS  # steps that do not overlap have none
        if (step.input_ids == PLACEHOLDER).any():
            placeholders, sources = self.batch.placeholder_sources(step, self._last_step)
        staged, device = self.buffers.stage(
            {
                "input_ids": step.input_ids,
                "positions": step.positions,
                "slot_mapping": step.slot_mapping,
                "logits_indices": step.logits_indices,
                "query_start_loc": step.query_start_loc,
                "seq_lens": step.seq_lens,
                "block_tables": step.block_tables.ravel(),
                "placeholder_rows": placeholders,
                "placeholder_sources": sources,
            }
        )
        self._last_step = step  # for the next step's placeholders
        meta = AttentionMetadata(
            query_start_loc=device["query_start_loc"],
            seq_lens=device["seq_lens"],
            block_tables=self.buffers.matrix("block_tables", len(requests), step.width),
            slot_mapping=device["slot_mapping"],
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            attention_backend=self.attention_backend,
        )
        return ModelInputs(
            input_ids=device["input_ids"],
            positions=device["positions"],
            attn_metadata=meta,
            logits_indices=device["logits_indices"],
            sampling=self.batch.sampling_tensors(
                step,
                self.model_config.vocab_size,
                HOST,  # host first: the step copies it over without waiting
            ),
            sampled_request_ids=step.sampled_request_ids,
            every_row_samples=len(step.logits_indices) == len(step.input_ids),
            staged=staged,
            placeholder_rows=device["placeholder_rows"] if len(placeholders) else None,
            placeholder_sources=device["placeholder_sources"] if len(placeholders) else None,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Run one step and wait for it. Returns request id -> sampled token."""
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Start one step (forward the new tokens, sample) and return without waiting."""
        if not scheduler_output.requests:
            return StepHandle((), list)
        inputs = self.prepare_inputs(scheduler_output)
        if self._stream is not None:  # CUDA: queue the step on a side stream, copy out async
            # The side stream waits for whatever the default stream queued before (nothing a
            # step reads is written there today; the wait keeps it so).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                tokens = self._run_step(inputs)
                wait, ready = self._outputs.copy_back(tokens, self._stream)
            # `ready` is polled, never blocking: a wait that can be given up
            return StepHandle(inputs.sampled_request_ids, wait, ready)
        if self._worker is None:  # a CPU without the overlap: the step runs here, now
            tokens = self._run_step(inputs).tolist()
            return StepHandle(inputs.sampled_request_ids, lambda: tokens)
        # The ids are read as lists on the worker: the engine's thread then holds no tensor
        # of the step, and the threads switched less often per step (the README measures it).
        future = self._worker.submit(lambda: self._run_step(inputs).tolist())
        return StepHandle(inputs.sampled_request_ids, future.result, future.done)

    def _run_step(self, inputs: ModelInputs) -> torch.Tensor:
        """Where steps run, in launch order: copy the staged inputs to the device (queued
        without waiting), then forward and sample."""
        self.buffers.copy_to_device(inputs.staged)
        sampling = to_device(inputs.sampling, self.device)
        if sampling is not inputs.sampling:  # a CPU's stays where it is: nothing to rebuild
            inputs = dataclasses.replace(inputs, sampling=sampling)
        return self._forward_and_sample(inputs)

    @torch.inference_mode()
    def _forward_and_sample(self, inputs: ModelInputs) -> torch.Tensor:
        """The device part of a step, in launch order: fill the placeholders from the previous
        step's sampled ids, forward, sample. Returns the sampled ids, still on the device.

        Input row `placeholder_rows[i]` takes the previous step's sampled id of row
        `placeholder_sources[i]` (the same request, wherever it sat in that step); this
        step's sampled ids are kept in `self._last_sampled` for the next one."""
        ids = inputs.input_ids
        if inputs.placeholder_rows is not None:
            assert self._last_sampled is not None, "a placeholder needs a previous step"
            assert inputs.placeholder_sources is not None
            ids[inputs.placeholder_rows] = self._last_sampled[inputs.placeholder_sources]
        hidden = self.model(ids, inputs.positions, self.kv_cache, inputs.attn_metadata)
        sampled_rows = hidden if inputs.every_row_samples else hidden[inputs.logits_indices]
        logits = self.model.compute_logits(sampled_rows)
        tokens = sample(logits, inputs.sampling)
        self._last_sampled = tokens
        return tokens

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence (teacher forcing), for comparing against a
        reference model. Writes nothing to the cache."""
        n = len(token_ids)
        meta = AttentionMetadata(
            query_start_loc=self._tensor([0, n], torch.int32),
            seq_lens=self._tensor([n], torch.int32),
            block_tables=None,
            slot_mapping=None,
            query_lens=(n,),
            context_lens=(0,),
            attention_backend=self.attention_backend,
        )
        ids, positions = self._tensor(token_ids), torch.arange(n, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, None, meta)).float()

    def _tensor(self, values: list | np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
        if isinstance(values, np.ndarray):
            return torch.from_numpy(values).to(device=self.device, dtype=dtype)
        return torch.tensor(values, dtype=dtype, device=self.device)
