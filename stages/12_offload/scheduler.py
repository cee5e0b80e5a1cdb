"""The scheduler: which requests run in the next forward, and which of their tokens.

Every request carries `num_computed_tokens`, the tokens whose K/V are already in the cache. A
step gives a request `num_tokens - num_computed_tokens` new tokens (vLLM V1's rule): the whole
prompt on its first step, one token per decode step after that. There is no "prefill" or
"decode" in the scheduler's data, only new tokens over a cached context, so later stages add a
recompute after preemption, a prefill chunk, a prefix-cache hit or k+1 speculative tokens
without a new case.

Prefix caching (stage 07) is one of those cases: a waiting request whose leading full blocks
are in the cache is admitted with them in its block table and `num_computed_tokens` at the end
of the hit, so the step computes only the rest of its prompt (always at least its last token).
Each scheduled step publishes the blocks it fills (`KVCacheManager.cache_blocks`).

Speculative decoding (stage 08) is another: a running request's draft tokens are scheduled
after its last token (`_drafts_that_fit`), and `rollback` takes back the rejected ones.

The scheduler's output is plain data (`SchedulerOutput`): ids, token ids, counts, sampling
settings. No tensors, no `Request` objects with their detokenizers, so it can be pickled and sent
to another process (tensor-parallel workers, a disaggregated decode worker) or kept while the
previous step is still running (async scheduling).

Static batching (stage 03) fixes a batch and runs it until its last member ends: a request that
finishes early leaves an idle seat, and a request that arrives meanwhile waits for the whole
batch. Continuous batching (Orca's iteration-level scheduling, as vLLM does it) decides again at
every step, under a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):

    1. running requests first, oldest first, each with its new tokens. When the block pool is
       full, the newest running request is *preempted*: its blocks are freed, its
       `num_computed_tokens` drops to 0 and it goes back to the front of the waiting queue, to be
       recomputed from its tokens later (a recompute is just more new tokens);
    2. then waiting requests join, in arrival order, while seats, tokens and free blocks allow
       (none in a step that preempted);
    3. finished requests leave at once (`finish`), so their blocks serve the next step.

`scheduling="static"` keeps stage 03's policy, for comparison.

Chunked prefill (stage 06; Sarathi-Serve, vLLM V1): the token budget is shared by everyone and
a prompt no longer has to fit in one step. Running requests come first (decodes and prompts
part-way through their chunks), then waiting ones; each gets `min(tokens left to compute, budget
left, long_prefill_token_threshold)`. A long prompt's KV is written chunk by chunk across steps
and only its last chunk samples a token. A 2,000-token prompt arriving next to running decodes
then costs them a few chunk-sized steps instead of one 2,000-token stall. With
`chunked_prefill=False` a prompt is scheduled whole, as in stage 05. A static batch chunks its
prompts too: its admission is bounded by seats and blocks, never by the chunk budget.

With async scheduling the next step is scheduled while the previous one still runs, so a
request's newest token may not be known yet: it counts as an *output placeholder*. A running
request then gets that placeholder as its one new token (`PLACEHOLDER` in `token_ids`; the model
runner takes the real id from the previous step's sampled ids on the device). A request whose
tokens in flight already reach max_tokens is not scheduled again, and a preempted request waits
for its token in flight to land before it is readmitted.

A KV connector (stage 12) adds one more source of cached tokens: a request may wait in
`loading` while its KV arrives, and a victim's KV may be swapped out instead of dropped. The
scheduler's part of it is in kv_connector/scheduler_side.py.
"""

from __future__ import annotations

import itertools
from collections import deque

from stages.common.devices import default_max_num_batched_tokens, resolve_device

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .kv_connector.base import KVConnectorScheduler
from .kv_connector.scheduler_side import ConnectorScheduling
from .request import Request
from .scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput

IN_FLIGHT = (PLACEHOLDER,)  # a decode's one new token when it is still in flight


