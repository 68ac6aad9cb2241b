"""The static check of ``formal/`` against the pinned Mathlib (docs/verification.md, "The static
check against the pinned Mathlib").

Implementation under test: ``scripts/mathlib_translate.py`` (Mathlib's ``to_additive``/``to_dual``
name guessing), ``scripts/lean_syntax.py`` (comments, commands, binders, explicit arity),
``scripts/mathlib_index.py`` (the committed index and the script that rebuilds it) and
``scripts/lean_names.py`` (the checker run by ``scripts/lean_check.sh``).

Oracles: the ``guessName`` examples of Mathlib's own test file
(``MathlibTest/Attribute/ToAdditive/Basic.lean`` at the pinned commit); facts read in Mathlib's
source at the pinned commit ``fabf563a`` (file and line quoted per test); the two build errors of
issue 46 on the old text of ``Reweight.lean`` and ``TierB.lean`` (kept in ``tests/fixtures/lean/``);
small Lean projects whose errors are known by construction. Domain: every Lean file under
``formal/``. Tolerance: exact.
"""
from __future__ import annotations

import json
import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "lean"


T = load_script("mathlib_translate")
L = load_script("lean_syntax")
MI = load_script("mathlib_index")
N = load_script("lean_names")
INDEX = MI.load(MI.index_path(N.mathlib_tag()))


# --- to_additive / to_dual names (oracle: Mathlib's own guessName tests) -------------------------

GUESS_NAME_EXAMPLES = [
    ("HMul_Eq_LEOne_Conj₂MulLT'", "HAdd_Eq_Nonpos_Conj₂AddLT'"),
    ("OneMulSMulInvDivPow", "ZeroAddVAddNegSubNSMul"),
    ("ProdFinprodNPowZPow", "SumFinsumNSMulZSMul"),
    ("comm_mul_CommMul_commMul", "comm_add_AddComm_addComm"),
    ("mul_comm_MulComm_mulComm", "add_comm_AddComm_addComm"),
    ("CommMonoid", "AddCommMonoid"), ("commMonoid", "addCommMonoid"),
    ("CancelCommMonoid", "AddCancelCommMonoid"), ("cancelCommMonoid", "addCancelCommMonoid"),
    ("CancelMonoid", "AddCancelMonoid"), ("cancelMonoid", "addCancelMonoid"),
    ("RightCancelMonoid", "AddRightCancelMonoid"), ("rightCancelMonoid", "addRightCancelMonoid"),
    ("LeftCancelMonoid", "AddLeftCancelMonoid"), ("leftCancelMonoid", "addLeftCancelMonoid"),
    ("IsLeftRegular", "IsAddLeftRegular"), ("isRightRegular", "isAddRightRegular"),
    ("IsRegular", "IsAddRegular"), ("LTOne_LEOne_OneLE_OneLT", "Neg_Nonpos_Nonneg_Pos"),
    ("LTHMulHPowLEHDiv", "LTHAddHSMulLEHSub"), ("OneLEHMul", "NonnegHAdd"),
    ("OneLTHPow", "PosHSMul"), ("OneLTPow", "PosNSMul"), ("instCoeTCOneHom", "instCoeTCZeroHom"),
    ("instCoeTOneHom", "instCoeTZeroHom"), ("instCoeOneHom", "instCoeZeroHom"),
    ("invFun_eq_symm", "invFun_eq_symm"), ("MulEquiv.symmInvFun", "AddEquiv.symmInvFun"),
    ("IsScalarTower", "VAddAssocClass"), ("isScalarTower", "vaddAssocClass"),
    ("eventuallyLE_one_mul_atBot", "eventuallyLE_zero_add_atBot"),
]


@pytest.mark.parametrize("src, expected", GUESS_NAME_EXAMPLES)
def test_guess_name_matches_mathlibs_own_examples(src, expected):
    assert T.guess_name(T.ADDITIVE, src) == expected


def test_target_name_translates_the_namespace_and_honours_explicit_targets():
    assert T.target_name(T.ADDITIVE, "Finset.prod_range_div", None, {}) == "Finset.sum_range_sub"
    assert T.target_name(T.ADDITIVE, "one_le", "zero_le", {}) == "zero_le"
    assert T.target_name(T.ADDITIVE, "Submonoid.one_mem", None,
                         {"Submonoid": "AddSubmonoid"}) == "AddSubmonoid.zero_mem"
    assert T.target_name(T.DUAL, "LT.lt.ne", "ne'", {}) == "LT.lt.ne'"
    assert T.target_name(T.DUAL, "Foo.le_sup", "_root_.bar", {}) == "bar"


