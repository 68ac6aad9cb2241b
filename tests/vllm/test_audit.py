"""The request audit in the plugin: settings, the verdict, the series, and its statement through vLLM.

Implementation: ``witcert.integrations.vllm.audit`` (settings from ``extra_args``, the per-request tally and
verdict, the ledger), the backend's picked-cells-only metering, ``prometheus`` (the ``witcert_audit_*``
series). Oracles: :func:`witcert.audit.requests_of` on the same cells (the audit package's own entry
point), :func:`witcert.audit.picks.picked` replayed from the request's seed, and the exact shadow's true
TV of every cell (the statement ``M <= M_upper``, checked per request at a large delta).
"""
import json
import os

import numpy as np
import pytest
import torch

from tests.vllm.engines import HAS_VLLM, NO_VLLM, run_engine
from witcert.audit import Audit, requests_of
from witcert.audit.picks import picked
from witcert.integrations.vllm import audit, config
from witcert.integrations.vllm.telemetry import Telemetry

LAYERS, HEADS = 30, 9  # SmolLM2-135M


def collector(directory):
    """The plugin's Prometheus collector over ``directory`` (skips where prometheus_client is not installed: the
    main venv runs this file's pure tests too)."""
    prometheus = pytest.importorskip("witcert.integrations.vllm.prometheus", reason="prometheus_client missing")
    return prometheus.WitCertCollector(str(directory))


@pytest.mark.parametrize("extra,match", [
    ({"witcert_audit_rate": 0}, r"witcert_audit_rate must lie in \(0, 1\]"),
    ({"witcert_audit_rate": "x"}, r"witcert_audit_rate must be a number"),
    ({"witcert_audit_rate": 0.1, "witcert_audit_tau": 1.0}, r"witcert_audit_tau must lie in \(0, 1\)"),
    ({"witcert_audit_rate": 0.1, "witcert_audit_delta": 0}, r"witcert_audit_delta must lie in \(0, 1\)"),
    ({"witcert_audit_delta": 0.1}, r"witcert_audit_delta needs witcert_audit_rate"),
    ({"witcert_audit_rate": 0.1, "witcert_gate": True}, r"witcert_audit_rate meters only the audit's picked cells"),
])
def test_bad_audit_settings_name_the_key(extra, match):
    cfg = config.PluginConfig(gate=True, scheme="none")
    with pytest.raises(ValueError, match=match):
        config.request_settings(cfg, dict({"witcert_gate": False}, **extra))


def test_audit_settings_from_extra_args():
    cfg = config.PluginConfig()
    plain = config.request_settings(cfg, {})
    assert plain.audit is None and plain.everything
    s = config.request_settings(cfg, {"witcert_audit_rate": "0.05", "witcert_audit_tau": 0.1,
                                      "witcert_audit_delta": 0.01, "witcert_audit_seed": "12"})
    assert s.audit == Audit(rate=0.05, tau=0.1, delta=0.01, seed=12) and not s.everything
    drawn = {config.request_settings(cfg, {"witcert_audit_rate": 0.02}).audit.seed for _ in range(4)}
    assert len(drawn) == 4  # a secret seed per request when none is given


def test_verdict_is_the_audit_packages_on_the_same_cells():
    g = torch.Generator().manual_seed(3)
    settings = Audit(rate=0.25, tau=0.2, delta=0.05, seed=99)
    positions = [40, 41, 42, 43]
    picks = audit.cell_picks(settings, 8, HEADS, positions)  # (L, Hq, T)
    tally, ledger = audit.Tally(settings), audit.Ledger()
    rows = {name: [] for name in ("request", "layer", "head", "pos", "audited", "flagged")}
    for layer in range(8):
        meters = torch.rand(len(positions), HEADS, generator=g, dtype=torch.float64) * 0.22
        ledger.add_rows(["r"] * len(positions), [settings] * len(positions), layer, positions, picks[layer].T, meters,
                        None, head_offset=0)  # a layer's rows at once, as the backend adds them
        for t, pos in enumerate(positions):
            meter = meters[t]
            tally.add(layer, pos, picks[layer, :, t], meter, None, head_offset=0)
            for h in range(HEADS):
                for name, value in zip(rows, (7, layer, h, pos, bool(picks[layer, h, t]),
                                              bool(picks[layer, h, t]) and float(meter[h]) > settings.tau)):
                    rows[name].append(value)
    expected, = requests_of({k: np.asarray(v) for k, v in rows.items()}, settings, seed=settings.seed)
    got = tally.verdict(7)
    assert 0 < got.flagged and got.M_upper < got.N and got == expected
    assert ledger.open["r"].verdict(7) == expected


def test_a_steps_picks_are_each_requests_own():
    audits = [Audit(rate=0.3, seed=5), Audit(rate=0.05, seed=2**62 + 1), Audit(rate=1.0, seed=0)]
    positions = [[700, 701], [12, 12], [3, 4]]
    together = audit.step_picks(audits, 4, 3, positions, head_offset=3)  # (L, B, Hq, T), this worker's heads
    for b, a in enumerate(audits):
        assert torch.equal(together[:, b], audit.cell_picks(a, 4, 3, positions[b], head_offset=3))
        assert torch.equal(together[:, b], picked(a.seed, [0], range(4), 6, positions[b], a.rate)[:, 0, 3:])



