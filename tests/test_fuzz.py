"""The adversarial regression (``witcert fuzz``) as a CI test: per query, never in aggregate.

Implementation: every bound in ``witcert.verification.fuzz.CHECKED`` (meter fp32/fp64, T1, P1, P1r, MN, RC).
Oracle: the sup-box adversary's vertex TV (exact sup for S <= 12) and a random interior error,
near-misses re-decided at 50 digits. Domain: ``witcert.verification.fuzz.FAMILIES`` x S in 1..4096,
derandomized (seed 0). Tolerance: zero violations.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from witcert.verification import adversary, fuzz
from witcert.cli import main
from witcert.spec import golden

CI_TRIALS = 200_000  # the issue asks >= 50,000; about 15 s here


@pytest.fixture(scope="module")
def report():
    return fuzz.run_fuzz(CI_TRIALS, seed=0)


def test_no_sound_bound_is_ever_violated(report):
    assert report.trials == CI_TRIALS
    for name in fuzz.CHECKED:
        tally = report.tallies[name]
        assert tally.cells == CI_TRIALS
        assert tally.violations == 0, f"{name} violated on {tally.violations} queries"


def test_no_nan_and_meters_in_unit_interval(report):
    assert report.nonfinite_outputs == 0


def test_exhaustive_adversary_is_never_beaten(report):
    assert report.adversary_below_interior == 0


def test_known_false_form_is_caught(report):
    """The dispersion form passed 32,256 aggregate checks in the paper; per query it fails."""
    assert report.tallies["dispersion (known false)"].violations > 0


def test_adversary_reaches_the_max_norm_bound(report):
    """tanh(D/2) is attained in the two-point case: a strong adversary gets close to it."""
    assert report.tallies["tanh(D/2) (MN)"].worst_ratio() >= 0.95


def test_counterexample_is_the_first_trial():
    name, s, scores, c = next(fuzz.batches(10, seed=0))
    assert (name, s) == ("counterexample", 2)
    sup = adversary.sup_box_tv(scores.double(), c.double())
    vertex = sup.eps(c.double())[0].tolist()  # (+-0.1 as held in fp32)
    assert sorted(vertex) == [-c[0, 0].item(), c[0, 0].item()]
    assert abs(sup.tv.item() - float(golden.tv_from_scores([0.0, 0.0], vertex))) < 1e-15
    assert fuzz.unsound_dispersion(scores.double(), c.double()).item() < sup.tv.item()


@pytest.mark.parametrize("s", [3, 7, 12])
def test_adversary_equals_golden_exhaustive_sup(s):
    g = torch.Generator().manual_seed(s)
    scores = torch.randn(20, s, generator=g, dtype=torch.float64) * 3
    c = torch.rand(20, s, generator=g, dtype=torch.float64) * 2
    sup = adversary.sup_box_tv(scores, c)
    for i in range(scores.shape[0]):
        exact = golden.sup_box_tv_exhaustive(scores[i].tolist(), c[i].tolist())
        assert abs(sup.tv[i].item() - float(exact)) <= 1e-14 * float(exact) + 1e-300


def test_local_search_matches_exhaustive_on_small_rows(monkeypatch):
    """With the exhaustive path switched off, the local search still finds the exact sup (S = 10)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(300, 10, generator=g, dtype=torch.float64) * 3
    c = torch.rand(300, 10, generator=g, dtype=torch.float64) * torch.rand(300, 1, generator=g, dtype=torch.float64) * 3
    exact = adversary.sup_box_tv(scores, c).tv
    monkeypatch.setattr(adversary, "EXHAUSTIVE_MAX", 4)
    local = adversary.sup_box_tv(scores, c).tv
    assert (local <= exact * (1 + 1e-12)).all()
    assert (exact - local).max().item() < 1e-12


def test_cli_writes_json_report(tmp_path):
    out = tmp_path / "fuzz.json"
    assert main(["fuzz", "--trials", "3000", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["trials"] == 3000
    assert data["seed"] == 0 and data["command"] == f"witcert fuzz --trials 3000 --seed 0 --json {out}" and "CPUs" in data["machine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", data["date"])  # what the results page prints beside it
    assert all(data["bounds"][name]["violations"] == 0 for name in fuzz.CHECKED)
    for name in ("underflow", "gate-tau", "fast-path", "fast radii", "user components", "engine KV formats"):  # issues 16, 14, 28, 47
        assert data["attacks"][name]["cells"] > 0 and data["attacks"][name]["violations"] == 0


def test_the_command_runs_where_the_environment_names_no_kernel_backend(tmp_path):
    """As a user's shell runs it: no ``TRITON_INTERPRET`` set (the test run's conftest sets one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([str(Path(sys.executable).parent / "witcert"), "fuzz", "--trials", "200", "--seed", "3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 violations of any sound bound" in done.stdout
