"""Drafters for speculative decoding, and the statistics of how their drafts fare.

A decode step reads every weight of the model to produce one token per request. When the host
can guess the next few tokens cheaply, one target forward over [last token, guess_1..guess_k]
checks them all at once (the attention already takes any number of new tokens over a cache),
and every accepted guess is a token that cost no extra weight read. Two drafters:

- `NgramProposer` (prompt lookup decoding, vLLM's "ngram"): find the longest suffix of the
  sequence, between `min_n` and `max_n` tokens, that occurred earlier, and propose the k tokens
  that followed it there. Free to compute, and very good when the output copies its input
  (editing, summarising, code), useless on open-ended chat.
- `DraftModelProposer`: a smaller model with the same tokenizer guesses k tokens, one forward
  each. No smaller model with SmolLM2's tokenizer installs from a package registry, so the
  draft is the target truncated to its first layers (its own final norm and LM head on top, as
  in self-speculative / early-exit decoding). Those layers compute exactly what the target's
  first layers do, so the draft reads and writes the target's own KV cache for them: no second
  cache and no draft prefill. The target's verification forward then overwrites the drafted
  positions with its own values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..input_buffers import to_device
from ..model import AttentionMetadata, CausalLM
from ..sampling import SamplingParams, SamplingTensors, probabilities
from .rejection_sampler import DRAFT_STREAM, race_exponentials

# An input id the draft model replaces on the device during the step with its draft. The
# sentinels share the int64 id space with real tokens, so each has its own negative value:
# scheduler.PLACEHOLDER = -1 (a token still in flight), DRAFT = -2, and the rejection sampler's
# output padding rejection_sampler.NO_TOKEN = -3.
DRAFT = -2


class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier match of the suffix.

    Searching the whole sequence costs O(length) per step, and a request only grows. So, per
    request, the proposer keeps its tokens and an index from every n-gram (min_n..max_n tokens)
    that has a token after it to its most recent start, updated as tokens arrive (`extend`:
    max_n - min_n + 1 entries per token). A proposal is then at most that many dict lookups,
    however long the request (`propose_for`). The engine drops a request's index when the
    request leaves (`forget`).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, list[int]] = {}  # per request: its tokens so far
        self._latest: dict[str, dict[tuple[int, ...], int]] = {}  # ... n-gram -> latest start

    def num_tokens(self, request_id: str) -> int:
        """How many of the request's tokens are indexed (0 for a request not seen yet)."""
        return len(self._tokens.get(request_id, ()))

    def extend(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Append tokens to the request's sequence and index them: O(new tokens)."""
        tokens = self._tokens.setdefault(request_id, [])
        self._index(tokens, self._latest.setdefault(request_id, {}), new_token_ids)

    def propose_for(self, request_id: str, k: int) -> list[int]:
        """Up to k drafts after the request's indexed tokens (see `_lookup`)."""
        return self._lookup(self._tokens.get(request_id, []), self._latest.get(request_id, {}), k)

    def forget(self, request_id: str) -> None:
        """The request left: drop its tokens and index."""
        self._tokens.pop(request_id, None)
        self._latest.pop(request_id, None)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k drafts for a whole sequence at once (indexing it first costs O(length)); a
        request that grows step by step uses `extend` and `propose_for` instead."""
        tokens: list[int] = []
        latest: dict[tuple[int, ...], int] = {}
        self._index(tokens, latest, token_ids)
        return self._lookup(tokens, latest, k)

    def _index(
        self, tokens: list[int], latest: dict[tuple[int, ...], int], new_token_ids: Sequence[int]
    ) -> None:
        """Append each new token to `tokens`. Its arrival gives the n-grams that end just before
        it a token to propose, so they become matchable: record where each starts. A later
        occurrence overwrites an earlier one, so the index keeps the most recent."""
        for token in new_token_ids:
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                latest[tuple(tokens[end - n : end])] = end - n
            tokens.append(int(token))

    def _lookup(self, tokens: list[int], latest: dict[tuple[int, ...], int], k: int) -> list[int]:
        """For n from max_n down to min_n, the k tokens after the most recent earlier
        occurrence of the last n tokens (likeliest to repeat); none when no suffix repeats."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = latest.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """What the draft model needs for one step, per drafting request (host data)."""

    rows: tuple[int, ...]  # input row of the request's last real token
    num_drafts: tuple[int, ...]  # how many tokens to draft after it
    contexts: tuple[int, ...]  # that token's position (tokens cached before it)
    table_rows: tuple[int, ...]  # its row in the step's block-table tensor
    params: tuple[SamplingParams, ...]
    seeds: tuple[int, ...]


class DraftModelProposer:
    """The target's first `num_layers` layers as the draft model, on the target's cache."""

    def __init__(self, model: CausalLM, num_layers: int) -> None:
        if num_layers >= model.config.num_layers:
            raise ValueError(
                f"draft_num_layers ({num_layers}) must be below the target's "
                f"{model.config.num_layers} layers"
            )
        self.model, self.num_layers = model, num_layers

    def propose(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, plan: DraftPlan, kv_cache: object
    ) -> torch.Tensor:
        """Fill each request's DRAFT rows of `input_ids` (in place), one draft forward per
        drafted position; return the draft distributions q [sum of drafts, V] in row order.

        Each draft is SAMPLED from its q (`probabilities`, the request's settings) by the
        exponential race on the draft's own random stream (seed ^ DRAFT_STREAM, offset = the
        draft's position), never its argmax: the rejection sampler emits the target's
        distribution only when the drafts are drawn from the q it is given."""
        device, vocab = input_ids.device, self.model.config.vocab_size
        steps = [  # per drafted position: the requests still drafting
            [i for i, n in enumerate(plan.num_drafts) if n > step]
            for step in range(max(plan.num_drafts))
        ]
        # Every step's row, position and block-table indices in one host tensor: one copy
        # that does not wait (pinned on CUDA), and no host-to-device copy inside the loop.
        packed = [
            [plan.rows[i] + step, plan.contexts[i] + step, plan.table_rows[i]]
            for step, active in enumerate(steps)
            for i in active
        ]
        indices = to_device(torch.tensor(packed, dtype=torch.long).T.contiguous(), device)
        q_rows: list[list[torch.Tensor]] = [[] for _ in plan.rows]
        first = 0
        for step, active in enumerate(steps):
            rows, positions, table_rows = indices[:, first : first + len(active)]
            first += len(active)
            step_meta = AttentionMetadata(
                query_start_loc=torch.arange(len(active) + 1, device=device, dtype=torch.int32),
                seq_lens=(positions + 1).to(torch.int32),
                block_tables=meta.block_tables[table_rows],
                slot_mapping=meta.slot_mapping[rows],
                query_lens=(1,) * len(active),
                context_lens=tuple(plan.contexts[i] + step for i in active),
                attention_backend=meta.attention_backend,
            )
            hidden = self.model(
                input_ids[rows], positions, kv_cache, step_meta, num_layers=self.num_layers
            )
            tensors = SamplingTensors.from_params(
                [plan.params[i] for i in active],
                [plan.seeds[i] ^ DRAFT_STREAM for i in active],
                [plan.contexts[i] + step + 1 for i in active],  # the position of the draft
                vocab,
                torch.device("cpu"),
            )
            tensors = to_device(tensors, device)
            q = probabilities(self.model.compute_logits(hidden), tensors)
            drafted = (q / race_exponentials(tensors.seeds, tensors.offsets, vocab)).argmax(-1)
            input_ids[rows + 1] = drafted
            for index, row in zip(active, q, strict=True):
                q_rows[index].append(row)
        return torch.stack([row for rows in q_rows for row in rows])


@dataclass
class SpecDecodeStats:
    """Drafts proposed and accepted, over every verification so far."""

    num_verifications: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts j accepted

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_verifications += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.append(0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens each verifying forward produced for a request: accepted drafts + 1."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications
