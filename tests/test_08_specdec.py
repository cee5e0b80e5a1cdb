"""Stage 08 promises: speculation changes how many tokens a forward yields, never which.

Greedy outputs and teacher-forced logits are identical with each drafter (n-gram and the
truncated-target draft model), with chunked prefill, prefix caching and preemption; sampled
tokens follow the target distribution (the rejection sampler checked statistically, with a
stated false-alarm rate); the Triton kernel equals the PyTorch reference under the
interpreter; acceptance statistics add up; rejected drafts leave no block behind.
"""

from __future__ import annotations

import importlib
import itertools
import random

import numpy as np
import pytest
import torch

from .conftest import needs_triton, since, subject, unit
from .test_03_paged import _bytes_per_block

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [
    since("08"),
    subject(
        "spec_decode/drafters.py", "spec_decode/rejection_sampler.py", "scheduler.py", "engine.py"
    ),
]

BLOCK = 4
REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # n-gram lookup has something to find
PROMPTS = [REPETITIVE, [10, 11, 12, 13, 14, 10, 11, 12], list(range(30, 67)), [3, 4]]


def _greedy(stage, n: int = 16):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _all_blocks_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


def _spec(stage, tiny_model, make_llm, mode, **config):
    extra = {"draft_num_layers": 1} if mode == "draft" else {}
    return make_llm(
        stage,
        tiny_model("llama-gqa"),
        block_size=BLOCK,
        speculative=mode,
        num_speculative_tokens=3,
        **extra,
        **config,
    )


