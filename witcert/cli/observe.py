"""``witcert observe``: run a workload on a real model under compressed KV caches and measure the meter."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from witcert.cli import _args
from witcert.cli.observe_output import print_table as _print_table, progress_for
from witcert.cli._exit import EXIT_USAGE, EXIT_VIOLATION
from witcert.integrations.hf.quantized_cache import HF_CACHE_SCHEMES, require_backend
from witcert.schemes.catalog import CACHE_SCHEMES, DITHERED
from witcert.schemes.plugins import resolve_scheme

HELP = "run a real model (default: embedded SmolLM2-135M-Instruct) under compressed KV caches; report meter vs true TV"

DEFAULT_SCHEME = "rtn-int4"
DEMO_SCHEMES = ("fp8-e4m3", "rtn-int4", "kivi-2bit", "dithered-int8")
CASES, DEMO_CASES = 4, 1  # the demo runs one needle per scheme; --demo --cases 4 --gate the full sweep
DEMO_CERTIFICATE = "spot"  # the demo shows the spot check's coverage beside the deterministic meter's
SPOT_KEYS = 256  # witcert.monitor's default spot_keys
TASKS = ("needle", "text", "code")


def add_arguments(parser) -> None:
    parser.add_argument("--scheme", action="append", default=None, metavar="NAME",
                        help="scheme to meter; repeat or comma-separate for a comparison. A registered name "
                             "(`witcert schemes`; also the caches dithered-int8 and transformers' hf-quanto-int4, "
                             "hf-hqq-int8, ...), an installed plugin (entry-point group witcert.schemes) or "
                             f"module:function for your own fn(x) -> x_hat (default: {DEFAULT_SCHEME}; with --demo: "
                             f"{', '.join(DEMO_SCHEMES)})")
    parser.add_argument("--tier", choices=("auto", "A", "B"), default="auto",
                        help="A: band-norm witness (adaptive-safe), every scheme; B: the dithered-int8 cache's "
                             "probabilistic certificate (min with A; non-adaptive scope); auto: B for dithered-int8, else A")
    parser.add_argument("--task", default="needle", help="needle | text | code | PATH to a text file")
    parser.add_argument("--tau", type=_args.certified_tau, default=0.2,
                        help="certified threshold for coverage and the gate (0 < tau < 1)")
    parser.add_argument("--gate", action="store_true", help="also run with the certified gate (block repair from the exact shadow)")
    parser.add_argument("--model", type=_args.existing_path, default=None, metavar="PATH",
                        help="local Hugging Face checkpoint (a directory with config.json, or a .gguf file) "
                             "(default: the embedded SmolLM2-135M-Instruct, converted once to a 517 MB copy in "
                             "$WITCERT_CACHE, else ~/.cache/witcert or a checkout's models/)")
    parser.add_argument("--context", type=_args.positive_int, default=512, help="context tokens per case")
    parser.add_argument("--cases", type=_args.positive_int, default=None,
                        help=f"cases per task (default {CASES}; with --demo {DEMO_CASES}: --demo --cases {CASES} is the full sweep)")
    parser.add_argument("--probe", type=_args.positive_int, default=32, help="teacher-forced continuation tokens (text/code)")
    parser.add_argument("--new-tokens", type=_args.positive_int, default=6, help="greedy answer tokens (needle)")
    parser.add_argument("--bands", type=_args.positive_int, default=16, help="Tier A bands B (must divide head_dim/2)")
    parser.add_argument("--seed", type=_args.philox_seed, default=None,
                        help="Philox seed of the dithered-int8 cache, in [0, 2^64) (default: a fresh secret seed per "
                             "case from the OS, recorded in telemetry.jsonl; give one only to replay a run: a known seed "
                             "voids Tier B)")
    parser.add_argument("--threads", type=_args.positive_int, default=1,
                        help="torch CPU threads (1: on a small shared machine more threads oversubscribe)")
    parser.add_argument("--out", type=_args.output_dir, default=None, metavar="DIR",
                        help="report directory, created before the run (default: reports/observe-<UTC time>)")
    parser.add_argument("--certificate", choices=("deterministic", "spot"), default=None,
                        help="deterministic: the witness's proved meter only; spot: cells whose meter exceeds tau "
                             "are also spot-checked with exact keys, a bound holding with probability 1 - 1e-6 per "
                             "cell (default: deterministic; with --demo: spot)")
    parser.add_argument("--spot-keys", type=_args.positive_int, default=None, metavar="N",
                        help=f"exact keys read per spot-checked cell (--certificate spot; default: {SPOT_KEYS})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--keep-exact", dest="keep_exact", action="store_true", default=True,
                      help="validation mode (the default): keep the exact cache, measure every cell's true TV")
    mode.add_argument("--production", dest="keep_exact", action="store_false",
                      help="production mode (keep_exact=False): no exact cache and no true TV; the spot check and "
                           "the gate read exact keys from a host backing store")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, metavar="TEXT",
                        help="run your own prompt instead of --task: prefilled, then --new-tokens greedy tokens, "
                             "every cell metered (one case)")
    prompt.add_argument("--prompt-file", type=_args.existing_path, default=None, metavar="PATH",
                        help="the same, the prompt read from a UTF-8 text file")
    parser.add_argument("--demo", action="store_true",
                        help=f"the demo: {', '.join(DEMO_SCHEMES)}, one needle case each, spot-checked (deterministic "
                             "and spot coverage side by side); add --gate for the gate, --cases 4 --gate for the full "
                             "sweep")


def check(args) -> None:
    """Every check that needs more than one argument, a file, a plugin or the tokenizer: before the model loads.

    Resolves each scheme (loading and probing ``module:function`` and entry-point plugins), the
    task, the tier, the model path (and, where its ``config.json`` is readable, ``--bands`` against
    its head dim), builds the workload with the model's tokenizer (``--context`` and ``--probe``
    against the prompt and the text), and creates the ``--out`` directory. Raises ``ValueError``
    naming the argument.
    """
    _args.require_installed("witcert observe", "observatory", "transformers", "matplotlib")
    args.out = _args.check_output_dir(args.out or _args.default_out("observe"))
    args.schemes = _schemes(args)
    for name in args.schemes:
        if name in HF_CACHE_SCHEMES:
            try:
                require_backend(HF_CACHE_SCHEMES[name].backend)
            except ImportError as err:
                raise ValueError(f"--scheme {name}: {err}") from None
        elif name not in CACHE_SCHEMES:
            resolve_scheme(name)  # SchemeLoadError is a ValueError with the known names
    if args.tier == "B" and any(name != DITHERED for name in args.schemes):
        raise ValueError(f"--tier B certifies the {DITHERED} cache only; got --scheme {','.join(args.schemes)}")
    _check_certificate(args)
    args.prompt = _prompt(args)
    if args.prompt is None and args.task not in TASKS:
        path = Path(args.task).expanduser()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"--task {args.task!r} is neither {' | '.join(TASKS)} nor a readable text file")
    head_dim = _check_model(args.model)
    if head_dim is not None and (head_dim // 2) % min(args.bands, head_dim // 2):
        raise ValueError(f"--bands {args.bands} must divide head_dim/2 = {head_dim // 2} of the model")
    if args.model is not None and args.model.is_dir() and not _has_rope(args.model / "config.json"):
        raise ValueError(f"--model {str(args.model)!r} has no rotary position embedding (RoPE): its config.json names "
                         "no rope or rotary setting. witcert observe runs RoPE decoders (Llama, Qwen2, Mistral, ...); "
                         "for a model without RoPE use witcert.monitor(model, scheme, rope='rotate_half')")
    args.config = _config(args)
    _check_workload(args)
    _args.prepare_output_dir(args.out)


def run(args) -> int:
    from witcert.observatory import plan, runner as observatory, report, telemetry

    import torch

    torch.set_num_threads(args.threads)
    config = args.config
    print("\n".join(plan.describe(config, args.n_cases, args.threads, demo=args.demo)), flush=True)
    start = time.perf_counter()
    loaded = _args.load_checked_model(args.model)
    print(f"model: {loaded.source}")
    try:
        with progress_for(sys.stdout) as progress:
            on_result = progress.show(config) if len(config.schemes) > 1 else None
            results, baseline = observatory.run_observe(loaded, config, progress, on_result)
    except ValueError as err:  # what only the loaded model can tell: --bands against a GGUF model's head dim
        print(f"witcert observe: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    wall = time.perf_counter() - start
    out = args.out
    jsonl = out / "telemetry.jsonl"
    for r in results:
        run_tag = {"scheme": r.scheme, "tier": r.tier, "task": r.task, "gated": False,  # the tier used, not "auto"
                   "certificate": config.certificate, "keep_exact": config.keep_exact}
        telemetry.write_jsonl(jsonl, r.raw, run_tag)
        if r.gated is not None:
            telemetry.write_jsonl(jsonl, r.gated, {**run_tag, "gated": True})
    md = report.write_report(out, results, config, baseline, loaded.source, wall)
    _print_table(results, config, baseline)
    print(f"report: {md}\ntelemetry: {jsonl}\nwall time: {wall:.1f} s")
    violations = sum(report.summarize(r.raw, config.tau).violations for r in results)
    if violations:
        print(f"SOUNDNESS VIOLATION: {violations} cells with true TV above the meter", file=sys.stderr)
        return EXIT_VIOLATION
    return 0


def _config(args):
    """The run's ``ObserveConfig`` (each field already checked by its argument's type)."""
    from witcert.observatory.runner import ObserveConfig

    return ObserveConfig(
        schemes=args.schemes, task="prompt" if args.prompt is not None else args.task, tau=args.tau, gate=args.gate,
        context_tokens=args.context, probe_tokens=args.probe, new_tokens=args.new_tokens,
        cases=args.cases or (DEMO_CASES if args.demo else CASES), bands=args.bands, tier=args.tier, seed=args.seed,
        keep_exact=args.keep_exact, certificate=args.certificate, spot_keys=args.spot_keys or SPOT_KEYS,
        prompt=args.prompt,
    )


def _check_certificate(args) -> None:
    """``--certificate`` (spot by default with ``--demo``) and ``--spot-keys``, which only the spot check reads."""
    if args.certificate is None:
        args.certificate = DEMO_CERTIFICATE if args.demo else "deterministic"
    if args.spot_keys is not None and args.certificate != "spot":
        raise ValueError(f"--spot-keys {args.spot_keys}: the spot check's key budget needs --certificate spot "
                         f"(the certificate is {args.certificate})")


def _prompt(args) -> str | None:
    """The text of ``--prompt`` or ``--prompt-file`` (``None``: a --task workload); checked against --task and --cases."""
    if args.prompt is None and args.prompt_file is None:
        return None
    option = "--prompt" if args.prompt is not None else "--prompt-file"
    if args.task != "needle":
        raise ValueError(f"{option} replaces --task: give one of them (got --task {args.task})")
    if args.cases not in (None, 1):
        raise ValueError(f"{option} runs its prompt once: --cases {args.cases} does not apply")
    text = args.prompt
    if text is None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompt-file {str(args.prompt_file)!r}: not a readable UTF-8 text file ({err})") from None
    if not text.strip():
        raise ValueError(f"{option}: the prompt is empty")
    return text


def _check_workload(args) -> None:
    """Build the cases with the model's tokenizer: ``--context`` and ``--probe`` fit the prompt and the text."""
    from witcert.integrations.hf.default_model import load_tokenizer
    from witcert.observatory.runner import build_cases

    tokenizer = load_tokenizer(args.model)
    try:
        args.n_cases = len(build_cases(tokenizer, args.config))
    except ValueError as err:
        if args.prompt is not None:
            option = "--prompt" if args.prompt_file is None else "--prompt-file"
            raise ValueError(f"{option}: {str(err).removeprefix('prompt: ')}") from None
        if args.task != "needle":
            raise ValueError(f"--context {args.context} / --probe {args.probe} (--task {args.task}): {err}") from None
        raise _args.context_too_small(args.context, lambda tokens: build_cases(
            tokenizer, dataclasses.replace(args.config, context_tokens=tokens)), err) from None


