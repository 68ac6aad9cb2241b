"""Generate and audit the paper-to-Lean map (docs/design.md "Verification chain").

``spec/registry.py`` is the single source: this script renders ``docs/theorem_map.md``
(paper item -> Lean declaration -> spec mirror -> implementation -> kernel -> tests) and
``formal/Export.lean`` (prints every registered statement and its axioms), and audits
``formal/`` statically:

* no forbidden token (``sorry``, ``admit``, ``axiom``, ``sorryAx``, ``native_decide``,
  ``implemented_by``) in any Lean source;
* every registry ``lean`` name, and every ``WitCert.*`` name quoted in a ``note``, is declared in
  ``formal/`` (declarations are parsed with their namespaces);
* every declaration carries a ``/-- -/`` docstring and every file a ``/-! -/`` module doc;
* scope: every project import names a file under ``formal/``, the project import graph has no
  cycle, and every identifier that resolves to a declaration of ``formal/`` (after Lean's name
  resolution through the enclosing ``namespace`` blocks, ``open`` commands, dotted names and
  ``_root_``) is declared in the file itself or in a module it imports, directly or
  transitively (``scope_problems``; this is the check that ``lake build`` would otherwise be
  the first to fail), and every module is imported by the root ``formal/WitCert.lean``;
* the map and ``Export.lean`` equal what this script renders.

The audit needs no Lean toolchain; ``scripts/lean_check.sh`` runs it in CI.

Usage::

    python scripts/gen_theorem_map.py --write   # regenerate docs/theorem_map.md, formal/Export.lean
    python scripts/gen_theorem_map.py --check   # audit; exit status 1 and a list of problems if any
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
FORMAL = ROOT / "formal"
REGISTRY_PATH = ROOT / "spec" / "registry.py"
MAP_PATH = ROOT / "docs" / "theorem_map.md"
EXPORT_PATH = FORMAL / "Export.lean"

FORBIDDEN_TOKENS = ("sorry", "admit", "axiom", "sorryAx", "native_decide", "implemented_by")
ALLOWED_AXIOMS = ("propext", "Classical.choice", "Quot.sound")
DECL_KINDS = ("theorem", "lemma", "def", "abbrev", "structure", "class", "inductive", "instance")
_MODIFIERS = ("private", "protected", "noncomputable", "nonrec", "partial", "unsafe")
_DECL_RE = re.compile(
    r"^(?:@\[[^\]]*\]\s*)?(?:(?:" + "|".join(_MODIFIERS) + r")\s+)*"
    r"(" + "|".join(DECL_KINDS) + r")\s+([^\s(:{\[]+)"
)
_NOTE_NAME_RE = re.compile(r"`(WitCert\.[A-Za-z0-9_.']+)`")
_IMPORT_RE = re.compile(r"^(?:(?:public|private|meta)\s+)*import\s+(\S+)")
# A Lean identifier, possibly dotted, not itself the tail of a projection (`x.foo`, `h.1`).
_IDENT_PART = r"[^\W\d][\w'!?]*"
_IDENT_RE = re.compile(r"(?<![\w.'])(" + _IDENT_PART + r"(?:\." + _IDENT_PART + r")*)")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


@dataclass(frozen=True)
class LeanDecl:
    """One declaration found in ``formal/``: fully qualified name, kind, file, line."""

    name: str
    kind: str
    path: Path
    line: int
    documented: bool


# --- registry -------------------------------------------------------------------------------


def load_registry(path: Path = REGISTRY_PATH) -> ModuleType:
    """Import ``spec/registry.py`` by path (it depends on the standard library only)."""
    spec = importlib.util.spec_from_file_location("_witcert_registry", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the registry from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def note_lean_names(note: str) -> list[str]:
    """``WitCert.*`` declarations quoted in backticks in a registry note."""
    return _NOTE_NAME_RE.findall(note)


# --- Lean source parsing --------------------------------------------------------------------


def lean_sources(formal: Path = FORMAL) -> list[Path]:
    """Every Lean source under ``formal/`` except the generated ``Export.lean``."""
    return sorted(p for p in formal.rglob("*.lean") if p.name != EXPORT_PATH.name)


def strip_comments(text: str) -> str:
    """Blank out ``--`` line comments and (nested) ``/- -/`` block comments, keeping newlines."""
    out: list[str] = []
    depth = 0
    i = 0
    n = len(text)
    while i < n:
        two = text[i : i + 2]
        if depth == 0 and two == "--":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif two == "/-":
            depth += 1
            out.append("  ")
            i += 2
        elif depth > 0 and two == "-/":
            depth -= 1
            out.append("  ")
            i += 2
        elif depth > 0:
            out.append("\n" if text[i] == "\n" else " ")
            i += 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _has_docstring(raw_lines: list[str], index: int) -> bool:
    """Whether the declaration at ``raw_lines[index]`` is directly preceded by a ``/-- -/``."""
    j = index - 1
    while j >= 0 and (not raw_lines[j].strip() or raw_lines[j].strip().startswith("@[")):
        if not raw_lines[j].strip():
            return False  # a blank line separates the docstring from the declaration
        j -= 1
    if j < 0 or not raw_lines[j].rstrip().endswith("-/"):
        return False
    while j >= 0:
        if "/--" in raw_lines[j]:
            return True
        if "/-" in raw_lines[j]:
            return False
        j -= 1
    return False


def parse_declarations(path: Path) -> list[LeanDecl]:
    """Declarations of one Lean file, qualified by the enclosing ``namespace`` blocks."""
    raw = path.read_text(encoding="utf-8")
    raw_lines = raw.splitlines()
    code_lines = strip_comments(raw).splitlines()
    scopes: list[tuple[str, str]] = []  # ("namespace" | "section", name)
    decls: list[LeanDecl] = []
    for index, line in enumerate(code_lines):
        stripped = line.strip()
        words = stripped.split()
        if not words:
            continue
        if words[0] == "namespace" and len(words) > 1:
            scopes.append(("namespace", words[1]))
        elif words[0] == "section" or words[:2] == ["noncomputable", "section"]:
            name = words[1] if words[0] == "section" and len(words) > 1 else ""
            scopes.append(("section", name))
        elif words[0] == "end" and scopes:
            scopes.pop()
        match = _DECL_RE.match(stripped)
        if match:
            kind, short = match.groups()
            if short.startswith("_root_."):
                name = short.removeprefix("_root_.")
            else:
                prefix = [n for k, n in scopes if k == "namespace"]
                name = ".".join([*prefix, short])
            decls.append(LeanDecl(name, kind, path, index + 1, _has_docstring(raw_lines, index)))
    return decls


def declared_names(formal: Path = FORMAL) -> dict[str, LeanDecl]:
    """All declarations under ``formal/``, by fully qualified name."""
    found: dict[str, LeanDecl] = {}
    for path in lean_sources(formal):
        for decl in parse_declarations(path):
            found.setdefault(decl.name, decl)
    return found


def forbidden_hits(formal: Path = FORMAL) -> list[str]:
    """``file:line: token`` for every forbidden token anywhere in a Lean source (comments too)."""
    pattern = re.compile(r"\b(" + "|".join(FORBIDDEN_TOKENS) + r")\b")
    hits = []
    for path in sorted(formal.rglob("*.lean")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(1)}")
    return hits


# --- scope: every project name used is declared in the file or in what it imports ---------


def module_name(path: Path, formal: Path = FORMAL) -> str:
    """The Lean module of a source under ``formal/`` (the ``srcDir``): ``WitCert/Foo.lean`` ->
    ``WitCert.Foo``."""
    return ".".join(path.relative_to(formal).with_suffix("").parts)


def parse_imports(path: Path) -> list[str]:
    """The modules a Lean file imports (``import``, ``public import``, ... lines)."""
    found = []
    for line in strip_comments(path.read_text(encoding="utf-8")).splitlines():
        match = _IMPORT_RE.match(line.strip())
        if match:
            found.append(match.group(1))
    return found


def _is_project_module(name: str, modules: dict[str, Path]) -> bool:
    return name in modules or name == "WitCert" or name.startswith("WitCert.")


def import_closure(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Per module, the project modules it imports directly or transitively; and the problems
    found on the way (an import of a missing project module, an import cycle)."""
    direct = {
        name: [m for m in parse_imports(path) if _is_project_module(m, modules)]
        for name, path in modules.items()
    }
    problems = []
    for name, imports in direct.items():
        for imported in imports:
            if imported not in modules:
                problems.append(f"{name} imports {imported}, which has no file under formal/")
    closure: dict[str, set[str]] = {}
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(name: str, stack: list[str]) -> set[str]:
        if state.get(name) == "done":
            return closure[name]
        if state.get(name) == "open":
            cycle = stack[stack.index(name):] + [name]
            problems.append("import cycle: " + " -> ".join(cycle))
            return set()
        state[name] = "open"
        reach: set[str] = set()
        for imported in direct.get(name, []):
            if imported in modules:
                reach.add(imported)
                reach |= visit(imported, stack + [name])
        state[name] = "done"
        closure[name] = reach
        return reach

    for name in sorted(modules):
        visit(name, [])
    return closure, problems