@pytest.mark.parametrize("mode", ["ngram", "draft"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunk5"])
def test_greedy_outputs_identical_with_each_drafter(stage, tiny_model, make_llm, mode, chunk):
    plain = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    params = [_greedy(stage, 12 + 5 * i) for i in range(len(PROMPTS))]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = _spec(stage, tiny_model, make_llm, mode, long_prefill_token_threshold=chunk)
    before = llm.spec_stats.num_draft_tokens
    for _ in range(2):  # the second run also hits the prefix cache
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert llm.spec_stats.num_draft_tokens > before, "nothing was speculated"
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_logits_match_teacher_forcing_when_drafts_are_verified(
    stage, tiny_model, monkeypatch, mode
):
    """Each verified row whose inputs were the true tokens (the drafts before it accepted) has
    the logits of a full recompute at that position: accepted drafts' K/V, and the rollback of
    rejected ones, leave the cache exactly right."""
    extra = {"draft_num_layers": 1} if mode == "draft" else {}
    llm = stage.LLM(
        str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=16 << 20,
        speculative=mode, num_speculative_tokens=3, **extra,
    )  # fmt: skip
    runner_module = importlib.import_module(f"{stage.__name__}.model_runner")
    runner, pending, seen = llm.runner, [], []
    prepare, verify, plain_sample = runner.prepare_inputs, runner._verify, runner_module.sample

    def record(logits, draft_ids=()):
        scheduler_output = pending.pop(0)
        rows, drafts = iter(logits), iter(draft_ids)
        for s in scheduler_output.requests:
            if s.sample:
                end, d = s.num_computed_tokens + s.num_new_tokens, s.num_draft_tokens
                tokens = s.token_ids[: len(s.token_ids) - d] + tuple(
                    int(next(drafts))
                    for _ in range(d)  # the draft model's, filled on device
                )
                for j in range(d + 1):
                    position = end - d + j  # of the token this row predicts
                    inputs = tokens[: position - s.num_computed_tokens]
                    seen.append((s.request_id, s.num_computed_tokens, inputs, next(rows).clone()))

    def recording_prepare(scheduler_output):
        pending.append(scheduler_output)
        return prepare(scheduler_output)

    def recording_verify(logits, inputs, draft_ids, draft_probs):
        record(logits, draft_ids.tolist())
        return verify(logits, inputs, draft_ids, draft_probs)

    def recording_sample(logits, tensors):
        record(logits)
        return plain_sample(logits, tensors)

    runner.prepare_inputs, runner._verify = recording_prepare, recording_verify
    monkeypatch.setattr(runner_module, "sample", recording_sample)
    outputs = llm.generate(PROMPTS, [_greedy(stage, 20) for _ in PROMPTS])
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outputs}
    forced = {rid: llm.prompt_logits(seq) for rid, seq in sequences.items()}
    checked = 0
    for request_id, start, inputs, row in seen:
        sequence, position = sequences[request_id], start + len(inputs)
        if position >= len(sequence) or list(inputs) != sequence[start:position]:
            continue  # after a rejected draft (or past the end): not the true context
        torch.testing.assert_close(
            row.float().cpu(), forced[request_id][position - 1], atol=1e-4, rtol=0
        )
        checked += 1
    assert checked >= sum(len(o.token_ids) for o in outputs)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_seeded_sampling_is_reproducible_and_stats_add_up(stage, tiny_model, make_llm, mode):
    params = [
        stage.SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    lookup = {"prompt_lookup_min": 1} if mode == "ngram" else {}  # drafts even on random text
    llm = _spec(stage, tiny_model, make_llm, mode, **lookup)
    stats = llm.spec_stats
    before = (stats.num_verifications, stats.num_draft_tokens, stats.num_accepted_tokens)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == first
    drafted = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    assert drafted > 0 and 0 <= accepted <= drafted
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(stats.accepted_per_position))
    assert all(len(t) == 24 for t in first)


def test_rejected_drafts_leave_no_block_behind(stage, tiny_model):
    """A small pool, drafts that are mostly rejected, preemptions: every table covers exactly
    its computed tokens after each step, and every block comes back."""
    model = tiny_model("llama-gqa")
    probe = stage.LLM(str(model), block_size=BLOCK, kv_cache_bytes=16 << 20)
    per_block = _bytes_per_block(probe, BLOCK)
    expected = [o.token_ids for o in probe.generate(PROMPTS, [_greedy(stage, 30)] * 4)]
    llm = stage.LLM(
        str(model), block_size=BLOCK, kv_cache_bytes=30 * per_block, speculative="draft",
        draft_num_layers=1, num_speculative_tokens=4,
    )  # fmt: skip
    requests = [llm.make_request(p, _greedy(stage, 30)) for p in PROMPTS]
    for request in requests:
        llm.add_request(request)
    while llm.has_unfinished():
        llm.step()
        for request in llm.scheduler.running:
            table = llm.kv_manager.block_ids(request.request_id)
            assert len(table) == llm.kv_manager.blocks_needed(request.num_computed_tokens)
            assert request.num_computed_tokens == request.num_tokens - 1
    assert [r.output_token_ids for r in requests] == expected
    assert llm.spec_stats.num_draft_tokens > llm.spec_stats.num_accepted_tokens > 0
    assert llm.scheduler.num_preemptions > 0
    assert _all_blocks_free(llm)


def _sampler_case(vocab: int, num_drafts: list[int], seed: int, onehot_draft: bool = False):
    gen = torch.Generator().manual_seed(seed)
    drafts = sum(num_drafts)
    target = torch.rand(drafts + len(num_drafts), vocab, generator=gen) ** 3
    target /= target.sum(1, keepdim=True)
    draft = torch.rand(drafts, vocab, generator=gen) ** 3
    draft /= draft.sum(1, keepdim=True)
    ids = torch.multinomial(draft, 1, generator=gen)[:, 0] if drafts else torch.zeros(0).long()
    if onehot_draft:
        draft = torch.zeros_like(draft).scatter_(1, ids.unsqueeze(1), 1.0)
    cu = [0, *itertools.accumulate(num_drafts)]
    uniforms = torch.rand(drafts, generator=gen)
    exps = -torch.rand(drafts + len(num_drafts), vocab, generator=gen).clamp_min(1e-9).log()
    return target, draft, ids, cu, uniforms, exps


def _on(device: torch.device, case: tuple) -> tuple:
    """A sampler case with its tensors on `device` (the host list of offsets stays a list)."""
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in case)


@needs_triton
@unit("spec_decode/rejection_sampler.py")
@pytest.mark.parametrize("num_drafts", [[0], [3], [1, 0, 4, 2], [5, 5]])
@pytest.mark.parametrize("onehot", [False, True], ids=["model-draft", "ngram-draft"])
def test_triton_rejection_sampler_equals_reference(stage, num_drafts, onehot, device):
    """On the test device (`pytest --device`): interpreted on a CPU, compiled on a GPU."""
    sampler = importlib.import_module(f"{stage.__name__}.spec_decode.rejection_sampler")
    for seed in range(3):
        case = _on(device, _sampler_case(37, num_drafts, seed, onehot))
        reference = sampler.rejection_sample_reference(*case)
        triton_out = sampler.rejection_sample_triton(*case)
        # Both answer on their inputs' device (the first GPU run found the reference on the CPU).
        assert reference.device == triton_out.device == case[0].device
        assert torch.equal(reference, triton_out), (reference, triton_out)


