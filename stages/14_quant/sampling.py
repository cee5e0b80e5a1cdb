"""Sampling parameters and the batched sampler that turns logits into next tokens.

The order of operations is the one vLLM and transformers use: divide the logits by the
temperature, keep the top-k, keep the smallest set of tokens whose probability reaches top-p,
then draw from what is left. A temperature below SAMPLING_EPS (or top_k=1) means greedy: the
most likely token. The sampler is vectorized as vLLM V1's is: every row's parameters are
tensors, one pass serves the whole batch, and nothing waits for the device (no .item()).

Seeds are counter-based. The noise for a token is a hash of (seed, offset, vocab index), where
offset is the position of the token being sampled; no generator carries state between steps.
So a request preempted and recomputed redraws exactly what it drew before, and a row's token
does not depend on which rows share its batch or on its row index. The noise is integer
arithmetic, bit-identical on every device (the float math after it may differ in rounding).

The draw is the exponential race (the Gumbel-max trick): with E_i ~ Exp(1) independent,
argmax_i p_i / E_i is token i with probability p_i, so one argmax replaces torch.multinomial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows)


MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256  # OpenAI allows 4 stops


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate for one request. Invalid values raise ValueError at construction."""

    max_tokens: int | None = 16  # None: as many as the context leaves room for
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first match
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks want fixed lengths)

    def __post_init__(self) -> None:
        # Normalise user-friendly inputs (a single string, a list) into immutable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
                f"max_tokens must be an integer, got {self.max_tokens!r}",
            )
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        # Chained comparisons also reject NaN (it fails every comparison) and inf.
        t = self.temperature
        _check(0 <= t < math.inf, f"temperature must be finite and >= 0, got {t}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be a list of non-empty strings",
        )
        # Stop checks run on the host for every token of every request: bound their cost, so
        # one request cannot slow every other request's step.
        _check(
            len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _to_int64(value: int) -> int:
    """Fold any Python int into int64 by its low 64 bits (so -1 and 2**64 - 1 are one seed)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def _int64_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """`values` folded to int64 (`_to_int64`) as a tensor; folding each one only when some
    value is out of int64's range (the check is two C loops, the fold a Python call each)."""
    if values and (min(values) < -(2**63) or max(values) >= 2**63):
        values = [_to_int64(v) for v in values]
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """One batch's sampling parameters as per-row device tensors, plus host-side flags that
    say which work any row needs (decided from the params, so no device sync).

    An all-greedy batch, the common one, carries its seeds and offsets only: the argmax
    decides every row, so the four per-row tensors of neutral values (temperature, top-k,
    top-p, greedy) would be built and copied to the device every step for nothing. They are
    None then, and nothing reads them (`sample` and `probabilities` stop at `all_greedy`).
    The persistent batch's all-greedy step goes further (`GREEDY_BATCH`): no tensor at all,
    seeds and offsets None too, since only a draw reads them (stage 08's acceptance test
    draws for greedy rows too, and builds its tensors with `from_params`)."""

    temperature: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None: all greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None: all greedy
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled; None: all greedy
    seeds: torch.Tensor | None  # [B] int64; None: all greedy, nothing draws (GREEDY_BATCH)
    offsets: torch.Tensor | None  # [B] int64, position of the token being sampled; as seeds
    greedy: torch.Tensor | None  # [B] bool; None: all greedy
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    filter_rows: torch.Tensor | None  # rows that need top-k/top-p: only they pay for the sort

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        offsets: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingTensors:
        """Seeds: one int per row, any size or sign (folded to int64 by their low 64 bits, so
        -1 and 2**64 - 1 are the same seed). Offsets: the position of the token sampled."""
        if not len(params) == len(seeds) == len(offsets):
            raise ValueError(f"{len(params)} params, {len(seeds)} seeds, {len(offsets)} offsets")
        host = torch.device("cpu")
        seed_array = _int64_tensor(seeds, host).numpy()
        offsets = _int64_tensor(offsets, host).numpy()
        greedy = np.fromiter((p.greedy for p in params), bool, count=len(params))
        if greedy.all():  # the common batch: no neutral rows to build, copy or read
            return cls.greedy_rows(seed_array, offsets, device)
        rows = SamplingArrays(
            temperature=np.array([p.temperature for p in params], dtype=np.float64),
            top_k=np.array([min(p.top_k, TOP_K_OFF) for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float64),
            greedy=greedy,
            seeds=seed_array,
        )
        return cls.from_arrays(rows, offsets, vocab_size, device)

    @classmethod
    def from_arrays(
        cls,
        rows: SamplingArrays,
        offsets: np.ndarray,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingTensors:
        """The same from per-row arrays (the persistent batch keeps them per seat, stage 05:
        no Python loop over the batch). Disabled and greedy rows get the neutral values."""
        if rows.greedy.all():
            return cls.greedy_rows(rows.seeds, offsets, device)
        greedy = rows.greedy
        top_k = np.where(greedy | (rows.top_k <= 0) | (rows.top_k >= vocab_size), vocab_size,
                         rows.top_k)  # fmt: skip
        top_p = np.where(greedy, 1.0, rows.top_p)  # compared in float64, as the params hold it
        filtered = np.flatnonzero((top_k < vocab_size) | (top_p < 1.0))
        return cls(
            temperature=torch.as_tensor(
                np.where(greedy, 1.0, rows.temperature), dtype=torch.float32, device=device
            ),
            top_k=torch.as_tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.as_tensor(top_p, dtype=torch.float32, device=device),
            seeds=torch.as_tensor(rows.seeds, device=device),
            offsets=torch.as_tensor(offsets, dtype=torch.int64, device=device),
            greedy=torch.as_tensor(greedy, device=device),
            all_greedy=False,
            any_top_k=bool((top_k < vocab_size).any()),
            any_top_p=bool((top_p < 1.0).any()),
            filter_rows=torch.as_tensor(filtered, device=device) if len(filtered) else None,
        )

    @classmethod
    def greedy_rows(
        cls, seeds: np.ndarray, offsets: np.ndarray, device: torch.device
    ) -> SamplingTensors:
        """An all-greedy batch (int64 seeds, folded, and offsets): the argmax decides every
        row, so it holds no per-row settings."""
        return cls(
            temperature=None,
            top_k=None,
            top_p=None,
            seeds=_tensor(seeds, device),
            offsets=_tensor(offsets.astype(np.int64, copy=False), device),
            greedy=None,
            all_greedy=True,
            any_top_k=False,
            any_top_p=False,
            filter_rows=None,
        )


# An all-greedy step's sampling tensors (`InputBatch.sampling_tensors`): none. Shared by every
# such step (frozen, and it holds nothing a step could change); `sample` returns the argmax.
GREEDY_BATCH = SamplingTensors(
    temperature=None,
    top_k=None,
    top_p=None,
    seeds=None,
    offsets=None,
    greedy=None,
    all_greedy=True,
    any_top_k=False,
    any_top_p=False,
    filter_rows=None,
)

TOP_K_OFF = 2**62  # a top_k beyond any vocabulary: off (an int64 holds it, a huge int may not)


@dataclass(frozen=True, slots=True)
class SamplingArrays:
    """Per-row sampling settings as numpy arrays (float64 and int64, as the params hold
    them; the rows' neutral values are `SamplingTensors.from_arrays`'s business)."""

    temperature: np.ndarray  # [B] float64
    top_k: np.ndarray  # [B] int64, 0 (or anything outside 1..vocab-1): off
    top_p: np.ndarray  # [B] float64
    greedy: np.ndarray  # [B] bool: SamplingParams.greedy
    seeds: np.ndarray  # [B] int64, folded (`_to_int64`)

    @classmethod
    def unset(cls, n: int) -> SamplingArrays:
        """`n` rows of the defaults (greedy, seed 0), before any request sets them."""
        zeros = lambda: np.zeros(n, dtype=np.int64)
        return cls(np.ones(n), zeros(), np.ones(n), np.ones(n, dtype=bool), zeros())


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k and top-p nucleus. logits: [B, V].

    Ties with a row's k-th largest logit stay. Top-p applies to the top-k survivors: a token
    is dropped when the probability mass ranked above it already reaches top_p, so the most
    likely token always stays, and top_p = 1 drops nothing (even where float32 rounds the
    mass above a token up to 1). top_k = V is off. Surviving logits are left unchanged."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # one sort for the batch
    kth_largest = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # ties with it stay
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    drop = (mass_before >= top_p.unsqueeze(1)).logical_and_((top_p < 1.0).unsqueeze(1))
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


_GOLDEN = _to_int64(0x9E3779B97F4A7C15)  # splitmix64's constants, as int64
_MUL1 = _to_int64(0xBF58476D1CE4E5B9)
_MUL2 = _to_int64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift: torch's >> on int64 copies the sign bit, so mask the copies away."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, a bijection on 64 bits (int64 multiplication wraps)."""
    z = (z ^ _shift_right(z, 30)).mul_(_MUL1)
    z = (z ^ _shift_right(z, 27)).mul_(_MUL2)
    return z ^ _shift_right(z, 31)


def random_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based noise [B, V] float32 in (0, 1), a pure function of (seed, offset, index).

    Row key = mix(mix(seed) + offset * golden); entry v is output v + 1 of the splitmix64
    stream that starts at the row key. Its top 23 bits k give u = (2k + 1) / 2**24: never 0
    (so -log u is finite) and never 1 (so the race never divides by 0).
    """
    key = _mix64(_mix64(seeds) + offsets * _GOLDEN)
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)
    z = index.mul_(_GOLDEN) + key.unsqueeze(1)  # [B, V]; in place from here on (speed)
    z ^= _shift_right(z, 30)
    z *= _MUL1
    z ^= _shift_right(z, 27)
    z *= _MUL2
    # _mix64's last step, z ^= z >>> 31, leaves the top 33 bits as they are: skipped.
    return _shift_right(z, 41).mul_(2).add_(1).float().mul_(2.0**-24)


def _filtered_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k / top-p where a row asks for them, then softmax (a fresh tensor:
    the race may divide it in place). Never for an all-greedy batch, which has no such rows."""
    assert tensors.temperature is not None and tensors.top_k is not None
    assert tensors.top_p is not None
    logits = logits.float() / tensors.temperature.unsqueeze(1)
    rows = tensors.filter_rows
    if rows is not None:  # sort only the rows whose top-k / top-p is on
        kept = apply_top_k_top_p(logits[rows], tensors.top_k[rows], tensors.top_p[rows])
        logits = logits.index_copy_(0, rows, kept)
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Next token of every row of `logits` [B, V]: [B] int64 on the logits' device.

    Greedy rows take the argmax; the others race `_filtered_probs` against the counter-based
    noise of `random_uniform` (seeds, offsets): the same (seed, position) draws the same token.
    An all-greedy batch draws no noise at all (random_uniform is not called), and nothing here
    waits for the device (no .item(), .tolist() or host copy)."""
    greedy_tokens = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return greedy_tokens
    probs = _filtered_probs(logits, tensors)
    exponential = random_uniform(tensors.seeds, tensors.offsets, logits.shape[-1]).log_().neg_()
    sampled = probs.div_(exponential).argmax(dim=-1)  # the exponential race
    return torch.where(tensors.greedy, greedy_tokens, sampled)


def probabilities(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from [B, V] float32: one-hot on the argmax for a
    greedy row. Speculative decoding verifies drafts against these (stage 08)."""
    greedy = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    greedy.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if tensors.all_greedy:
        return greedy
    return torch.where(tensors.greedy.unsqueeze(1), greedy, _filtered_probs(logits, tensors))


def sampling_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: broadcast a single one, or check the list's length."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`. On a CPU it shares the array's memory, as `as_tensor`
    does there, but through `from_numpy`, which does less: with the runner on its own thread
    (stage 05 on) the step switched threads less often with it (stage 05's README counts it)."""
    if device.type == "cpu":
        return torch.from_numpy(array)
    return torch.as_tensor(array, device=device)
