"""A step's inputs: the scheduler's output packed into flat tensors for one forward.

Input preparation is the model runner's largest piece and it is bookkeeping over plain lists:
which row holds which new token, where its K/V go (`slot_mapping`), which logits rows sample and
at which position, which rows are drafts to verify, which inputs are placeholders for a token the
previous step sampled. It lives apart from the runner (as vLLM V1's `InputBatch` does) so that the
runner reads as what it does with the inputs: start a step, forward, sample.

The values go to the host staging buffers of `input_buffers.py`; the step copies them to the
device when it runs, in launch order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from .cuda_graphs import GraphPlan
from .input_batch import InputBatch, PackedStep
from .input_buffers import InputBuffers, Staged
from .model import AttentionMetadata
from .sampling import SamplingTensors
from .scheduler_output import PLACEHOLDER, SchedulerOutput
from .spec_decode.drafters import DRAFT, DraftPlan

# Field readers run by `map` over every request of every step: the loops stay in C, where a
# generator would run Python once per request, several passes a step.
_NUM_DRAFTS = operator.attrgetter("num_draft_tokens")
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
    num_drafts: tuple[int, ...] = ()  # per sampled request: drafts to verify (0: plain sample)
    draft_rows: torch.Tensor | None = None  # input rows of every draft, in request order
    verify_rows: torch.Tensor | None = None  # the logits row that verifies each draft
    draft_plan: DraftPlan | None = None  # requests whose drafts the draft model writes
    write_blocks: frozenset[int] = frozenset()  # blocks the forward writes (with a connector)
    graph_bucket: int | None = None  # a decode step padded to this bucket's CUDA graph


class InputPreparer:
    """Packs each launched step's scheduler output into the runner's persistent buffers. It
    remembers which output row each request sampled in the last step: the source of that
    request's placeholder in the next one."""

    def __init__(
        self,
        buffers: InputBuffers,
        block_size: int,
        attention_backend: str,
        vocab_size: int,
        track_writes: bool = False,
    ) -> None:
        self.buffers, self.block_size = buffers, block_size
        self.attention_backend, self.vocab_size = attention_backend, vocab_size
        self.track_writes = track_writes  # a KV connector needs the blocks each forward writes
        # The last step packed: where its sampled tokens sit, for the placeholders of the next
        self._last_step: PackedStep | None = None
        seats = buffers.sizes["seq_lens"][0]  # the persistent batch (input_batch.py)
        blocks = buffers.sizes["block_tables"][0] // max(1, seats)
        self.batch = InputBatch(seats, blocks, block_size)

    def prepare(
        self,
        scheduler_output: SchedulerOutput,
        bucket: int | None = None,
        plan: GraphPlan | None = None,
    ) -> ModelInputs:
        """Pack every scheduled request's new tokens end to end, with the metadata attention
        needs to find each sequence's cached K/V through its block table (the persistent batch
        of `input_batch.py` keeps the tables and computes the per-token inputs with array
        operations). The values go to the host staging buffers; the step copies them to the
        device when it runs. Called once per launched step, in launch order (a placeholder's
        source is the previous step's row). A
        decode step that replays a CUDA graph (`bucket`, stage 15) is padded to the graph's size."""
        requests = scheduler_output.requests
        width = plan.max_blocks if bucket is not None and plan is not None else None
        step = self.batch.pack(requests, width)  # a graph reads tables of a full context's width
        logits_rows: list[int] | np.ndarray = []
        draft_rows: list[int] = []
        verify_rows: list[int] = []
        sampled, row_params, row_seeds, row_offsets = [], [], [], []
        drafting: list[tuple] = []  # per request the draft model drafts for: its DraftPlan entries
        sampling = None
        if not any(map(_NUM_DRAFTS, requests)):  # the common step: one row each
            logits_rows = step.logits_indices
            sampling = self.batch.sampling_tensors(step, self.vocab_size, HOST)  # by seat
        else:  # rows of the last real token and of each draft, per sampling request
            ends = step.query_start_loc[1:].tolist()
            for index, (r, last) in enumerate(zip(requests, ends, strict=True)):
                if not r.sample:
                    continue
                end = r.num_computed_tokens + r.num_new_tokens
                drafts = r.num_draft_tokens
                last_real = last - drafts - 1
                sampled.append(r)
                verify_rows += range(len(logits_rows), len(logits_rows) + drafts)
                logits_rows += range(last_real, last)
                draft_rows += range(last_real + 1, last)
                row_params += [r.params] * (drafts + 1)
                row_seeds += [r.seed] * (drafts + 1)
                row_offsets += range(end - drafts, end + 1)  # the position each row samples
                if drafts and r.token_ids[-1] == DRAFT:  # the draft model writes them
                    draft = (last_real, drafts, end - drafts - 1, index, r.params, r.seed)
                    drafting.append(draft)
        placeholders = sources = NO_ROWS  # steps that do not overlap have none
        if (step.input_ids == PLACEHOLDER).any():
            placeholders, sources = self.batch.placeholder_sources(step, self._last_step)
        values = {
            "input_ids": step.input_ids,
            "positions": step.positions,
            "slot_mapping": step.slot_mapping,
            "logits_indices": logits_rows,
            "query_start_loc": step.query_start_loc,
            "seq_lens": step.seq_lens,
            "block_tables": step.block_tables.ravel(),
            "placeholder_rows": placeholders,
            "placeholder_sources": sources,
            "draft_rows": draft_rows,
            "verify_rows": verify_rows,
        }
        if bucket is not None:  # pad the batch to its graph's size
            assert plan is not None
            values = plan.pad(values, len(requests), bucket)
        staged, device = self.buffers.stage(values)
        self._last_step = step  # for the next step's placeholders
        n, num_tokens = len(requests), len(step.input_ids)  # the real rows (padding: more)
        width, prefix = step.width, self.buffers.prefix  # real rows, as views kept across steps
        meta = AttentionMetadata(
            query_start_loc=prefix("query_start_loc", n + 1),
            seq_lens=prefix("seq_lens", n),
            block_tables=self.buffers.matrix("block_tables", n, width),
            slot_mapping=prefix("slot_mapping", num_tokens),
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            attention_backend=self.attention_backend,
        )
        if sampling is None:  # a row per draft: from each row's params
            sampling = SamplingTensors.from_params(
                row_params, row_seeds, row_offsets, self.vocab_size, HOST
            )
        draft_plan = None
        if drafting:
            rows, num_drafts, contexts, table_rows, params, seeds = zip(*drafting, strict=True)
            draft_plan = DraftPlan(
                rows=rows,
                num_drafts=num_drafts,
                contexts=contexts,
                table_rows=table_rows,
                params=params,
                seeds=seeds,
            )
        return ModelInputs(
            input_ids=prefix("input_ids", num_tokens),
            positions=prefix("positions", num_tokens),
            attn_metadata=meta,
            logits_indices=device["logits_indices"],
            sampling=sampling,
            sampled_request_ids=step.sampled_request_ids,  # who samples, in row order
            every_row_samples=len(logits_rows) == len(step.input_ids),
            staged=staged,
            placeholder_rows=device["placeholder_rows"] if len(placeholders) else None,
            placeholder_sources=device["placeholder_sources"] if len(placeholders) else None,
            num_drafts=tuple(map(_NUM_DRAFTS, sampled)),  # empty without drafts: none to verify
            draft_rows=device["draft_rows"] if draft_rows else None,
            verify_rows=device["verify_rows"] if draft_rows else None,
            draft_plan=draft_plan,
            write_blocks=frozenset((step.slot_mapping // self.block_size).tolist())
            if self.track_writes
            else frozenset(),
            graph_bucket=bucket,
        )