def test_picks_drawn_ahead_are_the_steps_own():
    """PickBlocks returns step_picks' picks at every decode step: across block edges, requests joining and
    leaving, a position met again (a preempted request recomputed), a prefill row and two rows of one seed."""
    blocks, rng = audit.PickBlocks(), np.random.default_rng(0)
    audits = [Audit(rate=0.3, seed=5), Audit(rate=0.05, seed=2**62 + 1), Audit(rate=1.0, seed=0),
              Audit(rate=0.3, seed=5)]
    position = {0: 10, 1: 500, 2: 0, 3: 40}
    for step in range(3 * audit.PickBlocks.BLOCK):
        rows = [b for b in range(3) if rng.random() < 0.8] or [1]
        if step == 50:
            position[0] = 12  # met again: drawn anew
        if step == 70:
            rows = [0, 3]  # one seed at two positions
        asked = [audits[b] for b in rows]
        positions = [[position[b]] for b in rows]
        if step == 80:
            positions[-1] = [position[rows[-1]], position[rows[-1]] + 1]  # two query tokens
        got = blocks.step(asked, 4, 3, positions, head_offset=3)
        assert torch.equal(got, audit.step_picks(asked, 4, 3, positions, head_offset=3)), step
        for b in rows:
            position[b] += 1
    assert 0 < len(blocks.blocks) <= audit.PickBlocks.KEPT

@pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)
def test_kept_cells_are_the_chosen_tokens_heads_and_the_audits_picks():
    # the cells a pass keeps (backend._kept_cells): with no sampling switch, every head of a chosen token; with an
    # audit, its picked heads of a chosen token and nothing else; a row sampling every 2nd step beside an audited
    # row takes the general path (oracle: the picks and the chosen tokens as given, and Metering.meters per cell)
    from witcert.integrations.vllm.backend import _kept_cells

    cfg = config.PluginConfig()
    plain = config.request_settings(cfg, None)
    audited = config.request_settings(cfg, {"witcert_audit_rate": 0.5, "witcert_audit_seed": 3})
    sampled = config.request_settings(cfg, {"witcert_meter_every": 2})
    chosen = [[True, False], [False, True], [True, True]]
    positions = [[10, 11], [20, 21], [30, 31]]
    kept = _kept_cells(chosen, [plain] * 3, 0, positions, 6, 2)
    assert torch.equal(kept, torch.tensor(chosen).unsqueeze(-1).expand(3, 2, 6))
    g = torch.Generator().manual_seed(0)
    picks = [torch.rand(6, 2, generator=g) < 0.5 for _ in range(3)]  # (Hq, T) per row
    kept = _kept_cells(chosen, [audited] * 3, 0, positions, 6, 2, picks)
    for i in range(3):
        for j in range(2):
            assert torch.equal(kept[i, j], picks[i][:, j] & chosen[i][j])
    kept = _kept_cells(chosen, [audited, sampled, plain], 0, positions, 6, 2, [picks[0], None, None])
    assert torch.equal(kept[0], (picks[0] & torch.tensor(chosen[0])).T)
    for j in range(2):
        assert bool(kept[1, j].all()) == (chosen[1][j] and sampled.metering.meters(0, positions[1][j]))
    assert torch.equal(kept[2], torch.tensor(chosen[2]).unsqueeze(-1).expand(2, 6))


def test_unpicked_tokens_count_in_the_tally():
    a = Audit(rate=0.5, seed=1)
    ledger = audit.Ledger()
    ledger.add_unpicked(["r", "r"], [a, a], 9)
    ledger.add_rows(["r"], [a], 0, [4], torch.tensor([[True] + [False] * 8]), torch.full((1, 9), 0.5,
                                                                                            dtype=torch.float64),
                    None, head_offset=0)
    tally = ledger.open["r"]
    assert (tally.cells, tally.picked, tally.flagged) == (27, 1, [(0, 0, 4)])


def test_audit_series_appear_on_metrics(tmp_path):
    t = Telemetry(tau=0.2)
    settings = Audit(rate=0.5, tau=0.2, delta=0.1, seed=1)
    picks = audit.cell_picks(settings, 2, HEADS, [5])
    for layer in range(2):
        t.audit.tally("req-a", settings).add(layer, 5, picks[layer, :, 0], torch.full((HEADS,), 0.3), None, 0)
    t.audit.finish(["req-a", "unknown"])
    t.publish(str(tmp_path))
    families = {f.name: f for f in collector(tmp_path).collect()}
    for name in ("witcert_audit_requests", "witcert_audit_flagged_requests", "witcert_audit_picked_cells",
                 "witcert_audit_flagged_cells", "witcert_audit_fraction_upper"):
        assert name in families, name
    labels = {"tau": "0.2", "delta": "0.1"}
    assert [s.value for s in families["witcert_audit_flagged_requests"].samples if s.labels == labels] == [1]
    count = [s.value for s in families["witcert_audit_fraction_upper"].samples if s.name.endswith("_count")]
    assert count == [1]


