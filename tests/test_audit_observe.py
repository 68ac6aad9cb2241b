"""``witcert observe --audit RATE``: the request audit on the observatory's workloads (registry AU).

Implementation: ``witcert.cli.observe`` with ``--audit`` and ``witcert.observatory.runner``'s audited run.
Oracle: the run's own every-cell telemetry (true TV per cell) for each case's true fraction above tau; the
statement ``M <= M_upper`` per case (one case at rate 0.5 and the default delta: it must hold); the JSONL's audited
rows rebuilt by ``witcert.audit.requests_of``. Domain: the embedded SmolLM2, rtn-int4, one text case of 160 tokens
and 8 probe tokens. Bad rates exit 2 with the argument's name before the model loads. Tolerance: exact.
"""
import json
import re

import numpy as np
import pytest
import torch

import witcert
from witcert.audit import requests_of
from witcert.cli import main
from witcert.integrations.hf import default_model


@pytest.mark.parametrize("rate, message", [("0", r"argument --audit: rate must lie in \(0, 1\]"),
                                           ("1.5", r"argument --audit: rate must lie in \(0, 1\]"),
                                           ("often", r"argument --audit: must be a number in \(0, 1\], got 'often'")])
def test_a_bad_rate_exits_2_with_its_name_before_any_work(rate, message, capsys, monkeypatch):
    monkeypatch.setattr(default_model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exc:
        main(["observe", "--audit", rate])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.model
def test_observe_audits_each_case_and_writes_its_statement(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        status = main(["observe", "--scheme", "rtn-int4", "--task", "text", "--cases", "1", "--context", "160",
                       "--probe", "8", "--audit", "0.5", "--out", str(tmp_path / "report")])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    printed = capsys.readouterr().out
    assert "request audit, rtn-int4 (each line holds with probability >= 1 - 0.001" in printed
    (audit,) = json.loads((tmp_path / "report" / "audit.json").read_text())["rtn-int4"]
    rows = [json.loads(line) for line in (tmp_path / "report" / "telemetry.jsonl").read_text().splitlines()]
    every, audited = [r for r in rows if "audit_rate" not in r], [r for r in rows if "audit_rate" in r]
    assert len(every) == len(audited) == audit["N"] == 30 * 9 * 8  # the same cells, metered or picked
    true_above = sum(r["true_tv"] > 0.2 for r in every)
    assert audit["true_fraction"] == true_above / audit["N"] and true_above <= audit["M_upper"]
    columns = {name: np.array([r[name] for r in audited]) for name in ("request", "layer", "head", "pos", "audited",
                                                                        "flagged")}
    (rebuilt,) = requests_of(columns, witcert.Audit(rate=0.5, tau=0.2))
    assert (rebuilt.N, rebuilt.picked, rebuilt.flagged, rebuilt.M_upper) == (audit["N"], audit["picked"],
                                                                            audit["flagged"], audit["M_upper"])
    picked = [r for r in audited if r["audited"]]
    assert picked and all(r["true_tv"] <= r["audit_bound"] for r in picked)
    picture = tmp_path / "report" / "audit-rtn-int4.png"  # picked and flagged cells over (layer, step)
    assert f"audit plot: {picture}" in printed and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
