"""The batched spot check of this tree against another checkout's: ``python -m benchmarks.spot_cost_ab --baseline PATH``.

The layer-step of :mod:`benchmarks.spot_cost` (SmolLM2's shape, 256 keys at most, tau 0.2, every round run) timed by
:func:`witcert.spot.check_cells` of this tree and of the checkout at ``--baseline`` (e.g. the main branch's), each in
its own process, the two processes alternating ``--rounds`` times (so both see the same load on a shared machine);
per process the median of ``--reps`` calls after one warm-up. Reported: each tree's median over its processes and
the baseline's time over this tree's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import spot_records

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).with_name("results") / "spot_cost_ab.json"
CONTEXTS = (2048, 32768)


def child(tree: str, reps: int) -> dict:
    """Milliseconds per layer-step of ``tree``'s ``check_cells`` at each context (run in a fresh process)."""
    sys.path.insert(0, tree)
    import torch

    import witcert
    from witcert.spot import KeyGather, check_cells, spot_randomness

    if not witcert.__file__.startswith(str(Path(tree).resolve())):
        raise RuntimeError(f"--tree {tree}: imported witcert from {witcert.__file__}")
    sys.path.insert(0, str(ROOT))
    from benchmarks.spot_cost import layer_step

    torch.set_num_threads(1)
    out = {}
    for context in CONTEXTS:
        q, k, _, scores, radii, scale = layer_step(context, 9, 3, 64)
        generator = spot_randomness(0).generator
        kv, rows = torch.arange(9) // 3, torch.zeros(9, dtype=torch.int64)

        def run():
            return check_cells(scores, radii, KeyGather(q, rows, kv, k[None], scale), keys=256, delta=1e-6, tau=0.2,
                               generator=generator)

        run()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        out[str(context)] = 1e3 * statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="the other checkout's root")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tree", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.tree:
        print(json.dumps(child(args.tree, args.reps)))
        return 0
    if args.baseline is None:
        p.error("--baseline is required")
    record = spot_records.provenance("benchmarks.spot_cost_ab", argv)
    trees = {"baseline": str(args.baseline.resolve()), "this tree": str(ROOT)}
    samples = {name: {str(c): [] for c in CONTEXTS} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            done = subprocess.run([sys.executable, "-m", "benchmarks.spot_cost_ab", "--tree", tree, "--reps",
                                   str(args.reps)], cwd=ROOT, capture_output=True, text=True, check=True)
            for context, ms in json.loads(done.stdout.strip().splitlines()[-1]).items():
                samples[name][context].append(ms)
    medians = {name: {c: statistics.median(v) for c, v in per.items()} for name, per in samples.items()}
    commits = {name: subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() for name, tree in trees.items()}
    record |= {"commits": commits, "shape": "SmolLM2 (9 query heads over 3 kv heads, d 64)", "keys": 256, "tau": 0.2,
               "rounds": args.rounds, "reps": args.reps, "ms_per_layer_step": medians, "samples_ms": samples,
               "baseline_over_this_tree": {c: medians["baseline"][c] / medians["this tree"][c] for c in medians["baseline"]}}
    print(json.dumps(record, indent=1))
    spot_records.write(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
