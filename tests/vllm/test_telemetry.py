"""Aggregation, snapshot files and the Prometheus series (no engine needed).

Implementation: ``telemetry.Telemetry`` and ``prometheus.WitCertCollector``. Oracle: counts and
maxima computed by hand from the cells fed in. Exact equality.
"""
import json
import os

import pytest
import torch

from witcert.integrations.vllm.telemetry import CellLog, Telemetry


def _fed(tau=0.2):
    t = Telemetry(tau=tau, max_requests=2, shadow=True)
    t.add("a", 0, torch.tensor([0.0, 0.1, 0.3], dtype=torch.float64), torch.tensor([0.0, 0.05, 0.31]))
    t.add("b", 1, torch.tensor([1.0, 0.2, 0.0], dtype=torch.float64), torch.tensor([0.5, 0.1, 0.0]))
    t.add("c", 1, torch.tensor([0.01, 0.0, 0.0], dtype=torch.float64))
    return t


def test_counts_maxima_and_violations():
    s = _fed().snapshot()
    assert (s["cells"], s["certified"], s["saturated"]) == (9, 7, 1)
    assert s["layer_max"] == {"0": 0.3, "1": 1.0}
    assert s["request_max"] == {"b": 1.0, "c": 0.01}  # the oldest request was dropped (max_requests=2)
    assert (s["shadow_cells"], s["shadow_violations"]) == (6, 1)  # 0.31 > 0.3
    assert sum(s["bucket_counts"]) == 9 and s["bucket_counts"][0] == 4  # four exact zeros


def test_a_step_is_folded_once_with_unmetered_cells_and_bound_kinds(tmp_path):
    # two layers' batches of one step (rows: request a's and b's decode token); NaN: a cell sampling left out
    from witcert.integrations.vllm.telemetry import CellBatch

    t = Telemetry(tau=0.2, max_requests=8, shadow=True)
    nan = float("nan")
    for layer, meters in ((0, [[0.1, nan, 0.5], [0.0, 0.0, 1.0]]), (1, [[nan, nan, nan], [0.3, 0.2, 0.1]])):
        m = torch.tensor(meters, dtype=torch.float64)
        t.queue(CellBatch(layer, ["a", "b"], ["rtn-int4", "none"], [False, False], [7, 3], m, true_tv=m.nan_to_num() / 2))
    assert t.cells == 0  # queued, not folded yet
    t.fold()
    s = t.snapshot()
    assert (s["cells"], s["unmetered"], s["certified"], s["saturated"]) == (8, 4, 5, 1)
    assert s["bounds"] == {"proved": 8, "probabilistic": 0}
    assert s["schemes"]["rtn-int4"]["cells"] == 2 and s["schemes"]["rtn-int4"]["unmetered"] == 4
    assert s["schemes"]["none"]["cells"] == 6 and s["shadow_cells"] == 8 and s["shadow_violations"] == 0
    assert s["layer_max"] == {"0": 1.0, "1": 0.3} and s["request_max"] == {"a": 0.5, "b": 1.0}
    log = CellLog(str(tmp_path / "cells.jsonl"))
    log.add_batch(CellBatch(0, ["a"], ["none"], [False], [7], torch.tensor([[0.1, nan]]),
                            risk=torch.tensor([[0.2, 0.3]])))
    log.flush()
    rows = [json.loads(x) for x in open(log.path)]
    assert len(rows) == 1 and rows[0]["bound"] == "proved" and (rows[0]["step"], rows[0]["tokens"]) == (7, 8)


def test_unmetered_tokens_count_as_an_all_unmetered_batch_would():
    from witcert.integrations.vllm.telemetry import CellBatch

    folded, counted = (Telemetry(tau=0.2, max_requests=2) for _ in range(2))
    for t in (folded, counted):
        t.add("a", 0, torch.tensor([0.1, 0.4], dtype=torch.float64), scheme="rtn-int4")
    requests, schemes = ["b", "a", "c"], ["rtn-int4", "none", "rtn-int4"]
    folded.queue(CellBatch(3, requests, schemes, [False] * 3, [5, 6, 7], torch.full((3, 2), float("nan"),
                                                                                     dtype=torch.float64)))
    folded.fold()
    counted.add_unmetered(3, requests, schemes, 2)
    assert counted.snapshot() == folded.snapshot()
    assert counted.unmetered == 6 and counted.schemes["rtn-int4"]["unmetered"] == 4


def test_cell_log_writes_one_line_per_head(tmp_path):
    log = CellLog(str(tmp_path / "cells.jsonl"))
    log.add("r", 3, 9, 10, torch.tensor([0.1, 0.2]), torch.tensor([0.1, float("inf")]), torch.tensor([0.0, 0.1]))
    log.flush()
    rows = [json.loads(x) for x in open(log.path)]
    assert [r["head"] for r in rows] == [0, 1] and rows[1]["risk"] == "inf" and rows[0]["step"] == 9


def test_collector_merges_live_engine_snapshots(tmp_path):
    prometheus = pytest.importorskip("witcert.integrations.vllm.prometheus", reason="prometheus_client missing")
    from prometheus_client import CollectorRegistry, generate_latest

    t = _fed()
    t.publish(str(tmp_path))
    dead = dict(t.snapshot(), pid=2**22 + 12345, cells=1000)  # a stale file of a dead engine
    (tmp_path / "witcert-999999.json").write_text(json.dumps(dead))
    registry = CollectorRegistry()
    registry.register(prometheus.WitCertCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    assert "witcert_cells_total 9.0" in text
    assert 'witcert_certified_fraction{tau="0.2"} 0.7777' in text
    assert "witcert_saturated_cells_total 1.0" in text
    assert 'witcert_meter_bucket{le="+Inf"} 9.0' in text
    assert 'witcert_layer_max_meter{layer="1"} 1.0' in text
    assert 'witcert_request_max_meter{request="b"} 1.0' in text
    assert "witcert_shadow_violations_total 1.0" in text
    assert 'witcert_cells_by_bound_total{bound="proved",delta=""} 9.0' in text
    assert "witcert_unmetered_cells_total 0.0" in text
    assert f"witcert_engines {1.0}" in text and os.getpid() == t.snapshot()["pid"]


def test_the_log_line_counts_cells_by_the_kind_of_bound_they_carry():
    from witcert.integrations.vllm.telemetry import CellBatch

    t = _fed()  # 9 proved cells, 7 at or below tau = 0.2, 1 saturated, 1 shadow violation of 6
    t._fold([CellBatch(2, ["d"], ["none"], [False], [0], torch.tensor([[0.05, float("nan")]]))], "probabilistic",
            delta=1e-3)
    assert t.log_line() == ("WitCert: Metered cells: 10 (proved: 9, probabilistic: 1, delta=0.001: 1), "
                            "Unmetered cells: 1, Certified at tau=0.2: 80.0%, Saturated cells: 1, "
                            "Shadow violations: 1 of 6")  # the last batch had no shadow truth
    assert "Shadow" not in Telemetry(tau=0.1, max_requests=2).log_line()  # no shadow, no cells: nothing to divide
