"""Static audit of the Lean development (docs/design.md "Verification chain"), runnable without a Lean toolchain.

Implementation under test: ``scripts/gen_theorem_map.py`` (declaration parser, forbidden-token
scan, scope check, map and ``Export.lean`` rendering) applied to ``formal/`` and
``spec/registry.py``. Oracle: the registry itself (every ``lean`` name must be declared),
hand-written Lean snippets with known declarations and import graphs (the scope check must flag
exactly the uses Lean could not resolve), and the real tree with its one historical scope bug
re-introduced. Domain: every ``*.lean`` file under ``formal/``. Tolerance: exact.

The check against the pinned Mathlib (``scripts/lean_names.py``) has its own tests,
``tests/test_lean_names.py``; here ``scripts/lean_check.sh`` is checked to run it, and the theorem
map to say per theorem which checks it has passed.

The build pins (``scripts/lean_pins.py``): no bare ``import Mathlib``, and ``lake-manifest.json``
pinning Mathlib and its dependencies at the revisions of Mathlib's own manifest (oracle: the two
JSON files read directly, and copies of the tree with one pin broken at a time).

The import check of the dotted Python names (spec/torch/kernel) lives in
``tests/test_registry.py``; this file covers the Lean side and the generated map.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import re

import pytest

from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


GEN = load_script("gen_theorem_map")
REGISTRY = GEN.load_registry()
DECLS = GEN.declared_names()


# --- oracle: small Lean snippets with known declarations ------------------------------------

SNIPPET = """\
/-! # doc -/
namespace A.B

/-- d -/
theorem foo : True := trivial

-- theorem commented_out : True := trivial
/- theorem also_commented : True := trivial -/

section S
/-- d -/
@[simp] lemma bar : True := trivial
end S

namespace C
/-- d -/
def baz : Nat := 0
end C

theorem undocumented : True := trivial
/-- d -/
theorem _root_.top_level : True := trivial
end A.B
"""


def _parse_snippet(tmp_path: Path, text: str):
    path = tmp_path / "Snippet.lean"
    path.write_text(text, encoding="utf-8")
    return {d.name: d for d in GEN.parse_declarations(path)}


def test_parser_qualifies_names_by_namespace(tmp_path):
    decls = _parse_snippet(tmp_path, SNIPPET)
    assert set(decls) == {"A.B.foo", "A.B.bar", "A.B.C.baz", "A.B.undocumented", "top_level"}


def test_parser_flags_missing_docstring(tmp_path):
    decls = _parse_snippet(tmp_path, SNIPPET)
    assert not decls["A.B.undocumented"].documented
    assert all(d.documented for n, d in decls.items() if n != "A.B.undocumented")


@pytest.mark.parametrize("token", GEN.FORBIDDEN_TOKENS)
def test_forbidden_scan_detects_each_token(tmp_path, token):
    (tmp_path / "Bad.lean").write_text(f"theorem t : True := by {token}\n", encoding="utf-8")
    hits = [h for h in _scan(tmp_path)]
    assert any(h.endswith(token) for h in hits)


def _scan(formal: Path) -> list[str]:
    # forbidden_hits reports paths relative to the repository root; tmp_path is outside it
    root = GEN.ROOT
    GEN.ROOT = formal
    try:
        return GEN.forbidden_hits(formal)
    finally:
        GEN.ROOT = root


# --- oracle: the scope check on small import graphs ------------------------------------

DECL_A = """\
/-! # A -/
namespace WitCert

/-- d -/
theorem foo : True := trivial

namespace Core
/-- d -/
theorem deep : True := trivial
end Core