# --- reading Lean text --------------------------------------------------------------------------


def test_comments_and_string_contents_are_blanked_in_place():
    text = 'def s := "a -- b" -- c\n/- x /- y -/ z -/ theorem t : True := trivial\n'
    code = L.blank_comments(text)
    assert len(code) == len(text) and code.count("\n") == 2
    assert "theorem t : True := trivial" in code
    assert all(word not in code for word in ("a --", " c", "x", "z"))
    assert '""' not in code and code.count('"') == 2


def test_attributes_on_their_own_line_belong_to_the_declaration():
    code = "@[to_additive (attr := simp)\n  zero_le]\ntheorem one_le : 1 ≤ a := x\n\n| not a command\n"
    commands = L.split_commands(code)
    assert len(commands) == 1 and commands[0].line == 1 and "theorem one_le" in commands[0].text


def test_end_with_a_dotted_name_closes_as_many_scopes():
    assert L.scopes_closed_by_end("Finset.Filter", ["Finset", "Filter"]) == 2
    assert L.scopes_closed_by_end("", ["WitCert", ""]) == 1
    assert L.scopes_closed_by_end("A.B", ["X", "A.B"]) == 1


def _arity(statement: str, binders: str = "", before: int = 0):
    tokens = L.tokenize(statement)
    kinds = L.binder_kinds_of_types(
        [L.Binder(n, "i", t) for n, t in (b.split(":") for b in binders.split(";") if b)])
    return L.extra_explicit_arity(tokens, kinds, before)


@pytest.mark.parametrize("statement, binders, before, expected", [
    ("0 ≤ a", "α:Type *;a:α", 0, 0),                 # zero_le: no argument can fix `α`
    ("0 ≤ a", "α:Type *;a:α", 1, None),              # an earlier argument may make `α` a function type
    ("a ≤ b → b ≤ c → a ≤ c", "a:ℝ;b:ℝ;c:ℝ", 0, 2),
    ("∀ x ∈ s, f x = g x", "", 0, 2),
    ("pure ≤ 𝓝", "", 0, None),                       # an order on functions unfolds to a `∀`
    ("f ≤ g", "f:ι → ℝ;g:ι → ℝ", 0, None),
    ("b * ∑ i ∈ s, f i = ∑ i ∈ s, b * f i", "", 0, 0),
    ("|∑ i ∈ s, f i| ≤ ∑ i ∈ s, |f i|", "", 0, 0),
    ("a ≠ b", "", 0, None), ("¬a < 1", "", 0, None), ("s ⊆ t", "", 0, None),
    ("HasSum f a", "", 0, None), ("x ∈ s ↔ p x", "", 0, 0), ("∃ x, p x", "", 0, 0),
])
def test_explicit_arity_of_a_statement(statement, binders, before, expected):
    assert _arity(statement, binders, before) == expected


# --- the committed index (oracle: Mathlib's source at the pinned commit) ---------------------------


def test_index_is_of_the_pinned_commits_and_small():
    manifest = {p["name"]: p for p in json.loads((ROOT / "lake-manifest.json").read_text())["packages"]}
    assert INDEX.header["mathlib"] == manifest["mathlib"]["rev"]
    assert INDEX.header["batteries"] == manifest["batteries"]["rev"]
    assert INDEX.header["tag"] == N.mathlib_tag() == "v4.31.0"
    assert MI.index_path("v4.31.0").stat().st_size < 4_000_000


def _one(name: str):
    hits = INDEX.names[name]
    assert len(hits) == 1, hits
    return hits[0]