def _candidates(base: str, namespace: list[str], opens: list[str]) -> list[str]:
    """The fully qualified names Lean tries for ``base``: inside ``namespace A.B`` it tries
    ``A.B.base``, ``A.base``, ``base``, then ``o.base`` for every opened namespace ``o``."""
    if base.startswith("_root_."):
        return [base.removeprefix("_root_.")]
    names = [".".join([*namespace[:i], base]) for i in range(len(namespace), -1, -1)]
    return names + [f"{o}.{base}" for o in opens]


def _resolve_project(token: str, namespace: list[str], opens: list[str],
                     decls: dict[str, str]) -> list[str]:
    """Project declarations a (possibly dotted) identifier can denote: the longest prefix of
    ``token`` that resolves to some declaration of ``formal/`` wins (the rest is field access,
    as in ``WitCert.partition_pos.le``)."""
    parts = token.split(".")
    for k in range(len(parts), 0, -1):
        hits = [n for n in _candidates(".".join(parts[:k]), namespace, opens) if n in decls]
        if hits:
            return hits
    return []


def _scope_commands(code_lines: list[str]):
    """Yield ``(line_number, line, namespace, opens)``, tracking ``namespace``/``section``/``end``
    blocks and the namespaces opened in each (``open X in`` is treated as opening ``X`` for the
    rest of the enclosing block: an over-approximation, so it can hide, never invent, a
    problem). ``open scoped X`` opens notation only and is ignored."""
    scopes: list[tuple[str, str, list[str]]] = [("root", "", [])]
    for number, line in enumerate(code_lines, 1):
        words = line.strip().split()
        if words[:1] == ["namespace"] and len(words) > 1:
            scopes.append(("namespace", words[1], []))
        elif words[:1] == ["section"] or words[:2] == ["noncomputable", "section"]:
            scopes.append(("section", "", []))
        elif words[:1] == ["end"] and len(scopes) > 1:
            scopes.pop()
        namespace = [c for kind, n, _ in scopes if kind == "namespace" for c in n.split(".")]
        if words[:1] == ["open"] and words[1:2] != ["scoped"]:
            for word in words[1:]:
                if word == "in" or word.startswith("("):
                    break
                # `open Core` inside `namespace WitCert` may mean `WitCert.Core`
                scopes[-1][2].extend(
                    ".".join([*namespace[:i], word]) for i in range(len(namespace), -1, -1))
        opens = [o for _, _, os in scopes for o in os]
        yield number, line, namespace, opens


