"""The results page's rows for transformers' own QuantizedCache (quanto, HQQ) on the default model.

Runs ``witcert observe``'s runner (:func:`witcert.observatory.runner.run_observe`: ``witcert.monitor``,
the one attention path, with ``--scheme hf-...``; transformers' defaults: axis 0, groups of 64, an
exact window of 128 tokens) per task, and prints one row per scheme: cells, violations (true TV
above the meter, against the exact keys the model wrote; must be 0), coverage at tau, median meter
and median true TV, teacher-forced KL, needle accuracy, and the competitor's shape
``tanh(max_t c_t)`` (``RC``) on the same per-token bounds ``c_t`` (the ``c_max`` column of every
cell): its coverage at tau and the share of cells where WitCert's meter is strictly below it.

``--flush-tokens N`` adds one greedy generation of N tokens per text case (a ``generate`` call in
the monitor), long enough for HF's window to flush and re-quantize the history, so the cells read
re-quantized tokens with maintained witnesses (``WM``); the observatory probes themselves are read
before any flush at the default lengths.

Usage: ``WITCERT_CACHE=... python scripts/hf_cache_table.py [--schemes hf-quanto-int4,...]
[--tasks needle,text] [--cases 2] [--context 512] [--flush-tokens 0]``.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from witcert.core.rounding import tanh_up  # noqa: E402
from witcert.integrations.hf.default_model import load_model  # noqa: E402
from witcert.integrations.hf.monitoring import Monitor  # noqa: E402
from witcert.observatory import report, runner, workloads  # noqa: E402

SCHEMES = "hf-quanto-int4,hf-quanto-int2,hf-hqq-int4,hf-hqq-int8"


def competitor(table) -> np.ndarray:
    """``tanh(max_t c_t)`` per cell (rounded up), from the cell table's ``c_max``."""
    return tanh_up(torch.from_numpy(np.asarray(table["c_max"], dtype=np.float64))).clamp(max=1.0).numpy()


def row(scheme: str, task: str, table, tau: float, quality: dict) -> str:
    s = report.summarize(table, tau)
    comp = competitor(table)
    needle = report.fmt(quality.get("needle_acc", float("nan")), 2)
    return (f"| {scheme} | {task} | {s.cells} | {s.violations} | {report.fmt(s.coverage)} | "
            f"{report.fmt(s.median_meter, 4)} / {report.fmt(s.median_true_tv, 4)} | {report.fmt(quality['kl'], 4)} | "
            f"{needle} | {report.fmt(float(np.mean(comp <= tau)))} | {report.fmt(float(np.mean(table['meter'] < comp)))} |")


def flush_run(loaded, scheme: str, cases, new_tokens: int, tau: float) -> str:
    """Greedy generation of ``new_tokens`` after each case's context: reads of re-quantized history."""
    with torch.no_grad(), Monitor(loaded.model, scheme, tau=tau) as mon:
        for case in cases:
            ids = loaded.tokenizer(case.context, return_tensors="pt").input_ids
            loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=loaded.tokenizer.eos_token_id)
    table = mon.table()
    s, comp = report.summarize(table, tau), competitor(table)
    return (f"| {scheme} | generate {new_tokens} | {s.cells} | {s.violations} | {report.fmt(s.coverage)} | "
            f"{report.fmt(s.median_meter, 4)} / {report.fmt(s.median_true_tv, 4)} | - | - | "
            f"{report.fmt(float(np.mean(comp <= tau)))} | {report.fmt(float(np.mean(table['meter'] < comp)))} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default=SCHEMES)
    parser.add_argument("--tasks", default="needle,text")
    parser.add_argument("--cases", type=int, default=2)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tau", type=float, default=0.2)
    parser.add_argument("--flush-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model()
    schemes = tuple(args.schemes.split(","))
    print(f"| scheme | task | cells | violations | coverage@{args.tau:g} | median meter / true TV | KL | needle acc "
          f"| tanh(max c) coverage | meter < tanh(max c) |\n|---|---|---|---|---|---|---|---|---|---|")
    for task in filter(None, args.tasks.split(",")):  # --tasks "": the flush run only
        start = time.time()
        config = runner.ObserveConfig(schemes=schemes, task=task, tau=args.tau, context_tokens=args.context,
                                      cases=args.cases)
        results, baseline = runner.run_observe(loaded, config)
        for r in results:
            print(row(r.scheme, task, r.raw, args.tau, r.quality), flush=True)
        print(f"(task {task}: uncompressed {baseline}, {time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    if args.flush_tokens:
        cases = workloads.text_cases(loaded.tokenizer, "text", args.context, 1, count=args.cases)
        for scheme in schemes:
            print(flush_run(loaded, scheme, cases, args.flush_tokens, args.tau), flush=True)


if __name__ == "__main__":
    main()
