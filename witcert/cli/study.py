"""``witcert study``: the paper's two empirical results (gated repair, cross-layer accumulation) with intervals."""
from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from witcert.cli import _args
from witcert.schemes.plugins import resolve_scheme

HELP = ("reproduce the gated-repair and layer-sweep studies on a needle family (accuracy with exact binomial "
        "intervals, paired differences, meter and true TV per cell); writes report.json and report.md")


def add_arguments(parser) -> None:
    from witcert.observatory.study_config import StudyConfig

    full = StudyConfig()
    parser.add_argument("--quick", action="store_true",
                        help="a small run (one to two minutes on an idle core): 4 cases at 192 tokens, kivi-2bit raw "
                             "and behind both gates, its sweep of the first and last layer and the thirds; the "
                             "other options are ignored")
    parser.add_argument("--cases", type=_args.positive_int, default=full.cases, help="needle cases of the repair study")
    parser.add_argument("--sweep-cases", type=_args.non_negative_int, default=full.sweep_cases,
                        help="the first cases of the family answered by every layer-sweep configuration")
    parser.add_argument("--context", type=_args.positive_int, default=full.context_tokens, help="context tokens per case")
    parser.add_argument("--batch", type=_args.positive_int, default=full.batch, help="cases per forward call")
    parser.add_argument("--probe", type=_args.positive_int, default=full.probe_tokens,
                        help="last prompt tokens read over the compressed cache before the greedy answer")
    parser.add_argument("--scheme", default=",".join(full.schemes), metavar="NAMES",
                        help="comma-separated schemes of the repair study (each raw)")
    parser.add_argument("--gate-scheme", default=",".join(full.gated_schemes), metavar="NAMES",
                        help="those of --scheme also run behind the certified gate ('' for none)")
    parser.add_argument("--risk-scheme", default=",".join(full.risk_schemes), metavar="NAMES",
                        help="those of --scheme also run behind the risk-ranked gate ('' for none)")
    parser.add_argument("--sweep-scheme", default=",".join(full.sweep_schemes), metavar="NAMES",
                        help="those of --scheme whose layers are swept ('' for none)")
    parser.add_argument("--tau", type=_args.open_unit_interval, default=full.tau_certified, help="certified gate threshold")
    parser.add_argument("--risk-tau", type=float, default=full.tau_risk, help="risk-ranked gate threshold (>= 1)")
    parser.add_argument("--model", type=_args.existing_path, default=None, metavar="PATH",
                        help="local Hugging Face checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=_args.positive_int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=_args.output_dir, default=None, metavar="DIR",
                        help="report directory (default: reports/study-<UTC time>)")


def check(args) -> None:
    """Resolve the schemes and the study's shape before any model loads (``ValueError`` names the argument)."""
    from witcert.observatory.study_config import QUICK, StudyConfig

    _args.require_installed("witcert study", "observatory", "transformers", "scipy", "matplotlib")
    schemes = {}
    for option, text in (("--scheme", args.scheme), ("--gate-scheme", args.gate_scheme),
                         ("--risk-scheme", args.risk_scheme), ("--sweep-scheme", args.sweep_scheme)):
        try:
            schemes[option] = tuple(resolve_scheme(name) for name in _names(text))  # the registered names
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    if args.quick:
        args.config = QUICK
        return
    args.config = StudyConfig(cases=args.cases, sweep_cases=args.sweep_cases, context_tokens=args.context,
                              batch=args.batch, probe_tokens=args.probe, schemes=schemes["--scheme"],
                              gated_schemes=schemes["--gate-scheme"], risk_schemes=schemes["--risk-scheme"],
                              sweep_schemes=schemes["--sweep-scheme"], tau_certified=args.tau, tau_risk=args.risk_tau)


def run(args) -> int:
    import torch

    from witcert.integrations.hf.default_model import ModelUnavailable, load_model
    from witcert.observatory import study, study_report

    torch.set_num_threads(args.threads)
    try:
        loaded = load_model(args.model)
    except (ModelUnavailable, ValueError) as err:
        print(f"witcert study: error: {err}", file=sys.stderr)
        return 2
    print(f"model: {loaded.source}", flush=True)
    start = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        elapsed = time.perf_counter() - start
        print(f"[{done}/{total}] {label:<32} {elapsed / 60:5.1f} min, about {elapsed / done * (total - done) / 60:.1f} "
              "min left", flush=True)

    report = study.run_study(loaded, args.config, progress)
    out = args.out or Path("reports") / f"study-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    md = study_report.write(report, out)
    print(study_report.markdown(report))
    print(f"report: {md}\nwall time: {report['wall_s'] / 60:.1f} min")
    if report["soundness"]["violations"] or report["soundness"]["unchecked"]:
        print(f"SOUNDNESS VIOLATION: {report['soundness']['violations']} cells with true TV above the meter "
              f"({report['soundness']['unchecked']} unchecked)", file=sys.stderr)
        return 1
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
