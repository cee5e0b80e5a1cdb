"""Stage 03 promises: one attention over the paged KV cache serves any mix of fresh prompts,
prompts continuing a cached context, and decodes; the Triton kernel, the PyTorch reference and
the CPU dispatcher all equal a naive oracle, and the attention is causal."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

import pytest
import torch

from .conftest import needs_triton, since, unit

pytestmark = [since("03"), unit("kernels.py")]


def _kernels(stage):
    return importlib.import_module(f"{stage.__name__}.kernels")


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    seqs: list[tuple[int, int]]  # (context, query_len) per sequence

    @property
    def args(self) -> tuple:
        return (
            self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
            self.block_tables, self.scale,
        )  # fmt: skip

    def to(self, device: torch.device) -> Batch:
        """The same batch on `device` (`pytest --device cuda` runs the kernels natively)."""
        moved = {
            name: getattr(self, name).to(device)
            for name in ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables")
        }
        return replace(self, **moved)

    def positions(self, s: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of positions 0 .. length - 1 of sequence s."""
        block_size = self.k_cache.shape[1]
        p = torch.arange(length, device=self.block_tables.device)
        return self.block_tables[s, p // block_size].long(), p % block_size

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K/V (the new tokens' rows of the cache), as the model would pass them."""
        ks, vs = [], []
        for s, (context, length) in enumerate(self.seqs):
            blocks, slots = self.positions(s, context + length)
            ks.append(self.k_cache[blocks[context:], slots[context:]])
            vs.append(self.v_cache[blocks[context:], slots[context:]])
        return torch.cat(ks), torch.cat(vs)

    def dispatch(self, kernels, backend: str, *, cache: bool = True) -> torch.Tensor:
        k_new, v_new = self.new_kv()
        return kernels.paged_attention(
            self.q, k_new, v_new,
            self.k_cache if cache else None, self.v_cache if cache else None,
            self.query_start_loc, self.seq_lens, self.block_tables if cache else None, self.scale,
            query_lens=tuple(length for _, length in self.seqs),
            context_lens=tuple(context for context, _ in self.seqs),
            backend=backend,
        )  # fmt: skip


def _batch(heads, kv_heads, dim, block_size, seqs, seed=0, dtype=torch.float32) -> Batch:
    """Random K/V in a pool whose block tables use shuffled blocks and leave spare ones; the
    entries past a sequence's last block are garbage."""
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = len(seqs) * width + 8

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    shuffled = torch.randperm(num_blocks, generator=generator)
    tables = shuffled[: len(seqs) * width].view(len(seqs), width).to(torch.int32)
    for s, (context, length) in enumerate(seqs):  # unused entries are arbitrary, even invalid
        tables[s, -(-(context + length) // block_size) :] = -1 if s % 2 else num_blocks + s
    query_lens = [n for _, n in seqs]
    return Batch(
        q=randn(sum(query_lens), heads, dim),
        k_cache=randn(num_blocks, block_size, kv_heads, dim),
        v_cache=randn(num_blocks, block_size, kv_heads, dim),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=tables,
        scale=dim**-0.5,
        seqs=list(seqs),
    )


def _oracle(batch: Batch) -> torch.Tensor:
    """Naive: for each query token, walk its visible positions through the block table one by
    one, and take a plain softmax over their scores."""
    q, k_cache, v_cache = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    token = 0
    for s, (context, length) in enumerate(batch.seqs):
        keys, values = [], []
        for p in range(context + length):
            block = int(batch.block_tables[s, p // block_size])
            keys.append(k_cache[block, p % block_size].repeat_interleave(group, dim=0))
            values.append(v_cache[block, p % block_size].repeat_interleave(group, dim=0))
        k, v = torch.stack(keys, dim=1), torch.stack(values, dim=1)  # [heads, seq_len, dim]
        for i in range(length):
            visible = context + i + 1  # positions 0 .. context + i
            scores = (k[:, :visible] @ q[token, :, :, None])[..., 0] * batch.scale
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            weights = weights / weights.sum(dim=1, keepdim=True)
            out[token] = (weights[:, :, None] * v[:, :visible]).sum(dim=1)
            token += 1
    return out.to(batch.q.dtype)


def _decodes(lengths):
    """The old decode-only table: one query token at the end of each sequence."""
    return [(n - 1, 1) for n in lengths]


# heads, kv_heads, head_dim, block_size, [(context, query_len), ...]
CASES = {
    # pure decodes (ragged lengths, block boundaries, GQA 3 and 4, block sizes 1 and 32)
    "decode-one-token": (4, 4, 16, 16, _decodes([1])),
    "decode-block-boundaries": (4, 4, 16, 16, _decodes([15, 16, 17, 32, 33])),
    "decode-gqa3-smollm-shape": (9, 3, 64, 16, _decodes([5, 40])),
    "decode-gqa4-ragged": (12, 3, 16, 8, _decodes([100, 1, 64, 9])),
    "decode-gqa4-block1": (8, 2, 16, 1, _decodes([3, 7])),
    "decode-gqa2-block32": (8, 4, 32, 32, _decodes([31, 32, 65])),
    # a decode step alone: one sequence, and equal lengths
    "decode-one-sequence": (9, 3, 64, 16, _decodes([37])),
    "decode-equal-lengths": (9, 3, 64, 16, _decodes([20, 20, 20])),
    "decode-odd-head-dim": (6, 3, 24, 4, _decodes([13, 40])),
    # whole prompts (context 0), several query tiles each
    "prompts": (4, 2, 16, 16, [(0, 5), (0, 17), (0, 1)]),
    "prompts-gqa3": (9, 3, 24, 4, [(0, 16), (0, 3)]),
    # prompt chunks continuing a cached context (not block-aligned, crossing block boundaries)
    "chunks-after-context": (6, 3, 24, 4, [(5, 7), (13, 6), (8, 2)]),
    "few-queries-long-cache": (8, 2, 16, 8, [(90, 4)]),
    "chunk-wide-group": (20, 1, 8, 4, [(5, 3), (0, 2)]),  # one query token per program
    # everything at once, in shuffled order
    "mixed-smollm-shape": (9, 3, 64, 16, [(20, 1), (0, 9), (33, 5), (0, 1), (7, 1), (16, 16)]),
    "mixed-block1": (8, 2, 16, 1, [(3, 1), (0, 4), (5, 3), (9, 1)]),
    "mixed-block32": (8, 4, 32, 32, [(40, 2), (0, 20), (31, 1), (32, 1)]),
    # the contiguous layout: one block of max_model_len per sequence
    "mixed-contiguous-layout": (4, 2, 16, 128, [(9, 1), (0, 5), (30, 1), (12, 3)]),
}
MIXED = [name for name in CASES if name.startswith(("mixed", "chunk"))]


def _case(name: str, **kwargs) -> Batch:
    return _batch(*CASES[name], seed=sorted(CASES).index(name), **kwargs)


@needs_triton
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_and_reference_match_naive_oracle(stage, case, device):
    """On the test device (`pytest --device`): interpreted on a CPU, compiled on a GPU, where
    the kernel's fp32 dot must not drop to TF32 (1e-5 would fail)."""
    kernels, on_host = _kernels(stage), _case(case)
    oracle, batch = _oracle(on_host), on_host.to(device)
    reference = kernels.unified_attention_reference(*batch.args)
    triton_out = kernels.unified_attention_triton(*batch.args)
    torch.testing.assert_close(reference.cpu(), oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(triton_out.cpu(), oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_dispatcher_matches_reference(stage, case):
    kernels, batch = _kernels(stage), _case(case)
    reference = kernels.unified_attention_reference(*batch.args)
    torch.testing.assert_close(batch.dispatch(kernels, "torch"), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(4, 1), (39, 1)], [(36, 1)]], ids=["two", "one"])
def test_cpu_decodes_mask_by_the_real_lengths_when_the_hosts_are_an_upper_bound(stage, seqs):
    """A captured graph's host lengths say the largest context for every row (runner_graphs),
    and the table has a spare column past the real blocks: the CPU path masks by `seq_lens`
    and clamps the spare entries, so the answer is the one the exact lengths give."""
    kernels, batch = _kernels(stage), _batch(9, 3, 64, 16, seqs, seed=11)
    reference = kernels.unified_attention_reference(*batch.args)
    spare = torch.full((len(seqs), 1), -1, dtype=torch.int32)  # garbage, even out of range
    tables = torch.cat([batch.block_tables, spare], dim=1)
    bound = tables.shape[1] * batch.k_cache.shape[1] - 1
    k_new, v_new = batch.new_kv()
    out = kernels.paged_attention(
        batch.q, k_new, v_new, batch.k_cache, batch.v_cache, batch.query_start_loc,
        batch.seq_lens, tables, batch.scale,
        query_lens=(1,) * len(seqs), context_lens=(bound,) * len(seqs), backend="torch",
    )  # fmt: skip
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("case", MIXED)
def test_triton_dispatcher_matches_reference(stage, case, device):
    kernels, batch = _kernels(stage), _case(case).to(device)
    reference = kernels.unified_attention_reference(*batch.args)
    torch.testing.assert_close(batch.dispatch(kernels, "triton"), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dispatcher_without_a_cache(stage, backend, device):
    """Every context 0 (teacher-forced logits): no pool, no block tables, same answer."""
    batch = _batch(6, 2, 24, 4, [(0, 7), (0, 1), (0, 18)], seed=7).to(device)
    kernels = _kernels(stage)
    reference = kernels.unified_attention_reference(*batch.args)
    out = batch.dispatch(kernels, backend, cache=False)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "implementation", ["reference", pytest.param("triton", marks=needs_triton), "dispatcher"]
)
def test_attention_is_causal(stage, implementation, device):
    """Query i of a chunk after 5 cached tokens sits at position 5 + i: changing the K/V of a
    later position leaves its output alone, changing its own or an earlier one does not."""
    kernels = _kernels(stage)
    attend = {
        "reference": lambda b: kernels.unified_attention_reference(*b.args),
        "triton": lambda b: kernels.unified_attention_triton(*b.args),
        "dispatcher": lambda b: b.dispatch(kernels, "torch"),
    }[implementation]
    batch = _batch(4, 2, 16, 4, [(3, 2), (5, 6)], seed=3).to(device)  # rows 2..7: positions 5..10
    before = attend(batch)
    for position in (10, 7, 5, 3):
        blocks, slots = batch.positions(1, position + 1)
        changed = replace(batch, k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
        changed.k_cache[blocks[position], slots[position]] += 1.0
        changed.v_cache[blocks[position], slots[position]] -= 2.0
        after = attend(changed)
        sees = [row for row in range(2, 8) if position <= 5 + row - 2]
        blind = [row for row in range(8) if row not in sees]
        torch.testing.assert_close(after[blind], before[blind], atol=0, rtol=0)
        for row in sees:
            assert (after[row] - before[row]).abs().max() > 1e-3, (position, row)


@needs_triton
def test_bf16_triton_matches_reference(stage, device):
    kernels = _kernels(stage)
    batch = _case("mixed-smollm-shape", dtype=torch.bfloat16).to(device)
    reference = kernels.unified_attention_reference(*batch.args)
    assert reference.dtype == torch.bfloat16
    torch.testing.assert_close(
        kernels.unified_attention_triton(*batch.args), reference, atol=2e-2, rtol=2e-2
    )
    torch.testing.assert_close(batch.dispatch(kernels, "torch"), reference, atol=2e-2, rtol=2e-2)


def test_missing_triton_is_a_clear_error(stage, monkeypatch):
    kernels, batch = _kernels(stage), _case("prompts")
    monkeypatch.setattr(kernels, "triton", None)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        kernels.unified_attention_triton(*batch.args)


@needs_triton
def test_triton_launch_names_a_tensor_on_another_device(stage):
    """Triton reads raw pointers: on a GPU a host tensor in the launch failed deep in the
    launcher ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"), naming
    nothing, and the CPU's interpreter never looks at devices. The launch checks first and
    names the tensor; here `meta` stands in for the other device. The dispatcher's no-cache
    path (teacher forcing) builds its block table beside `query_start_loc`, so host metadata
    with device activations is named too, not a mixed-device add."""
    kernels, batch = _kernels(stage), _case("prompts")
    for name in ("q", "k_cache", "seq_lens", "block_tables"):
        moved = replace(batch, **{name: getattr(batch, name).to("meta")})
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            kernels.unified_attention_triton(*moved.args)
    q, k_new, v_new = (t.to("meta") for t in (batch.q, *batch.new_kv()))
    with pytest.raises(ValueError, match="query_start_loc is on cpu"):
        kernels.paged_attention(
            q, k_new, v_new, None, None, batch.query_start_loc, batch.seq_lens, None,
            batch.scale, query_lens=tuple(n for _, n in batch.seqs),
            context_lens=(0,) * len(batch.seqs), backend="triton",
        )  # fmt: skip


@pytest.mark.parametrize("case", ["prompts-gqa3", "chunks-after-context", "mixed-smollm-shape"])
def test_cpu_dispatcher_runs_only_fused_attention(stage, case):
    """On a CPU, SDPA is fast only on its fused (flash) kernel; with grouped K/V heads or an
    unfit mask it silently falls back to unfused matmuls that hold every score in memory (a
    chunk over a long context ran 2-3x slower). With the fallback disabled the dispatcher must
    still run, and still match the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels, batch = _kernels(stage), _case(case)
    reference = kernels.unified_attention_reference(*batch.args)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = batch.dispatch(kernels, "torch")
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["chunks-after-context", "mixed-smollm-shape"])
def test_cpu_dispatcher_without_the_fused_kernel(stage, case, monkeypatch):
    """Where PyTorch has no fused CPU kernel that returns the log-sum-exp (another device, an
    older torch), the unfused fallback gives the same answer."""
    kernels, batch = _kernels(stage), _case(case)
    reference = kernels.unified_attention_reference(*batch.args)
    cpu_attention = importlib.import_module(f"{stage.__name__}.cpu_attention")
    monkeypatch.setattr(cpu_attention, "_FLASH_CPU", None)
    torch.testing.assert_close(batch.dispatch(kernels, "torch"), reference, atol=1e-5, rtol=1e-5)
