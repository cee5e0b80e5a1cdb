"""Stage 01 promises: sampling parameters mean what they say, and the batched sampler draws
from the right distribution, reproducibly per (seed, position), without waiting on the device."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from .conftest import since, unit

pytestmark = since("01")


@unit("sampling.py")
@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"top_p": float("inf")},
        {"top_k": -1},
        {"stop": [""]},
        {"stop": ["x"] * 17},
        {"stop": ["x" * 257]},
        {"stop_token_ids": list(range(257))},
    ],
)
def test_invalid_sampling_params_raise(stage, kwargs):
    with pytest.raises(ValueError):
        stage.SamplingParams(**kwargs)


def test_top_k_one_is_greedy(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    greedy = llm.generate("hello", stage.SamplingParams(max_tokens=20, temperature=0))[0]
    top1 = llm.generate(
        "hello", stage.SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=3)
    )[0]
    assert top1.token_ids == greedy.token_ids


def test_seed_makes_sampling_reproducible(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    params = [
        stage.SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
        for s in (7, 7, 8)
    ]
    a, b, c = llm.generate(["hello"] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.slow
def test_stop_string_cuts_output(stage, real_model, make_llm):
    llm = make_llm(stage, real_model)
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat(messages, stage.SamplingParams(max_tokens=40, temperature=0))[0]
    assert "5" in full.text, full.text
    cut = llm.chat(messages, stage.SamplingParams(max_tokens=40, temperature=0, stop=["5"]))[0]
    assert cut.finish_reason == "stop"
    assert "5" not in cut.text
    assert full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)


def test_max_tokens_and_ignore_eos(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    out = llm.generate("hi", stage.SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"


def test_stop_token_ids_end_the_request(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    base = llm.generate("hi", stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        "hi",
        stage.SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]
        ),
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def _sampling(stage):
    return __import__(f"{stage.__name__}.sampling", fromlist=["sample"])


def _tensors(stage, params, seeds, offsets, vocab_size):
    return _sampling(stage).SamplingTensors.from_params(
        params, seeds, offsets, vocab_size, torch.device("cpu")
    )


@unit("sampling.py")
def test_greedy_threshold_follows_sampling_eps(stage):
    sampling = _sampling(stage)
    assert sampling.SAMPLING_EPS == 1e-5
    for temperature in (0.0, 1e-40, 1e-6):
        assert stage.SamplingParams(temperature=temperature).greedy
    assert stage.SamplingParams(temperature=1.5, top_k=1).greedy
    assert not stage.SamplingParams(temperature=1e-5).greedy
    assert not stage.SamplingParams(temperature=0.7, top_k=2).greedy


@unit("sampling.py")
def test_sampling_tensors_from_params(stage):
    P = stage.SamplingParams
    params = [
        P(temperature=0),  # greedy
        P(temperature=0.5, top_k=3),
        P(temperature=2.0, top_p=0.9),
        P(temperature=1.5, top_k=1, top_p=0.5),  # greedy via top_k=1
        P(temperature=1.0, top_k=10),  # top_k >= vocab: disabled
    ]
    t = _tensors(stage, params, [1, 2, 3, 4, 5], [0, 7, 8, 9, 10], vocab_size=10)
    assert t.temperature.dtype == torch.float32 and t.top_p.dtype == torch.float32
    assert t.top_k.dtype == t.seeds.dtype == t.offsets.dtype == torch.int64
    assert t.greedy.dtype == torch.bool
    assert t.temperature.tolist() == [1.0, 0.5, 2.0, 1.0, 1.0]
    assert t.top_k.tolist() == [10, 3, 10, 10, 10]
    assert t.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0, 1.0])
    assert t.greedy.tolist() == [True, False, False, True, False]
    assert t.seeds.tolist() == [1, 2, 3, 4, 5] and t.offsets.tolist() == [0, 7, 8, 9, 10]
    assert (t.all_greedy, t.any_top_k, t.any_top_p) == (False, True, True)
    only_greedy = _tensors(stage, [params[0], params[3]], [0, 0], [0, 0], vocab_size=10)
    assert (only_greedy.all_greedy, only_greedy.any_top_k, only_greedy.any_top_p) == (
        True,
        False,
        False,
    )
    with pytest.raises(ValueError):
        _tensors(stage, params, [1, 2], [0, 0, 0, 0, 0], vocab_size=10)


@since("05")  # stage 05 shrinks the host's share of a step
@unit("sampling.py")
def test_an_all_greedy_batch_takes_the_short_path_to_the_same_tensors(stage):
    """An all-greedy batch (the common one) builds its tensors without a list per row, and
    only the ones it reads: its seeds and offsets are what a mixed batch gives its greedy rows
    (its own greedy rows' slice is the oracle), seeds out of int64's range folded the same
    way; the neutral per-row values (temperature, top-k, top-p, greedy) are not built, so
    never copied to the device, and the tokens are the argmax."""
    P = stage.SamplingParams
    greedy = [P(temperature=0), P(temperature=1.5, top_k=1, top_p=0.5), P(temperature=1e-9)]
    seeds, offsets = [-1, 2**64 - 1, 2**70 + 3], [4, 5, 2**63]
    short = _tensors(stage, greedy, seeds, offsets, vocab_size=10)
    mixed = _tensors(stage, [*greedy, P(temperature=0.5, top_k=3)], [*seeds, 9], [*offsets, 9], 10)
    assert (short.all_greedy, short.any_top_k, short.any_top_p) == (True, False, False)
    assert short.filter_rows is None
    for name in ("seeds", "offsets"):
        got, want = getattr(short, name), getattr(mixed, name)[:3]
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
    built = [f.name for f in dataclasses.fields(short) if torch.is_tensor(getattr(short, f.name))]
    assert built == ["seeds", "offsets"]
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    assert stage.sampling.sample(logits, short).tolist() == logits.argmax(-1).tolist()
    assert short.seeds.tolist() == [-1, -1, 3] and short.offsets.tolist()[2] == -(2**63)
    empty = _tensors(stage, [], [], [], vocab_size=10)
    assert empty.seeds.shape == (0,) and empty.seeds.dtype == torch.int64


def _reference_top_k_top_p(logits, top_k, top_p):
    """The scalar rule, one row at a time (what the batched version must equal)."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


@unit("sampling.py")
def test_top_k_top_p_masks(stage):
    sampling = _sampling(stage)
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = logits.softmax(-1)  # [0.636, 0.234, 0.086, 0.032, 0.012]
    shuffled = logits[torch.tensor([3, 0, 4, 2, 1])]
    rows = [  # (logits, top_k, top_p, kept); top_k 5 = vocab size = disabled
        (logits, 2, 1.0, [True, True, False, False, False]),
        (logits, 5, 0.8, [True, True, False, False, False]),
        (logits, 5, float(probs[0]) - 1e-3, [True, False, False, False, False]),
        (shuffled, 5, 0.8, [False, True, False, False, True]),
        (logits, 5, 1.0, [True] * 5),  # disabled row
        (logits, 5, 0.9, [True, True, True, False, False]),
        (logits, 3, 0.9, [True, True, False, False, False]),  # top-p of the renormalised top-3
        (shuffled, 2, 1.0, [False, True, False, False, True]),
        (torch.tensor([3.0, 3.0, 3.0, 0.0, 0.0]), 2, 1.0, [True, True, True, False, False]),  # ties
        # top_p 1 is off: the tail stays even where float32 rounds the mass above it to 1
        (torch.tensor([30.0, 0.0, 0.0, 0.0, 0.0]), 5, 1.0, [True] * 5),
    ]
    batch = torch.stack([r[0] for r in rows])
    out = sampling.apply_top_k_top_p(
        batch,
        torch.tensor([r[1] for r in rows], dtype=torch.int64),
        torch.tensor([r[2] for r in rows], dtype=torch.float32),
    )
    kept = torch.isfinite(out)
    for i, row in enumerate(rows):
        assert kept[i].tolist() == row[3], f"row {i}"
    assert torch.equal(out[kept], batch[kept])  # survivors are untouched


@unit("sampling.py")
def test_top_k_top_p_matches_the_per_row_rule(stage):
    sampling = _sampling(stage)
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 24, 50
    logits = torch.randn(batch, vocab, generator=gen) * 2
    top_k = torch.randint(1, vocab + 1, (batch,), generator=gen)
    top_p = torch.rand(batch, generator=gen).clamp_min(0.05)
    top_p[::3] = 1.0
    out = sampling.apply_top_k_top_p(logits, top_k, top_p)
    for i in range(batch):
        expected = _reference_top_k_top_p(logits[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(expected)), f"row {i}"


# Chi-square critical value for 4 degrees of freedom at a 0.1% false-alarm rate.
CHI2_CRITICAL_DF4_P001 = 18.467
DRAWS = 6000
SEEDS_OFFSETS = {  # one batched call of 6000 rows, same logits
    "one-seed-many-offsets": ([1234] * DRAWS, list(range(DRAWS))),
    "many-seeds-offset-0": (list(range(DRAWS)), [0] * DRAWS),
}


def _chi2(counts, target):
    expected = target * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@unit("sampling.py")
@pytest.mark.parametrize("streams", SEEDS_OFFSETS, ids=list(SEEDS_OFFSETS))
def test_sampled_tokens_follow_the_target_distribution(stage, streams):
    """Draws from the sampler match softmax(logits / T) restricted to top-k (chi-square)."""
    sampling = _sampling(stage)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0])
    params = stage.SamplingParams(temperature=0.7, top_k=5)
    seeds, offsets = SEEDS_OFFSETS[streams]
    tensors = _tensors(stage, [params] * DRAWS, seeds, offsets, vocab_size=7)
    tokens = sampling.sample(logits.expand(DRAWS, -1), tensors)
    assert tokens.shape == (DRAWS,) and tokens.dtype == torch.int64
    counts = torch.bincount(tokens, minlength=7).float()
    assert counts[5:].sum() == 0  # outside the top-k: never drawn
    assert _chi2(counts[:5], (logits[:5] / 0.7).softmax(-1)) < CHI2_CRITICAL_DF4_P001