def scope_problems(formal: Path = FORMAL) -> list[str]:
    """Every use of a ``formal/`` declaration that Lean could not see, every import of a missing
    project module, every import cycle. A use is checked where its name resolves (``_candidates``)
    to a declaration of ``formal/``; if none of the declarations it can denote is in the file or
    in a module the file imports (transitively), ``lake build`` stops there with an unknown
    identifier. Dotted uses on a local (``h.lemma``) are checked by their last component when
    that names project declarations only in unimported modules. Binders that shadow a project
    declaration's name would be reported too (none exist: project names are distinctive)."""
    paths = sorted(formal.rglob("*.lean"))
    modules = {module_name(p, formal): p for p in paths}
    closure, problems = import_closure(modules)
    decl_module: dict[str, str] = {}
    for name, path in modules.items():
        for decl in parse_declarations(path):
            decl_module.setdefault(decl.name, name)
    by_last: dict[str, list[str]] = {}
    for decl in decl_module:
        by_last.setdefault(decl.rsplit(".", 1)[-1], []).append(decl)
    for name, path in modules.items():
        visible = {name} | closure.get(name, set())
        rel = path.relative_to(formal.parent)
        code = _STRING_RE.sub('""', strip_comments(path.read_text(encoding="utf-8")))
        reported: set[str] = set()
        for number, line, namespace, opens in _scope_commands(code.splitlines()):
            if _IMPORT_RE.match(line.strip()):
                continue
            for match in _IDENT_RE.finditer(line):
                token = match.group(1)
                hits = _resolve_project(token, namespace, opens, decl_module)
                if not hits and "." in token:
                    field = token.rsplit(".", 1)[-1]
                    head_hits = _resolve_project(token.split(".")[0], namespace, opens, decl_module)
                    hits = [] if head_hits else by_last.get(field, [])
                if not hits or any(decl_module[h] in visible for h in hits) or token in reported:
                    continue
                reported.add(token)
                where = ", ".join(sorted({f"{h} ({decl_module[h]})" for h in hits}))
                problems.append(
                    f"{rel}:{number}: `{token}` is {where}, not imported by {name}"
                    " (directly or transitively)")
    return problems


