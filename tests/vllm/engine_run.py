"""Run SmolLM2 in one in-process vLLM engine and print a JSON summary (tests and the README table).

    python tests/vllm/engine_run.py MODEL --dtype float32 --kv-cache-dtype auto [--plugin] [--shadow]

The plugin is switched by the environment this script sets before vLLM starts; the summary holds
the generated token ids and logprobs (for bit-identity checks), decode tokens/s and the plugin's
snapshot (``null`` when off).
"""
import argparse
import json
import os
import sys
import time

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--plugin", action="store_true", help="WITCERT_VLLM=1")
    parser.add_argument("--shadow", action="store_true", help="WITCERT_VLLM_SHADOW=1")
    parser.add_argument("--jsonl", help="WITCERT_VLLM_JSONL: one JSON line per metered cell")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", nargs="+", help="prompts to generate from (default: three built-in ones)")
    parser.add_argument("--prompt-file", help="one extra long prompt (a workload) read from this file")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["WITCERT_VLLM"] = "1" if args.plugin else "0"
    os.environ["WITCERT_VLLM_SHADOW"] = "1" if args.shadow else "0"
    if args.jsonl:
        os.environ["WITCERT_VLLM_JSONL"] = args.jsonl
    prompts = list(args.prompts or PROMPTS)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts = [f.read()]

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True,
              max_model_len=1024, seed=0, kv_cache_memory_bytes=128 << 20)
    ready = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=5, ignore_eos=True)
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    summary = {
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "plugin": args.plugin, "shadow": args.shadow,
        "engine_start_s": ready - started,
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                     "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]}
                    for o in outs],
        "witcert": None,
    }
    if args.plugin:
        from witcert.integrations.vllm import runtime

        summary["witcert"] = runtime.get().telemetry.snapshot()
    print("WITCERT-SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
