"""WitCert benchmark runner: ``python -m benchmarks.run [--quick]`` (``make bench``).

Sections: cost (meter / decode attention), fastpath (the fused meter, eager and compiled, vs
attention), generation (tokens/s stock vs monitored vs observed), kernel (Triton cert on/off, GPU only), memory
(bytes per token per head), quality (SmolLM2, three domains), looseness (meter / sup-box TV /
true TV), throughput (adversarial trials per second), ranking (which statistic ranks layers and heads like their
true TV; also ``results/ranking.json``, ``python -m benchmarks.ranking``), spot (spot-check coverage on SmolLM2 at
64-512 exact keys; also ``results/spot_check.json``, ``python -m benchmarks.spot_check``). Writes ``results.json``, ``results.md``,
``machine.md`` and PNGs under ``benchmarks/results/`` (``--out``).
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import machine, report

SECTIONS = ("cost", "fastpath", "generation", "proposals", "kernel", "memory", "quality", "looseness", "throughput",
            "ranking", "spot")
RESULTS = Path(__file__).with_name("results")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fast subset (< 3 min on 2 cores)")
    p.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed, reported)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cost entry (>= 5)")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens per domain (default 768; quick 512)")
    p.add_argument("--queries", type=int, default=None, help="query positions per domain (default 16; quick 8)")
    p.add_argument("--layer-stride", type=int, default=None, help="every n-th layer (default 1: all; quick 6)")
    p.add_argument("--looseness-rows", type=int, default=None, help="sampled cells per domain per config")
    p.add_argument("--fuzz-trials", type=int, default=None, help="throughput trials (default 50000; quick 1500)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--merge", action="store_true",
                   help="update only the sections run in an existing results.json (others kept)")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(tokens=(512, 768), queries=(8, 16), layer_stride=(6, 1), looseness_rows=(16, 96),
                    fuzz_trials=(1500, 50000))
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    if args.reps < 5:
        p.error("--reps must be >= 5 (median of at least five repetitions)")
    return args


def _quality(args, results: dict) -> None:
    from benchmarks import capture, looseness, quality

    loaded = capture.load()
    caps = []
    for domain in capture.DOMAINS:
        cap = capture.capture(loaded, domain, args.tokens, args.queries)
        layers = list(range(0, cap.n_layers, args.layer_stride))
        caps.append(type(cap)(cap.domain, cap.q[layers], cap.k[layers], cap.v[layers], cap.mask))
    results["quality_setup"] = dict(model=loaded.source, tokens=int(caps[0].k.shape[2]), queries=args.queries,
                                    layers=f"every {args.layer_stride}th of {cap.n_layers}" if args.layer_stride > 1
                                    else f"all {cap.n_layers}", domains=list(capture.DOMAINS))
    pooled, sampled = quality.measure(caps, args.quick, args.looseness_rows)
    if "quality" in args.sections:
        results["quality"] = quality.summarize(pooled)
    if "looseness" in args.sections:
        started = time.perf_counter()
        results["looseness"] = looseness.split(sampled)
        print(f"  looseness: {time.perf_counter() - started:.0f} s", flush=True)


def _ranking(args, results: dict) -> None:
    """Spearman / top-6 overlap of layer and head rankings against the true TV (SmolLM2; about 8 min on 1 thread)."""
    from benchmarks import ranking

    if args.quick:  # one scheme, one short case per task; ranking.json keeps the full measurement
        measured = ranking.run(("rtn-int4",), cases_per_task=1, context=256)
    else:  # its defaults: 4 schemes, 2 cases per task, 512 tokens (the results page table)
        measured = ranking.run()
        (args.out / "ranking.json").write_text(json.dumps(measured, indent=1) + "\n")
    results["ranking"] = {"best": measured["best"], "rank_by": measured["rank_by"],
                          "mean_spearman": measured["mean_spearman"]}


def _spot(args, results: dict) -> None:
    """Spot-check coverage, bound / true TV and violations per scheme and key budget (SmolLM2; about 10 min on 1 thread)."""
    from benchmarks import spot_check

    if args.quick:  # one scheme, short contexts; spot_check.json keeps the full measurement
        measured = spot_check.run(("rtn-int4",), spot_check.parse(["--context", "512", "--per-call", "1",
                                                                  "--sections", "sampled"]))
    else:
        measured = spot_check.run()
        (args.out / "spot_check.json").write_text(json.dumps(measured, indent=1) + "\n")
    results["spot"] = {name: entry.get("all", entry) for name, entry in measured["schemes"].items()}


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"command": command.strip(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine.describe(args.threads), "seconds": {}}
    previous = args.out / "results.json"
    if args.merge and previous.is_file():
        kept = json.loads(previous.read_text())
        kept["seconds"] = {k: v for k, v in kept.get("seconds", {}).items() if k not in args.sections}
        kept["merged"] = kept.get("merged", []) + [dict(command=results["command"], sections=args.sections,
                                                        machine=results["machine"])]
        results = {**kept, "seconds": kept["seconds"]}
    started = time.perf_counter()

    def section(name, fn):
        if name not in args.sections and not (name == "quality" and "looseness" in args.sections):
            return
        t = time.perf_counter()
        print(f"[{name}]", flush=True)
        fn()
        results["seconds"][name] = time.perf_counter() - t

    def cost():
        from benchmarks import cost as cost_mod

        results["cost"] = cost_mod.run(args.quick, args.reps)
        results["cost_profile"] = cost_mod.profile(s=2048 if args.quick else 8192)

    def fastpath():
        from benchmarks import fast_cost

        results["fastpath"] = fast_cost.run(args.quick, args.reps)

    def generation():
        from benchmarks import generation as generation_mod

        contexts = (512,) if args.quick else (512, 4096)
        results["generation"] = generation_mod.record(contexts, 8 if args.quick else 16, 3 if args.quick else 7,
                                                      args.threads, command.strip())  # this run's, merged or not
        if not args.quick:  # the record the results page renders (docs/results.md#monitored-generation)
            (args.out / "generation.json").write_text(json.dumps(results["generation"], indent=1) + "\n")

    def proposals():
        from benchmarks import proposals as proposals_mod

        results["proposals"] = proposals_mod.run(args.quick, args.reps)

    def kernel():
        from benchmarks import kernel as kernel_mod

        results["kernel"] = kernel_mod.run()

    def memory():
        from benchmarks import memory as memory_mod

        results["memory"] = memory_mod.rows()

    def throughput():
        from benchmarks import throughput as throughput_mod

        results["throughput"] = throughput_mod.run(args.fuzz_trials)

    section("cost", cost)
    section("fastpath", fastpath)
    section("generation", generation)
    section("proposals", proposals)
    section("kernel", kernel)
    section("memory", memory)
    section("quality", lambda: _quality(args, results))
    section("throughput", throughput)
    section("ranking", lambda: _ranking(args, results))
    section("spot", lambda: _spot(args, results))
    results["seconds"]["total" if not args.merge else "total (merge)"] = time.perf_counter() - started
    results["finished"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (args.out / "machine.md").write_text(machine.markdown(results["machine"]))
    results["pngs"] = report.plots(results, args.out)
    (args.out / "results.md").write_text(report.markdown(results))
    print(f"wrote {args.out}/results.json, results.md, machine.md, {', '.join(results['pngs'])} "
          f"in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
