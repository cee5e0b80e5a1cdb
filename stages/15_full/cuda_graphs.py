"""CUDA graphs for decode steps: one recorded forward per batch size, replayed in one launch.

A decode step of a small batch is tiny work spread over hundreds of kernels (per layer: norms,
matmuls, RoPE, the cache write, attention). On a GPU the host then spends longer launching
them than the GPU spends running them: the step is launch-bound. A CUDA graph records the
kernels of one forward once, with their arguments; `replay()` launches all of them with one
call. What a graph cannot do is change: its kernels read and write the same addresses, and
its shapes, grids and Python branches are those of the capture. So, as nano-vllm and vLLM do:

- only pure decode steps are replayed (every request has exactly one new token, no drafts):
  their shape is fixed by the batch size alone. Prefills, chunks and drafts run eagerly;
- one graph per *bucket* of batch sizes (1, 2, 4, 8, 16, 24, ... up to the largest batch, at
  most 512: vLLM's sizes), captured largest first into one shared memory pool, so each smaller
  graph reuses the memory the largest one set aside;
- the inputs are the runner's persistent device buffers (input_buffers.py): a step writes its
  values there and the graph reads them. A batch is padded up to its bucket: the padding rows
  are one-token sequences whose K/V go to a *scratch block* the scheduler never hands out, so
  they never touch a real request's cache, and their outputs are dropped;
- the graph ends at the logits and their argmax (the LM head and greedy sampling inside it);
  a step with any sampled row samples the real rows' logits eagerly.

The planner (`GraphPlan`, `unsupported_reason`) is plain logic, tested on a CPU.
`DecodeGraphs` captures and replays; its capture function is injected, so the CPU tests run
the same bookkeeping with a stand-in that calls the forward again on every replay.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

MAX_CAPTURE_SIZE = 512  # vLLM's default largest graph: bigger batches are not launch-bound
# The persistent input buffers a graph reads (the rest of a step's inputs are used eagerly).
GRAPH_INPUTS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
)


def capture_sizes(max_batch: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """vLLM's buckets, 1, 2, 4, then every 8 to 256, then every 16, up to the largest batch
    (capped at `limit`), which is always a bucket itself so that every batch fits one."""
    largest = min(max_batch, limit)
    if largest < 1:
        raise ValueError(f"the largest batch must be at least 1, got {max_batch}")
    steps = (1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16))
    return (*[s for s in steps if s < largest], largest)


def unsupported_reason(
    *,
    device_type: str,
    attention_backend: str,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    moe: bool = False,
    kv_cache_dtype: str = "auto",
) -> str | None:
    """Why this engine's decode forward cannot be captured (None: it can). A capturable forward
    makes no decision on the host from the step's data: no `.item()`, `.tolist()`, or Python
    branch on a tensor, or the graph would freeze the first step's answer."""
    if device_type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device_type!r}"
    if attention_backend != "triton":
        return (
            f"attention_backend={attention_backend!r}: the torch path picks its work from the "
            "host's lengths (context_lens); only the Triton kernel reads them on the device"
        )
    if tensor_parallel_size > 1 or expert_parallel:
        return "tensor/expert parallelism: collectives stay eager here (counted on the host)"
    if moe:
        return "a mixture of experts: its dispatch counts tokens per expert on the host"
    if kv_cache_dtype != "auto":
        return f"kv_cache_dtype={kv_cache_dtype!r}: its writes grow scales after a host sync"
    return None