@unit("sampling.py")
@pytest.mark.parametrize("streams", SEEDS_OFFSETS, ids=list(SEEDS_OFFSETS))
def test_top_p_draws_follow_the_renormalised_nucleus(stage, streams):
    """softmax(logits / 0.7) is [.517 .253 .124 .061 .030 .015 .000]: top_p 0.97 keeps five."""
    sampling = _sampling(stage)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0])
    order = torch.tensor([4, 6, 0, 3, 5, 1, 2])  # shuffled, so the mask is scattered back
    params = stage.SamplingParams(temperature=0.7, top_p=0.97)
    seeds, offsets = SEEDS_OFFSETS[streams]
    tensors = _tensors(stage, [params] * DRAWS, seeds, offsets, vocab_size=7)
    tokens = sampling.sample(logits[order].expand(DRAWS, -1), tensors)
    counts = torch.bincount(order[tokens], minlength=7).float()  # back to sorted ids
    assert counts[5:].sum() == 0  # outside the nucleus: never drawn
    assert _chi2(counts[:5], (logits[:5] / 0.7).softmax(-1)) < CHI2_CRITICAL_DF4_P001


@unit("sampling.py")
def test_tiny_temperatures_are_greedy_and_finite(stage):
    sampling = _sampling(stage)
    P = stage.SamplingParams
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)) * 30
    params = [P(temperature=1e-40), P(temperature=1e-6), P(temperature=1e-40, top_p=0.5)]
    params.append(P(temperature=1e-5, top_k=3))  # smallest non-greedy temperature
    tensors = _tensors(stage, params, [1, 2, 3, 4], [5, 6, 7, 8], vocab_size=100)
    assert torch.isfinite(tensors.temperature).all()
    assert tensors.greedy.tolist() == [True, True, True, False]
    tokens = sampling.sample(logits, tensors)
    assert tokens[:3].tolist() == logits[:3].argmax(-1).tolist()
    assert tokens[3] in logits[3].topk(3).indices


