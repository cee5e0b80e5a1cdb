"""The model runner: the only part of the engine that touches the model and its KV cache.

    SchedulerOutput (plain data) --prepare_inputs--> flat tensors + AttentionMetadata
                                 --execute_model---> forward, logits, sampling --> token ids

The split is nano-vllm's and vLLM V1's (`ModelRunner`, `GPUModelRunner`): the scheduler decides
*what* runs, the runner decides *how*. Everything the runner needs comes in the scheduler's
output, so a later stage can run it in another process (a tensor-parallel worker) or overlap it
with the scheduling of the next step (async scheduling) without touching the scheduler.

Here the cache is one pool of blocks, sized from a memory budget when the runner starts
(`runner_memory.py`). The scheduler sends each request's block table; the runner turns it into
the batch's block-table tensor and the slot mapping that says where each new token's K/V go.

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

With tensor parallelism (stage 09) every rank has a runner like this one over its shard of the
model and of the KV cache (`tp`); each builds its inputs from the same scheduler output, and the
collectives inside the forward keep them in step (parallel/executor.py).

The inputs live in persistent device buffers (`input_buffers.py`): `prepare_inputs` writes a
step's values into host staging memory, and the step itself starts by copying them over, in
launch order. Nothing in a step waits for the device, and no step's input tensor is freed while
a forward may still read it.

With a KV connector (stage 12: a host tier, offload/connector.py) every rank also runs the worker
side of the connector on its own shard: a step first starts the transfers its metadata names (after
the compute queued before), waits for any transfer still on a block its forward writes, runs the
forward, and returns without waiting for its stores: they end in a later step, which reports
them (offload/connector.py). A step may carry transfers and no request. A transfer to or from
another engine (stage 13, disagg/transfer_worker.py) also runs across steps: the step only starts
it, and later steps report it drained.

With CUDA graphs (stage 15, runner_graphs.py) the runner captures the decode forward at start
and replays it for a pure decode step, padded to its bucket, instead of running the model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig

from .config import EngineConfig
from .cuda_graphs import resolve_cuda_graphs
from .input_buffers import PinnedOutputs, to_device
from .kernels import resolve_attention_backend
from .kv_connector.base import KVConnectorMetadata, KVConnectorOutput
from .kv_connector.runner_side import make_kv_connector
from .model import AttentionMetadata, CausalLM
from .model_inputs import InputPreparer, ModelInputs
from .model_loader import load_model
from .moe.expert_parallel import EPGroup
from .moe.layer import MoESettings
from .parallel.group import TPGroup
from .quant.linear import quant_config_for
from .runner_graphs import capture_decode_graphs, cuda_graphs_reason, graph_bucket
from .runner_memory import allocate_input_buffers, allocate_kv_cache
from .sampling import probabilities, sample
from .scheduler_output import SchedulerOutput
from .spec_decode.drafters import DraftModelProposer
from .spec_decode.rejection_sampler import (
    NO_TOKEN,
    acceptance_uniforms,
    race_exponentials,
    rejection_sample,
)


class StepHandle:
    """A launched step. `result()` waits for it: request id -> its new tokens (one, or with
    speculative decoding the accepted drafts and one more). `done()` says, without waiting,
    whether the step has finished, so a caller can wait with a deadline and give up early
    (stage 09's executor does, when a tensor-parallel peer dies)."""

    def __init__(
        self,
        request_ids: tuple[str, ...],
        wait: Callable[[], list[list[int]]],
        done: Callable[[], bool] = lambda: True,
    ) -> None:
        self.request_ids, self._wait, self.done = request_ids, wait, done

    def result(self) -> dict[str, list[int]]:
        """Each request's row without its NO_TOKEN padding. A step without drafts has rows of
        one token, which is never padding: they are returned as they are, not filtered one by
        one: a list built per request per step for nothing."""
        rows = self._wait()
        if not rows or len(rows[0]) == 1:  # rows of one [B, W] tensor: W == 1, no drafts
            return dict(zip(self.request_ids, rows, strict=True))
        pairs = zip(self.request_ids, rows, strict=True)
        return {request_id: [t for t in row if t != NO_TOKEN] for request_id, row in pairs}


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
        tp: TPGroup | None = None,
    ) -> None:
        self.device, self.dtype, self.model_config = device, dtype, model_config
        self.tp = tp or TPGroup()  # this rank's tensor-parallel group (size 1: stage 08)
        # Expert parallelism: the same ranks split the experts; attention is replicated.
        self.ep = EPGroup()
        if config.expert_parallel:
            self.ep = EPGroup(self.tp.rank, self.tp.size, self.tp.group)
        self.attention_tp = TPGroup() if config.expert_parallel else self.tp
        moe = MoESettings(config.moe_dispatch, config.moe_split_experts, config.moe_top_k)
        self.linear_backend = resolve_linear_backend(config.linear_backend, device, dtype)
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        assert config.max_model_len is not None  # the engine resolves it
        quant = (
            "auto"  # decided by the loader once the weights are in (quant/auto.py)
            if config.quantization == "auto"
            else quant_config_for(
                config.quantization, config.quant_group_size, config.quant_activations
            )
        )
        self.model: CausalLM = load_model(
            model_path, model_config, device, dtype, config.max_model_len, self.linear_backend,
            tp=self.attention_tp, moe=moe, ep=self.ep, quant=quant,
        )  # fmt: skip
        self.cuda_graphs_reason = cuda_graphs_reason(  # why graphs are off, for a reader
            config, device, self.attention_backend, self.tp.size, self.model
        )
        use_graphs = resolve_cuda_graphs(config.cuda_graphs, self.cuda_graphs_reason)
        # With CUDA graphs one block more than the scheduler's pool: the padding rows' scratch.
        self.kv_cache = allocate_kv_cache(
            config, model_config, config.max_model_len, device, dtype, self.tp, self.attention_tp,
            int(use_graphs),
        )  # fmt: skip
        self.num_blocks = self.kv_cache.num_blocks - int(use_graphs)
        self.block_size = self.kv_cache.block_size
        self.kv_connector = make_kv_connector(config, self.kv_cache)
        self.num_host_blocks = getattr(self.kv_connector, "num_host_blocks", 0)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CPU with async scheduling: runs launched steps in order (None: each runs in `launch`)
        self._worker: ThreadPoolExecutor | None = None
        self.buffers = allocate_input_buffers(config, self.block_size, device, self._stream)
        self._outputs = PinnedOutputs()  # CUDA: where the sampled ids come back
        self.inputs = InputPreparer(
            self.buffers,
            self.block_size,
            self.attention_backend,
            model_config.vocab_size,
            track_writes=self.kv_connector is not None,
        )
        self._last_sampled: torch.Tensor | None = None  # the previous step's ids, on the device
        self.draft_proposer = (
            DraftModelProposer(self.model, config.draft_num_layers)
            if config.speculative == "draft"
            else None
        )
        self.graphs = None  # captured last, over the buffers and the cache above
        if use_graphs:
            self.graphs = capture_decode_graphs(
                config,
                self.model,
                self.kv_cache,
                self.buffers,
                self.attention_backend,
                self.num_blocks,
            )

    def take_kv_connector_output(self) -> KVConnectorOutput:
        """What this rank's transfers did since the last call (empty without a connector)."""
        if self.kv_connector is None:
            return KVConnectorOutput()
        return self.kv_connector.take_output()

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Pack the step's new tokens into flat tensors and attention metadata
        (`model_inputs.py`). Called once per launched step, in launch order."""
        bucket = graph_bucket(self.graphs, scheduler_output)
        plan = self.graphs.plan if self.graphs is not None else None
        return self.inputs.prepare(scheduler_output, bucket, plan)

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Run one step and wait for it. Returns request id -> sampled token."""
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Start one step (forward the new tokens, sample) and return without waiting."""
        metadata = scheduler_output.kv_connector_metadata
        if not scheduler_output.requests and metadata is None:
            return StepHandle((), list)
        inputs = self.prepare_inputs(scheduler_output) if scheduler_output.requests else None
        request_ids = inputs.sampled_request_ids if inputs is not None else ()
        if self._stream is not None:  # CUDA: queue the step on a side stream, copy out async
            # The side stream waits for whatever the default stream queued before (nothing a
            # step reads is written there today; the wait keeps it so).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                tokens = self._run_step(inputs, metadata)
                wait, ready = self._outputs.copy_back(tokens, self._stream)
            # `ready` is polled, never blocking: a wait that can be given up
            return StepHandle(request_ids, wait, ready)
        if self._worker is None:  # a CPU without the overlap: the step runs here, now
            tokens = self._run_step(inputs, metadata).tolist()
            return StepHandle(request_ids, lambda: tokens)
        # The ids are read as lists on the worker: the engine's thread then holds no tensor
        # of the step, and the threads switched less often per step (the README measures it).
        future = self._worker.submit(lambda: self._run_step(inputs, metadata).tolist())
        return StepHandle(request_ids, future.result, future.done)

    def _run_step(
        self, inputs: ModelInputs | None, metadata: KVConnectorMetadata | None = None
    ) -> torch.Tensor:
        """Where steps run, in launch order: start the step's KV transfers, copy the staged
        inputs to the device (queued without waiting), forward and sample once no transfer is
        still on a block the forward writes, then hand the connector its end of step (stores
        stay in flight across steps)."""
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(metadata)
        if inputs is None:  # a step of KV transfers only
            tokens = torch.empty((0, 1), dtype=torch.long, device=self.device)
        else:
            if connector is not None:
                connector.handle_preemptions(inputs.write_blocks)
            self.buffers.copy_to_device(inputs.staged)
            sampling = to_device(inputs.sampling, self.device)
            if sampling is not inputs.sampling:  # a CPU's stays where it is: nothing to rebuild
                inputs = dataclasses.replace(inputs, sampling=sampling)
            tokens = self._forward_and_sample(inputs)
        if connector is not None:  # every rank reports what ended (parallel/executor.py combines)
            connector.wait_for_save()
        return tokens

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
        draft_probs = None
        if inputs.draft_plan is not None:
            assert self.draft_proposer is not None
            meta, plan = inputs.attn_metadata, inputs.draft_plan
            draft_probs = self.draft_proposer.propose(ids, meta, plan, self.kv_cache)
        greedy = None
        if inputs.graph_bucket is not None and self.graphs is not None:
            # A pure decode step: the graph ran the LM head and the argmax too. Every real
            # row samples (logits_indices is 0..n-1); the padding rows come last.
            logits, greedy = self.graphs.replay(inputs.graph_bucket)
            rows = len(inputs.sampled_request_ids)
            logits, greedy = logits[:rows], greedy[:rows]
        else:
            hidden = self.model(ids, inputs.positions, self.kv_cache, inputs.attn_metadata)
            sampled_rows = hidden if inputs.every_row_samples else hidden[inputs.logits_indices]
            logits = self.model.compute_logits(sampled_rows)
        if inputs.draft_rows is None and greedy is not None and inputs.sampling.all_greedy:
            # sampled in the graph; a copy, since the next replay overwrites the graph's output
            # while this step's ids may still wait to be read (a CPU worker runs ahead)
            tokens = greedy.unsqueeze(1).clone()
        elif inputs.draft_rows is None:  # nothing to verify: one token each
            tokens = sample(logits, inputs.sampling).unsqueeze(1)
        else:
            tokens = self._verify(logits, inputs, ids[inputs.draft_rows], draft_probs)
        if inputs.draft_rows is None:  # one token each, a torch call, not four (a CPU's step)
            self._last_sampled = tokens[:, 0]
        else:  # each request's last emitted token
            emitted = (tokens != NO_TOKEN).sum(1, keepdim=True)
            self._last_sampled = tokens.gather(1, emitted - 1)[:, 0]
        return tokens

    def _verify(
        self,
        logits: torch.Tensor,
        inputs: ModelInputs,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rejection-sample every request's drafts against the target: [requests, k + 1]
        emitted tokens, NO_TOKEN after each request's last. An n-gram draft's q is one-hot."""
        tensors, vocab = inputs.sampling, logits.shape[-1]
        cu_num_draft = [0, *itertools.accumulate(inputs.num_drafts)]
        if draft_probs is None:
            draft_probs = torch.zeros(len(draft_ids), vocab, device=logits.device)
            draft_probs.scatter_(1, draft_ids.unsqueeze(1), 1.0)
        rows = inputs.verify_rows
        assert rows is not None
        return rejection_sample(
            probabilities(logits, tensors),
            draft_probs,
            draft_ids,
            cu_num_draft,
            acceptance_uniforms(tensors.seeds[rows], tensors.offsets[rows]),
            race_exponentials(tensors.seeds, tensors.offsets, vocab),
            backend=self.attention_backend,
        ).to(logits.device)

    def rank_report(self) -> dict[str, object]:
        """This rank's share of the model: its weight bytes, KV heads and collectives so far."""
        return {
            "rank": self.tp.rank,
            "weight_bytes": self.model.decode_weight_bytes(),
            "kv_heads": self.kv_cache.k.shape[3],
            "collectives": self.tp.stats.snapshot(),
            "moe": self.ep.stats.snapshot(),
        }

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

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