end WitCert
"""


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    """A throwaway ``formal/`` (the srcDir) holding ``files`` (module path -> text)."""
    formal = tmp_path / "formal"
    for module, text in files.items():
        path = formal / (module.replace(".", "/") + ".lean")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return formal


def _user(imports: str, body: str) -> str:
    return f"{imports}\n\n/-! # user -/\n\n{body}\n"


USE_UNQUALIFIED = "namespace WitCert\n\n/-- d -/\ntheorem bar : True := foo\n\nend WitCert"


def test_scope_flags_a_name_declared_in_a_module_not_imported(tmp_path):
    # B uses `foo` (declared in A) but imports only C, which does not import A: the MaxNorm bug
    formal = _project(tmp_path, {
        "WitCert.A": DECL_A,
        "WitCert.C": "import Mathlib\n\n/-! # C -/\n",
        "WitCert.B": _user("import WitCert.C", USE_UNQUALIFIED),
    })
    problems = GEN.scope_problems(formal)
    assert len(problems) == 1
    assert "formal/WitCert/B.lean:8" in problems[0]
    assert "`foo` is WitCert.foo (WitCert.A)" in problems[0]


def test_scope_accepts_a_transitive_import(tmp_path):
    formal = _project(tmp_path, {
        "WitCert.A": DECL_A,
        "WitCert.C": "import WitCert.A\n\n/-! # C -/\n",
        "WitCert.B": _user("import WitCert.C", USE_UNQUALIFIED),
    })
    assert GEN.scope_problems(formal) == []


@pytest.mark.parametrize("body", [
    "/-- d -/\ntheorem bar : True := WitCert.foo",                      # fully qualified
    "open WitCert\n\n/-- d -/\ntheorem bar : True := foo",              # opened namespace
    "namespace WitCert\n/-- d -/\ntheorem bar : True := Core.deep\nend WitCert",  # relative
    "/-- d -/\ntheorem bar : True := _root_.WitCert.Core.deep",          # _root_
    "/-- d -/\ntheorem bar : True := (@WitCert.foo)",                    # @-explicit
    "/-- d -/\ntheorem bar : 0 < 1 := WitCert.foo.elim",                 # dotted use
])
def test_scope_resolves_qualified_opened_and_dotted_names(tmp_path, body):
    missing = _project(tmp_path / "missing", {"WitCert.A": DECL_A,
                                               "WitCert.B": _user("import Mathlib", body)})
    assert len(GEN.scope_problems(missing)) == 1, body
    present = _project(tmp_path / "present", {"WitCert.A": DECL_A,
                                               "WitCert.B": _user("import WitCert.A", body)})
    assert GEN.scope_problems(present) == [], body


def test_scope_ignores_comments_unrelated_names_and_other_namespaces(tmp_path):
    body = (
        "-- foo is mentioned in a comment\n/- and foo here -/\n"
        "namespace Other\n/-- the docstring names `foo` -/\n"
        "theorem bar (h : True) : True := h\nend Other"
    )
    formal = _project(tmp_path, {"WitCert.A": DECL_A, "WitCert.B": _user("import Mathlib", body)})
    assert GEN.scope_problems(formal) == []


def test_scope_flags_field_notation_on_a_local(tmp_path):
    decl = "/-! # A -/\nnamespace WitCert\n/-- d -/\ntheorem Foo.twist (x : Nat) : x = x := rfl\nend WitCert\n"
    body = "namespace WitCert\n/-- d -/\ntheorem bar (f : Foo) : 1 = 1 := f.twist\nend WitCert"
    formal = _project(tmp_path, {"WitCert.A": decl, "WitCert.B": _user("import Mathlib", body)})
    problems = GEN.scope_problems(formal)
    assert len(problems) == 1 and "`f.twist`" in problems[0]


def test_scope_flags_missing_modules_and_cycles(tmp_path):
    formal = _project(tmp_path, {
        "WitCert.A": "import WitCert.B\n/-! # A -/\n",
        "WitCert.B": "import WitCert.A\nimport WitCert.Gone\n/-! # B -/\n",
    })
    problems = GEN.scope_problems(formal)
    assert any("imports WitCert.Gone, which has no file" in p for p in problems)
    assert any(p.startswith("import cycle: WitCert.A -> WitCert.B -> WitCert.A") for p in problems)


def test_scope_check_catches_the_historical_maxnorm_import_bug(tmp_path):
    # the real tree with MaxNorm importing only Reweight again (before the fix of issue 19)
    formal = tmp_path / "formal"
    shutil.copytree(ROOT / "formal", formal)
    maxnorm = formal / "WitCert" / "MaxNorm.lean"
    text = maxnorm.read_text(encoding="utf-8")
    assert text.startswith("import WitCert.EForm\n")
    maxnorm.write_text(text.replace("import WitCert.EForm\n", "import WitCert.Reweight\n", 1),
                       encoding="utf-8")
    problems = GEN.scope_problems(formal)
    assert problems and all("MaxNorm.lean" in p for p in problems)
    assert any("`partition_pos` is WitCert.partition_pos (WitCert.EForm)" in p for p in problems)


# --- the real development -------------------------------------------------------------------


def test_no_forbidden_tokens_in_formal():
    assert GEN.forbidden_hits() == []


@pytest.mark.parametrize("row", REGISTRY.THEOREMS, ids=lambda r: r.key)
def test_registry_lean_name_is_declared(row):
    if row.lean is None:
        assert row.note, f"{row.key}: lean=None needs a note saying why it is not a theorem"
    else:
        assert row.lean in DECLS, f"{row.key}: {row.lean} is not declared in formal/"
        assert DECLS[row.lean].kind in ("theorem", "lemma")


@pytest.mark.parametrize("row", REGISTRY.THEOREMS, ids=lambda r: r.key)
def test_names_quoted_in_notes_are_declared(row):
    for name in GEN.note_lean_names(row.note):
        assert name in DECLS, f"{row.key}: note quotes {name}, not declared in formal/"


def test_every_project_name_is_in_scope():
    assert GEN.scope_problems() == []


def test_every_lean_file_is_reachable_from_the_root_module():
    assert GEN.unreachable_modules() == []


def test_a_module_missing_from_the_root_is_flagged(tmp_path):
    formal = _project(tmp_path, {"WitCert": "import WitCert.A\n/-! # root -/\n",
                                 "WitCert.A": DECL_A, "WitCert.Orphan": "/-! # orphan -/\n"})
    assert GEN.unreachable_modules(formal) == ["WitCert.Orphan"]


def _signature(name: str) -> str:
    """The text of a declaration's statement (from its keyword to its `:=`)."""
    decl = DECLS[name]
    lines = GEN.strip_comments(decl.path.read_text(encoding="utf-8")).splitlines()
    text = "\n".join(lines[decl.line - 1:])
    return text[: text.index(":=")]


