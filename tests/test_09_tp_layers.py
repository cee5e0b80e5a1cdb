"""Stage 09 promises, the model side: a sharded model is the same model.

Real processes, never threads: a module-scoped pool of three spawned ranks joined in one gloo
group (ranks 0-1 also form a TP=2 subgroup) runs a function in each of its first TP ranks, so
process start-up is paid once per module. Each rank loads its shard of a tiny checkpoint and
computes the prompt's logits without a KV cache, as `ModelRunner.prompt_logits` does.

Tolerance: TP=2/3 logits equal TP=1's within TP_ATOL = 1e-4 in fp32. A row-parallel matmul
sums its dot products in TP partial sums that the all-reduce adds, a different order from one
matmul's, so the results differ by float rounding: measured at most 6e-6 on these checkpoints
(logits up to ~6, 2-3 layers; SmolLM2-135M at TP=3, 30 layers, logits up to ~30: 3e-4). A
sharding error (a wrong head, a row off by one, a missing mask) moves logits by 1e-1 or more.
Against transformers the suite's LOGIT_ATOL applies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing.connection
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.multiprocessing

import stages
from stages.common.model_config import ModelConfig
from stages.common.tooling.hf_oracle import LOGIT_ATOL, hf_logits

from .conftest import since, unit

pytestmark = since("09")

TP_ATOL = 1e-4
WORLD = 3  # ranks in the pool: TP=3 uses all, TP=2 the first two
STARTUP_TIMEOUT = 120.0  # seconds for the ranks to start and join the group
TASK_TIMEOUT = 120.0  # seconds for one function to return in every rank
COLLECTIVE_TIMEOUT = 60.0  # a collective whose peer is gone fails after this
MAX_POSITIONS = 64
# Byte-level ids (vocabulary 259): both ends of the vocabulary and the rank boundaries of TP=2
# (rows 0-129 | 130-258 + 1 padding row) and TP=3 (0-86 | 87-173 | 174-258 + 2 padding rows).
TOKEN_IDS = [1, 0, 72, 101, 108, 108, 111, 129, 130, 86, 87, 173, 174, 258, 257, 32, 119, 44]
# (tiny spec, TP): KV heads = ranks, KV heads < ranks, TP=3, untied heads, q/k norms, then
# attention biases with the KV head replicated (TP=2 and 3) and KV heads split (TP=3).
CASES = [
    ("llama-gqa", 2),
    ("llama-mqa", 2),
    ("llama-tp3", 3),
    ("llama-mha-untied", 2),
    ("qwen3", 2),
    ("llama-bias-mqa", 2),
    ("llama-bias-mqa", 3),
    ("llama-bias-tp3", 3),
]
BIAS_CASES = [("llama-bias-mqa", 2), ("llama-bias-mqa", 3), ("llama-bias-tp3", 3)]


# ------------------------------------------------------------------------- the pool of ranks
def _load_stage(name: str, folder: str) -> ModuleType:
    return stages.import_stage(name, folder)


def _rank_main(rank: int, world: int, port: int, conn: Any) -> None:
    """One rank: join the group, then run (function, stage, TP size, args) until told to stop
    or until the parent is gone (its end of the pipe closes)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout)  # the parent serves it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    groups = {world: dist.group.WORLD}
    for size in range(2, world):  # every rank takes part in creating every subgroup
        groups[size] = dist.new_group(list(range(size)))
    conn.send_bytes(pickle.dumps(("ok", os.getpid())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if message is None:
            break
        function, stage_name, stage_folder, size, args = message
        try:
            stage = _load_stage(stage_name, stage_folder)
            parallel = importlib.import_module(f"{stage.__name__}.parallel.group")
            tp = parallel.TPGroup(rank=rank, size=size, group=groups[size])
            reply = ("ok", function(stage, tp, *args))
        except Exception:
            reply = ("error", f"rank {rank}:\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(reply))
    dist.destroy_process_group()


class RankPool:
    """WORLD spawned processes in one gloo group; `run` calls a function in the first TP.

    A function that fails in one rank leaves its peers waiting in a collective: the pool then
    kills every rank at once (no waiting for the collective timeout) and starts afresh on the
    next `run`, so one failing test does not fail the module's other tests."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.stopped: list[Any] = []
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        self._start()

    def _start(self) -> None:
        import torch.distributed as dist

        context = torch.multiprocessing.get_context("spawn")
        # the ranks meet at a store this process serves, on a port the OS picked as it bound
        # it: a port probed free and bound later by rank 0 could be taken in between
        timeout = timedelta(seconds=STARTUP_TIMEOUT)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.world, True, timeout, wait_for_workers=False
        )
        port = self.store.port
        try:
            for rank in range(self.world):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_rank_main, args=(rank, self.world, port, child_end), daemon=True
                )
                process.start()
                child_end.close()
                self.conns.append(parent_end)
                self.processes.append(process)
            self._gather(self.conns, STARTUP_TIMEOUT)
        except BaseException:
            self.close(kill=True)
            raise

    def _gather(self, conns: list[Any], timeout: float) -> list[Any]:
        """Every conn's answer, in order; the first error or a timeout kills the pool."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(conns):
            pending = [c for i, c in enumerate(conns) if i not in answers]
            ready = multiprocessing.connection.wait(pending, deadline - time.monotonic())
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"a rank gave no answer within {timeout:.0f} s")
            for conn in ready:
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, value = "error", "a rank died"
                if status != "ok":
                    self.close(kill=True)
                    raise RuntimeError(value)
                answers[conns.index(conn)] = value
        return [answers[i] for i in range(len(conns))]

    def run(self, size: int, function: Callable[..., Any], stage: ModuleType, *args: Any) -> list:
        """[function(stage, tp, *args) in rank r for r < size], tp being the TP=size group."""
        if not self.processes:
            self._start()
        folder = str(Path(stage.__file__).parent)
        message = pickle.dumps((function, stage.__name__, folder, size, args))
        for conn in self.conns[:size]:
            conn.send_bytes(message)
        return self._gather(self.conns[:size], TASK_TIMEOUT)

    def close(self, kill: bool = False) -> None:
        """Stop every rank: ask them to leave, or kill them; either way none survives."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that rank may be gone already
                conn.send_bytes(pickle.dumps(None))
        for process in self.processes:
            if kill:
                process.kill()
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        self.stopped = self.processes
        self.conns, self.processes = [], []


@pytest.fixture(scope="module")
def tp_ranks() -> Iterator[RankPool]:
    pool = RankPool(WORLD)
    yield pool
    pool.close()
    assert not any(p.is_alive() for p in pool.stopped), "a rank outlived the test module"


# ------------------------------------------------------------------------- what a rank runs
def _prompt_logits(stage: ModuleType, model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, no KV cache (ModelRunner.prompt_logits)."""
    model_module = importlib.import_module(f"{stage.__name__}.model")
    n = len(ids)
    meta = model_module.AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=None,
        slot_mapping=None,
        query_lens=(n,),
        context_lens=(0,),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), None, meta)
        return model.compute_logits(hidden).float()


