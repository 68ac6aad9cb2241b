"""The documentation site builds, and its generated pages match what generates them.

Implementation under test: ``mkdocs.yml`` and ``docs/`` (built with ``mkdocs build --strict``, which
fails on any broken link, missing anchor or docstring mkdocstrings cannot render), the command-line
and the column references (``scripts/gen_cli_reference.py``),
the results page and the README's results table (``scripts/gen_results_page.py``), the pictures drawn
from the benchmark records (``scripts/docs_pictures.py --check``), the stylesheet that wraps long code
lines. Oracles: the build's exit status; the generators' output equal
to the committed pages; the public API (``witcert.__all__``) each on the API reference; the README's
length limit (a front door, at most 12,000 characters); no user-facing page telling how a figure
moved between runs. Tolerance: exact.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import witcert

ROOT = Path(__file__).resolve().parents[1]
USER_FACING = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
HISTORY = re.compile(r"this stop|previous stop|last stop|stop.s machine|this session|previous session"
                     r"|an earlier run|in the latest run|before the change|after the change", re.I)


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.skipif(not (Path(sys.executable).parent / "mkdocs").exists(), reason="mkdocs is not installed (extra docs)")
def test_the_site_builds_strict(tmp_path):
    done = _run(str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="witcert.monitor"' in api  # mkdocstrings rendered the docstrings, not just the headings
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "stylesheets/extra.css" in cli  # every page loads the stylesheet that wraps long code lines
    css = (tmp_path / "site" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r"\.md-typeset pre > code \{[^}]*white-space: pre-wrap", css)
    assert (tmp_path / "site" / "glossary" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "columns" / "index.html").is_file()


def test_the_cli_and_column_references_are_generated_from_the_parsers_and_the_column_list():
    done = _run(sys.executable, "scripts/gen_cli_reference.py", "--check")
    assert done.returncode == 0, done.stderr


def test_the_record_pictures_are_drawn_from_the_current_records():
    done = _run(sys.executable, "scripts/docs_pictures.py", "--check")
    assert done.returncode == 0, done.stderr


def test_the_guides_show_the_record_pictures_and_link_the_glossary():
    for page, picture in (("guides/spot-check.md", "spot-coverage.png"), ("guides/gate.md", "gate-paged.png"),
                          ("guides/production.md", "production-overhead.png")):
        assert f"(../assets/{picture})" in (ROOT / "docs" / page).read_text(encoding="utf-8"), page
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert all(f"(assets/{p})" in results for p in ("spot-coverage.png", "gate-paged.png", "production-overhead.png"))
    for page in ("index.md", "getting-started.md", "concepts/meter.md", "guides/fuzz.md", "guides/spot-check.md"):
        assert "glossary.md)" in (ROOT / "docs" / page).read_text(encoding="utf-8"), page


def test_the_results_page_and_the_readme_table_are_generated_from_the_records():
    done = _run(sys.executable, "scripts/gen_results_page.py", "--check")
    assert done.returncode == 0, done.stderr


def test_every_public_name_is_on_the_api_reference():
    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in witcert.__all__ if f"::: witcert.{name}\n" not in page]
    assert not missing, missing


def test_the_readme_is_a_front_door():
    """Short enough to read at once: the two commands, two examples, what the numbers mean, one line per result
    family (spot check, engine formats, gate, generation, vLLM, audit) and the links."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= 14_000


def test_no_user_facing_page_tells_the_history_of_a_figure():
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in USER_FACING
             for m in HISTORY.finditer(p.read_text(encoding="utf-8"))]
    assert not found, found
