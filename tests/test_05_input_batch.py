"""Stage 05: the persistent batch packs a step exactly as packing it from scratch would.

The runner keeps a seat per running request and its block-table row from step to step
(`input_batch.py`), writing a row only where the table changed, and computes positions and slots
with array operations. The oracle is the plain per-request packing that stages 01-04 do: random
steps (requests joining, finishing, growing a block, preempted and back with a new table, ids
reused, more requests than seats) must give the same inputs, step after step. The sampling
tensors the batch gathers from its seats must equal the ones built from every sampled request's
params (`SamplingTensors.from_params`).
"""

from __future__ import annotations

import importlib
import itertools
import random

import pytest
import torch

from .conftest import since, unit

pytestmark = since("05")
BLOCK = 4


def _modules(stage):
    return (
        importlib.import_module(f"{stage.__name__}.input_batch"),
        importlib.import_module(f"{stage.__name__}.scheduler_output"),
        importlib.import_module(f"{stage.__name__}.sampling"),
    )


def _plain(requests, width=None):
    """The per-request packing of stages 01-03 (the oracle)."""
    ids, positions, slots, logits = [], [], [], []
    for r in requests:
        start = r.num_computed_tokens
        ids += r.token_ids
        for p in range(start, start + len(r.token_ids)):
            positions.append(p)
            slots.append(r.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
        if r.sample:
            logits.append(len(ids) - 1)
    width = width or max(len(r.block_ids) for r in requests)
    tables = [[*r.block_ids, *[0] * (width - len(r.block_ids))] for r in requests]
    query = [len(r.token_ids) for r in requests]
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "logits_indices": logits,
        "query_start_loc": [0, *itertools.accumulate(query)],
        "seq_lens": [r.num_computed_tokens + len(r.token_ids) for r in requests],
        "block_tables": tables,
        "sampled_request_ids": [r.request_id for r in requests if r.sample],
    }


def _packed(step):
    return {
        "input_ids": step.input_ids.tolist(),
        "positions": step.positions.tolist(),
        "slot_mapping": step.slot_mapping.tolist(),
        "logits_indices": step.logits_indices.tolist(),
        "query_start_loc": step.query_start_loc.tolist(),
        "seq_lens": step.seq_lens.tolist(),
        "block_tables": step.block_tables.tolist(),
        "sampled_request_ids": list(step.sampled_request_ids),
    }