def resolve_cuda_graphs(setting: bool | None, reason: str | None) -> bool:
    """`EngineConfig.cuda_graphs`: None is on wherever graphs work; True where they cannot is
    an error that says why; False is off."""
    if setting and reason is not None:
        raise ValueError(f"cuda_graphs=True, but {reason}: set cuda_graphs=False (or None)")
    return reason is None if setting is None else setting


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """Which steps replay which graph, and how a batch is padded to its bucket."""

    sizes: tuple[int, ...]  # the buckets, ascending
    max_blocks: int  # every graph reads block tables of this width (a full context)
    block_size: int
    scratch_block: int  # padding rows write their K/V here; never given to a request

    @property
    def max_context(self) -> int:
        """The longest context a row can have: the host-side length every captured row
        declares (the graph cannot know the real ones; the device tensors hold them)."""
        return self.max_blocks * self.block_size - 1

    def why_eager(
        self,
        query_lens: Sequence[int],
        num_draft_tokens: Sequence[int],
        table_widths: Sequence[int] = (),
        samples: Sequence[bool] = (),
    ) -> str | None:
        """Why this step runs eagerly (None: it replays a graph). `table_widths`: each
        request's number of blocks, which must fit the graphs' fixed-width tables. `samples`:
        whether each request samples; a graph samples every real row (its LM head and argmax
        run on rows 0..n-1), so a row that does not (a one-token chunk of a prompt that goes
        on) must run eagerly, or the tokens would shift between requests."""
        if not query_lens:
            return "no request"
        if any(n != 1 for n in query_lens):
            return "a prefill or chunk: a request has more than one new token"
        if any(num_draft_tokens):
            return "drafts to verify"
        if not all(samples):
            return "a request that does not sample (a one-token chunk of a longer prompt)"
        if len(query_lens) > self.sizes[-1]:
            return f"batch {len(query_lens)} is beyond the largest graph ({self.sizes[-1]})"
        if any(width > self.max_blocks for width in table_widths):
            return f"a block table wider than the graphs' {self.max_blocks} blocks"
        return None

    def bucket(
        self,
        query_lens: Sequence[int],
        num_draft_tokens: Sequence[int],
        table_widths: Sequence[int] = (),
        samples: Sequence[bool] = (),
    ) -> int | None:
        """The graph a step replays, or None when it runs eagerly."""
        if self.why_eager(query_lens, num_draft_tokens, table_widths, samples) is not None:
            return None
        return bucket_for(len(query_lens), self.sizes)

    def pad(
        self, values: dict[str, Sequence[int]], num_seqs: int, bucket: int
    ) -> dict[str, Sequence[int]]:
        """A decode step's staged inputs padded from `num_seqs` to `bucket` rows: one token per
        padding row, at position 0 of a one-token sequence in the scratch block. Block tables
        are [rows, max_blocks], flat. Other inputs are left as they are. The padded inputs are
        numpy arrays, made by one concatenation each: a step's arrays never go back to Python
        lists (at 256 requests with wide tables that round trip cost milliseconds a step)."""
        pad = bucket - num_seqs
        padded = dict(values)

        def extend(name: str, tail: np.ndarray) -> None:
            padded[name] = np.concatenate([np.asarray(values[name], dtype=np.int64), tail])

        extend("input_ids", np.zeros(pad, dtype=np.int64))
        extend("positions", np.zeros(pad, dtype=np.int64))
        extend("slot_mapping", np.full(pad, self.scratch_slot, dtype=np.int64))
        extend("query_start_loc", np.arange(num_seqs + 1, bucket + 1, dtype=np.int64))
        extend("seq_lens", np.ones(pad, dtype=np.int64))
        extend("block_tables", np.full(pad * self.max_blocks, self.scratch_block, dtype=np.int64))
        return padded

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    def idle_values(self, rows: int) -> dict[str, Sequence[int]]:
        """Inputs of `rows` padding rows only: what the buffers hold while graphs are captured,
        so that warming up and capturing write nothing but the scratch block."""
        empty: dict[str, Sequence[int]] = {
            "input_ids": [],
            "positions": [],
            "slot_mapping": [],
            "query_start_loc": [0],
            "seq_lens": [],
            "block_tables": [],
        }
        return self.pad(empty, 0, rows)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch` rows (None: larger than every bucket)."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None], object], Replayable]


def capture_cuda_graph(run: Callable[[], None], pool: object) -> Replayable:
    """Warm up (Triton compiles, cuBLAS picks its kernels: none of that may happen inside a
    capture), then record one `run()` into a graph whose memory comes from `pool`."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    torch.cuda.synchronize()
    return graph


class DecodeGraphs:
    """One captured decode forward per bucket over the runner's persistent input buffers.

    `forward(size, out)` runs the model and its LM head on the first `size` rows of the
    `buffers` named in GRAPH_INPUTS and returns their logits, written into `out[:size]` where
    the LM head can write there itself (then no graph copies [bucket, vocab] logits: 130 MB a
    replay at 256 rows of a 128k vocabulary); each graph takes their argmax into a second buffer
    (a greedy batch's sampling, done in the graph: the eager launches of the LM head and argmax
    cost a small step as much as a layer), and `replay` returns both (valid until the next
    replay). If the buffers are ever
    reallocated (input_buffers grows one for an unusually large step), the graphs would read
    stale memory: `usable` says so.
    """

    def __init__(
        self,
        plan: GraphPlan,
        forward: Callable[[int, torch.Tensor | None], torch.Tensor],
        buffers: dict[str, torch.Tensor],
        capture: Capture = capture_cuda_graph,
    ) -> None:
        self.plan, self._forward, self._capture = plan, forward, capture
        self._buffers = buffers  # InputBuffers.device_tensors: a reallocation replaces an entry
        self._captured = {name: buffers[name] for name in GRAPH_INPUTS}
        self._graphs: dict[int, Replayable] = {}
        self._out: torch.Tensor | None = None  # the last replay's logits
        self._greedy: torch.Tensor | None = None  # ... and their argmax
        self.num_replays = 0

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        self._out = torch.empty_like(self._forward(self.plan.sizes[-1], None))  # also a warm-up
        self._greedy = torch.empty(self._out.shape[0], dtype=torch.long, device=self._out.device)
        pool = torch.cuda.graph_pool_handle() if self._out.is_cuda else None
        for size in reversed(self.plan.sizes):
            self._graphs[size] = self._capture(functools.partial(self._run, size), pool)

    def _run(self, size: int) -> None:
        assert self._out is not None
        logits = self._forward(size, self._out)
        if logits.data_ptr() != self._out.data_ptr():  # the LM head could not write in place
            self._out[:size].copy_(logits)
        torch.argmax(logits, dim=-1, out=self._greedy[:size])  # greedy sampling, in the graph

    def usable(self) -> bool:
        """Whether the buffers are still the tensors the graphs were captured on."""
        return all(self._buffers[name] is t for name, t in self._captured.items())

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run bucket `bucket`'s graph on what the buffers hold: its logits [bucket, vocab]
        and each row's argmax [bucket] (the padding rows last)."""
        assert self._out is not None, "capture() first"
        self._graphs[bucket].replay()
        self.num_replays += 1
        return self._out[:bucket], self._greedy[:bucket]