@unit("sampling.py")
def test_huge_and_negative_seeds_fold_into_int64(stage):
    sampling = _sampling(stage)
    params = [stage.SamplingParams(temperature=1.0)] * 6
    seeds = [2**100 + 5, 5, -1, 2**64 - 1, -(2**63), 2**63]  # low 64 bits: pairs are equal
    tensors = _tensors(stage, params, seeds, [3] * 6, vocab_size=1000)
    assert tensors.seeds.tolist() == [5, 5, -1, -1, -(2**63), -(2**63)]
    logits = torch.zeros(6, 1000)
    tokens = sampling.sample(logits, tensors).tolist()
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[4] == tokens[5]
    assert all(0 <= t < 1000 for t in tokens)


@unit("sampling.py")
def test_draws_do_not_depend_on_the_batch(stage):
    """A row's token depends on its (seed, offset), logits and params only: not on its batch
    neighbours (greedy, top-k, top-p ones switch on work for the whole batch), the batch size
    or its row index."""
    sampling = _sampling(stage)
    P = stage.SamplingParams
    vocab = 500
    gen = torch.Generator().manual_seed(2)
    others = [P(temperature=0), P(temperature=0.6, top_k=7), P(temperature=1.3, top_p=0.5), P()]
    other_logits = torch.randn(4, vocab, generator=gen)
    for params in (P(temperature=1.0), P(temperature=0.8, top_k=50), P(top_p=0.7, seed=1)):
        for offset in range(12):
            logits = torch.randn(1, vocab, generator=gen)
            alone = sampling.sample(logits, _tensors(stage, [params], [99], [offset], vocab))
            batch = torch.cat([other_logits[:3], logits, other_logits[3:]])
            five = [*others[:3], params, others[3]]
            seeds, offsets = [1, 2, 3, 99, 4], [offset + 1, 0, 5, offset, 9]
            in_five = sampling.sample(batch, _tensors(stage, five, seeds, offsets, vocab))
            first_of_three = sampling.sample(
                torch.cat([logits, other_logits[1:3]]),
                _tensors(stage, [params, others[2], others[1]], [99, 7, 8], [offset, 1, 1], vocab),
            )
            assert alone.item() == in_five[3].item() == first_of_three[0].item()