def test_index_facts_read_at_the_pin():
    # Mathlib/Algebra/BigOperators/Field.lean:26
    # `lemma Finset.sum_div (s : Finset ι) (f : ι → K) (a : K) : (∑ i ∈ s, f i) / a = ∑ i ∈ s, f i / a`
    d = _one("Finset.sum_div")
    assert (d.module, d.line, d.max_explicit) == ("Mathlib.Algebra.BigOperators.Field", 26, 3)
    assert "Mathlib.Algebra.BigOperators.Ring.Finset" in INDEX.imports[d.module]
    # Mathlib/Algebra/Order/IsBotOne.lean:37-38 `@[to_additive (attr := simp) zero_le]
    # theorem one_le {a : α} : 1 ≤ a`, and `@[deprecated ...] alias zero_le' := zero_le`
    d = _one("zero_le")
    assert (d.module, d.line, d.max_explicit, "g" in d.flags) == (
        "Mathlib.Algebra.Order.IsBotOne", 38, 0, True)
    assert "d" in _one("zero_le'").flags
    # Mathlib/Algebra/BigOperators/Group/Finset/Basic.lean:896 `@[to_additive] lemma
    # prod_range_div (f : ℕ → G) (n : ℕ)` generates `Finset.sum_range_sub`
    assert _one("Finset.sum_range_sub").max_explicit == 2
    # Mathlib/Order/Basic.lean:147 `@[to_dual ne'] alias LT.lt.ne := ne_of_lt`
    assert "LT.lt.ne'" in INDEX.names
    # Mathlib/MeasureTheory/Measure/MeasureSpaceDef.lean:358 `export MeasureSpace (volume)`
    assert _one("MeasureTheory.volume").module == "Mathlib.MeasureTheory.Measure.MeasureSpaceDef"
    # Mathlib/Data/Finset/Filter.lean:127, after `end Finset.Filter` and a `namespace Mathlib.Meta`
    assert _one("Finset.mem_filter").line == 127


# --- the checker on the real tree and on the old text -------------------------------------------


UNIVERSE = N.load_universe(index=INDEX)


def test_the_development_passes():
    assert N.check(N.FORMAL, UNIVERSE) == []


def _copy_formal(tmp_path: Path) -> Path:
    formal = tmp_path / "formal"
    shutil.copytree(ROOT / "formal", formal)
    return formal


def test_both_errors_of_issue_46_are_caught_on_the_old_text(tmp_path):
    formal = _copy_formal(tmp_path)
    shutil.copy(FIXTURES / "Reweight_before_issue46.lean", formal / "WitCert" / "Reweight.lean")
    shutil.copy(FIXTURES / "TierB_before_issue46.lean", formal / "WitCert" / "TierB.lean")
    problems = N.check(formal, N.load_universe(formal, INDEX))
    sum_div = [p for p in problems if "`Finset.sum_div` is Finset.sum_div "
               "(Mathlib.Algebra.BigOperators.Field:26), not in the import closure" in p]
    zero_le = [p for p in problems if "`zero_le` is applied to 1 explicit arguments but takes at "
               "most 0 (Mathlib.Algebra.Order.IsBotOne:38)" in p]
    assert len(problems) == len(sum_div) + len(zero_le), problems
    by_file = sorted(p.split(":")[0].rsplit("/", 1)[1] for p in sum_div)
    assert by_file == ["MassSplit.lean"] * 3 + ["Reweight.lean", "TwoSided.lean"]
    assert "formal/WitCert/Reweight.lean:70:" in " ".join(sum_div)
    assert sorted(p.split(":")[1] for p in zero_le) == ["108", "125"]


# --- the checker on small projects with known errors ---------------------------------------------


def _project(tmp_path: Path, body: str, imports: str = "import Mathlib.Order.Basic") -> list[str]:
    formal = tmp_path / "formal"
    (formal / "WitCert").mkdir(parents=True)
    (formal / "WitCert" / "A.lean").write_text(f"{imports}\n\n/-! # A -/\n\n{body}\n",
                                                encoding="utf-8")
    return N.check(formal, N.load_universe(formal, INDEX))


def test_an_import_that_is_not_a_module_at_the_pin_is_flagged(tmp_path):
    problems = _project(tmp_path, "", "import Mathlib.Order.Basic\nimport Mathlib.Order.NoSuchFile")
    assert problems == ["formal/WitCert/A.lean: imports Mathlib.Order.NoSuchFile, which is not "
                        "a module at the pin"]


def test_a_name_outside_the_import_closure_is_flagged(tmp_path):
    body = "theorem x : (∑ i ∈ s, f i) / a = 0 := by rw [Finset.sum_div]"
    problems = _project(tmp_path, body)
    assert len(problems) == 1 and "`Finset.sum_div` is Finset.sum_div" in problems[0]
    assert _project(tmp_path / "ok", body, "import Mathlib.Algebra.BigOperators.Field") == []