def _load(stage: ModuleType, folder: str, backend: str = "torch", tp: Any = None) -> Any:
    loader = importlib.import_module(f"{stage.__name__}.model_loader")
    extra = {} if tp is None else {"tp": tp}
    config = ModelConfig.from_pretrained(folder)
    cpu = torch.device("cpu")
    return loader.load_model(
        Path(folder), config, cpu, torch.float32, MAX_POSITIONS, backend, **extra
    )


def _rank_forward(stage: ModuleType, tp: Any, folder: str, backend: str) -> dict[str, Any]:
    """Load this rank's shard, compute the prompt's logits, report what the rank holds."""
    model = _load(stage, folder, backend, tp)
    tp.stats.reset()
    logits = _prompt_logits(stage, model, TOKEN_IDS)
    attention = model.layers[0].self_attn
    return {
        "logits": logits,
        "numel": {name: p.numel() for name, p in model.named_parameters()},
        "bytes_read": model.checkpoint_bytes_read,
        "comm": tp.stats.snapshot(),
        "heads": (attention.num_heads, attention.num_kv_heads),
    }


_RUNS: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}


def _sharded(pool: RankPool, stage: ModuleType, folder: Path, size: int, backend: str = "torch"):
    """Every rank's report for (stage, checkpoint, TP), run once for the module's tests."""
    key = (stage.__name__, str(folder), size, backend)
    if key not in _RUNS:
        _RUNS[key] = pool.run(size, _rank_forward, stage, str(folder), backend)
    return _RUNS[key]


def _parallel(stage: ModuleType) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.parallel.group")