@unit("sampling.py")
def test_different_offsets_and_seeds_draw_differently(stage):
    sampling = _sampling(stage)
    params = [stage.SamplingParams(temperature=1.0)] * 200
    logits = torch.zeros(200, 1000)  # uniform: 200 independent draws show ~181 distinct tokens
    by_offset = sampling.sample(logits, _tensors(stage, params, [5] * 200, range(200), 1000))
    by_seed = sampling.sample(logits, _tensors(stage, params, range(200), [0] * 200, 1000))
    assert len(set(by_offset.tolist())) > 150
    assert len(set(by_seed.tolist())) > 150
    assert (by_offset != by_seed).sum() > 150


def _splitmix64_reference(seed: int, offset: int, index: int) -> float:
    """random_uniform's construction in plain Python integers (the spec the tensors follow)."""
    mask = 2**64 - 1
    golden = 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key = mix((mix(seed & mask) + offset * golden) & mask)
    bits = mix((key + (index + 1) * golden) & mask)
    return ((bits >> 41) * 2 + 1) / 2**24


@unit("sampling.py")
def test_random_uniform_is_the_documented_counter_hash(stage):
    sampling = _sampling(stage)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789]
    offsets = [0, 1, 2**40, 7, 0, 31]
    u = sampling.random_uniform(torch.tensor(seeds), torch.tensor(offsets), 300)
    assert u.shape == (6, 300) and u.dtype == torch.float32
    for row, (seed, offset) in enumerate(zip(seeds, offsets, strict=True)):
        for index in (0, 1, 2, 150, 299):
            assert u[row, index].item() == _splitmix64_reference(seed, offset, index)
    # seed 0, offset 0 is the splitmix64 stream from state 0; its first output is published.
    assert u[0, 0].item() == ((0xE220A8397B1DCDAF >> 41) * 2 + 1) / 2**24
    # A row's noise is the same computed alone or in a batch.
    alone = sampling.random_uniform(torch.tensor([seeds[2]]), torch.tensor([offsets[2]]), 300)
    assert torch.equal(alone[0], u[2])