def unreachable_modules(formal: Path = FORMAL, root: str = "WitCert") -> list[str]:
    """Modules under ``formal/`` that ``lake build`` of the root library would not compile: not
    imported, directly or transitively, by ``formal/WitCert.lean`` (``Export`` excepted)."""
    modules = {module_name(p, formal): p for p in sorted(formal.rglob("*.lean"))}
    closure, _ = import_closure(modules)
    return sorted(set(modules) - closure.get(root, set()) - {root, "Export"})


# --- rendering ------------------------------------------------------------------------------


def _cell(value: object) -> str:
    if value is None or value == "" or value == ():
        return "—"
    if isinstance(value, tuple):
        return "<br>".join(f"`{v}`" for v in value)
    return f"`{value}`"


def _lean_cell(name: str | None, decls: dict[str, LeanDecl]) -> str:
    if name is None:
        return "— (not a theorem)"
    decl = decls.get(name)
    where = f" ({decl.path.relative_to(ROOT)})" if decl else " (MISSING)"
    return f"`{name}`{where}"


def _checks_cell(row, registry: ModuleType) -> str:
    """Which checks the row's Lean declaration has passed; "never compiled" until a forge build."""
    if row.lean is None:
        return "—"
    checks = list(row.lean_checks)
    if registry.FORGE_BUILD not in checks:
        checks.append("never compiled")
    return "; ".join(checks)


