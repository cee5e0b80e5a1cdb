"""The scheduler's output: the plain-data contract between the scheduler and the model runner.

It lives apart from the scheduler's policy (vLLM V1 keeps it in `sched/output.py`) because
everything downstream of a step reads it: the model runner, and in later stages the executor's
workers and the KV connectors. They import this small module, not the scheduler. The data is
plain (ids, token ids, counts, sampling settings): no tensors and no `Request` objects, so it can
be pickled to another process or kept while the previous step still runs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

from .kv_connector.base import KVConnectorMetadata
from .sampling import SamplingParams

# Each sentinel in the token id space has its own value (stage 08 adds DRAFT -2, NO_TOKEN -3).
PLACEHOLDER = -1  # a token id not known on the host yet: sampled by the step in flight


class ScheduledRequest(NamedTuple):
    """One request's share of a step: its new tokens, sitting after its cached ones.

    A NamedTuple, not a frozen dataclass (stages 01-04): as immutable and as plain (picklable,
    no live state), but built by one C call, where a frozen dataclass sets each field through
    `object.__setattr__`, one Python call per field; the scheduler makes one per running
    request per step, and builds it positionally (keywords cost twice as much to bind). Read
    it by field name; one reader alone uses its being a tuple: `InputBatch.pack` turns a step
    into columns with one `zip`, so the first eight fields keep their order (input_batch.py
    checks it on import).
    """

    request_id: str
    admission_id: int  # which admission of request_id (Scheduler.add): ids can be reused
    token_ids: tuple[int, ...]  # the new tokens whose K/V this step computes
    num_computed_tokens: int  # tokens already cached: the first new token's position
    params: SamplingParams
    seed: int
    sample: bool  # the new tokens reach the end of the request: sample its next token
    block_ids: tuple[int, ...]  # its block table: where every position's K/V lives
    num_draft_tokens: int = 0  # the last new tokens are drafts to verify (speculative decoding)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step, as plain picklable data."""

    requests: tuple[ScheduledRequest, ...] = ()
    finished_request_ids: tuple[str, ...] = ()  # gone since the last step: drop their state
    kv_connector_metadata: KVConnectorMetadata | None = None  # the step's KV transfers

    @property
    def num_tokens(self) -> int:
        return sum(map(len, map(_TOKEN_IDS, self.requests)))  # C loops (stage 15 reads it per step)


_TOKEN_IDS = operator.attrgetter("token_ids")