# Chi-square critical value for 9 degrees of freedom at a 0.1% false-alarm rate.
CHI2_CRITICAL_DF9_P001 = 27.877


@unit("sampling.py")
def test_random_uniform_is_uniform_and_uncorrelated(stage):
    sampling = _sampling(stage)
    rows, vocab = 64, 4096  # 262144 draws: the standard error of a correlation is 0.002
    seeds = torch.arange(rows + 1) * 3 - 40  # includes negative seeds
    offsets = torch.full((rows + 1,), 17)
    u = sampling.random_uniform(seeds, offsets, vocab)
    assert (u > 0).all() and (u <= 1).all()
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u[:rows], bins=10, min=0, max=1)
    assert _chi2(counts, torch.full((10,), 0.1)) < CHI2_CRITICAL_DF9_P001
    next_offset = sampling.random_uniform(seeds, offsets + 1, vocab)

    def corr(a, b):
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()

    bound = 0.01  # five standard errors
    assert abs(corr(u[:rows], next_offset[:rows])) < bound  # adjacent offsets
    assert abs(corr(u[:rows], u[1:])) < bound  # neighbouring seeds
    assert abs(corr(u[:, :-1], u[:, 1:])) < bound  # adjacent vocab entries


@unit("sampling.py")
def test_sample_never_syncs_with_the_host(stage, monkeypatch):
    """No .item(), .tolist(), bool/int/float of a tensor: the batch never waits for the device."""
    sampling = _sampling(stage)
    P = stage.SamplingParams
    params = [
        P(temperature=0),
        P(temperature=0.7),
        P(temperature=1.0, top_k=5),
        P(temperature=1.2, top_p=0.8),
        P(temperature=0.9, top_k=20, top_p=0.95, seed=3),
        P(temperature=1e-30),
    ]
    logits = torch.randn(len(params), 64, generator=torch.Generator().manual_seed(3))
    tensors = _tensors(stage, params, [11, 12, 13, 14, 3, 15], [4, 5, 6, 7, 8, 9], 64)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync inside sample")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, forbidden)
        m.setattr(torch.Tensor, "__index__", forbidden)
        tokens = sampling.sample(logits, tensors)
    assert tokens.shape == (len(params),) and tokens.dtype == torch.int64
    assert tokens[0].item() == logits[0].argmax().item()
    assert tokens[5].item() == logits[5].argmax().item()
    assert tokens[2] in logits[2].topk(5).indices


@unit("sampling.py")
def test_all_greedy_batches_skip_the_random_work(stage, monkeypatch):
    sampling = _sampling(stage)
    P = stage.SamplingParams
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    params = [P(temperature=0), P(top_k=1), P(temperature=1e-9)]
    tensors = _tensors(stage, params, [1, 2, 3], [0, 0, 0], 40)
    monkeypatch.setattr(sampling, "random_uniform", lambda *a: pytest.fail("drew noise"))
    assert sampling.sample(logits, tensors).tolist() == logits.argmax(-1).tolist()


