"""The README's "Library quick start" scripts, run as written (extracted from README.md).

Implementation: the four ``python`` blocks of that section, each executed alone in a fresh
namespace (in a temporary working directory). Oracles: each script's own assertion (the first
checks the meter against the fp64 true TV per cell), then per script: every cell's true TV at
most its meter (summary violations 0), the telemetry's tier, and the bytes saved in production
mode. The three model scripts load the embedded SmolLM2 (``@pytest.mark.model``).
"""
import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Library quick start")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_block(index: int, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(quickstart_blocks()[index], f"README.md quick start block {index}", "exec"), namespace)
    return namespace


def test_the_section_has_four_scripts():
    assert len(quickstart_blocks()) == 4


def test_tier_a_from_q_k_k_hat(tmp_path, monkeypatch, capsys):
    ns = run_block(0, tmp_path, monkeypatch)  # the script asserts true TV <= meter on every cell
    assert ns["meter"].shape == (4, 3) and (ns["true_tv"] <= ns["meter"]).all()
    assert "tensor" in capsys.readouterr().out


@pytest.mark.model
def test_monitor_around_generate(tmp_path, monkeypatch, capsys, one_thread):
    ns = run_block(1, tmp_path, monkeypatch)
    mon = ns["mon"]
    rows = mon.summary().rows
    assert len(rows) == 30 and all(r["violations"] == 0 for r in rows)
    assert ns["meters"].shape[:3] == (2, 30, 9)
    assert "violations" in capsys.readouterr().out


@pytest.mark.model
def test_monitor_with_a_callable_scheme(tmp_path, monkeypatch, one_thread):
    ns = run_block(2, tmp_path, monkeypatch)
    assert all(r["violations"] == 0 for r in ns["mon"].summary().rows)
    lines = [json.loads(line) for line in (tmp_path / "int6-cells.jsonl").read_text().splitlines()]
    assert lines and {line["tier"] for line in lines} == {"A"}


@pytest.mark.model
def test_production_mode_reports_the_bytes_saved(tmp_path, monkeypatch, capsys, one_thread):
    ns = run_block(3, tmp_path, monkeypatch)
    memory = ns["mon"].memory().total
    assert memory.exact_shadow == 0 and memory.saved > 0.5 * memory.exact_cache
    assert "saved" in capsys.readouterr().out
