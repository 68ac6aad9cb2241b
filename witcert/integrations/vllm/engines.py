"""How the vLLM benches build an engine and its workloads (:mod:`.bench` and :mod:`.speed` share them).

The plugin's switches go into the environment before the engine starts (:func:`_environment`); the workloads
are the observatory's cases cut with the model's own tokenizer.
"""
import os

CONTEXT_TOKENS = 700  # workloads fit max_model_len=1024 with the generated tokens


def workload_prompts(model: str, name: str) -> list[str]:
    """Prompts of the observatory's workloads, cut with the model's own tokenizer."""
    return [getattr(case, "prompt", None) or case.context for case in workload_cases(model, name)]


def workload_cases(model: str, name: str, needle_cases: int = 6, text_cases: int = 3) -> list:
    """The observatory's cases: needles (three quarters one key, the rest four keys, spread depths), text, code."""
    from transformers import AutoTokenizer

    from witcert.observatory import workloads

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if name == "needle":
        multi = needle_cases // 4
        cases = workloads.needle_cases(tok, CONTEXT_TOKENS, depths=_depths(needle_cases - multi), keys=(1,))
        if multi:
            cases += workloads.needle_cases(tok, CONTEXT_TOKENS, depths=_depths(multi), keys=(4,), seed=1)
        return cases
    return workloads.text_cases(tok, name, CONTEXT_TOKENS, 32, count=text_cases)


def _depths(n: int) -> tuple:
    return (0.5,) if n == 1 else tuple(0.1 + 0.8 * i / (n - 1) for i in range(n))


def _environment(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["WITCERT_VLLM"] = "1" if args.plugin else "0"
    os.environ["WITCERT_VLLM_SHADOW"] = "1" if args.shadow else "0"
    os.environ["WITCERT_VLLM_GATE"] = "1" if args.gate else "0"
    os.environ["WITCERT_VLLM_SCHEME"] = args.scheme
    os.environ["WITCERT_VLLM_SCHEMES"] = args.schemes
    if args.jsonl:
        os.environ["WITCERT_VLLM_JSONL"] = args.jsonl
    if args.tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        # one core per worker: vLLM's automatic binding wants one NUMA node per worker
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(args.tp))
    if args.plugin:
        from .runtime import ensure_metrics_dir

        ensure_metrics_dir()


def engine(args):
    """The engine ``args`` describe (the plugin's switches already in the environment)."""
    from vllm import LLM

    cache_bytes = getattr(args, "cache_bytes", 128 << 20)  # the speed table's engines hold every request at once
    ngram = getattr(args, "speculative_ngram", 0)
    speculative = {"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1} if ngram else None
    return LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True,
               max_model_len=args.max_model_len, seed=0, kv_cache_memory_bytes=cache_bytes,
               tensor_parallel_size=args.tp, enable_prefix_caching=args.prefix_caching,
               speculative_config=speculative,
               disable_log_stats=False)  # keeps per-request timestamps (decode_rate)


def fp8_unsupported_reason() -> str | None:
    """Why vLLM's CPU build cannot run an fp8 KV cache on this machine (``None`` if it can)."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("vLLM's CPU fp8 KV cache needs x86 AVX-512 or AMX; this CPU has neither "
            "(vllm-cpu 0.32 raises NotImplementedError and its AVX2 kernels have no fp8 path)")