@unit("sampling.py")
def test_sample_races_on_the_filtered_distribution(stage):
    """`_filtered_probs` is the distribution a row is drawn from (temperature, top-k/top-p,
    softmax), and `sample` is the exponential race on it: stage 08 verifies drafts against the
    same function, so it lives with the sampler from stage 01 on."""
    sampling = _sampling(stage)
    P = stage.SamplingParams
    params = [P(temperature=0.7), P(temperature=1.3, top_k=4), P(temperature=0.9, top_p=0.6)]
    logits = torch.randn(len(params), 32, generator=torch.Generator().manual_seed(5))
    tensors = _tensors(stage, params, [21, 22, 23], [7, 8, 9], 32)
    probs = sampling._filtered_probs(logits, tensors)
    for i, p in enumerate(params):
        kept = _reference_top_k_top_p(logits[i] / p.temperature, p.top_k or 32, p.top_p)
        torch.testing.assert_close(probs[i], kept.softmax(-1))
    noise = sampling.random_uniform(tensors.seeds, tensors.offsets, 32).log_().neg_()
    assert sampling.sample(logits, tensors).tolist() == (probs / noise).argmax(-1).tolist()


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
@unit("sampling.py")
def test_filtered_probs_divides_by_temperature_filters_and_softmaxes(stage):
    """`_filtered_probs` alone: each row's logits / its temperature, top-k/top-p only on the
    rows in `filter_rows` (the others keep their whole vocabulary), then a softmax per row."""
    sampling = _sampling(stage)
    P = stage.SamplingParams
    params = [P(temperature=0.7), P(temperature=1.3, top_k=4), P(temperature=0.9, top_p=0.6)]
    params.append(P(temperature=2.0))
    logits = torch.randn(len(params), 32, generator=torch.Generator().manual_seed(5))
    tensors = _tensors(stage, params, [21, 22, 23, 24], [7, 8, 9, 10], 32)
    probs = sampling._filtered_probs(logits, tensors)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for i, p in enumerate(params):
        kept = _reference_top_k_top_p(logits[i] / p.temperature, p.top_k or 32, p.top_p)
        torch.testing.assert_close(probs[i], kept.softmax(-1))
    assert int((probs[1] > 0).sum()) == 4 and bool((probs[0] > 0).all())


def _request(stage, tiny_model, **params):
    """A Request of a tiny byte-level tokenizer (one character, one token) and prompt "hi"."""
    from stages.common.tokenizer import Tokenizer

    request_module = __import__(f"{stage.__name__}.request", fromlist=["Request"])
    tokenizer = Tokenizer.from_pretrained(tiny_model("llama-gqa"))
    prompt = tokenizer.encode("hi", add_special_tokens=False)
    request = request_module.Request.create(
        "r", "hi", prompt, stage.SamplingParams(**params), tokenizer, 0
    )
    return request, tokenizer


@unit("request.py")
def test_append_token_records_and_stops_on_each_rule(stage, tiny_model):
    """Request.append_token alone: each token is recorded (id, text, time); the request
    finishes with "stop" on a stop token id, on EOS (unless ignore_eos) or when a stop string
    appears (the text cut before it, even across two tokens), and with "length" on exactly
    its max_tokens-th token."""
    request, tokenizer = _request(stage, tiny_model, max_tokens=3, ignore_eos=True)
    a, b = tokenizer.encode("ab", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    request.append_token(a)
    request.append_token(eos)  # ignored EOS: a token like any other
    assert request.output_token_ids == [a, eos] and request.text.startswith("a")
    assert request.finish_reason is None and len(request.token_times) == 2
    request.append_token(b)
    assert request.finish_reason == "length", "finished on its max_tokens-th token"

    request, _ = _request(stage, tiny_model, max_tokens=10)
    request.append_token(a)
    request.append_token(eos)
    assert request.finish_reason == "stop" and request.num_tokens == 4

    request, _ = _request(stage, tiny_model, max_tokens=10, stop_token_ids=[b])
    request.append_token(a)
    request.append_token(b)
    assert request.finish_reason == "stop" and request.output_token_ids == [a, b]

    request, _ = _request(stage, tiny_model, max_tokens=10, stop=["bc"])
    for token in tokenizer.encode("xab", add_special_tokens=False):
        request.append_token(token)
    assert request.finish_reason is None and request.text == "xab"
    request.append_token(tokenizer.encode("c", add_special_tokens=False)[0])
    assert request.finish_reason == "stop" and request.text == "xa", "cut before 'bc'"
