"""Static checks of the Lean build inputs, runnable without a toolchain (docs/design.md
"Verification chain").

* No file under ``formal/`` imports all of Mathlib (a bare ``import Mathlib``): a build from
  source would compile every Mathlib module instead of the cone the proofs use.
* ``lake-manifest.json`` exists and pins what the first ``lake build`` would otherwise resolve
  itself: ``mathlib`` as a git package at the lakefile's URL, its ``inputRev`` the lakefile's tag
  and its ``rev`` the commit of that tag, and every other package at the revision Mathlib's own
  manifest names. The reference is ``formal/mathlib-manifest-<tag>.json`` (its ``_source`` field
  says where each value was read); the tag must also be the ``lean-toolchain`` version.

Usage: ``python scripts/lean_pins.py``; exit status 1 with one line per problem.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "lake-manifest.json"
REQUIRE_MATHLIB = re.compile(r'require\s+mathlib\s+from\s+git\s+"([^"]+)"\s*@\s*"([^"]+)"')
BARE_IMPORT = re.compile(r"^import\s+Mathlib\s*$", re.MULTILINE)


def bare_mathlib_imports(formal: Path) -> list[str]:
    """Files under ``formal`` with a bare ``import Mathlib`` line, as ``path:line`` strings."""
    hits = []
    for path in sorted(formal.rglob("*.lean")):
        text = path.read_text(encoding="utf-8")
        for match in BARE_IMPORT.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            hits.append(f"{path.relative_to(formal.parent)}:{line}: `import Mathlib` imports all of "
                        "Mathlib; import the modules defining the names used")
    return hits


def lakefile_mathlib_pin(lakefile_text: str) -> tuple[str, str] | None:
    """``(url, rev)`` of the lakefile's ``require mathlib from git URL @ REV``, or ``None``."""
    match = REQUIRE_MATHLIB.search(lakefile_text)
    return (match.group(1), match.group(2)) if match else None


def _load_json(path: Path) -> tuple[dict | None, str | None]:
    """The parsed JSON object at ``path``, or ``None`` and the reason it could not be read."""
    if not path.is_file():
        return None, f"{path.name} is missing"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return None, f"{path.name} is not valid JSON: {err}"
    if not isinstance(data, dict) or not isinstance(data.get("packages"), list):
        return None, f"{path.name} has no `packages` list"
    return data, None


def _mathlib_entry_problems(entry: dict | None, url: str, tag: str, commit: str) -> list[str]:
    """What is wrong with our manifest's ``mathlib`` entry, against the lakefile and the record."""
    if entry is None:
        return [f"{MANIFEST} has no `mathlib` package"]
    expected = {"type": "git", "url": url, "inputRev": tag, "rev": commit, "inherited": False}
    return [f"{MANIFEST}: mathlib {key} is {entry.get(key)!r}, expected {value!r}"
            for key, value in expected.items() if entry.get(key) != value]


def _dependency_problems(ours: dict[str, dict], theirs: list[dict]) -> list[str]:
    """Each of Mathlib's dependencies must appear in our manifest at Mathlib's url and revision."""
    problems = []
    for dep in theirs:
        mine = ours.get(dep["name"])
        if mine is None:
            problems.append(f"{MANIFEST} lacks Mathlib's dependency `{dep['name']}`")
            continue
        for key in ("url", "rev"):
            if mine.get(key) != dep[key]:
                problems.append(f"{MANIFEST}: {dep['name']} {key} is {mine.get(key)!r}, "
                                f"Mathlib's manifest names {dep[key]!r}")
    extra = set(ours) - {dep["name"] for dep in theirs} - {"mathlib"}
    problems += [f"{MANIFEST} pins `{name}`, which Mathlib's manifest does not name"
                 for name in sorted(extra)]
    return problems


def manifest_problems(root: Path = ROOT) -> list[str]:
    """Every way ``root/lake-manifest.json`` fails to pin the Mathlib the lakefile requires."""
    pin = lakefile_mathlib_pin((root / "lakefile.lean").read_text(encoding="utf-8"))
    if pin is None:
        return ["lakefile.lean has no `require mathlib from git URL @ REV`"]
    url, tag = pin
    toolchain = (root / "lean-toolchain").read_text(encoding="utf-8").strip()
    problems = [] if toolchain == f"leanprover/lean4:{tag}" else [
        f"lean-toolchain is {toolchain!r}, but the lakefile requires Mathlib {tag}"]
    record, why = _load_json(root / "formal" / f"mathlib-manifest-{tag}.json")
    if record is None:
        return problems + [f"the record of Mathlib's manifest at {tag}: {why}"]
    ours, why = _load_json(root / MANIFEST)
    if ours is None:
        return problems + [f"{why}: the first `lake build` would resolve Mathlib {tag} and its "
                           "dependencies itself"]
    by_name = {entry.get("name"): entry for entry in ours["packages"]}
    problems += _mathlib_entry_problems(by_name.get("mathlib"), url, tag, record.get("commit"))
    return problems + _dependency_problems(by_name, record["packages"])


def main() -> int:
    problems = bare_mathlib_imports(ROOT / "formal") + manifest_problems(ROOT)
    for problem in problems:
        print(f"lean_pins: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