@needs_triton
@unit("spec_decode/rejection_sampler.py")
def test_triton_rejection_sampler_names_a_tensor_on_another_device(stage):
    """A host tensor in a GPU launch failed deep in Triton's launcher, naming nothing (the
    interpreter on a CPU never looks): the launch names it first; `meta` stands in here."""
    sampler = importlib.import_module(f"{stage.__name__}.spec_decode.rejection_sampler")
    names = ("target_probs", "draft_probs", "draft_token_ids", None, "uniforms", "exponentials")
    for index, name in enumerate(names):
        if name is None:
            continue  # the host list of offsets, copied to the device by the sampler
        case = list(_sampler_case(37, [3, 1], 0))
        case[index] = case[index].to("meta")
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            sampler.rejection_sample_triton(*case)


@unit("spec_decode/rejection_sampler.py")
@pytest.mark.parametrize("onehot", [False, True], ids=["model-draft", "ngram-draft"])
def test_rejection_sampling_follows_the_target_distribution(stage, onehot):
    """Draws of the first emitted token, with drafts from q, follow p. Chi-square test over
    20,000 draws with a fixed seed; the false-alarm rate of the threshold is 1e-4 (it is the
    99.99% quantile of chi-square with vocab - 1 = 7 degrees of freedom, 27.9)."""
    sampler = importlib.import_module(f"{stage.__name__}.spec_decode.rejection_sampler")
    vocab, n = 8, 20_000
    gen = torch.Generator().manual_seed(1234)
    p = torch.rand(vocab, generator=gen) ** 2
    p /= p.sum()
    q = torch.rand(vocab, generator=gen) ** 2
    q /= q.sum()
    drafts = torch.multinomial(q.expand(n, vocab), 1, generator=gen)[:, 0]
    draft_probs = q.expand(n, vocab).clone()
    if onehot:  # an n-gram drafter: q is a point mass on its (here random) draft
        draft_probs = torch.zeros(n, vocab).scatter_(1, drafts.unsqueeze(1), 1.0)
    target = p.expand(2 * n, vocab).clone()  # each request: one draft, then its bonus row
    uniforms = torch.rand(n, generator=gen)
    exps = -torch.rand(2 * n, vocab, generator=gen).log()
    out = sampler.rejection_sample_reference(
        target, draft_probs, drafts, list(range(n + 1)), uniforms, exps
    )
    counts = torch.bincount(out[:, 0], minlength=vocab).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, (chi2, counts, expected)