def test_tier_b_radius_assumes_the_dither_model_not_tail_bounds():
    # TB's hypotheses: the laws (IdentDistrib to the grid law) and independence; no tail bound
    signature = _signature(REGISTRY.by_key("TB").lean)
    assert "IdentDistrib (U t c) id μ (gridCell N)" in signature
    assert "iIndepFun (U t) μ" in signature
    for tail_hypothesis in ("Real.exp", "HasSubgaussianMGF", "htail"):
        assert tail_hypothesis not in signature


def test_every_declaration_is_documented():
    undocumented = [f"{d.path.name}:{d.line} {d.name}" for d in DECLS.values() if not d.documented]
    assert undocumented == []


def test_core_layer_imports_nothing():
    core = sorted((ROOT / "formal" / "WitCert" / "Core").glob("*.lean"))
    assert core, "formal/WitCert/Core/ holds the dependency-free layer"
    for path in core:
        imports = [l for l in path.read_text(encoding="utf-8").splitlines() if l.startswith("import")]
        assert imports == [], f"{path.name} must import nothing (core Lean only): {imports}"


def test_theorem_map_is_generated_from_registry():
    expected = GEN.render_map(REGISTRY, DECLS)
    actual = GEN.MAP_PATH.read_text(encoding="utf-8")
    assert actual == expected, "docs/theorem_map.md is stale: python scripts/gen_theorem_map.py --write"