def _same_sampling(got, want):
    """Two SamplingTensors hold the same values (None where the other is None)."""
    for name in ("all_greedy", "any_top_k", "any_top_p"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("temperature", "top_k", "top_p", "seeds", "offsets", "greedy", "filter_rows"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), (name, a, b)


def _random_params(sampling, rng):
    """Greedy (three ways), plain, top-k, top-p, both, and the edges of the neutral values."""
    P = sampling.SamplingParams
    return rng.choice([
        P(temperature=0), P(temperature=0.7, top_k=1), P(temperature=1e-9), P(temperature=0.8),
        P(temperature=1.3, top_k=5), P(top_p=0.9), P(temperature=0.5, top_k=3, top_p=0.5),
        P(top_k=VOCAB), P(top_k=VOCAB - 1), P(top_k=2**80), P(top_p=1 - 1e-12),
    ])  # fmt: skip


VOCAB = 50


@unit("input_batch.py")
@pytest.mark.parametrize("seed", range(4))
def test_the_persistent_batch_packs_what_packing_from_scratch_does(stage, seed):
    input_batch, scheduler_output, sampling = _modules(stage)
    rng = random.Random(seed)
    batch = input_batch.InputBatch(max_num_seqs=4, max_blocks=3, block_size=BLOCK)  # grows
    live: dict[str, dict] = {}  # request id -> its table and cached tokens
    next_block, names = 0, itertools.count()

    def blocks(n):
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    last_seats: dict[str, int] = {}  # the previous step's requests and their seats
    for _ in range(60):
        for request_id in [r for r in live if rng.random() < 0.15]:  # finished
            del live[request_id]
        while len(live) < 6 and rng.random() < 0.6:  # joined (an id may come back)
            request_id = f"r{rng.randrange(8)}" if rng.random() < 0.3 else f"n{next(names)}"
            seed_ = rng.choice([0, 7, -1, 2**64 - 1, 2**70 + 3])
            new_state = {"table": [], "computed": 0, "params": _random_params(sampling, rng)}
            live.setdefault(request_id, {**new_state, "seed": seed_})
        for state in live.values():
            if state["computed"] and rng.random() < 0.1:  # preempted, back with a new table
                state["table"], state["computed"] = [], rng.choice([0, state["computed"]])
        if not live:
            continue
        scheduled = rng.sample(sorted(live), rng.randint(1, len(live)))
        requests = []
        for request_id in scheduled:
            state = live[request_id]
            new = rng.randint(1, 5) if state["computed"] == 0 else rng.choice([1, 1, 1, 3])
            end = state["computed"] + new
            missing = -(-end // BLOCK) - len(state["table"])
            state["table"] += blocks(max(0, missing))
            requests.append(
                scheduler_output.ScheduledRequest(
                    request_id=request_id, admission_id=0,
                    token_ids=tuple(rng.randrange(100) for _ in range(new)),
                    num_computed_tokens=state["computed"], params=state["params"],
                    seed=state["seed"], sample=rng.random() < 0.8,
                    block_ids=tuple(state["table"]),
                )
            )  # fmt: skip
            state["computed"] = end
        width = rng.choice([None, None, 12])
        step = batch.pack(requests, width)
        assert _packed(step) == _plain(requests, width)
        sampled = [r for r in requests if r.sample]
        want = sampling.SamplingTensors.from_params(
            [r.params for r in sampled], [r.seed for r in sampled],
            [r.num_computed_tokens + len(r.token_ids) for r in sampled], VOCAB, torch.device("cpu"),
        )  # fmt: skip
        got = batch.sampling_tensors(step, VOCAB, torch.device("cpu"))
        if want.all_greedy:  # the argmax decides every row: no tensor to build at all
            assert got is sampling.GREEDY_BATCH
        else:
            _same_sampling(got, want)
        # A request in two steps in a row keeps its seat, and `rows_by_seat` maps each seat to
        # its request's row among the sampled ones: stage 05's placeholders find their tokens so
        seats = dict(zip((r.request_id for r in requests), step.seats.tolist(), strict=True))
        assert all(seats[i] == s for i, s in last_seats.items() if i in seats), "a seat moved"
        last_seats = seats
        rows = batch.rows_by_seat(step).tolist()
        want_rows = {seats[r.request_id]: row for row, r in enumerate(sampled)}
        assert rows == [want_rows.get(seat, -1) for seat in range(len(rows))]


@unit("input_batch.py")
def test_an_all_greedy_step_carries_no_sampling_tensor(stage):
    """A step whose requests all sample greedily gets the shared `GREEDY_BATCH` (nothing to
    build or copy). A random request's step gets its real tensors, and once it leaves, the
    seat it held is greedy again, even for a request that brings the same params object and
    seed back to that seat (its settings are written afresh, not assumed kept)."""
    input_batch, scheduler_output, sampling = _modules(stage)
    batch = input_batch.InputBatch(max_num_seqs=2, max_blocks=2, block_size=BLOCK)
    greedy, random_ = sampling.SamplingParams(temperature=0), sampling.SamplingParams(top_p=0.9)

    def step(*requests):
        scheduled = [
            scheduler_output.ScheduledRequest(
                request_id=request_id, admission_id=0, token_ids=(5,), num_computed_tokens=0,
                params=params, seed=3, sample=True, block_ids=(seat,),
            )
            for seat, (request_id, params) in enumerate(requests)
        ]  # fmt: skip
        return batch.sampling_tensors(batch.pack(scheduled), VOCAB, torch.device("cpu"))

    assert step(("a", greedy), ("b", greedy)) is sampling.GREEDY_BATCH
    mixed = step(("a", greedy), ("c", random_))
    assert not mixed.all_greedy and mixed.greedy.tolist() == [True, False]
    assert step(("a", greedy)) is sampling.GREEDY_BATCH  # c skipped: its seat samples nothing
    batch.release(["c"])
    assert step(("a", greedy), ("d", greedy)) is sampling.GREEDY_BATCH  # d took c's seat
    batch.release(["a", "d"])
    assert not step(("e", random_), ("f", random_)).all_greedy
    batch.release(["e", "f"])
    assert step(("e", greedy), ("f", greedy)) is sampling.GREEDY_BATCH
    assert not step(("e", random_), ("f", greedy)).all_greedy  # same id, params changed


@unit("input_batch.py")
def test_a_decode_step_writes_only_the_rows_that_gained_a_block(stage):
    """Four requests decode for eight steps: a row is written when its request joins and again
    only when its table gains a block (every BLOCK tokens), never copied in between."""
    input_batch, scheduler_output, sampling = _modules(stage)
    batch = input_batch.InputBatch(max_num_seqs=4, max_blocks=8, block_size=BLOCK)
    params = sampling.SamplingParams(temperature=0)
    tables = {f"r{i}": [10 * i] for i in range(4)}
    for position in range(2, 10):
        requests = []
        for request_id, table in tables.items():
            if position // BLOCK >= len(table):
                table.append(table[-1] + 1)
            requests.append(
                scheduler_output.ScheduledRequest(
                    request_id, 0, (7,), position, params, 0, True, tuple(table)
                )
            )
        batch.pack(requests)
    # joined at position 2 (4 writes), a block at positions 4 and 8 (4 writes each)
    assert batch.rows_written == 12


def test_the_kept_decode_rows_are_only_read(stage, make_llm, tiny_model):
    """A decode step's row offsets (`InputBatch._decode_rows`: 0..n and 0..n-1) are one set
    of arrays per batch size, shared by every later decode step of that size: after a whole
    run, with prompts and decodes of several sizes, each still holds what it was made with
    (a step that wrote into one would have changed every step after it)."""
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    # Three lengths: the decode batch shrinks from 3 requests to 1 as they finish.
    params = [stage.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    llm.generate([[11, 12, 13], [14, 15], [16, 17, 18, 19]], params)
    batch = getattr(llm.runner, "inputs", llm.runner).batch
    assert set(batch._decode_rows_of) >= {1, 2, 3}
    for n, (starts, last_rows, starts32) in batch._decode_rows_of.items():
        assert starts.tolist() == list(range(n + 1)) == starts32.tolist()
        assert last_rows.tolist() == list(range(n))