class Scheduler(ConnectorScheduling):
    """Waiting and running queues over one KV block pool, decided again at every step."""

    def __init__(
        self,
        config: EngineConfig,
        kv_manager: KVCacheManager,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        assert config.max_model_len is not None  # the engine resolves it
        self.kv = kv_manager
        self._init_connector(config, connector)  # kv_connector/scheduler_side.py
        self.max_num_seqs = config.max_num_seqs
        self.chunked = config.chunked_prefill
        default_budget = default_max_num_batched_tokens(  # 256 on a CPU, 2,048 on a GPU
            resolve_device(config.device),
            chunked_prefill=self.chunked,
            max_model_len=config.max_model_len,
        )
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        if not self.chunked and self.max_num_batched_tokens < config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({config.max_model_len}) without chunked prefill: a whole "
                "prompt runs in one forward"
            )
        # One request's share of a step: lets several long prompts progress side by side.
        self.long_prefill_token_threshold = config.long_prefill_token_threshold or 0
        self.policy = config.scheduling
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._finished_ids: list[str] = []
        self._admissions = itertools.count()  # numbers every add(): see Request.admission_id
        self.num_preemptions = 0
        # Decodes with room in their last block are scheduled in `_schedule_running`'s loop
        # itself; off, they take the general path too (the test that compares the two).
        self.decode_path = True

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.admission_id = next(self._admissions)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Pick the step's requests and their new tokens.

        Contract: a scheduled request gets `min(tokens not computed yet, budget left,
        long_prefill_token_threshold)` new tokens (all of them without chunked prefill) with KV
        slots for all, and its `num_computed_tokens` moves past them now, before the forward
        runs; it samples only when they reach its end. The step holds at most `max_num_seqs`
        requests and `max_num_batched_tokens` tokens. A preempted request holds no blocks, has
        `num_computed_tokens == 0` and waits at the front of the queue.
        """
        if self.policy == "static":
            if not self.running:
                self._admit_static_batch()
            scheduled = self._schedule_static_batch()
        else:
            scheduled, budget, preempted = self._schedule_running()
            if not preempted:
                scheduled += self._admit_waiting(budget)
        output = SchedulerOutput(tuple(scheduled), self._take_finished_ids())
        return self._with_connector_meta(output)

    @staticmethod
    def _left(request: Request) -> int:
        """Tokens the request has not computed, its token in flight included."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _chunk(self, request: Request, budget: int) -> int:
        """How many of its tokens a request gets this step: all, or a chunk under the budget
        and the per-request threshold (0 when it must wait)."""
        left = self._left(request)
        if not self.chunked:
            return left if left <= budget else 0
        cap = self.long_prefill_token_threshold
        return min(left, budget, cap) if cap else min(left, budget)

    def _schedule_running(self) -> tuple[list[ScheduledRequest], int, bool]:
        """Each running request's next tokens (a decode, or a prompt's next chunk), oldest
        first, under the token budget; preempt the newest when blocks run out. Drafts join
        only once every real token has its place, in what is left (`_drafts_that_fit`), so
        they never cost anyone a preemption. Returns the scheduled requests, the token budget
        they leave, and whether anyone was preempted.

        Nearly every running request at nearly every step is a decode whose last block still
        has room: one token left (the one in flight with async scheduling, else its last),
        nothing to allocate (15 steps in 16 with blocks of 16 tokens), no drafts, and the step
        samples. The loop schedules that case itself, in place, with no call but the builder
        (`_scheduled`); every other case, a decode that needs a new block or has drafts
        included, goes through `_chunk` and `allocate_slots`, keeps its place in the step, and
        gets its tokens from `_schedule_new_tokens` once the drafts know the budget left. A
        test holds the decode path to the general one: with `decode_path` off, every decode
        takes the general path, and the engine must schedule the same steps and produce the
        same tokens."""
        scheduled: list[ScheduledRequest | None] = []  # None: a place `chosen` fills
        chosen: list[tuple[int, Request, int]] = []  # its place, its number of real new tokens
        preempted = False
        budget = self.max_num_batched_tokens
        tables, block_size = self.kv.block_tables, self.kv.block_size
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            output, start = request.output_token_ids, request.num_computed_tokens
            in_flight = request.num_output_placeholders
            left = len(request.prompt_token_ids) + len(output) + in_flight - start  # `_left`
            decode = left == 1 and self.decode_path and not request.spec_token_ids
            table = tables.get(request.request_id) if decode else None
            if table and len(table) * block_size > start and not request.finishes_in_flight:
                end = request.num_computed_tokens = start + 1
                # A block is published once its last token is on the host (`cache_blocks`): a
                # decode ends at that token (steps one at a time) or one after it (in flight;
                # on this path only where a table has room at a block's start: an exact table
                # sends that decode through the general path, which publishes as well).
                if end % block_size < 2:
                    self.kv.cache_blocks(request, end)  # hits for later requests
                if in_flight:  # its token is still in flight
                    token_ids = IN_FLIGHT
                else:  # its last token: the last sampled, or a prompt's last one-token chunk
                    token_ids = (output[-1] if output else request.prompt_token_ids[-1],)
                request.num_output_placeholders = in_flight + 1  # sampled now, unseen yet
                scheduled.append(self._scheduled(request, token_ids, start, True))
                budget -= 1
                index += 1
                continue
            num_new = 1 if left == 1 else self._chunk(request, budget)  # a decode: no rule to apply
            if request.finishes_in_flight or num_new == 0:  # done, or no room this step
                index += 1
                continue
            if self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                chosen.append((len(scheduled), request, num_new))
                scheduled.append(None)
                budget -= num_new
                index += 1
                continue
            victim = self.running[-1]  # the most recent arrival gives way
            self._preempt(victim)
            preempted = True
            if victim is request:
                break
        for place, request, num_new in chosen:
            if request.spec_token_ids:  # most requests have none: no call for them
                num_drafts = self._drafts_that_fit(request, num_new, budget)
                budget -= num_drafts
                num_new += num_drafts
            scheduled[place] = self._schedule_new_tokens(request, num_new)
        return scheduled, budget, preempted  # type: ignore[return-value]  # every place filled

    def _preempt(self, victim: Request) -> None:
        """Recompute preemption: the victim leaves `running`, its blocks are freed, its
        `num_computed_tokens` is 0 (its KV is gone; its tokens are kept), it waits at the front
        of `waiting`, and `num_preemptions` counts it. With swap preemption the connector first
        takes its KV (`_swap_out`)."""
        self.running.remove(victim)
        self._swap_out(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # drafted for a step that will not come
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Waiting requests join in arrival order while seats, tokens and blocks allow; with
        chunked prefill a long prompt joins with its first chunk. A request whose leading
        blocks are cached starts after them: only the rest of its prompt is computed.

        The hit is recorded once per request, at its first admission: `num_cached_tokens`
        (None until then) becomes the hit's tokens and `self.kv.stats.record(num_tokens,
        num_cached_tokens)` counts it; a recompute after a preemption records nothing."""
        scheduled: list[ScheduledRequest] = []
        self._loaded_first()
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted with a token in flight: wait for it
                break
            if self.kv.block_ids(request.request_id):  # its KV was loaded: go on after it
                num_new = self._fit_held(request, self._chunk(request, budget))
                if num_new == 0:
                    break
                self.waiting.popleft()
                self.running.append(request)
                scheduled.append(self._schedule_new_tokens(request, num_new))
                budget -= num_new
                continue
            hit = self.kv.find_cached_prefix(request)
            request.num_computed_tokens = len(hit) * self.kv.block_size
            external = self._external_tokens(request)
            if external is None:  # the connector cannot tell yet (a store in flight): wait
                request.num_computed_tokens = 0
                break
            if external:
                if not self._start_load(request, hit, external):
                    break
                continue
            num_new = self._chunk(request, budget)
            if num_new == 0 or not self.kv.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new, hit
            ):
                request.num_computed_tokens = 0  # still waiting: nothing is held for it
                break
            self.waiting.popleft()
            self.running.append(request)
            if request.num_cached_tokens is None:  # its first admission, not a recompute
                request.num_cached_tokens = request.num_computed_tokens
                self.kv.stats.record(request.num_tokens, request.num_cached_tokens)
            scheduled.append(self._schedule_new_tokens(request, num_new))
            budget -= num_new
        return scheduled

    def _admit_static_batch(self) -> None:
        """Stage 03's policy: a new batch only when the running one is empty, admitted on its
        members' worst case (prompt + max_tokens) so it never needs a preemption. Without
        chunked prefill the batch's prompts must also fit one step's token budget; with it they
        run chunk by chunk (`_schedule_static_batch`), so the budget bounds no admission."""
        promised, free, tokens = 0, self.kv.num_free_blocks, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            assert request.params.max_tokens is not None
            worst = self.kv.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)
            over_budget = tokens + request.num_tokens > self.max_num_batched_tokens
            if promised + worst > free or (over_budget and not self.chunked):
                break
            promised += worst
            tokens += request.num_tokens
            self.running.append(self.waiting.popleft())

    def _schedule_static_batch(self) -> list[ScheduledRequest]:
        """The static batch's next tokens, members in arrival order under the token budget: a
        whole prompt without chunked prefill (admission made the prompts fit one step), else
        chunk by chunk as running requests get them. Blocks never run out: admission promised
        every member its worst case."""
        scheduled: list[ScheduledRequest] = []
        budget = self.max_num_batched_tokens
        for request in self.running:
            num_new = 0 if request.finishes_in_flight else self._chunk(request, budget)
            if num_new:
                self._allocate_promised(request, request.num_computed_tokens + num_new)
                num_new += self._drafts_that_fit(request, num_new, budget - num_new)
                scheduled.append(self._schedule_new_tokens(request, num_new))
                budget -= num_new
        return scheduled

    def _drafts_that_fit(self, request: Request, num_new: int, budget: int) -> int:
        """How many of its drafts ride after a request's `num_new` real tokens: none unless
        those reach its last real token, else as many as the budget, the per-request threshold
        and the blocks free now allow. Drafts are optional work: they shrink, to none, where a
        real token would have to preempt someone for them."""
        if not request.spec_token_ids or num_new < self._left(request):
            return 0
        room = budget
        if self.long_prefill_token_threshold:
            room = min(room, self.long_prefill_token_threshold - num_new)
        end = request.num_computed_tokens + num_new
        held = len(self.kv.block_ids(request.request_id)) + self.kv.num_free_blocks
        return max(0, min(len(request.spec_token_ids), room, held * self.kv.block_size - end))

    def _allocate_promised(self, request: Request, end: int) -> None:
        """Slots the scheduler has made sure of: a static batch's member (admission promised
        its worst case) or a request's drafts (`_drafts_that_fit` counted the free blocks)."""
        if not self.kv.allocate_slots(request.request_id, end):
            raise RuntimeError(f"no KV blocks for {request.request_id}: a scheduling bug")

    def _schedule_new_tokens(self, request: Request, num_new: int) -> ScheduledRequest:
        """The request's next `num_new` tokens (its token in flight included, as a PLACEHOLDER
        id, then as many of its drafts as fit). Only a step that reaches the end of its tokens
        samples: an intermediate chunk computes KV and nothing else. A sampling step counts one
        more placeholder. The caller has allocated the slots of its real tokens
        (`allocate_slots` runs once per request per step, not a second time here to check);
        its drafts' slots, which `_drafts_that_fit` sized to the free blocks, are taken here."""
        start, known = request.num_computed_tokens, request.num_tokens
        end = start + num_new
        reach = known + request.num_output_placeholders  # the end of its real tokens
        sample = end >= reach
        num_drafts = max(0, end - reach)
        if num_drafts:
            self._allocate_promised(request, end)
        self.kv.cache_blocks(request, end)  # full blocks after this step: hits for later ones
        request.num_computed_tokens = end
        request.num_output_placeholders += sample  # sampled now, unseen until resolved
        if start >= known and not num_drafts:  # the common decode: its new token in flight
            token_ids = (PLACEHOLDER,) * num_new
        elif end <= known:  # every token on the host: a prompt's chunk, a decode not overlapped
            token_ids = tuple(request.token_ids_between(start, end))
        else:
            token_ids = request.token_ids_between(start, min(end, known))
            token_ids += [PLACEHOLDER] * (min(end, reach) - max(start, known))
            token_ids = tuple(token_ids + request.spec_token_ids[:num_drafts])
        return self._scheduled(request, token_ids, start, sample, num_drafts)

    def _scheduled(
        self,
        request: Request,
        token_ids: tuple[int, ...],
        start: int,
        sample: bool,
        num_drafts: int = 0,
    ) -> ScheduledRequest:
        """The step's share of a request as plain data, its block table copied."""
        # Positional, each field named beside it: binding them as keywords costs twice as much, and
        # this runs once per running request per step (scheduler_output.py, ScheduledRequest).
        return ScheduledRequest(
            request.request_id,  # request_id
            request.admission_id,  # admission_id
            token_ids,  # token_ids
            start,  # num_computed_tokens
            request.params,  # params
            request.seed,  # seed
            sample,  # sample
            tuple(self.kv.block_ids(request.request_id)),  # block_ids
            num_drafts,  # num_draft_tokens
        )

    def rollback(self, request: Request, num_rejected: int) -> None:
        """The target rejected the last `num_rejected` drafts it computed: their positions
        hold no token of the request. Count them uncomputed and free the blocks they alone
        used (speculative decoding)."""
        request.num_computed_tokens -= num_rejected
        self.kv.trim(request.request_id, request.num_computed_tokens)

    def _take_finished_ids(self) -> tuple[str, ...]:
        finished, self._finished_ids = tuple(self._finished_ids), []
        return finished

    def finish(self, request: Request) -> None:
        """A request is done: it leaves now and its blocks serve the next step."""
        self._remove(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is, freeing its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self._remove(request)
        return request

    def _remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it, for good, and free its blocks."""
        request_id = request.request_id
        if request in self.running:
            self.running.remove(request)
        elif self.loading.pop(request_id, None) is None:
            self.waiting.remove(request)
        self._free_blocks(request)
        del self.requests[request_id]
        self._finished_ids.append(request.request_id)
