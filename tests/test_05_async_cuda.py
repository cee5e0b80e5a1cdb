"""Stage 05 on a GPU: the CUDA path of async scheduling (side stream, persistent input buffers
filled from pinned staging by non-blocking copies, tokens back through pinned memory and an
event) gives exactly the outputs of synchronous steps.

Runs only where CUDA is available: the CPU suite runs the same code with plain tensors and a
worker thread (tests/test_05_async.py), but not the streams, events and pinned memory.

    .venv/bin/pytest -q tests/test_05_async_cuda.py            # every stage from 05
"""

from __future__ import annotations

import pytest

from .conftest import requires_cuda, since

pytestmark = [
    since("05"),
    *requires_cuda("the side stream, events and pinned copies exist only there"),
]

PROMPTS = [[11 + i, 23, 5 + 3 * i, 42, *range(60, 60 + 4 * i)] for i in range(8)]


def _tight_pool_bytes(stage, path) -> int:
    """A pool of 24 blocks of 4 tokens: eight requests of up to ~60 tokens must preempt."""
    probe = stage.LLM(str(path), block_size=4, kv_cache_bytes=8 << 20, device="cuda")
    mc = probe.runner.model_config
    per_block = probe.runner.kv_cache.bytes_per_block(
        mc.num_layers, 4, mc.num_kv_heads, mc.head_dim, probe.runner.dtype
    )
    return 24 * per_block


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_cuda_async_steps_equal_sync_steps_under_preemption(stage, tiny_model, sampling):
    """Many steps, two in flight at a time, with preemptions of requests whose token is still
    in flight: async == sync token for token (the step's inputs are never overwritten or freed
    while a forward reads them, placeholders land on the right rows)."""
    path = tiny_model("llama-gqa")
    config = {"block_size": 4, "kv_cache_bytes": _tight_pool_bytes(stage, path), "device": "cuda"}
    sync = stage.LLM(str(path), async_scheduling=False, **config)
    overlapped = stage.LLM(str(path), async_scheduling=True, **config)
    extra = {"temperature": 0} if sampling == "greedy" else {"temperature": 0.9, "seed": 7}
    params = [
        stage.SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True, **extra)
        for i in range(len(PROMPTS))
    ]
    expected = [o.token_ids for o in sync.generate(PROMPTS, params)]
    for _ in range(3):  # buffers and staging slots reused across runs
        assert [o.token_ids for o in overlapped.generate(PROMPTS, params)] == expected
    assert overlapped.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert overlapped.runner.buffers.host[0]["input_ids"].is_pinned()
    outputs = overlapped.runner._outputs  # the sampled ids' pinned buffers: reused, not remade
    assert 1 <= outputs.allocated <= 4, f"{outputs.allocated} pinned output buffers"
    manager = overlapped.kv_manager
    assert manager.num_free_blocks == manager.allocator.num_blocks