def test_export_lists_every_registered_theorem():
    text = GEN.EXPORT_PATH.read_text(encoding="utf-8")
    assert text == GEN.render_export(REGISTRY)
    for row in REGISTRY.THEOREMS:
        if row.lean:
            assert f"#print axioms {row.lean}\n" in text


def test_toolchain_and_mathlib_pins():
    assert (ROOT / "lean-toolchain").read_text().strip() == "leanprover/lean4:v4.31.0"
    lakefile = (ROOT / "lakefile.lean").read_text(encoding="utf-8")
    assert '@ "v4.31.0"' in lakefile
    assert "lean_lib WitCertCore" in lakefile and "lean_lib WitCert " in lakefile


def test_lean_check_script_passes_without_lake():
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    if shutil.which("lake", path=env["PATH"]):
        pytest.skip("lake is installed: the script would build instead of reporting")
    result = subprocess.run(
        ["bash", "scripts/lean_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )
    lines = result.stdout.splitlines()
    assert "Lean proofs were NOT checked: lake not found on PATH" in lines
    assert any(line.startswith("lean_names: ok (") for line in lines), result.stdout
    assert result.returncode == 0, result.stderr


def test_theorem_map_says_which_checks_each_theorem_passed():
    # oracle: the registry's lean_checks; a theorem without a forge build is "never compiled"
    text = GEN.MAP_PATH.read_text(encoding="utf-8")
    for row in REGISTRY.THEOREMS:
        line = next(l for l in text.splitlines() if l.startswith(f"| {row.key} |"))
        if row.lean is None:
            assert "static check" not in line
            continue
        assert REGISTRY.STATIC_CHECK in row.lean_checks, row.key
        assert REGISTRY.STATIC_CHECK in line
        assert ("never compiled" in line) == (REGISTRY.FORGE_BUILD not in row.lean_checks)


# --- the build pins: targeted imports and the committed manifest (scripts/lean_pins.py) ----------

PINS = load_script("lean_pins")
# Mathlib's tag v4.31.0 is commit fabf563a7c95a166b8d7b6efca11c8b4dc9d911f ("chore: bump toolchain
# to v4.31.0 (#40633)", 2026-06-15), as recorded by independent downstream projects pinned to it;
# formal/mathlib-manifest-v4.31.0.json says why it is a record and not a byte copy.
MATHLIB_V4_31_0 = "fabf563a7c95a166b8d7b6efca11c8b4dc9d911f"


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_no_file_imports_all_of_mathlib():
    assert PINS.bare_mathlib_imports(ROOT / "formal") == []


def test_bare_mathlib_import_is_flagged_and_targeted_imports_are_not(tmp_path):
    formal = _project(tmp_path, {
        "WitCert.A": "import Mathlib.Tactic.Ring\nimport Mathlib\n\n/-! # A -/\n",
        "WitCert.B": "import Mathlib.Analysis.SpecialFunctions.Exp\n/-! # B, mentions import Mathlib -/\n",
    })
    hits = PINS.bare_mathlib_imports(formal)
    assert len(hits) == 1 and hits[0].startswith("formal/WitCert/A.lean:2:")


def test_manifest_pins_mathlib_and_its_dependencies_at_mathlibs_revisions():
    # oracle: the two files read directly, independent of the checker
    ours = {p["name"]: p for p in _json(ROOT / "lake-manifest.json")["packages"]}
    record = _json(ROOT / "formal" / "mathlib-manifest-v4.31.0.json")
    assert record["tag"] == "v4.31.0" and record["commit"] == MATHLIB_V4_31_0
    assert ours["mathlib"]["rev"] == MATHLIB_V4_31_0
    assert ours["mathlib"]["inputRev"] == "v4.31.0" and ours["mathlib"]["type"] == "git"
    theirs = {p["name"]: p for p in record["packages"]}
    assert set(ours) == set(theirs) | {"mathlib"}
    for name, dep in theirs.items():
        assert (ours[name]["url"], ours[name]["rev"]) == (dep["url"], dep["rev"]), name
        assert ours[name]["inherited"] is True, name


def test_manifest_check_passes_on_the_real_tree():
    assert PINS.manifest_problems() == []


def _pinned_tree(tmp_path: Path) -> Path:
    """A throwaway root holding copies of the lakefile, toolchain, manifest and Mathlib record."""
    for name in ("lakefile.lean", "lean-toolchain", "lake-manifest.json",
                 "formal/mathlib-manifest-v4.31.0.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _edit_manifest(root: Path, edit) -> None:
    path = root / "lake-manifest.json"
    manifest = _json(path)
    edit({p["name"]: p for p in manifest["packages"]}, manifest)
    path.write_text(json.dumps(manifest), encoding="utf-8")


def test_missing_manifest_is_flagged(tmp_path):
    root = _pinned_tree(tmp_path)
    (root / "lake-manifest.json").unlink()
    problems = PINS.manifest_problems(root)
    assert len(problems) == 1 and problems[0].startswith("lake-manifest.json is missing")


@pytest.mark.parametrize("edit, expected", [
    (lambda by, m: by["mathlib"].update(rev="0" * 40), "mathlib rev is '" + "0" * 40),
    (lambda by, m: by["mathlib"].update(inputRev="master"), "mathlib inputRev is 'master'"),
    (lambda by, m: by["batteries"].update(rev="1" * 40), "batteries rev is '" + "1" * 40),
    (lambda by, m: m["packages"].remove(by["aesop"]), "lacks Mathlib's dependency `aesop`"),
    (lambda by, m: m["packages"].append(dict(by["Qq"], name="extra")), "pins `extra`"),
])
def test_mismatched_manifest_is_flagged(tmp_path, edit, expected):
    root = _pinned_tree(tmp_path)
    _edit_manifest(root, edit)
    problems = PINS.manifest_problems(root)
    assert len(problems) == 1 and expected in problems[0], problems


def test_toolchain_other_than_the_mathlib_tag_is_flagged(tmp_path):
    root = _pinned_tree(tmp_path)
    (root / "lean-toolchain").write_text("leanprover/lean4:v4.30.0\n", encoding="utf-8")
    problems = PINS.manifest_problems(root)
    assert problems == ["lean-toolchain is 'leanprover/lean4:v4.30.0', but the lakefile requires "
                        "Mathlib v4.31.0"]


# --- every Lean name the code and docs cite is declared ------------------------------------

CITED = re.compile(r"``(WitCert\.[A-Za-z_][A-Za-z0-9_'.]*)``|`(WitCert\.[A-Za-z_][A-Za-z0-9_'.]*)`")
CITING = ("witcert", "spec", "kernels", "contracts", "docs", "benchmarks", "README.md")


def _citations() -> list[tuple[str, str]]:
    """``(file:line, name)`` for every ``WitCert.<name>`` written in backticks in code or user docs."""
    found = []
    for root in CITING:
        paths = [ROOT / root] if root.endswith(".md") else sorted((ROOT / root).rglob("*"))
        for path in paths:
            if path.suffix not in (".py", ".md") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for match in CITED.finditer(line):
                    found.append((f"{path.relative_to(ROOT)}:{number}", (match[1] or match[2]).rstrip(".")))
    return found


def test_every_cited_lean_name_is_declared():
    citations = _citations()
    assert len(citations) > 20  # the scan reads the files that cite theorems
    missing = [f"{where}: {name}" for where, name in citations if name not in DECLS and name != "WitCert"]
    assert not missing, "Lean names cited but declared nowhere in formal/:\n" + "\n".join(missing)
