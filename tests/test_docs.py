"""The documentation stays inside the repository and its section pointers resolve.

Implementation under test: every tracked text file (README, docs, docstrings, comments, tests,
Lean sources, scripts). Oracle: the headings of ``docs/design.md`` and the file list of the
checkout. Tolerance: exact. Domain: pointers of the form ``docs/design.md "Section"`` (the
convention of this repository) and references to design material outside it.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
OUTSIDE = ("../shared", "/work/shared", "DESIGN.md", "witcert-paper")
POINTER = re.compile(r'docs/design\.md\)?,? "([^"]+)"')


def _text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.splitlines():
        path = ROOT / name
        if path.suffix in (".py", ".md", ".lean", ".sh", ".toml", ".txt", "") and path.is_file():
            files.append(path)
    return files


def _headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", DESIGN.read_text(), re.MULTILINE)}


def test_nothing_points_outside_the_repository():
    offenders = []
    for path in _text_files():
        text = path.read_text(errors="replace")
        for marker in OUTSIDE:
            if marker in text and path != Path(__file__).resolve():
                offenders.append(f"{path.relative_to(ROOT)}: {marker}")
    assert not offenders, offenders


def test_every_design_pointer_names_a_section_of_the_design_document():
    headings = _headings()
    assert {"Mathematics", "Tier A: the band witness", "Scope of the guarantee", "Package layout"} <= headings
    missing = []
    for path in _text_files():
        if path == Path(__file__).resolve():
            continue
        for match in POINTER.finditer(path.read_text(errors="replace")):
            if match.group(1) not in headings:
                missing.append(f"{path.relative_to(ROOT)}: {match.group(1)!r}")
    assert not missing, missing
