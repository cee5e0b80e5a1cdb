"""Stage 14's quantized KV cache where stages 12 and 13 copy blocks: a block is its codes and its
scales, and every copy carries both (`kv_quant.block_tensors`).

- The host tier's copy engine: store, then load into other block ids, is bit-exact in codes and
  scales; a write past offset 0 into the loaded block gives what the block that never left
  gives (the scale grows from the same value).
- In the engine (kv_cache_dtype="int8"): a request swapped out, its device blocks wiped, and
  swapped back in holds the codes and scales of a run that was never preempted, and produces its
  tokens; a prefix evicted to the host tier comes back as a host hit with exactly the logits of
  a device prefix hit.
- The transfer: the fake and the gloo transports move codes and scales bit-exactly into other
  block ids; an int8 pair of engines decodes within the int8 cache's bound of teacher forcing
  while computing one prompt token per request; an int8 prefill engine and a float decode engine
  refuse each other's blocks (a layout error, never garbage) and the decode engine computes the
  prompts itself.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

import pytest
import torch

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject
from .test_13_disagg import _bounded, _decode_prompt_tokens, _no_leaks, _pair

pytestmark = [
    since("14"),
    subject(
        "quant/kv_cache.py",
        "offload/copy_engine.py",
        "offload/connector.py",
        "disagg/transport.py",
        "harness/fake_transport.py",
    ),
]

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
PROMPTS = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]
HOST = 2**20
TIGHT_BLOCKS = 24
SYSTEM = list(range(60, 60 + 33))  # 8 full blocks and one token
KV_ATOL = 0.3  # test_14_quant.KV_ATOL["int8"]: int8 cache vs fp32 on llama-gqa, measured 0.09


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _greedy(stage, n=12):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _filled_cache(stage, num_blocks: int, fmt: str = "int8", seed: int = 0):
    """A quantized pool whose first four blocks hold three tokens each, written in two steps so
    that some scales grew."""
    kv_quant = _module(stage, "quant.kv_cache")
    cache = kv_quant.QuantizedPagedKVCache(LAYERS, num_blocks, BLOCK, HEADS, DIM, fmt)
    generator = torch.Generator().manual_seed(seed)
    for offsets, spread in (((0, 1), 1.0), ((2,), 3.0)):
        slots = torch.tensor([b * BLOCK + o for b in range(4) for o in offsets])
        for layer in range(LAYERS):
            k, v = (spread * torch.randn(len(slots), HEADS, DIM, generator=generator) for _ in "kv")
            cache.write(layer, k, v, slots)
    return cache


def _same_blocks(a, a_ids, b, b_ids, block_tensors) -> None:
    for x, y in zip(block_tensors(a), block_tensors(b), strict=True):
        assert torch.equal(x[:, list(a_ids)], y[:, list(b_ids)]), x.dtype


# ------------------------------------------------------------------------------ host tier
def test_the_copy_engine_moves_codes_and_scales_and_a_loaded_block_grows_as_if_it_never_left(
    stage,
):
    kv_quant, copy_engine = _module(stage, "quant.kv_cache"), _module(stage, "offload.copy_engine")
    block_tensors = kv_quant.block_tensors
    device = _filled_cache(stage, num_blocks=6)
    kept = _filled_cache(stage, num_blocks=6)  # the same writes: the block that never leaves
    k, v, *scales = block_tensors(device)
    pool = copy_engine.KVPool(k, v, tuple(scales))
    engine = copy_engine.CopyEngine(pool, copy_engine.host_pool_like(k, 5, pool.scales))
    try:
        engine.submit(copy_engine.TransferJob("out", "store", (0, 1, 2, 3), (4, 0, 3, 1)))
        engine.wait(["out"])
        for tensor in block_tensors(device):
            tensor.zero_()  # the device blocks are reused meanwhile
        engine.submit(copy_engine.TransferJob("in", "load", (4, 0, 3, 1), (5, 4, 2, 0)))
        engine.wait(["in"])
        assert all(ok for _, ok in engine.take_finished())
    finally:
        engine.close()
    _same_blocks(device, (5, 4, 2, 0), kept, (0, 1, 2, 3), block_tensors)
    # Past the block's range in every head (|x| up to 40, the writes above stay near 8): the
    # scales must grow.
    big = torch.linspace(-40.0, 40.0, HEADS * DIM).reshape(1, HEADS, DIM)
    before = device.k_scale[0, 5].clone()
    device.write(0, big, -big, torch.tensor([5 * BLOCK + 3]))
    kept.write(0, big, -big, torch.tensor([0 * BLOCK + 3]))
    _same_blocks(device, (5,), kept, (0,), block_tensors)
    assert device.k_scale[0, 5].gt(before).all(), "the write was meant to grow the scales"


def _state_at(llm, request, num_tokens, block_tensors):
    """The codes of a request's first `num_tokens` positions and the scales of their blocks."""
    table = llm.kv_manager.block_ids(request.request_id)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)])
    blocks = torch.tensor(table[: -(-num_tokens // BLOCK)])
    k, v, k_scale, v_scale = block_tensors(llm.kv_cache)
    flat = (k.shape[0], -1, *k.shape[3:])
    codes = [c.reshape(flat)[:, slots].clone() for c in (k, v)]
    return [*codes, k_scale[:, blocks].clone(), v_scale[:, blocks].clone()]


def test_an_int8_swap_restores_the_codes_and_scales_of_a_run_never_preempted(
    stage, make_llm, tiny_model
):
    block_tensors = _module(stage, "quant.kv_cache").block_tensors
    llm = make_llm(
        stage, tiny_model("llama-gqa"), block_size=BLOCK, kv_cache_dtype="int8",
        kv_offload_bytes=HOST, preemption_mode="swap", prefix_caching=False,
        async_scheduling=False,
    )  # fmt: skip
    runs = {}
    for preempt in (False, True):
        request = llm.make_request(PROMPTS[2], _greedy(stage))
        llm.add_request(request)
        for _ in range(5):
            llm.step()
        target = request.num_computed_tokens + 3
        if preempt:
            llm.scheduler._preempt(request)
            llm.step()  # the store runs
            for tensor in block_tensors(llm.kv_cache):
                tensor.zero_()
        while request.num_computed_tokens < target:
            llm.step()
        assert request.num_computed_tokens == target
        state = _state_at(llm, request, target, block_tensors)
        while llm.has_unfinished():
            llm.step()
        runs[preempt] = state, list(request.output_token_ids)
    assert llm.scheduler.num_swapped_out >= 1
    for got, want in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(got, want), got.dtype
    assert runs[True][1] == runs[False][1]
    llm.check_no_leaks()


def test_an_int8_prefix_from_the_host_tier_is_a_device_hit_bit_for_bit(stage, make_llm, tiny_model):
    path = tiny_model("llama-gqa")
    device_hit = make_llm(stage, path, block_size=BLOCK, kv_cache_dtype="int8")
    per_block = sum(
        t[:, 0].numel() * t.element_size()
        for t in _module(stage, "quant.kv_cache").block_tensors(device_hit.kv_cache)
    )
    tiers = make_llm(
        stage, path, block_size=BLOCK, kv_cache_dtype="int8",
        kv_cache_bytes=per_block * TIGHT_BLOCKS, kv_offload_bytes=HOST,
    )  # fmt: skip
    first, later = [*SYSTEM, 1, 2, 3], [*SYSTEM, 7, 8]
    fillers = [[200 + 10 * i + j for j in range(30)] for i in range(3)]
    loaded, seen = tiers.kv_connector.stats.tokens_loaded, {}
    for llm in (tiers, device_hit):
        llm.generate([first], _greedy(stage, 4))
        for filler in fillers if llm is tiers else ():
            llm.generate([filler], _greedy(stage, 4))
        with step_logits(llm) as recorded:
            out = llm.generate([later], _greedy(stage, 6))[0]
        seen[llm is tiers] = out.num_cached_tokens, out.token_ids, recorded[out.request_id]
    assert tiers.kv_connector.stats.tokens_loaded > loaded, "the host tier was meant to supply it"
    assert seen[True][0] == seen[False][0] == len(SYSTEM) // BLOCK * BLOCK
    assert seen[True][1] == seen[False][1]
    torch.testing.assert_close(torch.stack(seen[True][2]), torch.stack(seen[False][2]))
    tiers.check_no_leaks()


# ------------------------------------------------------------------------------ transfer
def test_the_fake_transport_moves_codes_and_scales_and_refuses_another_layout(stage):
    transport, fake = _module(stage, "disagg.transport"), _module(stage, "harness.fake_transport")
    block_tensors = _module(stage, "quant.kv_cache").block_tensors
    sent, received = _filled_cache(stage, 6), _filled_cache(stage, 6, seed=1)
    prefill, decode = fake.FakeTransport.pair()
    prefill.start_send("r", sent, (3, 0)).result(timeout=1)
    decode.start_recv("r", received, (1, 5)).result(timeout=1)
    _same_blocks(received, (1, 5), sent, (3, 0), block_tensors)
    other = _filled_cache(stage, 6, fmt="fp8")
    prefill.start_send("x", sent, (2,)).result(timeout=1)
    with pytest.raises(transport.TransferError, match="not this pool's"):
        decode.start_recv("x", other, (0,)).result(timeout=1)
    with pytest.raises(transport.TransferError, match="layout"):  # gloo checks the header
        transport.check_header(transport.encode_header("x", sent, 1), "x", other, 1)


def test_gloo_moves_codes_and_scales_between_two_ends(stage):
    """Both ends in one process, one thread each (a gloo pair meets through its TCP store)."""
    transport = _module(stage, "disagg.transport")
    block_tensors = _module(stage, "quant.kv_cache").block_tensors
    sent, received = _filled_cache(stage, 6, fmt="fp8"), _filled_cache(stage, 6, "fp8", seed=1)
    # stage 09's rendezvous: a store on a port the OS picked, held as long as the test runs
    (_store, init), ends, errors = _module(stage, "parallel.group").open_rendezvous(2, 60.0), {}, []

    def meet(rank: int) -> None:
        try:
            ends[rank] = transport.GlooTransport(
                rank, init, 10.0, connect_timeout_seconds=30.0, serve_store=False
            )
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=meet, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(ends) == 2, errors
    try:
        receiving = ends[0].start_recv("r", received, (4, 1, 0))
        ends[1].start_send("r", sent, (0, 2, 3)).result(timeout=30)
        receiving.result(timeout=30)
    finally:
        for end in ends.values():
            end.close()
    _same_blocks(received, (4, 1, 0), sent, (0, 2, 3), block_tensors)


def test_an_int8_pair_decodes_within_the_int8_bound_on_transferred_blocks(
    stage, make_llm, tiny_model
):
    """Teacher forcing over fresh fp32 K/V vs the decode engine reading transferred codes: within
    the int8 cache's bound (lost scales would put it units away), one prompt token computed
    on the decode side per request."""
    pair = _pair(stage, make_llm, tiny_model("llama-gqa"), "int8", kv_cache_dtype="int8")
    computed = _decode_prompt_tokens(pair)
    loaded = pair.decode.kv_connector.stats.tokens_loaded
    try:
        with step_logits(pair.decode) as recorded:
            outputs = pair.generate(PROMPTS, [_greedy(stage)] * len(PROMPTS), on_step=_bounded())
    finally:
        del pair.decode.scheduler.schedule
    assert_logits_match_teacher_forcing(pair.decode, outputs, recorded, atol=KV_ATOL)
    assert sum(computed) == len(PROMPTS)
    assert pair.decode.kv_connector.stats.tokens_loaded > loaded
    _no_leaks(pair)


def test_an_int8_prefill_and_a_float_decode_refuse_each_other_at_start_up(
    stage, make_llm, tiny_model
):
    """Two engines whose `kv_cache_dtype` differ cannot use each other's blocks: the second to
    start (here the decode engine) refuses at the transport's handshake, with a ValueError
    that names the setting, before any request (not a failed transfer per request)."""
    path = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _pair(
            stage, make_llm, path, "int8-to-float", decode_config={"kv_cache_dtype": "auto"},
            kv_cache_dtype="int8",
        )  # fmt: skip
