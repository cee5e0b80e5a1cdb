"""Verifying draft tokens so that the output follows the target model exactly.

A drafter proposes tokens d_1..d_k, each drawn from its distribution q; one target forward over
[last token, d_1..d_k] gives the target's distributions p_1..p_{k+1}. The modified rejection
sampling of Leviathan et al. (2023) and Chen et al. (2023) then walks the drafts in order:

    accept d_j when  p_j(d_j) >= u_j * q_j(d_j)      (u_j ~ U(0, 1): probability min(1, p/q))
    at the first rejection, emit a token from  max(p_j - q_j, 0), normalised, and stop;
    if all k are accepted, emit a bonus token from p_{k+1}.

Every emitted token is distributed exactly as the target alone would sample it, whatever q is;
a good drafter only makes acceptances likelier. Greedy requests fit the same rule: their p is
one-hot on the target's argmax (and an n-gram drafter's q is one-hot on its draft), so a draft
is accepted exactly when it is the argmax, and the token emitted at a rejection is the argmax.

Randomness is counter-based, as in sampling.py. The token emitted at position x uses the same
exponential-race noise the plain sampler would use at x (so a request with no drafts gets the
plain sampler's token); the acceptance draws and the draft model's own draws use other streams,
so the three are independent.

`rejection_sample` runs the Triton kernel (one program per request) or the PyTorch reference,
which share one signature and are tested equal under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import itertools

import torch

from stages.common.devices import kernel_device, on_device

from ..input_buffers import to_device
from ..sampling import random_uniform

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

# Pads a request's row of emitted tokens after its last one. Not a token id, and apart from the
# input sentinels (scheduler.PLACEHOLDER = -1, spec_decode.DRAFT = -2): one that leaked into an
# output would then show up, not be dropped as padding.
NO_TOKEN = -3

ACCEPT_STREAM = 0x2545F4914F6CDD1D  # xor-ed into a request's seed for its acceptance draws
DRAFT_STREAM = 0x5851F42D4C957F2D  # ... and for the draft model's own draws


def acceptance_uniforms(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """u in (0, 1) for each draft position, independent of every other draw."""
    return random_uniform(seeds ^ ACCEPT_STREAM, offsets, 1)[:, 0]


def race_exponentials(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, V] for the exponential race: argmax(probs / noise) samples probs."""
    return random_uniform(seeds, offsets, vocab).log_().neg_()


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft: list[int],
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> torch.Tensor:
    """target_probs, exponentials [D + R, V]: request r's rows start at cu_num_draft[r] + r
    (d_r + 1 of them); draft_probs [D, V], draft_token_ids [D], uniforms [D]: request r's rows
    start at cu_num_draft[r]. Returns [R, max d_r + 1] emitted tokens, NO_TOKEN after the last.

    Draft j of request r is accepted when p(d) >= uniforms[j] * q(d). At the first rejection
    the emitted token is argmax(residual / exponentials[row]) with residual = max(p - q, 0),
    and the request's walk stops there; when that residual is all zero (p == q up to
    rounding) the residual is p itself. With every draft accepted, the bonus token is
    argmax(p / exponentials[row]) of the row after the last draft."""
    num_requests = len(cu_num_draft) - 1
    widest = max(b - a for a, b in itertools.pairwise(cu_num_draft)) + 1
    out = target_probs.new_full((num_requests, widest), NO_TOKEN, dtype=torch.int64)  # its device
    for r in range(num_requests):
        first, count = cu_num_draft[r], cu_num_draft[r + 1] - cu_num_draft[r]
        row = first + r
        for j in range(count):
            token = int(draft_token_ids[first + j])
            p, q = target_probs[row + j], draft_probs[first + j]
            if p[token] >= uniforms[first + j] * q[token]:
                out[r, j] = token
                continue
            residual = (p - q).clamp_min_(0)
            if residual.sum() <= 0:  # p == q up to rounding: p itself is the residual's limit
                residual = p
            out[r, j] = int((residual / exponentials[row + j]).argmax())
            break
        else:
            out[r, count] = int((target_probs[row + count] / exponentials[row + count]).argmax())
    return out