# ------------------------------------------------------------------------- tests
@unit("model_loader.py")
@pytest.mark.parametrize(("spec", "size"), CASES)
def test_sharded_logits_equal_one_rank_and_transformers(
    stage, tiny_model, hf_model, tp_ranks, spec, size
):
    folder = tiny_model(spec)
    reports = _sharded(tp_ranks, stage, folder, size)
    for report in reports[1:]:  # every rank samples from the same logits
        assert torch.equal(report["logits"], reports[0]["logits"])
    sharded = reports[0]["logits"]
    single = _prompt_logits(stage, _load(stage, str(folder)), TOKEN_IDS)
    assert sharded.shape == single.shape == (len(TOKEN_IDS), 259)
    torch.testing.assert_close(sharded, single, atol=TP_ATOL, rtol=0)
    assert torch.equal(sharded.argmax(-1), single.argmax(-1))
    reference = hf_logits(hf_model(folder), TOKEN_IDS)
    torch.testing.assert_close(sharded, reference, atol=LOGIT_ATOL[torch.float32], rtol=0)


@unit("model_loader.py")
@pytest.mark.parametrize(("spec", "size"), [("llama-gqa", 2), ("llama-tp3", 3)])
def test_one_all_reduce_per_block_and_one_all_gather_per_forward(
    stage, tiny_model, tp_ranks, spec, size
):
    """Embedding + (attention, MLP) per layer all-reduce the hidden states; the head gathers."""
    folder = tiny_model(spec)
    config = ModelConfig.from_pretrained(folder)
    padded_vocab = -(-config.vocab_size // size) * size
    for report in _sharded(tp_ranks, stage, folder, size):
        comm, tokens = report["comm"], len(TOKEN_IDS)
        assert comm["all_reduce_calls"] == 1 + 2 * config.num_layers
        assert (
            comm["all_reduce_bytes"] == comm["all_reduce_calls"] * tokens * config.hidden_size * 4
        )
        assert comm["all_gather_calls"] == 1
        assert comm["all_gather_bytes"] == tokens * padded_vocab * 4


@unit("model_loader.py")
def test_sharded_layers_work_on_packed_onednn_weights(stage, tiny_model, tp_ranks):
    from stages.common.linear import onednn_available

    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    folder = tiny_model("llama-gqa")
    packed = _sharded(tp_ranks, stage, folder, 2, "onednn")[0]["logits"]
    plain = _sharded(tp_ranks, stage, folder, 2)[0]["logits"]
    torch.testing.assert_close(packed, plain, atol=TP_ATOL, rtol=0)


def _expected_local_numel(name: str, full: int, config: ModelConfig, size: int) -> int:
    """What one rank holds, stated independently of the code under test: norms replicated;
    vocabulary rows padded to a multiple of TP; KV heads split, or one replicated head per
    rank when there are fewer KV heads than ranks; every other matrix 1/TP."""
    if name.endswith(("norm.weight", "o_proj.bias")):  # o_proj's bias: rank 0's, zeros elsewhere
        return full
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return -(-config.vocab_size // size) * config.hidden_size
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        kv = config.num_kv_heads // size if config.num_kv_heads >= size else 1
        columns = config.hidden_size if name.endswith("weight") else 1
        return (config.num_heads // size + 2 * kv) * config.head_dim * columns
    assert full % size == 0, name
    return full // size


@unit("model_loader.py")
@pytest.mark.parametrize(
    ("spec", "size"), [("llama-mqa", 2), ("llama-tp3", 3), ("qwen3", 2), ("llama-bias-mqa", 3)]
)
def test_each_rank_holds_its_share_of_every_parameter(stage, tiny_model, tp_ranks, spec, size):
    folder = tiny_model(spec)
    config = ModelConfig.from_pretrained(folder)
    full = {name: p.numel() for name, p in _load(stage, str(folder)).named_parameters()}
    parallel = _parallel(stage)
    for report in _sharded(tp_ranks, stage, folder, size):
        assert report["numel"].keys() == full.keys()
        for name, numel in report["numel"].items():
            assert numel == _expected_local_numel(name, full[name], config, size), name
        local_kv = parallel.local_kv_heads(config.num_kv_heads, size)
        assert report["heads"] == (config.num_heads // size, local_kv)


@unit("model_loader.py")
@pytest.mark.parametrize(("spec", "size"), [("llama-tp3", 3), ("llama-mqa", 2)])
def test_each_rank_reads_only_its_shard_of_the_checkpoint(stage, tiny_model, tp_ranks, spec, size):
    """Summed over ranks, the bytes read are the checkpoint once plus the replicated tensors
    once per extra rank: nothing sharded is read twice."""
    from safetensors import safe_open

    folder = tiny_model(spec)
    config = ModelConfig.from_pretrained(folder)
    total = replicated = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # the tied head is the embedding: never read
                numel = f.get_slice(name).get_shape()
                nbytes = 4 * int(torch.Size(numel).numel())
                total += nbytes
                kv_replicated = config.num_kv_heads < size and name.endswith(
                    ("k_proj.weight", "v_proj.weight")
                )
                replicated += nbytes if name.endswith("norm.weight") or kv_replicated else 0
    reads = [report["bytes_read"] for report in _sharded(tp_ranks, stage, folder, size)]
    assert sum(reads) == total + (size - 1) * replicated
    for read in reads:
        assert read <= total / size + replicated


@unit("parallel/group.py")
def test_a_group_the_heads_do_not_divide_is_refused_naming_the_sizes(stage, tiny_model):
    parallel = _parallel(stage)
    config = ModelConfig.from_pretrained(tiny_model("llama-tp3"))  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*\b9\b"):
        parallel.check_tensor_parallel_fits(config, 2)
    for size in (1, 3):
        parallel.check_tensor_parallel_fits(config, size)
    odd_mlp = dataclasses.replace(config, intermediate_size=100)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*intermediate_size=100"):
        parallel.check_tensor_parallel_fits(odd_mlp, 3)
    kv_4 = dataclasses.replace(config, num_heads=12, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"num_kv_heads=4.*tensor_parallel_size=3"):
        parallel.check_tensor_parallel_fits(kv_4, 3)
    parallel.check_tensor_parallel_fits(dataclasses.replace(config, vocab_size=49153), 3)


@unit("parallel/group.py")
def test_kv_heads_are_split_or_replicated_as_the_query_heads_need(stage):
    """A rank holds the KV heads its query heads read in the unsplit model."""
    parallel = _parallel(stage)
    for num_heads, num_kv_heads, size in [(4, 2, 2), (4, 1, 2), (8, 2, 4), (9, 3, 3), (8, 4, 2)]:
        group = num_heads // num_kv_heads
        for rank in range(size):
            heads = parallel.kv_head_range(num_kv_heads, size, rank)
            assert len(heads) == parallel.local_kv_heads(num_kv_heads, size)
            per_rank = num_heads // size
            read = {h // group for h in range(rank * per_rank, (rank + 1) * per_rank)}
            assert read == set(heads), (num_heads, num_kv_heads, size, rank)


@unit("model_loader.py")
def test_each_shard_holds_its_slices_of_the_checkpoint(stage, tiny_model):
    """Weight loaders alone (a TPGroup of size 2 needs no process to load): rank r's fused
    matrices are its q heads | its KV head | its KV head, and its gate | up columns."""
    from safetensors.torch import load_file

    folder = tiny_model("llama-mqa")  # 4 heads of 16, 1 KV head: replicated at TP=2
    hf = load_file(str(next(folder.glob("*.safetensors"))))
    parallel = _parallel(stage)
    for rank in range(2):
        model = _load(stage, str(folder), tp=parallel.TPGroup(rank=rank, size=2))
        params = dict(model.named_parameters())
        q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
        rows = slice(32 * rank, 32 * (rank + 1))
        expected_qkv = torch.cat([q[rows], k, v])
        assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"], expected_qkv)
        gate, up = (hf[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
        rows = slice(64 * rank, 64 * (rank + 1))
        expected_gate_up = torch.cat([gate[rows], up[rows]])
        assert torch.equal(params["layers.1.mlp.gate_up_proj.weight"], expected_gate_up)
        down = hf["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(params["layers.1.mlp.down_proj.weight"], down[:, rows])
        embed = params["embed_tokens.weight"]  # rows 0-129 | 130-258 and one zero row
        vocab = hf["model.embed_tokens.weight"]
        assert torch.equal(embed[: 130 - rank], vocab[130 * rank : 130 * (rank + 1)])
        assert not embed[130 - rank :].any()


@unit("model_loader.py")
@pytest.mark.parametrize(("spec", "size"), BIAS_CASES)
def test_each_shard_holds_its_slices_of_the_attention_biases(stage, tiny_model, spec, size):
    """Weight loaders alone: rank r's fused qkv bias is its q heads' | its KV heads' k | v
    bias (a slice, or the one replicated head), as for the weight; o_proj's bias is rank 0's
    (zeros elsewhere: the all-reduce adds it once). Qwen2-style checkpoints carry q/k/v biases;
    a loader that skips 1-D parameters (or slices them as if every rank held other heads)
    leaves every layer's attention off."""
    from safetensors.torch import load_file

    folder = tiny_model(spec)
    config = ModelConfig.from_pretrained(folder)
    hf = load_file(str(next(folder.glob("*.safetensors"))))
    parallel, d = _parallel(stage), config.head_dim
    q_rows = config.num_heads // size * d
    for rank in range(size):
        model = _load(stage, str(folder), tp=parallel.TPGroup(rank=rank, size=size))
        params = dict(model.named_parameters())
        heads = parallel.kv_head_range(config.num_kv_heads, size, rank)
        kv = slice(heads.start * d, heads.stop * d)
        for layer in range(config.num_layers):
            prefix = f"layers.{layer}.self_attn"
            q, k, v = (hf[f"model.{prefix}.{p}_proj.bias"] for p in "qkv")
            assert q.abs().min() > 0, "the checkpoint's biases must not be zero"
            expected = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv], v[kv]])
            assert torch.equal(params[f"{prefix}.qkv_proj.bias"], expected), (rank, layer)
            o_bias = hf[f"model.{prefix}.o_proj.bias"]
            held = params[f"{prefix}.o_proj.bias"]
            assert torch.equal(held, o_bias if rank == 0 else torch.zeros_like(o_bias))


@unit("model_loader.py")
def test_a_checkpoint_that_does_not_fit_is_refused(stage, tiny_model):
    from safetensors.torch import load_file

    loader = importlib.import_module(f"{stage.__name__}.model_loader")
    folder = tiny_model("llama-gqa")
    state = load_file(str(next(folder.glob("*.safetensors"))))
    model = _load(stage, str(folder), tp=_parallel(stage).TPGroup(rank=1, size=2))
    extra = {**state, "model.layers.0.mlp.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="no place"):
        loader.load_weights(model, extra)
    lacking = {k: t for k, t in state.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*qkv_proj.weight\[v\]"):
        loader.load_weights(model, lacking)
    wrong = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(ValueError, match=r"k_proj.weight: checkpoint \(16, 64\) vs model"):
        loader.load_weights(model, wrong)


@unit("model.py")
@pytest.mark.parametrize("spec", ["llama-gqa", "llama-mha-untied"])
@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_one_rank_is_stage_08s_model(stage, tiny_model, spec, backend):
    from stages.common.linear import onednn_available

    if backend == "onednn" and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    folder = str(tiny_model(spec))
    before = stages.load("08")
    ours = _prompt_logits(stage, _load(stage, folder, backend), TOKEN_IDS)
    theirs = _prompt_logits(before, _load(before, folder, backend), TOKEN_IDS)
    assert torch.equal(ours, theirs)


@unit("parallel/layers.py")
def test_column_then_row_parallel_is_the_plain_pair_of_matmuls(stage):
    """A column-parallel layer feeding a row-parallel one, both with a bias: the ranks' partial
    outputs (what the all-reduce adds) sum to the unsplit layers' output, the row layer's bias
    counted once. Loading needs no process group; the sum stands in for the all-reduce."""
    layers = importlib.import_module(f"{stage.__name__}.parallel.layers")
    parallel = _parallel(stage)
    gen = torch.Generator().manual_seed(0)
    w1, b1, w2, b2 = (torch.randn(shape, generator=gen) for shape in [(6, 5), 6, (4, 6), 4])
    x = torch.randn(3, 5, generator=gen)
    total = torch.zeros(3, 4)
    for rank in range(2):
        tp = parallel.TPGroup(rank=rank, size=2)
        column = layers.ColumnParallelLinear(5, 6, bias=True, tp=tp)
        row = layers.RowParallelLinear(6, 4, bias=True, tp=tp)
        for layer, weight, bias in [(column, w1, b1), (row, w2, b2)]:
            layer.weight.weight_loader(layer.weight, weight)
            layer.bias.weight_loader(layer.bias, bias)
        with torch.no_grad():
            total += torch.nn.functional.linear(column(x), row.weight, row.bias)
    expected = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=0)
