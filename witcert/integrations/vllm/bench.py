"""Measure the plugin in a real vLLM engine: one run, or the README's tables.

    python -m witcert.integrations.vllm.bench run MODEL [--dtype float32] [--kv-cache-dtype auto]
                                                  [--plugin] [--shadow] [--jsonl PATH] [--workload W]
    python -m witcert.integrations.vllm.bench table MODEL [--repeats 3]

``run`` starts one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), switches the plugin
by the environment it sets before vLLM starts, generates greedily and prints one line
``WITCERT-SUMMARY {json}``: token ids and logprobs (for bit-identity checks), decode tokens/s,
engine start time and the plugin's snapshot (``null`` when off). ``table`` runs ``run`` in fresh
processes over the observatory's workloads (needle, text, code; ``witcert.workloads``) for every
(model dtype, cache dtype) this CPU can run, and prints the coverage / meter / true-TV table and
the tokens/s table (plugin off, metering, metering + shadow) in Markdown.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
CONTEXT_TOKENS = 700  # workloads fit max_model_len=1024 with the generated tokens
SUMMARY = "WITCERT-SUMMARY "


def workload_prompts(model: str, name: str) -> list[str]:
    """Prompts of the observatory's workloads, cut with the model's own tokenizer."""
    from transformers import AutoTokenizer

    from witcert.observatory import workloads

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if name == "needle":
        return [case.prompt for case in workloads.needle_cases(tok, CONTEXT_TOKENS)]
    return [case.context for case in workloads.text_cases(tok, name, CONTEXT_TOKENS, 32, count=3)]


def run(args) -> dict:
    """One engine, one batch of prompts: the summary dict."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["WITCERT_VLLM"] = "1" if args.plugin else "0"
    os.environ["WITCERT_VLLM_SHADOW"] = "1" if args.shadow else "0"
    if args.jsonl:
        os.environ["WITCERT_VLLM_JSONL"] = args.jsonl
    prompts = list(args.prompts or (workload_prompts(args.model, args.workload) if args.workload else PROMPTS))
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True,
              max_model_len=1024, seed=0, kv_cache_memory_bytes=128 << 20,
              disable_log_stats=False)  # keeps per-request timestamps (decode_rate)
    ready = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=5, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    summary = {
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "plugin": args.plugin, "shadow": args.shadow,
        "workload": args.workload, "prompts": len(prompts), "engine_start_s": ready - started,
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "decode_tokens_per_s": decode_rate(outs),
        "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                     "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]}
                    for o in outs],
        "witcert": None,
    }
    if args.plugin:
        from witcert.integrations.vllm import runtime

        summary["witcert"] = runtime.get().telemetry.snapshot()
    return summary


def decode_rate(outs) -> float | None:
    """Tokens after the first, per second from the first request's first token to the last token.

    The prefill is excluded (metering runs on decode steps only); engine-core timestamps, so
    ``None`` when vLLM kept no per-request stats.
    """
    stats = [o.metrics for o in outs]
    if any(s is None or not s.first_token_ts for s in stats):
        return None
    span = max(s.last_token_ts for s in stats) - min(s.first_token_ts for s in stats)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / span if span > 0 else None


def run_in_subprocess(model: str, *flags: str, timeout: int = 1800) -> dict:
    """``run`` in a fresh process (each engine in its own): the summary dict."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, "-m", "witcert.integrations.vllm.bench", "run", model, *flags],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(SUMMARY):
            return json.loads(line[len(SUMMARY):])
    raise RuntimeError(f"bench run failed (rc={done.returncode}):\n{done.stderr[-4000:]}")


def runnable_cache_dtypes() -> list[str]:
    """The kv_cache_dtype values vLLM's CPU build runs here (fp8 needs AVX-512 or AMX)."""
    import torch

    fp8 = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    return ["auto", "fp8_e4m3", "fp8_e5m2"] if fp8 else ["auto"]


def table(args) -> None:
    """Print the README's two tables, measured now on this machine."""
    import tempfile

    print(f"| model dtype | cache | workload | cells | coverage (true TV <= meter) | median meter "
          f"| median true TV | max true TV |\n|---|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for kv in runnable_cache_dtypes():
            for workload in ("needle", "text", "code"):
                with tempfile.TemporaryDirectory() as tmp:
                    jsonl = os.path.join(tmp, "cells.jsonl")
                    run_in_subprocess(args.model, "--dtype", dtype, "--kv-cache-dtype", kv, "--plugin", "--shadow",
                                      "--workload", workload, "--max-tokens", "32", "--jsonl", jsonl)
                    rows = [json.loads(line) for name in os.listdir(tmp) if name.startswith("cells.jsonl")
                            for line in open(os.path.join(tmp, name))]
                meters = [r["meter"] for r in rows]
                tvs = [r["true_tv"] for r in rows]
                covered = sum(t <= m for t, m in zip(tvs, meters)) / len(rows)
                print(f"| {dtype} | {kv} | {workload} | {len(rows)} | {covered:.2%} | {statistics.median(meters):.2e} "
                      f"| {statistics.median(tvs):.2e} | {max(tvs):.2e} |", flush=True)
    modes = {"plugin off": (), "metering": ("--plugin",), "metering + shadow": ("--plugin", "--shadow")}
    speeds = {name: [] for name in modes}
    for _ in range(args.repeats):  # interleaved, so a change of machine load hits every mode alike
        for name, flags in modes.items():
            speeds[name].append(run_in_subprocess(args.model, "--workload", "needle", "--max-tokens", "32",
                                                  *flags)["decode_tokens_per_s"])
    print("\n| fp32 model, auto cache, needle (6 requests x 32 tokens) | decode tokens/s (median of "
          f"{args.repeats}) | runs |\n|---|---|---|")
    for name, values in speeds.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one engine, one batch: print WITCERT-SUMMARY {json}")
    one.add_argument("model")
    one.add_argument("--dtype", default="float32")
    one.add_argument("--kv-cache-dtype", default="auto")
    one.add_argument("--plugin", action="store_true", help="WITCERT_VLLM=1")
    one.add_argument("--shadow", action="store_true", help="WITCERT_VLLM_SHADOW=1")
    one.add_argument("--jsonl", help="WITCERT_VLLM_JSONL: one JSON line per metered cell")
    one.add_argument("--max-tokens", type=int, default=24)
    one.add_argument("--workload", choices=("needle", "text", "code"), help="the observatory's prompts")
    one.add_argument("--prompts", nargs="+", help="prompts (default: three built-in ones)")
    tab = sub.add_parser("table", help="the README tables, measured now")
    tab.add_argument("model")
    tab.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "run":
        print(SUMMARY + json.dumps(run(args)), flush=True)
    else:
        table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
