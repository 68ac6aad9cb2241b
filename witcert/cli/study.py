"""``witcert study``: the paper's two empirical results (gated repair, cross-layer accumulation) with intervals."""
from __future__ import annotations

import shlex
import sys
import time

from witcert.cli import _args
from witcert.cli._exit import EXIT_VIOLATION
from witcert.schemes.catalog import CACHE_SCHEMES
from witcert.schemes.plugins import resolve_scheme

HELP = ("reproduce the gated-repair and layer-sweep studies on a needle family (accuracy with exact binomial "
        "intervals, paired differences, meter and true TV per cell); writes report.json and report.md")


def add_arguments(parser) -> None:
    from witcert.observatory.study_config import StudyConfig

    full = StudyConfig()
    parser.add_argument("--quick", action="store_true",
                        help="a small run (one to two minutes on an idle core): 4 cases at 192 tokens, kivi-2bit raw "
                             "and behind the certified, spot-certified and risk-ranked gates, its sweep of the first and last layer and the thirds; the "
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
    parser.add_argument("--spot-gate-scheme", default=",".join(full.spot_gated_schemes), metavar="NAMES",
                        help="those of --scheme also run behind the spot-certified gate ('' for none)")
    parser.add_argument("--spot-keys", type=_args.positive_int, default=full.spot_keys,
                        help="exact keys per spot check of the spot-certified gate")
    parser.add_argument("--tau", type=_args.certified_tau, default=full.tau_certified,
                        help="certified gate threshold (0 < tau < 1)")
    parser.add_argument("--risk-tau", type=_args.risk_threshold, default=full.tau_risk,
                        help="risk-ranked gate threshold (>= 1)")
    parser.add_argument("--model", type=_args.existing_path, default=None, metavar="PATH",
                        help="local Hugging Face checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=_args.positive_int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=_args.output_dir, default=None, metavar="DIR",
                        help="report directory, created before the run (default: reports/study-<UTC time>)")


def check(args) -> None:
    """Resolve the schemes, the study's shape and the ``--out`` directory before any model loads.

    Raises ``ValueError`` naming the argument (``--sweep-cases``, ``--gate-scheme``, ...).
    """
    from witcert.observatory.study_config import QUICK, StudyConfig

    _args.require_installed("witcert study", "observatory", "transformers", "scipy", "matplotlib")
    schemes = {}
    for option, text in (("--scheme", args.scheme), ("--gate-scheme", args.gate_scheme),
                         ("--risk-scheme", args.risk_scheme), ("--sweep-scheme", args.sweep_scheme),
                         ("--spot-gate-scheme", args.spot_gate_scheme)):
        schemes[option] = _tensor_schemes(option, text)
    args.out = _args.check_output_dir(args.out or _args.default_out("study"))
    if args.quick:
        args.config = QUICK
        _args.prepare_output_dir(args.out)
        return
    _check_shape(args, schemes)
    args.config = StudyConfig(cases=args.cases, sweep_cases=args.sweep_cases, context_tokens=args.context,
                              batch=args.batch, probe_tokens=args.probe, schemes=schemes["--scheme"],
                              gated_schemes=schemes["--gate-scheme"], risk_schemes=schemes["--risk-scheme"],
                              sweep_schemes=schemes["--sweep-scheme"], spot_gated_schemes=schemes["--spot-gate-scheme"],
                              spot_keys=args.spot_keys, tau_certified=args.tau, tau_risk=args.risk_tau)
    _check_context(args)
    _args.prepare_output_dir(args.out)


def _check_context(args) -> None:
    """The needle family at ``--context`` fits this model's tokenizer (built once here, before the model loads)."""
    from witcert.integrations.hf.default_model import load_tokenizer
    from witcert.observatory.study import needle_family

    tokenizer, config = load_tokenizer(args.model), args.config
    try:
        needle_family(tokenizer, config.cases, config.context_tokens, config.seed)
    except ValueError as err:
        raise _args.context_too_small(config.context_tokens, lambda tokens: needle_family(
            tokenizer, config.cases, tokens, config.seed), err) from None


def _tensor_schemes(option: str, text: str) -> tuple[str, ...]:
    """The registered names of ``text``'s schemes: the study runs tensor schemes, not the caches."""
    names = _names(text)
    caches = [name for name in names if name in CACHE_SCHEMES]
    if caches:
        raise ValueError(f"{option}: {', '.join(caches)} is a cache, which `witcert observe` meters; the study runs "
                         "tensor schemes (registered, plugins or module:function)")
    try:
        return tuple(resolve_scheme(name) for name in names)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None


def _check_shape(args, schemes: dict) -> None:
    """What ``StudyConfig`` checks across fields, in the command's own names."""
    if args.sweep_cases > args.cases:
        raise ValueError(f"--sweep-cases {args.sweep_cases} must not exceed --cases {args.cases}")
    if not schemes["--scheme"] and not schemes["--sweep-scheme"]:
        raise ValueError("--scheme: give at least one scheme")
    for option in ("--gate-scheme", "--risk-scheme", "--sweep-scheme", "--spot-gate-scheme"):
        extra = sorted(set(schemes[option]) - set(schemes["--scheme"]))
        if extra:
            raise ValueError(f"{option}: {', '.join(extra)} must also be in --scheme (its raw row is the comparison)")


def run(args) -> int:
    import torch

    from witcert.observatory import study, study_report

    torch.set_num_threads(args.threads)
    loaded = _args.load_checked_model(args.model)
    print(f"model: {loaded.source}", flush=True)
    start = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        elapsed = time.perf_counter() - start
        print(f"[{done}/{total}] {label:<32} {elapsed / 60:5.1f} min, about {elapsed / done * (total - done) / 60:.1f} "
              "min left", flush=True)

    report = study.run_study(loaded, args.config, progress)
    report["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    report["command"] = "witcert " + shlex.join(args.argv)
    md = study_report.write(report, args.out)
    print(study_report.markdown(report))
    print(f"report: {md}\nwall time: {report['wall_s'] / 60:.1f} min")
    sound = report["soundness"]
    if sound["violations"] or sound["unchecked"] or sound.get("violations_after_repair"):
        print(f"SOUNDNESS VIOLATION: {sound['violations']} cells with true TV above the meter "
              f"({sound['unchecked']} unchecked), {sound.get('violations_after_repair', 0)} above their meter after "
              "repair", file=sys.stderr)
        return EXIT_VIOLATION
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