def render_map(registry: ModuleType, decls: dict[str, LeanDecl]) -> str:
    """The full text of ``docs/theorem_map.md``."""
    lines = [
        "# Theorem map",
        "",
        "Generated by `python scripts/gen_theorem_map.py --write` from `spec/registry.py`;",
        "do not edit by hand (`tests/test_formal_audit.py` fails when this file is stale).",
        "",
        'Chain ([docs/design.md](design.md), "Verification chain"): paper item → Lean declaration (`formal/`) → spec mirror (`spec/`)',
        "→ torch implementation (`witcert/`) → Triton kernel (`kernels/`) → tests.",
        "",
        "Lean checks: *static check (here)* is `bash scripts/lean_check.sh` without a toolchain",
        "(the audit below and the check against the pinned Mathlib, in CI on every commit);",
        "*lake build on a forge (workflow)* is `.github/workflows/lean.yml`. A declaration without",
        "a forge build has **never been compiled** by Lean.",
        "",
        "| Key | Paper item | Statement | Lean declaration | Lean checks | Spec mirror "
        "| Implementation | Kernel | Tests |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in registry.THEOREMS:
        statement = row.statement.replace("|", "\\|")
        lines.append(
            f"| {row.key} | {row.paper} | `{statement}` | {_lean_cell(row.lean, decls)} "
            f"| {_checks_cell(row, registry)} | {_cell(row.spec)} | {_cell(row.torch)} "
            f"| {_cell(row.kernel)} | {_cell(row.tests)} |"
        )
    lines += ["", "## Notes", ""]
    for row in registry.THEOREMS:
        if row.note:
            lines.append(f"- **{row.key}**: {row.note}")
    lines += [
        "",
        "## Checking",
        "",
        "- `bash scripts/lean_check.sh`: `lake build --wfail` and the axiom report of",
        "  `formal/Export.lean` when `lake` is on PATH (only `propext`, `Classical.choice`,",
        "  `Quot.sound` allowed); always the static audit of this script, whose scope check",
        "  fails when a file uses a `formal/` name declared only in modules it does not import,",
        "  and `scripts/lean_names.py`, which checks every file against the committed index of",
        "  the pinned Mathlib (imports that exist, Mathlib names in the import closure and not",
        "  deprecated, no lemma applied to more explicit arguments than it takes).",
        "- Mathlib names used by the proofs, and where their statements were read:",
        "  `formal/MATHLIB_NAMES.md`.",
        "",
    ]
    return "\n".join(lines)


def export_names(registry: ModuleType) -> list[str]:
    """Registered Lean names followed by Lean names quoted in notes, without repeats."""
    names: list[str] = []
    for row in registry.THEOREMS:
        for name in ([row.lean] if row.lean else []) + note_lean_names(row.note):
            if name not in names:
                names.append(name)
    return names


def render_export(registry: ModuleType) -> str:
    """The full text of ``formal/Export.lean``."""
    lines = [
        "import WitCert",
        "",
        "/-!",
        "# Export: registered statements and their axioms",
        "",
        "Generated by `python scripts/gen_theorem_map.py --write` from `spec/registry.py`.",
        "`lake env lean formal/Export.lean` prints each registered declaration's statement and",
        "the axioms it depends on; `scripts/lean_check.sh` fails unless those are among",
        "`" + "`, `".join(ALLOWED_AXIOMS) + "`.",
        "-/",
        "",
    ]
    for name in export_names(registry):
        lines += [f"#check @{name}", f"#print axioms {name}", ""]
    return "\n".join(lines)


# --- audit ----------------------------------------------------------------------------------


def audit(registry: ModuleType | None = None, formal: Path = FORMAL) -> list[str]:
    """Every disagreement between the registry, ``formal/``, the map and ``Export.lean``."""
    registry = registry or load_registry()
    decls = declared_names(formal)
    problems = [f"forbidden token {hit}" for hit in forbidden_hits(formal)]
    for row in registry.THEOREMS:
        if row.lean is None and not row.note:
            problems.append(f"{row.key}: lean is None without a note saying why")
        if row.lean is not None and row.lean not in decls:
            problems.append(f"{row.key}: Lean declaration {row.lean} not found in formal/")
        for name in note_lean_names(row.note):
            if name not in decls:
                problems.append(f"{row.key}: note names {name}, not found in formal/")
    for decl in decls.values():
        if not decl.documented:
            rel = decl.path.relative_to(ROOT)
            problems.append(f"{rel}:{decl.line}: {decl.name} has no /-- -/ docstring")
    for path in lean_sources(formal):
        if "/-!" not in path.read_text(encoding="utf-8"):
            problems.append(f"{path.relative_to(ROOT)}: no /-! -/ module docstring")
    problems += [f"scope: {problem}" for problem in scope_problems(formal)]
    problems += [f"scope: {m} is not imported by formal/WitCert.lean"
                 for m in unreachable_modules(formal)]
    if not MAP_PATH.exists() or MAP_PATH.read_text(encoding="utf-8") != render_map(registry, decls):
        problems.append("docs/theorem_map.md is stale: run python scripts/gen_theorem_map.py --write")
    if not EXPORT_PATH.exists() or EXPORT_PATH.read_text(encoding="utf-8") != render_export(
        registry
    ):
        problems.append("formal/Export.lean is stale: run python scripts/gen_theorem_map.py --write")
    return problems


def write(registry: ModuleType | None = None) -> None:
    """Regenerate ``docs/theorem_map.md`` and ``formal/Export.lean``."""
    registry = registry or load_registry()
    MAP_PATH.parent.mkdir(parents=True, exist_ok=True)
    MAP_PATH.write_text(render_map(registry, declared_names()), encoding="utf-8")
    EXPORT_PATH.write_text(render_export(registry), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the map and Export.lean")
    mode.add_argument("--check", action="store_true", help="static audit; non-zero on problems")
    args = parser.parse_args(argv)
    if args.write:
        write()
        return 0
    problems = audit()
    for problem in problems:
        print(f"formal audit: {problem}", file=sys.stderr)
    if not problems:
        print(f"formal audit: ok ({len(declared_names())} declarations, no forbidden tokens,"
              " every project name in scope)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
