"""``witcert observe``'s production options, the demo's plan and time estimate, and what its table marks (issue 41
items 4 and 5, issue 42 item 4).

Implementations: ``witcert.cli.observe`` (``--certificate``, ``--spot-keys``, ``--keep-exact``/``--production``,
``--prompt``/``--prompt-file``, ``--demo``), ``witcert.observatory.plan`` (``steps``, ``Pace``, ``describe``),
``witcert.observatory.report.terminal_rows``/``bound_lines``, ``witcert.observatory.workloads.prompt_case``.
Oracles: the exit status 2 and the message naming the argument with a model loader that fails the test if
reached; the run configuration each option produces; for the time left, the per-kind prediction done by hand
(and the mean-per-step extrapolation it replaces); for a real run on the embedded model, its telemetry.
"""
import json
import math

import numpy as np
import pytest

from witcert.cli import main, observe
from witcert.observatory import plan, report, workloads
from witcert.observatory.runner import ObserveConfig, SchemeResult
from witcert.integrations.hf.telemetry import CellTable
from tests.test_cli import _exit_status, no_model_load  # noqa: F401  (a fixture)


# ----------------------------------------------------------------------------- bad arguments: exit 2, before the model


@pytest.mark.parametrize("argv,message", [
    (["--spot-keys", "64"], r"--spot-keys 64: the spot check's key budget needs --certificate spot"),
    (["--certificate", "spot", "--spot-keys", "0"], r"argument --spot-keys: must be a positive integer"),
    (["--certificate", "sampled"], r"argument --certificate: invalid choice: 'sampled'"),
    (["--keep-exact", "--production"], r"argument --production: not allowed with argument --keep-exact"),
    (["--prompt", "hello there", "--prompt-file", "README.md"], r"argument --prompt-file: not allowed with argument"),
    (["--prompt", "hello there", "--task", "code"], r"--prompt replaces --task: give one of them"),
    (["--prompt", "   "], r"--prompt: the prompt is empty"),
    (["--prompt", "hello there", "--cases", "2"], r"--prompt runs its prompt once: --cases 2 does not apply"),
    (["--prompt-file", "no/such/prompt.txt"], r"argument --prompt-file: no such file or directory"),
])
def test_a_bad_production_option_exits_2_naming_it(argv, message, capsys, no_model_load):
    import re

    status, err = _exit_status(["observe", *argv], capsys)
    assert status == 2
    assert re.search(message, " ".join(err.split())), err


