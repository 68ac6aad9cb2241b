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
    from witcert.integrations.vllm.bench import fp8_unsupported_reason as reason

    return reason()


def run_engine(*args: str, timeout: int = 1800, model: Path | None = None) -> dict:
    """One engine in a fresh process (``bench run``): its summary (tokens, logprobs, snapshot)."""
    from witcert.integrations.vllm.bench import run_in_subprocess

    return run_in_subprocess(str(model or model_path()), *args, timeout=timeout)


def heads_dividing(model: Path, tp: int) -> str | None:
    """vLLM's own check of ``tensor_parallel_size=tp`` for ``model``: its error message, ``None`` if it passes."""
    import json

    cfg = json.loads((model / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % tp:  # vllm/config/model.py, ModelConfig.verify_with_parallel_config
        return f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp})."
    if kv_heads >= tp and kv_heads % tp:  # vllm/model_executor/layers/linear.py, QKVParallelLinear
        return f"{kv_heads} kv heads cannot be split over {tp} tensor-parallel workers"
    return None


def sliced_model(source: Path, out: Path, kv_heads: int = 2) -> Path:
    """SmolLM2 cut to its first ``kv_heads`` kv heads and their query heads (a model TP=2 can split).

    Query head i reads kv head i // group, so the first ``kv_heads * group`` query heads and their
    ``o_proj`` columns are kept; the rest of the weights are unchanged. Its text is worse than the
    full model's, which does not matter to what the TP test checks (metering, shadow, merge).
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((source / "config.json").read_text())
    d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q_keep = kv_heads * (heads // kv)
    weights = load_file(source / "model.safetensors")
    for name in list(weights):
        if name.endswith("self_attn.q_proj.weight"):
            weights[name] = weights[name][: q_keep * d].contiguous()
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            weights[name] = weights[name][: kv_heads * d].contiguous()
        elif name.endswith("self_attn.o_proj.weight"):
            weights[name] = weights[name][:, : q_keep * d].contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    cfg.update(num_attention_heads=q_keep, num_key_value_heads=kv_heads)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out
