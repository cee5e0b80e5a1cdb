"""Feature combinations the engine refuses, each with the reason and what to do instead.

`EngineConfig.__post_init__` checks each field on its own (a range, a choice). What is checked
here is a combination: a switch that needs another one, or a topology that one `LLMEngine`
cannot be. Keeping these rules apart from the fields keeps config.py a list of switches, and
gives each later stage one place to add the combinations its technique rules out.
"""

from __future__ import annotations

from typing import Any  # each check takes an EngineConfig: config.py imports these (no circle)

from stages.common.devices import requested_device

from .cuda_graphs import resolve_cuda_graphs, unsupported_reason
from .kernels import resolve_attention_backend

QUANTIZATIONS = ("auto", "none", "int8", "int4", "int4-asym", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)  # quant_formats.INT4_GROUP_SIZES
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def check_one_engine(config: Any) -> None:
    """An `LLMEngine` is one engine of one replica: refuse a config that asks for several, and
    say which front end runs them."""
    if config.data_parallel_size > 1:  # one engine is one replica
        raise ValueError(
            "LLMEngine runs one replica; for data_parallel_size > 1 serve it (python -m "
            "stages 10 serve --config data_parallel_size=2) or use DPClient"
        )
    if config.disaggregated:  # two engines, each a process, behind a front end
        raise ValueError(
            "LLMEngine is one engine; for disaggregated=True serve it (python -m stages 13 "
            "serve --config disaggregated=true) or use DisaggClient"
        )


def check_checkpoint(config: Any, num_experts: int) -> None:
    """What the checkpoint rules out, refused before any rank starts: expert parallelism
    splits experts, so a dense model (`num_experts` 0) has none to split unless its MLP is
    cut into experts (`moe_split_experts`)."""
    dense = not num_experts
    if config.expert_parallel and dense and config.moe_split_experts is None:
        raise ValueError(
            f"expert_parallel=True needs a mixture-of-experts checkpoint, and {config.model!r} "
            "is dense: every rank would hold the whole model and exchange nothing. Use a MoE "
            "checkpoint (Mixtral, Qwen3-MoE), split the dense MLP into experts "
            "(moe_split_experts=N), or leave expert_parallel off"
        )


def check_disaggregation(config: Any) -> None:
    """A prefill or decode role (`kv_role`) and the disaggregated front end: what each needs
    (an address to meet the other engine at), and what they cannot share an engine with (a
    second KV connector, several ranks)."""
    if config.kv_role not in ("both", "prefill", "decode"):
        raise ValueError(f"kv_role must be 'both', 'prefill' or 'decode', got {config.kv_role!r}")
    if config.kv_transfer_on_failure not in ("local_prefill", "fail"):
        raise ValueError(
            "kv_transfer_on_failure must be 'local_prefill' or 'fail', got "
            f"{config.kv_transfer_on_failure!r}"
        )
    if not (config.kv_transfer_timeout_seconds > 0 and config.kv_lease_seconds > 0):
        raise ValueError("kv_transfer_timeout_seconds and kv_lease_seconds must be positive")
    if config.disaggregated and (config.data_parallel_size > 1 or config.tensor_parallel_size > 1):
        raise ValueError("disaggregated=True runs one prefill and one decode engine of one rank")
    if config.disaggregated and config.kv_offload_bytes:
        raise ValueError(
            "disaggregated=True and kv_offload_bytes are two KV connectors on each engine "
            "(the transfer between the engines and a host tier): pick one (kv_offload_bytes=0, "
            "preemption_mode='recompute')"
        )
    if config.kv_role == "both":
        return
    if not config.kv_transfer_address:
        raise ValueError(
            f"kv_role={config.kv_role!r} needs kv_transfer_address: tcp://host:port for a gloo "
            "pair with the other engine"
        )
    if config.tensor_parallel_size != 1 or config.data_parallel_size != 1:
        raise ValueError("a prefill or decode engine runs one rank here (tensor/data size 1)")
    if config.kv_offload_bytes:
        raise ValueError("kv_role and kv_offload_bytes are two connectors: pick one")
    if config.disaggregated:
        raise ValueError("disaggregated=True is the front end's switch; it sets each kv_role")
    if config.device is not None and config.device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(
            f"a KV transfer stages blocks through host memory from cpu or cuda, not "
            f"device={config.device!r}"
        )


def check_quantization(config: Any) -> None:
    """The weight and KV-cache formats (stage 14): each one of those the kernels implement."""
    if config.quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS}, got {config.quantization!r}"
        )
    if config.quant_group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quant_group_size must be one of {INT4_GROUP_SIZES}, got {config.quant_group_size}"
        )
    if config.quant_activations not in ("fp32", "bf16"):
        raise ValueError(
            f"quant_activations must be 'fp32' or 'bf16', got {config.quant_activations!r}"
        )
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {config.kv_cache_dtype!r}"
        )


def check_cuda_graphs(config: Any) -> None:
    """CUDA graphs (stage 15), as far as the config alone can tell: the device, the attention
    backend, parallelism and the KV cache's type (the runner checks the checkpoint too: a
    mixture of experts)."""
    if config.cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be True, False or None, got {config.cuda_graphs!r}")
    if config.cuda_graph_max_batch is not None and config.cuda_graph_max_batch < 1:
        raise ValueError(
            f"cuda_graph_max_batch must be at least 1, got {config.cuda_graph_max_batch}"
        )
    if not config.cuda_graphs:
        return
    resolve_cuda_graphs(
        True,
        unsupported_reason(
            device_type=device_type(config.device),
            attention_backend=resolve_attention_backend(  # the runner's own "auto" rule
                config.attention_backend, requested_device(config.device)
            ),
            tensor_parallel_size=config.tensor_parallel_size,
            expert_parallel=config.expert_parallel,
            moe=config.moe_split_experts is not None,
            kv_cache_dtype=config.kv_cache_dtype,
        ),
    )


def device_type(device: str | None) -> str:
    """What a config's device will be, "cuda" or "cpu", without building anything
    (devices.requested_device's rule)."""
    return requested_device(device).type