def test_an_empty_prompt_file_is_refused(capsys, no_model_load, tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    status, err = _exit_status(["observe", "--prompt-file", str(tmp_path / "empty.txt")], capsys)
    assert status == 2 and "--prompt-file: the prompt is empty" in err


@pytest.mark.model
def test_a_one_token_prompt_is_refused_with_the_tokenizer_before_the_model(capsys, no_model_load):
    status, err = _exit_status(["observe", "--prompt", "Hi"], capsys)
    assert status == 2 and "--prompt: 'Hi' is 1 token(s) with this model's tokenizer; give at least two" in err


# ----------------------------------------------------------------------------- what each option configures


def _configured(argv):
    """The arguments and ObserveConfig ``witcert observe`` builds (the checks that need no tokenizer)."""
    from witcert.cli import build_parser

    args = build_parser().parse_args(["observe", *argv])
    observe._check_certificate(args)
    args.prompt = observe._prompt(args)
    args.schemes = observe._schemes(args)
    return observe._config(args)


def test_the_demo_is_one_case_per_scheme_spot_checked_and_the_gate_and_sweep_opt_in():
    demo = _configured(["--demo"])
    assert demo.schemes == observe.DEMO_SCHEMES and demo.cases == 1 and not demo.gate
    assert demo.certificate == "spot" and demo.spot_keys == 256 and demo.keep_exact
    full = _configured(["--demo", "--cases", "4", "--gate"])
    assert full.cases == 4 and full.gate
    assert _configured(["--demo", "--certificate", "deterministic"]).certificate == "deterministic"
    assert _configured([]).certificate == "deterministic"


def test_the_production_options_reach_the_monitor_configuration():
    config = _configured(["--certificate", "spot", "--spot-keys", "64", "--production", "--prompt", "Say hi to me"])
    assert (config.certificate, config.spot_keys, config.keep_exact) == ("spot", 64, False)
    assert (config.task, config.prompt) == ("prompt", "Say hi to me")
    with pytest.raises(ValueError, match="prompt: task 'prompt' runs a non-empty prompt"):
        ObserveConfig(schemes=("rtn-int4",), task="prompt")
    with pytest.raises(ValueError, match="certificate must be one of"):
        ObserveConfig(schemes=("rtn-int4",), certificate="sampled")


def test_a_prompt_case_splits_its_own_token_ids():
    class Tokenizer:
        def __call__(self, text, return_tensors=None):
            import torch

            return type("Encoded", (), {"input_ids": torch.tensor([[5, 6, 7, 8]])})()

    case = workloads.prompt_case(Tokenizer(), "four tokens here")
    assert case.context_ids.tolist() == [[5, 6, 7]] and case.probe_ids.tolist() == [[8]]
    assert workloads.generates(case) and not isinstance(case, workloads.NeedleCase)


# ----------------------------------------------------------------------------- the plan and the time left


def test_the_time_left_predicts_each_kind_from_its_own_runs_not_the_mean_per_step():
    config = ObserveConfig(schemes=("fp8-e4m3", "rtn-int4"), certificate="spot", cases=1)
    steps = plan.steps(config, 1)
    assert [s.kind for s in steps] == ["reference", "spot", "spot"]
    pace = plan.Pace(steps)
    assert math.isnan(pace.left())
    pace.record(2.0)  # the uncompressed case: a spot-checked case is predicted at its relative cost
    assert pace.left() == pytest.approx(2 * plan.RELATIVE_COST["spot"] * 2.0)
    assert pace.left() != pytest.approx(2.0 * 2)  # what extrapolating the mean per step would say
    pace.record(30.0)  # one spot-checked case measured: the other is predicted from it
    assert pace.left() == pytest.approx(30.0)
    pace.record(25.0)
    assert pace.left() == 0.0
    with pytest.raises(ValueError, match="already recorded"):
        pace.record(1.0)


def test_the_plan_is_printed_with_the_gate_steps_and_the_full_sweep():
    config = ObserveConfig(schemes=("fp8-e4m3", "rtn-int4"), certificate="spot", cases=1, gate=True)
    kinds = [s.kind for s in plan.steps(config, 1)]
    assert kinds == ["reference", "spot", "spot gated", "spot", "spot gated"]
    production = ObserveConfig(schemes=("rtn-int4",), gate=True, keep_exact=False)
    assert [s.kind for s in plan.steps(production, 2)] == ["reference"] * 2 + ["metered"] * 2 + ["gated"] * 2
    demo = ObserveConfig(schemes=observe.DEMO_SCHEMES, certificate="spot", cases=1)
    text = "\n".join(plan.describe(demo, 1, 2, demo=True, share=1.0))
    assert text.startswith("plan: 4 scheme(s)") and "spot-checked (256 exact keys" in text
    assert "--demo --cases 4 --gate" in text and "time: about" in text and "busy" not in text
    idle = plan.prior_seconds(plan.steps(demo, 1), 512, 2)
    busy = "\n".join(plan.describe(demo, 1, 2, demo=True, share=0.25))
    assert f"busy (about 25% of a core for each thread now): expect {plan.minutes(idle / 0.25)}" in busy
    assert plan.share_of_machine(1, load=11.0, cpus=2) == pytest.approx(2 / 12)
    assert plan.share_of_machine(1, load=0.1, cpus=2) == 1.0


# ----------------------------------------------------------------------------- the printed table


def _spot_result(scheme: str, cases_marked: bool = False) -> SchemeResult:
    g = np.random.default_rng(0)
    n = 40
    tv = g.uniform(0, 0.1, n)
    det = np.minimum(1.0, tv * 8 + 0.1)
    spot = np.where(det > 0.2, tv * 1.5, np.nan)
    meter = np.where(np.isnan(spot), det, np.minimum(det, spot))
    cols = {"layer": np.repeat(np.arange(4), 10), "head": np.tile(np.arange(10), 4), "pos": np.full(n, 100),
            "meter": meter, "true_tv": tv, "risk": det * 2, "c_max": det, "output_bound": np.ones(n),
            "true_output_error": np.zeros(n), "joint": meter <= 0.2, "repaired": np.zeros(n, bool),
            "meter_before_spot": det, "spot_bound": spot, "spot_delta": np.where(np.isnan(spot), 0.0, 1e-6),
            "spot_keys": np.where(np.isnan(spot), 0.0, 64.0)}
    return SchemeResult(scheme=scheme, task="needle", raw=CellTable(cols), quality={"kl": 0.1, "top1": 0.9,
                                                                                     "needle_acc": 1.0})


def test_the_table_shows_both_coverages_the_bound_counts_and_marks_one_case_columns():
    import io

    from witcert.cli.observe_output import print_table

    results = [_spot_result(name) for name in observe.DEMO_SCHEMES]
    header, rows = report.terminal_rows(results, 0.2, cases=1)
    s = report.summarize(results[0].raw, 0.2)
    assert rows[0][header.index("cert.")] == f"{s.coverage_deterministic:.3f}"
    assert rows[0][header.index("spot")] == f"{s.coverage:.3f}" and s.coverage > s.coverage_deterministic
    assert "KL*" in header and "needle*" in header  # one case per scheme: an example, not a rate
    assert "KL" in report.terminal_rows(results, 0.2, cases=4)[0]
    line = report.bound_lines(results)[0]
    spot_cells = int(np.sum(~np.isnan(results[0].raw["spot_bound"])))
    assert line == f"bounds, fp8-e4m3: {40 - spot_cells} proved, {spot_cells} hold with probability >= 1 - 1e-06 " \
                   "(spot check)"
    out = io.StringIO()
    print_table(results, ObserveConfig(schemes=observe.DEMO_SCHEMES, cases=1, certificate="spot", gate=True),
                {"needle_acc": 1.0}, out)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100 and "…" not in text
    assert "*: rests on one case per scheme" in text and line in text


# ----------------------------------------------------------------------------- a run on the embedded model


@pytest.mark.model
def test_a_prompt_in_production_with_the_spot_check_runs_and_labels_every_cell(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        status = main(["observe", "--prompt", "The capital of France is", "--scheme", "rtn-int4", "--certificate",
                       "spot", "--spot-keys", "32", "--production", "--new-tokens", "2", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    out = capsys.readouterr().out
    assert out.index("plan: 1 scheme(s) (rtn-int4) x 1 prompt case") < out.index("model: ")
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert rows and all(r["certificate"] == "spot" and r["keep_exact"] is False for r in rows)
    assert all(r["true_tv"] is None for r in rows)  # production: no exact cache
    assert {r["bound_kind"] for r in rows} <= {"proved", "probabilistic"}
    assert "bounds, rtn-int4: " in out


def test_the_report_documents_the_spot_and_bounds_columns(tmp_path):
    results = [_spot_result("rtn-int4")]
    config = ObserveConfig(schemes=("rtn-int4",), cases=1, certificate="spot")
    text = report.write_report(tmp_path, results, config, {"needle_acc": 1.0}, "synthetic", 1.0).read_text()
    header, rows = report.table_rows(results, 0.2, {"needle_acc": 1.0}, cases=1)
    docs = "\n".join(report.COLUMN_DOCS)
    for name in header:
        assert name.rstrip(report.ONE_CASE).replace("@0.2", "@tau").replace(" (mean TV)", "") in docs, name
    assert rows[0][header.index("bounds")].endswith("p >= 1 - 1e-06") and "spot certified@0.2" in header
    assert "- bounds, rtn-int4: " in text and "spot check on the cells above tau: 256 exact keys" in text