def test_a_deprecated_name_is_flagged(tmp_path):
    problems = _project(tmp_path, "theorem x (a : ℕ) : 0 ≤ a := zero_le'",
                        "import Mathlib.Algebra.Order.IsBotOne")
    assert len(problems) == 1 and "`zero_le'` is deprecated at the pin" in problems[0]


def test_a_dotted_name_declared_nowhere_is_flagged(tmp_path):
    problems = _project(tmp_path, "theorem x : True := by exact Finset.sum_div_nonexistent")
    assert problems == ["formal/WitCert/A.lean:5: `Finset.sum_div_nonexistent` is not declared "
                        "at the pin (nor in formal/ or core Lean)"]


def test_over_application_of_a_project_lemma_is_flagged_and_named_arguments_are_not(tmp_path):
    body = ("namespace WitCert\n\n/-- d -/\ntheorem two (a b : ℝ) (h : a ≤ b) : a ≤ b := h\n\n"
            "theorem use1 (a b : ℝ) (h : a ≤ b) : a ≤ b := two a b h\n"
            "theorem use2 (a b : ℝ) (h : a ≤ b) : a ≤ b := (two (a := a) b h)\n"
            "theorem use3 (a b : ℝ) (h : a ≤ b) : a ≤ b := two a b h h\n\nend WitCert")
    problems = _project(tmp_path, body)
    assert problems == ["formal/WitCert/A.lean:12: `two` is applied to 4 explicit arguments but "
                        "takes at most 3 (WitCert.A:8)"]


def test_scoping_opens_locals_and_projections_are_followed(tmp_path):
    body = (
        "open MeasureTheory in\n"
        "theorem x {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) (s t : Set Ω) (h : s ⊆ t) :\n"
        "    μ s ≤ μ t := measure_mono h\n\n"
        # a local named like a Mathlib declaration, and dot notation on a local: not references
        "theorem y (sq : ℕ) (h : sq = 1) : sq = 1 := h.trans rfl\n"
    )
    assert _project(tmp_path, body, "import Mathlib.MeasureTheory.Measure.MeasureSpaceDef") == []
    # without the `open`, `measure_mono` is not a name of this scope (an unqualified miss is not
    # reported: it may be a local or a core name)
    assert _project(tmp_path / "b", body.replace("open MeasureTheory in\n", ""),
                    "import Mathlib.MeasureTheory.Measure.MeasureSpaceDef") == []


# --- rebuilding the index -------------------------------------------------------------------------


def _git_repo(path: Path, files: dict[str, str]) -> str:
    """A git repository at ``path`` holding ``files``; its commit."""
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "pin"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, check=True, env=env,
                          capture_output=True, text=True).stdout.strip()


def test_the_index_is_rebuilt_reproducibly_from_pinned_sources(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    mathlib = _git_repo(tmp_path / "mathlib", {
        "Mathlib/Foo.lean": "module\npublic import Batteries.Bar\n\nnamespace Foo\n"
                            "variable {α : Type*} (a : α)\n\n@[to_additive (attr := simp)]\n"
                            "theorem prod_one_le : a = a := rfl\nend Foo\n",
        "Mathlib.lean": "import Mathlib.Foo\n"})
    batteries = _git_repo(tmp_path / "batteries", {"Batteries/Bar.lean": "def Bar.baz := 1\n"})
    root = tmp_path / "root"
    root.mkdir()
    (root / "lake-manifest.json").write_text(json.dumps({"packages": [
        {"name": "mathlib", "rev": mathlib, "inputRev": "v0.0.1"},
        {"name": "batteries", "rev": batteries}]}), encoding="utf-8")
    first = MI.build(tmp_path / "mathlib" / ".git", tmp_path / "batteries" / ".git", root)
    second = MI.build(tmp_path / "mathlib" / ".git", tmp_path / "batteries" / ".git", root)
    assert first == second
    path = tmp_path / "index.tsv.xz"
    path.write_bytes(first)
    index = MI.load(path)
    assert index.imports["Mathlib.Foo"] == ["Batteries.Bar"]
    assert index.names["Foo.prod_one_le"][0].max_explicit == 1  # the section variable `(a : α)`
    assert index.names["Foo.sum_nonneg"][0].flags == "g"  # `zero_le` abbreviates to `nonneg`
    assert "Bar.baz" in index.names and index.header["mathlib"] == mathlib
    assert lzma.decompress(first).decode().startswith("# witcert-mathlib-index 1 ")
