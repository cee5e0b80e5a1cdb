"""The persistent batch: the runner's rows of the running requests, kept from step to step.

With continuous batching the batch is never rebuilt from scratch: from one step to the next,
a few requests join, a few finish, and every other request adds one token and, once every
`block_size` tokens, one block. Yet a runner that packs each step from the scheduler's output
alone redoes everything per request per step in Python: it copies and pads each block table,
and walks each new token to find its cache slot. At 256 running requests that bookkeeping
costs about as much as a small model's forward (the step profile's "prepare inputs" phase,
`python -m stages 04 bench --step-profile`).

So, as vLLM's `InputBatch` and `BlockTable` do (vllm/v1/worker/gpu_input_batch.py,
block_table.py), the runner keeps:

- a seat (a row) per running request, kept while it runs;
- the block table as one 2-D array, a row per seat, written only where it changed: a request
  that gained a block appends it; a table replaced (the request was preempted and came back)
  is written whole. The scheduler still sends each request's whole table (plain data: a
  worker in another process can read it); the runner compares it with the row's (a C-level
  tuple comparison) instead of copying it;
- each seat's sampling settings (temperature, top-k, top-p, greedy, seed) as arrays, written
  when a request takes the seat (vLLM's `temperature_cpu` and the rest): a step's sampling
  tensors are then gathered by seat (`sampling_tensors`), not rebuilt from every request's
  params;
- and the per-token inputs computed with array operations over the step, not per token:
  positions from each request's first new position, slots from the table
  (`block_table[seat, position // block_size] * block_size + position % block_size`).

Seats are reclaimed when they run out: the seats of requests not in this step (finished ones,
mostly) go back at once, so the runner needs no word from the scheduler about which requests
ended. A request that skipped a step and lost its seat gets a new one, its table written whole.
A row beyond its table's length holds zeros, as a padded table does.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .sampling import (
    GREEDY_BATCH,
    TOP_K_OFF,
    SamplingArrays,
    SamplingParams,
    SamplingTensors,
    _to_int64,
)
from .scheduler_output import PLACEHOLDER, ScheduledRequest

# The fields `pack` reads, in the order a ScheduledRequest holds them: it takes a step apart
# into columns with one `zip` over the requests (they are tuples), so the order is checked here.
_COLUMNS = (
    "request_id", "admission_id", "token_ids", "num_computed_tokens",
    "params", "seed", "sample", "block_ids",
)  # fmt: skip
if ScheduledRequest._fields[: len(_COLUMNS)] != _COLUMNS:
    raise ImportError(
        f"ScheduledRequest's fields {ScheduledRequest._fields} do not start {_COLUMNS}"
    )


@dataclass(frozen=True, slots=True)
class PackedStep:
    """One step's inputs, flat over its new tokens (numpy, ready for the staging buffers)."""

    input_ids: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    slot_mapping: np.ndarray  # [tokens] int64: where each new token's K/V go
    query_start_loc: np.ndarray  # [requests + 1] int32: each request's first row, then the end
    seq_lens: np.ndarray  # [requests] int32: cached plus new tokens
    block_tables: np.ndarray  # [requests, width] int32, zero past each table's end
    logits_indices: np.ndarray  # [sampling requests] int64: each one's last new token's row
    query_lens: tuple[int, ...]  # new tokens per request
    context_lens: tuple[int, ...]  # cached tokens per request
    seats: np.ndarray  # [requests] int64: each request's seat (its row in the kept arrays)
    sampled_seats: np.ndarray  # [sampling requests] int64: each one's seat, in row order
    sampled_offsets: np.ndarray  # [sampling requests] int64: the position each one samples
    sampled_request_ids: tuple[str, ...]  # whose token each sampled row is, in row order

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]