def test_ngram_proposer_finds_the_longest_recent_match(stage):
    spec = importlib.import_module(f"{stage.__name__}.spec_decode.drafters")
    proposer = spec.NgramProposer(min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    assert proposer.propose([1, 2, 9, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # the most recent
    assert proposer.propose([1, 2, 3, 4, 5], 3) == []
    assert proposer.propose([7, 7, 7, 7], 5) == [7]  # what followed the latest match
    longest = spec.NgramProposer(min_n=1, max_n=3)  # "3" recurs later than "1 2 3": longest wins
    assert longest.propose([1, 2, 3, 9, 3, 8, 1, 2, 3], 2) == [9, 3]


def test_a_speculating_server_streams_the_plain_tokens(stage, tiny_model, live_server):
    """A speculating server's stream delivers accepted drafts as they land (an event may carry
    several tokens), and the same tokens as a server without speculation."""
    import json

    import httpx

    body = {"prompt": REPETITIVE, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    model = tiny_model("llama-gqa")
    plain, _ = live_server(stage, model, block_size=BLOCK)
    spec, spec_app = live_server(
        stage, model, block_size=BLOCK, speculative="ngram", prompt_lookup_min=1
    )
    expected = httpx.post(f"{plain.url}/generate", json=body, timeout=60).json()["token_ids"]
    with httpx.stream(
        "POST", f"{spec.url}/generate", json={**body, "stream": True}, timeout=60
    ) as response:
        events = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    streamed = [t for event in events for t in event["token_ids"]]
    assert streamed == expected
    assert spec_app.state.engine.engine.spec_stats.num_draft_tokens > 0, "nothing was drafted"


@pytest.mark.slow  # seconds: runs on stage 08 and the newest stage
def test_speculative_samples_follow_the_target_model(stage, tiny_model):
    """End to end on a tiny model with the draft-model drafter: the token after a fixed first
    token, sampled with speculation (drafts accepted and rejected), follows the target model's
    top-4 distribution there. 3,000 seeded requests, grouped by their first token; chi-square
    over 4 tokens (3 degrees of freedom) against 21.1, its 99.99% quantile: a false alarm
    once in 10,000 seeds. The seeds are fixed, so the test is deterministic."""
    llm = stage.LLM(
        str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=64 << 20,
        speculative="draft", draft_num_layers=1, num_speculative_tokens=2, max_num_seqs=64,
    )  # fmt: skip
    prompt = [7, 19, 3, 101, 55, 7, 19, 3, 42, 9, 17]
    params = [
        stage.SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True)
        for s in range(3000)
    ]
    outputs = llm.generate([prompt] * len(params), params)
    assert llm.spec_stats.num_accepted_tokens > 0, "no draft was ever accepted"
    assert llm.spec_stats.num_draft_tokens > llm.spec_stats.num_accepted_tokens
    firsts = torch.tensor([o.token_ids[0] for o in outputs])
    first = int(torch.mode(firsts).values)
    seconds = torch.tensor([o.token_ids[1] for o in outputs if o.token_ids[0] == first])
    logits = llm.prompt_logits([*prompt, first])[-1]
    top = logits.topk(4)
    expected = top.values.softmax(-1).double() * len(seconds)
    counts = torch.tensor([(seconds == t).sum() for t in top.indices]).double()
    assert counts.sum() == len(seconds), "a token outside the target's top-4 was emitted"
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert len(seconds) > 500 and chi2 < 21.1, (chi2, counts, expected)


def _truncated_logits(stage, llm, token_ids: list[int], num_layers: int) -> torch.Tensor:
    """Logits of the target truncated to its first `num_layers` layers at every position of
    `token_ids`: one forward without a cache (teacher forcing), independent of the drafter."""
    model_module = importlib.import_module(f"{stage.__name__}.model")
    runner, n = llm.runner, len(token_ids)
    meta = model_module.AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=runner.device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=runner.device),
        block_tables=None,
        slot_mapping=None,
        query_lens=(n,),
        context_lens=(0,),
        attention_backend=runner.attention_backend,
    )
    with torch.inference_mode():
        ids = torch.tensor(token_ids, device=runner.device)
        hidden = runner.model(ids, torch.arange(n, device=runner.device), None, meta, num_layers)
        return runner.model.compute_logits(hidden).float().cpu()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunk5"])
def test_draft_model_drafts_are_the_truncated_models_own_continuation(
    stage, tiny_model, sampling, chunk
):
    """Every draft d_1..d_k the draft-model drafter writes is what the truncated target itself
    produces after the context and d_1..d_{j-1}: greedy, its argmax; seeded, the exponential
    race on its draft stream at that position. The reference runs the truncated model over the
    whole sequence without a cache, so it checks the drafter's cache reads and writes (the K/V
    of earlier drafts in the draft layers), positions, slot mapping and noise offsets."""
    sampler = importlib.import_module(f"{stage.__name__}.spec_decode.rejection_sampler")
    sampling_module = importlib.import_module(f"{stage.__name__}.sampling")
    layers, k = 1, 4
    llm = stage.LLM(
        str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=16 << 20,
        speculative="draft", draft_num_layers=layers, num_speculative_tokens=k,
        long_prefill_token_threshold=chunk,
    )  # fmt: skip
    runner, proposer = llm.runner, llm.runner.draft_proposer
    outputs_so_far, drafted = [], []
    prepare, propose = runner.prepare_inputs, proposer.propose

    def recording_prepare(scheduler_output):
        outputs_so_far.append(scheduler_output)
        return prepare(scheduler_output)

    def recording_propose(input_ids, meta, plan, kv_cache):
        q = propose(input_ids, meta, plan, kv_cache)
        requests = outputs_so_far[-1].requests
        for i, row in enumerate(plan.rows):
            drafts = input_ids[row + 1 : row + 1 + plan.num_drafts[i]].tolist()
            request = requests[plan.table_rows[i]]
            drafted.append((request.request_id, plan.contexts[i], drafts, request.params))
            drafted[-1] += (request.seed,)
        return q

    runner.prepare_inputs, proposer.propose = recording_prepare, recording_propose
    if sampling == "greedy":
        params = [_greedy(stage, 20) for _ in PROMPTS]
    else:
        params = [
            stage.SamplingParams(max_tokens=20, temperature=0.9, top_k=30, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
    outputs = llm.generate(PROMPTS, params)
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outputs}
    vocab = runner.model_config.vocab_size
    checked = 0
    for request_id, context, drafts, request_params, seed in drafted:
        prefix = sequences[request_id][: context + 1]  # the real tokens up to the last one
        assert len(prefix) == context + 1
        logits = _truncated_logits(stage, llm, prefix + drafts[:-1], layers)[context:]
        if request_params.greedy:
            expected = logits.argmax(-1).tolist()
        else:
            positions = list(range(context + 1, context + 1 + len(drafts)))
            tensors = sampling_module.SamplingTensors.from_params(
                [request_params] * len(drafts), [seed ^ sampler.DRAFT_STREAM] * len(drafts),
                positions, vocab, torch.device("cpu"),
            )  # fmt: skip
            q = sampling_module.probabilities(logits, tensors)
            race = sampler.race_exponentials(tensors.seeds, tensors.offsets, vocab)
            expected = (q / race).argmax(-1).tolist()
        assert drafts == expected, (request_id, context, drafts, expected)
        checked += len(drafts)
    assert checked > 0 and max(len(d[2]) for d in drafted) == k, "no full-length draft"


def test_drafts_never_cost_a_preemption(stage, tiny_model, make_llm):
    """A pool where every real token fits (plain decoding never preempts) but six drafts per
    request do not: the drafts shrink to what the free blocks hold instead of preempting the
    newest request, and the outputs equal plain decoding's."""
    path = tiny_model("llama-gqa")
    probe = make_llm(stage, path, block_size=BLOCK)
    tight = {"block_size": BLOCK, "kv_cache_bytes": 12 * _bytes_per_block(probe, BLOCK)}
    prompts = [REPETITIVE, [*REPETITIVE[:8], 10, 11, 12, 13, 14]]
    params = [_greedy(stage, 14), _greedy(stage, 24)]
    plain = make_llm(stage, path, async_scheduling=False, **tight)
    before = plain.scheduler.num_preemptions
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.scheduler.num_preemptions == before, "the real tokens alone must fit"
    llm = make_llm(
        stage, path, speculative="draft", draft_num_layers=1, num_speculative_tokens=6, **tight
    )
    before, drafted = llm.scheduler.num_preemptions, llm.spec_stats.num_draft_tokens
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.scheduler.num_preemptions == before, "a draft preempted a request"
    assert llm.spec_stats.num_draft_tokens > drafted
    assert _all_blocks_free(llm)


def test_sentinels_are_named_apart_and_only_padding_is_dropped(stage):
    """PLACEHOLDER (a token in flight), DRAFT (a draft the draft model writes) and the
    rejection sampler's padding are three different negative ids; a step's result drops the
    padding and nothing else, so a sentinel that leaked into an output would show."""
    scheduler = importlib.import_module(f"{stage.__name__}.scheduler")
    spec = importlib.import_module(f"{stage.__name__}.spec_decode.drafters")
    sampler = importlib.import_module(f"{stage.__name__}.spec_decode.rejection_sampler")
    runner_module = importlib.import_module(f"{stage.__name__}.model_runner")
    sentinels = {scheduler.PLACEHOLDER, spec.DRAFT, sampler.NO_TOKEN}
    assert len(sentinels) == 3 and max(sentinels) < 0
    out = sampler.rejection_sample_reference(*_sampler_case(37, [1, 0, 4, 2], 0))
    assert (out == sampler.NO_TOKEN).any() and not ((out < 0) & (out != sampler.NO_TOKEN)).any()
    rows = [[5, sampler.NO_TOKEN], [scheduler.PLACEHOLDER, 7]]
    handle = runner_module.StepHandle(("a", "b"), lambda: rows)
    assert handle.result() == {"a": [5], "b": [scheduler.PLACEHOLDER, 7]}


def _reference_ngram(token_ids, min_n: int, max_n: int, k: int) -> list[int]:
    """The array search the index replaced: every window compared with the suffix, each step."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # the most recent occurrence
            return tokens[start : start + k].tolist()
    return []


@unit("spec_decode/drafters.py")
def test_ngram_index_answers_as_the_full_search(stage):
    """The per-request n-gram index, fed in random pieces, proposes after every piece exactly
    what a search of the whole sequence finds (random sequences over small vocabularies, so
    suffixes repeat at every length)."""
    spec = importlib.import_module(f"{stage.__name__}.spec_decode.drafters")
    rng = random.Random(0)
    for case in range(300):
        min_n = rng.randint(1, 3)
        max_n, vocab, k = min_n + rng.randint(0, 3), rng.randint(2, 6), rng.randint(1, 5)
        proposer = spec.NgramProposer(min_n, max_n)
        tokens: list[int] = []
        while len(tokens) < 60:
            piece = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            tokens += piece
            proposer.extend(f"r{case}", piece)
            expected = _reference_ngram(tokens, min_n, max_n, k)
            assert proposer.propose_for(f"r{case}", k) == expected, (tokens, min_n, max_n, k)
        assert proposer.propose(tokens, k) == expected
        proposer.forget(f"r{case}")
        assert proposer.num_tokens(f"r{case}") == 0


def test_ngram_drafting_never_rereads_the_whole_sequence(stage, tiny_model, make_llm, monkeypatch):
    """Per-step host work stays O(new tokens): proposing n-gram drafts never reads a request's
    whole sequence (`all_token_ids`), and a request's index goes when it finishes or aborts."""
    request_type = importlib.import_module(f"{stage.__name__}.request").Request
    reads = []
    whole = request_type.all_token_ids
    monkeypatch.setattr(
        request_type, "all_token_ids", property(lambda r: reads.append(1) or whole.fget(r))
    )
    llm = _spec(stage, tiny_model, make_llm, "ngram")
    drafted = llm.spec_stats.num_draft_tokens
    outputs = llm.generate(PROMPTS, [_greedy(stage, 20) for _ in PROMPTS])
    assert llm.spec_stats.num_draft_tokens > drafted and not reads
    assert all(llm.ngram.num_tokens(o.request_id) == 0 for o in outputs)
    request = llm.make_request(REPETITIVE, _greedy(stage, 20))
    llm.add_request(request)
    while len(request.output_token_ids) < 3:
        llm.step()
    assert llm.ngram.num_tokens(request.request_id) == request.num_tokens
    llm.abort_request(request.request_id)
    assert llm.ngram.num_tokens(request.request_id) == 0 and not reads


def test_a_step_drafts_the_first_proposals_that_fit(stage, tiny_model):
    """Scheduler._schedule_new_tokens directly: under a budget too small for every draft, a
    step's new tokens are the real ones then the first `num_draft_tokens` proposals, and they
    cover exactly the positions the request advances by (no draft rides along uncounted)."""
    llm = stage.LLM(
        str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=16 << 20,
        speculative="draft", draft_num_layers=1, num_speculative_tokens=3,
        max_num_batched_tokens=6, async_scheduling=False,
    )  # fmt: skip
    scheduler, steps = llm.scheduler, []
    schedule = scheduler.schedule

    def recording():
        proposed = {r.request_id: list(r.spec_token_ids) for r in scheduler.running}
        output = schedule()
        advanced = {r.request_id: r.num_computed_tokens for r in scheduler.running}
        steps.append((proposed, output, advanced))
        return output

    scheduler.schedule = recording
    prompts = [REPETITIVE, REPETITIVE[2:], [*REPETITIVE[:8], 5]]
    llm.generate(prompts, [_greedy(stage, 12) for _ in prompts])
    partial = 0
    for proposed, output, advanced in steps:
        for request in output.requests:
            drafts, count = proposed.get(request.request_id, []), request.num_draft_tokens
            new = len(request.token_ids)
            assert new == advanced[request.request_id] - request.num_computed_tokens
            assert count <= len(drafts)
            assert list(request.token_ids[new - count :]) == drafts[:count]
            partial += 0 < count < len(drafts) or (count == 0 and bool(drafts))
    assert partial > 0, "the budget was meant to cut some request's drafts"


@unit("spec_decode/drafters.py")
def test_ngram_index_records_the_latest_start_of_every_ngram(stage):
    """NgramProposer._index alone: each new token makes the n-grams ending just before it
    matchable (it is what they propose), each recorded at its most recent start."""
    spec = importlib.import_module(f"{stage.__name__}.spec_decode.drafters")
    proposer = spec.NgramProposer(min_n=1, max_n=2)
    tokens: list[int] = []
    latest: dict[tuple[int, ...], int] = {}
    proposer._index(tokens, latest, [5, 6, 5])
    assert tokens == [5, 6, 5]
    assert latest == {(5,): 0, (6,): 1, (5, 6): 0}  # (5,) at 2 has no token after it yet
    proposer._index(tokens, latest, [6])
    assert tokens == [5, 6, 5, 6]
    assert latest == {(5,): 2, (6,): 1, (5, 6): 0, (6, 5): 1}  # (5,) moved to its latest


@unit("spec_decode/drafters.py")
def test_ngram_lookup_tries_the_longest_suffix_first(stage):
    """NgramProposer._lookup alone, on a hand-made index: the longest suffix found wins, then
    shorter ones; the k tokens after its start (fewer at the end); none when nothing is found."""
    spec = importlib.import_module(f"{stage.__name__}.spec_decode.drafters")
    proposer = spec.NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 3, 8, 1, 2, 3]
    index = {(3,): 4, (2, 3): 1, (1, 2, 3): 0}
    assert proposer._lookup(tokens, index, 2) == [9, 3]  # (1, 2, 3), not the later (3,)
    assert proposer._lookup(tokens, {(3,): 4, (2, 3): 1}, 2) == [9, 3]
    assert proposer._lookup(tokens, {(3,): 4}, 2) == [8, 1]
    assert proposer._lookup(tokens, {(3,): 4}, 10) == [8, 1, 2, 3]
    assert proposer._lookup(tokens, {(9,): 3}, 2) == []


def _seated_spec(stage, tiny_model, make_llm, prompts: dict[str, list[int]], **params):
    """An n-gram engine (k = 3) with requests seated by hand: added, then moved to the
    running queue, nothing scheduled or computed yet (no admission runs)."""
    llm = _spec(stage, tiny_model, make_llm, "ngram")
    seated = []
    for request_id, prompt in prompts.items():
        request = llm.make_request(prompt, _greedy(stage, **params), request_id=request_id)
        llm.add_request(request)
        llm.scheduler.waiting.remove(request)
        llm.scheduler.running.append(request)
        seated.append(request)
    return llm, seated


def _schedule_by_hand(scheduler, request, num_new: int):
    """`Scheduler._schedule_new_tokens` as its callers use it: they allocate the slots of the
    request's real tokens first (once per request per step); it takes the drafts' own."""
    real = min(num_new, scheduler._left(request))
    assert scheduler.kv.allocate_slots(request.request_id, request.num_computed_tokens + real)
    return scheduler._schedule_new_tokens(request, num_new)


def _unseat(llm, requests) -> None:
    for request in requests:
        llm.abort_request(request.request_id)
    assert _all_blocks_free(llm)


def test_schedule_new_tokens_puts_the_first_drafts_after_the_real_tokens(
    stage, tiny_model, make_llm
):
    """Scheduler._schedule_new_tokens alone (requests seated by hand): a chunk that does not
    reach the last real token carries no draft and samples nothing; one that does carries the
    FIRST num_new - (real tokens left) drafts after the real tokens (and after the token in
    flight, a PLACEHOLDER), counts them in num_draft_tokens, and samples."""
    placeholder = importlib.import_module(f"{stage.__name__}.scheduler").PLACEHOLDER
    prompt = list(range(30, 40))
    llm, (r, q) = _seated_spec(stage, tiny_model, make_llm, {"r": prompt, "q": [1, 2, 3]})
    scheduler = llm.scheduler
    try:
        r.spec_token_ids = [70, 71, 72]
        first = _schedule_by_hand(scheduler, r, 6)
        assert first.token_ids == tuple(prompt[:6]) and first.num_draft_tokens == 0
        assert not first.sample and r.num_computed_tokens == 6
        second = _schedule_by_hand(scheduler, r, 4 + 2)
        assert second.token_ids == (*prompt[6:], 70, 71) and second.num_draft_tokens == 2
        assert second.sample and second.num_computed_tokens == 6
        assert r.num_computed_tokens == 12 and r.num_output_placeholders == 1
        assert len(second.block_ids) == llm.kv_manager.blocks_needed(12)
        r.output_token_ids += [70, 80]  # draft 70 accepted, 80 sampled; 71 rejected
        r.num_output_placeholders, r.num_computed_tokens = 0, 11
        r.spec_token_ids = [81, 82, 83]
        third = _schedule_by_hand(scheduler, r, 1 + 3)
        assert third.token_ids == (80, 81, 82, 83) and third.num_draft_tokens == 3
        assert third.num_computed_tokens == 11 and r.num_computed_tokens == 15
        assert _schedule_by_hand(scheduler, q, 3).token_ids == (1, 2, 3)
        q.spec_token_ids = [90, 91, 92]  # drafted while its token is in flight
        after = _schedule_by_hand(scheduler, q, 1 + 2)
        assert after.token_ids == (placeholder, 90, 91) and after.num_draft_tokens == 2
        assert after.sample and q.num_computed_tokens == 6 and q.num_output_placeholders == 2
    finally:
        _unseat(llm, [r, q])


def test_rollback_uncounts_rejected_drafts_and_frees_their_blocks(stage, tiny_model, make_llm):
    """Scheduler.rollback alone (a step with drafts scheduled by hand): the rejected drafts'
    positions are computed no more, and the blocks only they used go back to the pool."""
    prompt = list(range(30, 40))  # 10 tokens: 3 blocks of 4
    llm, (r,) = _seated_spec(stage, tiny_model, make_llm, {"r": prompt})
    manager = llm.kv_manager
    try:
        r.spec_token_ids = [70, 71, 72]
        _schedule_by_hand(llm.scheduler, r, 10 + 3)  # 13 positions: 4 blocks
        table, free = manager.block_ids("r")[:3], manager.num_free_blocks
        assert len(manager.block_ids("r")) == 4
        llm.scheduler.rollback(r, 0)  # every draft accepted
        assert r.num_computed_tokens == 13 and len(manager.block_ids("r")) == 4
        llm.scheduler.rollback(r, 3)  # every draft rejected
        assert r.num_computed_tokens == 10 and manager.block_ids("r") == table
        assert manager.num_free_blocks == free + 1, "the block only the drafts used"
    finally:
        _unseat(llm, [r])


def test_update_from_output_appends_accepted_drafts_and_rolls_back_the_rest(
    stage, tiny_model, make_llm
):
    """LLMEngine.update_from_output alone (a step scheduled by hand, its sampled tokens made
    up): a request gets its accepted drafts and the token after them, the rejected drafts'
    positions are rolled back, the statistics count accepted drafts (not the extra token),
    and the next drafts are proposed; a stop inside the accepted drafts ends the request
    there and it leaves at once."""
    scheduler_module = importlib.import_module(f"{stage.__name__}.scheduler")
    prompts = {"r": REPETITIVE, "s": REPETITIVE[:10]}
    llm, (r, s) = _seated_spec(stage, tiny_model, make_llm, prompts)
    s.params = stage.SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[9])
    stats = llm.spec_stats
    before = (stats.num_verifications, stats.num_draft_tokens, stats.num_accepted_tokens)
    try:
        r.spec_token_ids, s.spec_token_ids = [8, 9, 7], [5, 6, 7]
        step = scheduler_module.SchedulerOutput(
            (
                _schedule_by_hand(llm.scheduler, r, len(REPETITIVE) + 3),
                _schedule_by_hand(llm.scheduler, s, 10 + 3),
            )
        )
        llm.update_from_output(step, {"r": [8, 9, 5], "s": [5, 6, 7, 8]})
        assert r.output_token_ids == [8, 9, 5] and r.num_output_placeholders == 0
        assert r.num_computed_tokens == len(REPETITIVE) + 2, "the rejected draft rolled back"
        assert r.spec_token_ids == [6, 7, 8], "the next drafts: what followed ...7, 8, 9, 5"
        after = (stats.num_verifications, stats.num_draft_tokens, stats.num_accepted_tokens)
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 6, 5]
        assert s.output_token_ids == [5, 6, 7, 8] and s.finish_reason is None
        s.spec_token_ids = [9, 5, 6]
        step = scheduler_module.SchedulerOutput((_schedule_by_hand(llm.scheduler, s, 1 + 3),))
        outputs = llm.update_from_output(step, {"s": [9, 5, 6, 7]})
        assert s.output_token_ids == [5, 6, 7, 8, 9] and s.finish_reason == "stop"
        assert "s" not in llm.scheduler.requests and llm.kv_manager.block_ids("s") == []
        assert [o.request_id for o in outputs] == ["s"] and outputs[0].finished
    finally:
        _unseat(llm, [r, s])