def _schemes(args) -> tuple[str, ...]:
    if args.demo and not args.scheme:
        return DEMO_SCHEMES
    names = []
    for item in args.scheme or [DEFAULT_SCHEME]:
        names += [s.strip() for s in item.split(",") if s.strip()]
    if not names:
        raise ValueError("--scheme: give at least one scheme name")
    return tuple(dict.fromkeys(names))  # a repeated name runs once


def _check_model(model: Path | None) -> int | None:
    """Check ``--model`` (or that the default model is there); its head dim where a config.json says."""
    from witcert.integrations.hf import default_model  # no transformers import: it loads lazily

    if model is None:
        # the saved copy load_model reads first (default_model's own path), else the package's GGUF file
        config = default_model.cache_dir() / default_model._CACHE_SUBDIR / "config.json"
        if not config.is_file():
            try:
                default_model.default_gguf_path()
            except default_model.ModelUnavailable as err:
                raise ValueError(f"--model not given, and {err}") from None
            return None
    elif model.is_dir():
        config = model / "config.json"
        if not config.is_file():
            raise ValueError(f"--model {str(model)!r} is a directory without config.json (not a Hugging Face checkpoint)")
    elif model.suffix == ".gguf":
        return None
    else:
        raise ValueError(f"--model {str(model)!r} is neither a checkpoint directory nor a .gguf file")
    return _head_dim(config)


def _has_rope(config_path: Path) -> bool:
    """Whether a config.json names a RoPE setting (a key with "rope" or "rotary", its text config's too).

    Deliberately broad: it only refuses a config that names none at all (GPT-2, BERT), so an
    unreadable config or an unknown spelling lets the model load and ``witcert.monitor`` decide.
    """
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return True
    if not isinstance(config, dict):
        return True
    sections = [config] + [value for value in config.values() if isinstance(value, dict)]
    return any("rope" in key or "rotary" in key for section in sections for key in section)


def _head_dim(config_path: Path) -> int | None:
    """head_dim from a Hugging Face config.json (as ``layout_for`` reads it), or None if it does not say."""
    try:
        config = json.loads(config_path.read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return head_dim if isinstance(head_dim, int) and head_dim >= 2 else None