def test_every_picked_cell_is_metered_without_the_shadow(smollm2, monkeypatch):
    """Deferred metering without the shadow: a layer queues only the tokens its own picks choose, so each layer's
    queued rows must carry that layer's choice. Were one layer's choice reused for the others (it once was: cached
    per step), a picked cell in another layer's unchosen step would be counted picked and never metered, never
    flagged (its meter NaN), and the statement would undercount. Oracle: the picks replayed from each request's
    seed; the engine's metered cells are exactly those, plus the warm-up request's."""
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    monkeypatch.setenv("WITCERT_VLLM_DEFER", "8")
    monkeypatch.setenv("WITCERT_VLLM_COMPILE", "0")
    tokens, seed = 6, 20261207
    xargs = {"witcert_audit_rate": 0.1, "witcert_audit_tau": 0.2, "witcert_audit_seed": seed}
    out = run_engine("--plugin", "--scheme", "rtn-int4", "--max-tokens", str(tokens),
                     "--prompts", "The capital of France is", "Once upon a time, in a small village by the sea,",
                     "--xargs", json.dumps(xargs))
    snap = out["witcert"]
    verdicts = {v["request_id"].split("-")[0]: v for v in snap["audit"]["recent"].values()}
    settings = Audit(rate=0.1, tau=0.2, seed=seed)
    picked_total = 0
    for rid, o in zip(out["request_ids"], out["outputs"]):
        decode = range(o["prompt_tokens"], o["prompt_tokens"] + tokens - 1)
        picks = audit.cell_picks(settings, LAYERS, HEADS, list(decode))
        assert verdicts[rid]["picked"] == int(picks.sum()) > 0
        picked_total += int(picks.sum())
    assert snap["cells"] == picked_total + LAYERS * HEADS  # every picked cell metered (the warm-up: all of it)


@pytest.mark.parametrize("defer", ["1", "8"], ids=["per-step", "deferred"])
def test_statement_holds_against_the_exact_shadow_through_vllm(smollm2, defer, monkeypatch, tmp_path):
    """rtn-int4 through vLLM, audited at rate 0.3: per request, the picks replay from its seed, only they are
    metered, and its true count of cells above tau (exact shadow) is at most M_upper (delta 0.2 is large: a
    failure would be a delta-probability event per request; 0 cells above their meter in any case)."""
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    monkeypatch.setenv("WITCERT_VLLM_DEFER", defer)
    monkeypatch.setenv("WITCERT_VLLM_COMPILE", "0")  # eager: the audit's logic, not the compiled pass, is tested
    tokens, seed = 6, 20261206
    xargs = {"witcert_audit_rate": 0.3, "witcert_audit_tau": 0.2, "witcert_audit_delta": 0.2,
             "witcert_audit_seed": seed}
    out = run_engine("--plugin", "--shadow", "--scheme", "rtn-int4", "--max-tokens", str(tokens),
                     "--prompts", "The capital of France is", "Once upon a time, in a small village by the sea,",
                     "--xargs", json.dumps(xargs))
    snap = out["witcert"]
    assert snap["shadow_violations"] == 0 and snap["shadow_cells"] > 0
    # vLLM's internal request id is the caller's with a suffix ("1" -> "1-<hex>")
    verdicts = {v["request_id"].split("-")[0]: v for v in snap["audit"]["recent"].values()}
    assert set(verdicts) == set(out["request_ids"]) and snap["audit"]["open"] == 0
    settings = Audit(rate=0.3, tau=0.2, delta=0.2, seed=seed)
    picked_total = 0
    for rid, o in zip(out["request_ids"], out["outputs"]):
        v = verdicts[rid]
        decode = range(o["prompt_tokens"], o["prompt_tokens"] + tokens - 1)  # each decode step's query position
        picks = audit.cell_picks(settings, LAYERS, HEADS, list(decode))
        assert v["N"] == LAYERS * HEADS * len(decode) and v["picked"] == int(picks.sum())
        assert all(bool(picks[layer, head, pos - decode.start]) for layer, head, pos in v["flagged_cells"])
        assert v["true_above"] <= v["M_upper"], v  # the statement, against every cell's true TV
        assert v["true_above"] > 0  # not vacuous: rtn-int4 moves attention above tau somewhere
        picked_total += v["picked"]
    warm = LAYERS * HEADS  # the warm-up request (no audit) is metered whole
    assert snap["cells"] == picked_total + warm  # only picked cells were metered
    by_level = snap["audit"]["by_level"]["0.2|0.2"]
    assert by_level["requests"] == 2 and by_level["shadow_violations"] == 0
    snap = dict(snap, pid=os.getpid())  # the engine process has exited: read its snapshot as a live one's
    (tmp_path / f"witcert-{os.getpid()}.json").write_text(json.dumps(snap))
    names = {s.name for f in collector(tmp_path).collect() for s in f.samples}
    assert {"witcert_audit_flagged_requests_total", "witcert_audit_fraction_upper_bucket",
            "witcert_audit_shadow_violations_total"} <= names