if triton is not None:

    @triton.jit
    def _race_argmax(p_ptr, q_ptr, e_ptr, vocab, USE_Q: tl.constexpr, BLOCK_V: tl.constexpr):
        """argmax over v of score(v) / e(v), score = max(p - q, 0) (or p when that is all 0)."""
        mass = 0.0
        if USE_Q:
            for start in range(0, vocab, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                mask = offs < vocab
                p = tl.load(p_ptr + offs, mask=mask, other=0.0)
                q = tl.load(q_ptr + offs, mask=mask, other=0.0)
                mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        best = -1.0
        best_index = 0
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            score = p
            if USE_Q:
                q = tl.load(q_ptr + offs, mask=mask, other=0.0)
                score = tl.where(mass > 0, tl.maximum(p - q, 0.0), p)
            e = tl.load(e_ptr + offs, mask=mask, other=1.0)
            score = tl.where(mask, score / e, -1.0)
            block_best = tl.max(score, axis=0)
            block_index = tl.argmax(score, axis=0) + start
            if block_best > best:  # strictly: the earliest maximum wins, as torch.argmax
                best = block_best
                best_index = block_index
        return best_index

    @triton.jit
    def _rejection_kernel(
        out_ptr,
        target_ptr,
        draft_ptr,
        draft_ids_ptr,
        cu_ptr,
        u_ptr,
        e_ptr,
        vocab,
        out_stride,
        BLOCK_V: tl.constexpr,
    ):
        r = tl.program_id(0)
        first = tl.load(cu_ptr + r)
        count = tl.load(cu_ptr + r + 1) - first
        row = first + r
        rejected = 0
        for j in range(0, count):
            if rejected == 0:
                token = tl.load(draft_ids_ptr + first + j)
                p_token = tl.load(target_ptr + (row + j) * vocab + token)
                q_token = tl.load(draft_ptr + (first + j) * vocab + token)
                u = tl.load(u_ptr + first + j)
                if p_token >= u * q_token:
                    tl.store(out_ptr + r * out_stride + j, token)
                else:
                    emitted = _race_argmax(
                        target_ptr + (row + j) * vocab,
                        draft_ptr + (first + j) * vocab,
                        e_ptr + (row + j) * vocab,
                        vocab,
                        True,
                        BLOCK_V,
                    )
                    tl.store(out_ptr + r * out_stride + j, emitted.to(tl.int64))
                    rejected = 1
        if rejected == 0:
            bonus = _race_argmax(
                target_ptr + (row + count) * vocab,
                target_ptr,
                e_ptr + (row + count) * vocab,
                vocab,
                False,
                BLOCK_V,
            )
            tl.store(out_ptr + r * out_stride + count, bonus.to(tl.int64))


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft: list[int],
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> torch.Tensor:
    """The reference's contract, one Triton program per request."""
    if triton is None:
        raise RuntimeError("the Triton rejection sampler needs triton installed")
    num_requests = len(cu_num_draft) - 1
    widest = max(b - a for a, b in itertools.pairwise(cu_num_draft)) + 1
    device = target_probs.device
    out = torch.full((num_requests, widest), NO_TOKEN, dtype=torch.int64, device=device)
    vocab = target_probs.shape[1]
    draft = draft_probs if draft_probs.numel() else target_probs  # never read when D == 0
    ids = draft_token_ids if draft_token_ids.numel() else torch.zeros(1, device=device).long()
    u = uniforms if uniforms.numel() else torch.zeros(1, device=device)
    kernel_device(  # names a tensor on another device (empty ones are never read)
        target_probs=target_probs,
        draft_probs=draft,
        draft_token_ids=ids,
        uniforms=u,
        exponentials=exponentials,
    )
    cu = to_device(torch.tensor(cu_num_draft, dtype=torch.int64), device)  # does not wait
    with on_device(device):  # Triton launches on the current device
        _rejection_kernel[(num_requests,)](
            out,
            target_probs.float().contiguous(),
            draft.float().contiguous(),
            ids,
            cu,
            u.float(),
            exponentials.float().contiguous(),
            vocab,
            widest,
            BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
        )
    return out


def rejection_sample(*args: object, backend: str = "torch") -> torch.Tensor:
    """Dispatch to the Triton kernel or the PyTorch reference (see their contract)."""
    if backend == "triton":
        return rejection_sample_triton(*args)  # type: ignore[arg-type]
    return rejection_sample_reference(*args)  # type: ignore[arg-type]