class InputBatch:
    """Seats and the persistent block table of the running requests."""

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_table = np.zeros((max(1, max_num_seqs), max(1, max_blocks)), dtype=np.int32)
        self._seats: dict[str, int] = {}  # request id -> its row
        self._held: list[tuple[int, ...]] = [()] * self.block_table.shape[0]  # each row's table
        self._free = list(range(self.block_table.shape[0] - 1, -1, -1))
        self.rows_written = 0  # tables written whole or appended to: what the reuse saves
        self.sampling = SamplingArrays.unset(self.block_table.shape[0])  # each seat's settings
        self._params_of: list[SamplingParams | None] = [None] * len(self._held)  # what each seat's
        self._seed_of: list[int] = [0] * len(self._held)  # sampling arrays hold, to spot a change
        self._random_seats: set[int] = set()  # seats whose request does not sample greedily
        self._decode_rows_of: dict[int, tuple[np.ndarray, ...]] = {}  # by batch size (_decode_rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the seats of these requests (rows zeroed)."""
        for request_id in request_ids:
            seat = self._seats.pop(request_id, None)
            if seat is not None:
                self._held[seat] = ()
                self.block_table[seat] = 0
                self._params_of[seat] = None  # its next request sets its sampling afresh
                self._random_seats.discard(seat)
                self._free.append(seat)

    def pack(self, requests: Sequence[ScheduledRequest], width: int | None = None) -> PackedStep:
        """The step's inputs, from the requests' new tokens and the persistent table. The
        block tables are `width` wide (None: the longest table's length; a CUDA graph reads a
        fixed width, stage 15).

        The requests are read as columns: a `ScheduledRequest` is a tuple, so one `zip`
        transposes the step in C, and each column is compared with the seats' kept values by
        `map`, also in C. Python runs per request only where something changed (a new seat, a
        table that gained a block, a new request's sampling settings). It replaced a loop that
        read each request's fields one by one: 337 -> 315 us a step at 256 requests (the step
        profile, plots/step_profile/columns_pack_2026-11-29.log), a small cut."""
        n = len(requests)
        columns = list(zip(*requests, strict=True))[: len(_COLUMNS)] if n else [()] * len(_COLUMNS)
        request_ids, _, token_ids, computed_list, params, seeds, sample_list, tables = columns
        seat_list = list(map(self._seats.get, request_ids))
        if None in seat_list:  # joined (or lost its seat while it skipped a step)
            for i in [i for i, seat in enumerate(seat_list) if seat is None]:
                seat_list[i] = self._seat(request_ids[i], requests)
        held = self._held
        changed = map(operator.ne, tables, map(held.__getitem__, seat_list))
        for i in itertools.compress(range(n), changed):  # tuples compared at C speed
            self._write(seat_list[i], tables[i])
        new_params = map(operator.is_not, params, map(self._params_of.__getitem__, seat_list))
        new_seeds = map(operator.ne, seeds, map(self._seed_of.__getitem__, seat_list))
        for i in itertools.compress(range(n), map(operator.or_, new_params, new_seeds)):
            self._set_sampling(seat_list[i], params[i], seeds[i])  # a new request's seat
        query_list = list(map(len, token_ids))
        seats = np.array(seat_list, dtype=np.int64)
        computed = np.array(computed_list, dtype=np.int64)
        total = sum(query_list)
        ids = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, count=total)
        if total == n:  # a decode step (one new token each): no per-token expansion needed
            starts, last_rows, starts32 = self._decode_rows(n)
            rows, positions, seq_lens = seats, computed, computed + 1
        else:  # each new token's request and position: vLLM's `_prepare_inputs`, no loop
            query = np.array(query_list, dtype=np.int64)
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(query, out=starts[1:])
            owner = np.repeat(np.arange(n), query)
            rows = seats[owner]
            positions = np.arange(total, dtype=np.int64) + np.repeat(computed - starts[:-1], query)
            seq_lens = computed + query
            last_rows, starts32 = starts[1:] - 1, starts.astype(np.int32)
        block, offset = np.divmod(positions, self.block_size)
        slots = self.block_table[rows, block].astype(np.int64) * self.block_size + offset
        if all(sample_list):  # every request samples (decodes, whole prompts): no mask needed
            logits_indices, sampled_seats, sampled_offsets = last_rows, seats, seq_lens
            sampled_ids = request_ids
        else:  # a prompt's intermediate chunk (stage 06) samples nothing
            sampling = np.array(sample_list, dtype=bool)
            logits_indices, sampled_seats = last_rows[sampling], seats[sampling]
            sampled_offsets = seq_lens[sampling]
            sampled_ids = tuple(itertools.compress(request_ids, sample_list))
        if width is None:
            width = max(map(len, tables)) if n else 0
        elif width > self.block_table.shape[1]:
            self._grow(columns=width)
        return PackedStep(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=starts32,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=self.block_table[seats, :width],
            logits_indices=logits_indices,
            query_lens=tuple(query_list),
            context_lens=computed_list,
            seats=seats,
            sampled_seats=sampled_seats,
            sampled_offsets=sampled_offsets,
            sampled_request_ids=sampled_ids,
        )

    def _decode_rows(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode step of `n` requests: each one's first row (0..n, int64 and int32) and its
        last (0..n-1). The same for every decode step of that size, so they are made once per
        size and kept. Every later step of that size hands out the same arrays, so they are
        only read: copied into the runner's buffers, never written there (torch refuses a
        read-only array, so no flag says it). A test
        runs an engine and checks they still hold 0..n."""
        kept = self._decode_rows_of.get(n)
        if kept is None:
            starts = np.arange(n + 1, dtype=np.int64)
            kept = self._decode_rows_of[n] = (starts, starts[:-1].copy(), starts.astype(np.int32))
        return kept

    def sampling_tensors(
        self, step: PackedStep, vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        """The step's sampling tensors, one row per sampling request, gathered from its seat's
        settings; each samples the position after its last new token. An all-greedy step, the
        common one, gets `GREEDY_BATCH`: the argmax decides every row, so it needs no tensor at
        all, and a batch with no random seat finds that out without reading an array."""
        if not self._random_seats:
            return GREEDY_BATCH
        seats = step.sampled_seats
        a = self.sampling
        greedy = a.greedy[seats]
        if greedy.all():  # the random seats sample nothing this step
            return GREEDY_BATCH
        rows = SamplingArrays(
            a.temperature[seats], a.top_k[seats], a.top_p[seats], greedy, a.seeds[seats]
        )
        return SamplingTensors.from_arrays(rows, step.sampled_offsets, vocab_size, device)

    def rows_by_seat(self, step: PackedStep) -> np.ndarray:
        """Each seat's row among `step`'s sampled requests, -1 for a seat that samples none:
        where each request's token will sit in the step's output. From stage 05 the next step
        reads it to find the tokens its placeholders stand for, by seat and with no Python per
        request: a request in two steps in a row keeps its seat (`_seat` reclaims only the
        seats of requests absent from the step it packs)."""
        rows = np.full(self.block_table.shape[0], -1, dtype=np.int64)
        rows[step.sampled_seats] = np.arange(len(step.sampled_seats))
        return rows

    def placeholder_sources(
        self, step: PackedStep, last_step: PackedStep | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each placeholder's input row in `step`, and the row of `last_step`'s output that
        holds its token: the same request's, found by its seat (`rows_by_seat`, no Python per
        request). Only a step launched before the last one resolved has any (async
        scheduling, stage 05); the runner asks only when `step` holds a PLACEHOLDER."""
        placeholders = np.flatnonzero(step.input_ids == PLACEHOLDER)
        owners = np.searchsorted(step.query_start_loc, placeholders, side="right") - 1
        if last_step is None:
            raise RuntimeError("a placeholder in the first step")
        sources = self.rows_by_seat(last_step)[step.seats[owners]]
        if (sources < 0).any():
            raise RuntimeError("a placeholder whose request sampled nothing in the last step")
        return placeholders, sources

    def _set_sampling(self, seat: int, params: SamplingParams, seed: int) -> None:
        a = self.sampling
        a.temperature[seat], a.top_p[seat] = params.temperature, params.top_p
        a.top_k[seat], a.greedy[seat] = min(params.top_k, TOP_K_OFF), params.greedy
        a.seeds[seat] = _to_int64(seed)
        self._params_of[seat], self._seed_of[seat] = params, seed
        if params.greedy:
            self._random_seats.discard(seat)
        else:
            self._random_seats.add(seat)

    def _seat(self, request_id: str, step: Sequence[ScheduledRequest]) -> int:
        if not self._free:  # reclaim the seats of requests not in this step
            present = {r.request_id for r in step}
            self.release([rid for rid in self._seats if rid not in present])
        if not self._free:  # more requests than seats (a larger step than configured): grow
            self._grow(rows=2 * self.block_table.shape[0])
        seat = self._free.pop()
        self._seats[request_id] = seat
        return seat

    def _write(self, seat: int, table: tuple[int, ...]) -> None:
        """Bring a row to `table`: append the new blocks when the row's table is its prefix,
        else write it whole (zeros after it)."""
        held = self._held[seat]
        if len(table) > self.block_table.shape[1]:
            self._grow(columns=max(len(table), 2 * self.block_table.shape[1]))
        row = self.block_table[seat]
        if len(table) >= len(held) and table[: len(held)] == held:
            row[len(held) : len(table)] = table[len(held) :]
        else:
            row[: len(table)] = table
            row[len(table) :] = 0
        self._held[seat] = table
        self.rows_written += 1

    def _grow(self, rows: int | None = None, columns: int | None = None) -> None:
        old = self.block_table
        shape = (rows or old.shape[0], columns or old.shape[1])
        self.block_table = np.zeros(shape, dtype=np.int32)
        self.block_table[: old.shape[0], : old.shape[1]] = old
        added = range(shape[0] - 1, old.shape[0] - 1, -1)
        self._held += [()] * (shape[0] - old.shape[0])
        if shape[0] > old.shape[0]:
            grown = SamplingArrays.unset(shape[0])
            for name in SamplingArrays.__slots__:
                getattr(grown, name)[: old.shape[0]] = getattr(self.sampling, name)
            self.sampling = grown
            self._params_of += [None] * (shape[0] - old.shape[0])
            self._seed_of += [0] * (shape[0] - old.shape[0])
        self._free = [*added, *self._free] if rows else self._free
