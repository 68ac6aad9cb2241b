"""Check ``formal/`` against the pinned Mathlib without a Lean toolchain: the part of
``lake build`` that can be checked by reading (docs/verification.md, "The static check against
the pinned Mathlib").

For every Lean file under ``formal/`` (``Export.lean`` included), using the committed index of
Mathlib and Batteries at the pinned commits (``scripts/mathlib_index.py``):

* every ``import`` names a module that exists at the pin (a project file, a Mathlib or Batteries
  module, or a core/dependency module that Mathlib itself imports);
* every identifier that resolves, by Lean's rules (enclosing ``namespace`` blocks, ``open``
  commands including ``open … in``, ``_root_``, ``protected`` names, the longest declared prefix
  of a dotted name, the rest being field notation), to a Mathlib/Batteries declaration resolves
  to one declared in the file's import closure (project imports followed transitively into
  Mathlib); and is not deprecated at the pin (a warning, hence an error under ``--wfail``);
* a dotted name whose first component is a namespace of the index or the project, and of which
  no prefix is declared anywhere (index, project, ``formal/lean-core-names.txt``), is reported
  as not declared at the pin (a renamed or misspelt lemma);
* an application ``f a b c`` of a declaration in term position (after ``(``, ``:=``, ``exact``,
  ``⟨``, ``,``, ...) passes no more explicit arguments than ``f`` takes: its explicit binders
  (section variables included) plus the explicit ``∀``/``→`` in front of a closed conclusion
  (``=``, ``≤``, ``↔``, ...). ``@f`` is counted against every binder. Named arguments
  ``(x := e)`` and ``..`` are not counted.

What it cannot see: dot notation on a local hypothesis (``h.trans``, whose namespace is its
type's), the types that decide which overload or coercion applies, implicit arguments filled by
unification, instances, ``simp`` sets, anything a tactic does, and an order relation on a
function, set or filter type that unfolds to a ``∀`` (it would be reported as over-applied; none
occurs here). A name with no dot that resolves nowhere is taken for a local or a core name.

Usage: ``python scripts/lean_names.py`` (exit status 1 and one line per problem); run by
``scripts/lean_check.sh``.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lean_syntax as L  # noqa: E402
import mathlib_index as MI  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FORMAL = ROOT / "formal"
CORE_NAMES = FORMAL / "lean-core-names.txt"
CORE_MODULE = "Init"  # core Lean, imported by every file
_REQUIRE_TAG = re.compile(r'require\s+mathlib\s+from\s+git\s+"[^"]+"\s*@\s*"([^"]+)"')
# Declarations Lean creates on demand (equation lemmas, functional induction principles).
RESERVED_SUFFIXES = ("eq_def", "induct", "fun_cases", "mutual_induct", "eq_unfold")
_RESERVED_EQ = re.compile(r"\.eq_\d+$")

# Tokens after which an identifier starts a term whose arguments follow it.
HEAD_PRECEDERS = {"(", "⟨", "[", ",", ":=", "=>", "<|", "←", "exact", "refine", "refine'",
                  "apply", "exacts", "from", "using", "calc", "↦"}
# Tokens that end an application's arguments.
ARG_STOPS = {",", ":=", ":", "|>", "|>.", "at", "with", "using", "then", "else", "in", "from",
             "generalizing", "<;>", ";", "=>", "↦", "|", "do", "only", "..", "$"}
COMMAND_WORDS = {"import", "namespace", "section", "end", "open", "universe", "set_option",
                 "variable", "include", "omit", "mutual", "module", "assert_not_exists"}
# Tactics whose names are also declarations (`lift`, `ring`, ...): not references where a tactic
# starts (the first token of a line or after `by`, `·`, `;`, `<;>`).
TACTICS = {"lift", "ring", "ring_nf", "abel", "group", "field_simp", "simp", "simp_all", "simpa",
           "dsimp", "norm_num", "positivity", "linarith", "nlinarith", "omega", "decide", "rfl",
           "exact", "apply", "intro", "intros", "cases", "rcases", "obtain", "induction",
           "constructor", "use", "refine", "rw", "rwa", "calc", "show", "congr", "ext", "funext",
           "gcongr", "bound", "aesop", "tauto", "trivial", "contradiction", "exfalso", "left",
           "right", "subst", "unfold", "set", "filter_upwards", "push_cast", "norm_cast",
           "exact_mod_cast", "convert", "specialize", "change", "symm", "trans", "measurability",
           "continuity", "fun_prop", "finiteness", "by_contra", "by_cases", "choose",
           "interval_cases", "mono", "nth_rw", "nth_rewrite", "infer_instance", "exists", "clear",
           "revert", "generalize", "apply_fun", "wlog", "linear_combination", "peel", "order",
           "grind", "split", "classical", "haveI", "letI", "assumption", "norm_num1", "zify",
           "qify", "push_neg", "lia", "module", "compute_degree", "split_ifs"}
_TACTIC_STARTS = {"by", "·", ";", "<;>"}


@dataclass(frozen=True)
class Known:
    """One declaration a name can resolve to: where (a module of the index or of ``formal/``)
    and how it may be applied."""

    name: str
    module: str
    line: int
    flags: str
    max_explicit: int | None
    max_total: int | None
    project: bool


@dataclass
class Universe:
    """Every name the check knows: the index, the project's own declarations, core names."""

    index: MI.Index
    project: dict[str, list[Known]]
    project_imports: dict[str, list[str]]
    core: dict[str, Known]
    namespaces: set[str] = field(default_factory=set)
    wildcard_prefixes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.wildcard_prefixes = {w for ws in self.index.wildcards.values() for w in ws}
        for name in list(self.index.names) + list(self.project) + list(self.core):
            parts = name.split(".")
            for k in range(1, len(parts)):
                self.namespaces.add(".".join(parts[:k]))

    def lookup(self, name: str) -> list[Known]:
        found = list(self.project.get(name, [])) + ([self.core[name]] if name in self.core else [])
        for d in self.index.names.get(name, []):
            found.append(Known(d.name, d.module, d.line, d.flags, d.max_explicit, d.max_total,
                               False))
        return found

    def declared_elsewhere(self, name: str) -> bool:
        """Declared by a mechanism the index keeps no binders for: a ``simps`` wildcard, an
        equation lemma made on demand."""
        head, _, last = name.rpartition(".")
        if last in RESERVED_SUFFIXES or _RESERVED_EQ.search(name):
            return bool(self.lookup(head)) or head in self.core
        return any(name[:k] in self.wildcard_prefixes for k in range(1, len(name)))


# --- loading -------------------------------------------------------------------------------


def mathlib_tag(root: Path = ROOT) -> str:
    """The Mathlib tag the lakefile requires (the index file is named after it)."""
    match = _REQUIRE_TAG.search((root / "lakefile.lean").read_text(encoding="utf-8"))
    if match is None:
        raise ValueError("lakefile.lean has no `require mathlib from git URL @ TAG`")
    return match.group(1)


def project_modules(formal: Path = FORMAL) -> dict[str, Path]:
    """``module -> path`` of every Lean file under ``formal/`` (the lakefile's ``srcDir``)."""
    return {".".join(p.relative_to(formal).with_suffix("").parts): p
            for p in sorted(formal.rglob("*.lean"))}


def load_universe(formal: Path = FORMAL, index: MI.Index | None = None,
                  root: Path = ROOT) -> Universe:
    """The index, the project's declarations (read with the indexer's reader) and core names."""
    index = index or MI.load(MI.index_path(mathlib_tag(root), root / "formal"))
    project: dict[str, list[Known]] = {}
    imports: dict[str, list[str]] = {}
    modules = [MI.read_module(m, p.read_text(encoding="utf-8"))
               for m, p in project_modules(formal).items()]
    for m in MI.finish(modules):
        imports[m.module] = m.imports
        for d in m.decls:
            n = MI.IndexedName(d.name, m.module, d.line, d.flags, d.binders, d.extra)
            project.setdefault(d.name, []).append(
                Known(d.name, m.module, d.line, d.flags, n.max_explicit, n.max_total, True))
    core = read_core_names(formal / CORE_NAMES.name)
    return Universe(index, project, imports, core)


def read_core_names(path: Path) -> dict[str, Known]:
    """``formal/lean-core-names.txt``: core Lean names with their binders and arity."""
    core: dict[str, Known] = {}
    if not path.is_file():
        return core
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, binders, extra = line.split()[:3]
        n = MI.IndexedName(name, CORE_MODULE, number, "", None if binders == "?" else
                           binders.strip("."), None if extra == "?" else int(extra))
        core[name] = Known(name, CORE_MODULE, number, "", n.max_explicit, n.max_total, False)
    return core


# --- scope ---------------------------------------------------------------------------------


@dataclass
class Scope:
    """The namespaces and opens in force at one command."""

    namespace: list[str]
    opens: list[str]

    def candidates(self, name: str) -> list[str]:
        if name.startswith("_root_."):
            return [name.removeprefix("_root_.")]
        ns = self.namespace
        return [".".join([*ns[:i], name]) for i in range(len(ns), -1, -1)] + [
            f"{o}.{name}" for o in self.opens]


def walk_commands(code: str):
    """Yield ``(command, tokens, scope)`` for every command, tracking ``namespace``/``section``/
    ``end`` and ``open`` (``open X in`` for the next command only)."""
    frames: list[tuple[str, str, list[str]]] = [("root", "", [])]
    pending: list[str] = []
    for command in L.split_commands(code):
        tokens = L.tokenize(command.text)
        if not tokens:
            continue
        namespace = [c for kind, n, _ in frames if kind == "namespace" for c in n.split(".")]
        word = tokens[0].text
        ends_in = tokens[-1].text == "in"
        if word == "namespace" and len(tokens) > 1:
            frames.append(("namespace", tokens[1].text, []))
        elif word in ("section", "noncomputable", "mutual") and not ends_in:
            if word == "section":
                named = len(tokens) > 1 and tokens[1].kind == "ident"
                frames.append(("section", tokens[1].text if named else "", []))
            elif word == "mutual" or tokens[1:2] and tokens[1].text == "section":
                frames.append(("section", "", []))
        elif word == "end":
            name = tokens[1].text if len(tokens) > 1 and tokens[1].kind == "ident" else ""
            for _ in range(L.scopes_closed_by_end(name, [n for _, n, _ in frames[1:]])):
                frames.pop()
        opens = [o for _, _, os in frames for o in os] + pending
        if word == "open" and tokens[1:2] and tokens[1].text != "scoped":
            opened = []
            for t in tokens[1:]:
                if t.kind != "ident" or t.text in ("hiding", "renaming", "in"):
                    break
                opened += [".".join([*namespace[:i], t.text]) for i in range(len(namespace), -1, -1)]
            if ends_in:
                pending = opened
                continue
            frames[-1][2].extend(opened)
            continue
        yield command, tokens, Scope(namespace, opens)
        if not ends_in:
            pending = []


# --- the checks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """What an identifier token denotes: the declarations of its longest declared prefix, and
    whether a field-access tail follows it."""

    known: list[Known]
    has_tail: bool
    prefix: str


def resolve(token: str, scope: Scope, universe: Universe) -> Resolution | None:
    """Lean's resolution of a (possibly dotted) identifier to declarations (``None``: none)."""
    parts = token.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        known: list[Known] = []
        elsewhere = False
        for candidate in scope.candidates(prefix):
            hits = [h for h in universe.lookup(candidate)
                    if "p" not in h.flags or "." in prefix or candidate == prefix]
            known += hits
            elsewhere = elsewhere or universe.declared_elsewhere(candidate)
        if known or elsewhere:
            return Resolution(known, k < len(parts), prefix)
    return None


def visible_modules(module: str, universe: Universe) -> tuple[set[str], set[str]]:
    """``(project modules, index modules)`` a project module sees: itself, its project imports
    transitively, and the index closure of every Mathlib/Batteries module among them."""
    project: set[str] = set()
    stack = [module]
    roots: list[str] = []
    while stack:
        m = stack.pop()
        if m in project:
            continue
        project.add(m)
        for imported in universe.project_imports.get(m, []):
            if imported in universe.project_imports:
                stack.append(imported)
            else:
                roots.append(imported)
    return project, universe.index.closure(roots)


def _is_visible(k: Known, project: set[str], index: set[str]) -> bool:
    if k.project:
        return k.module in project
    return k.module == CORE_MODULE or k.module in index


def count_arguments(tokens: list[L.Token], head: int) -> int | None:
    """Explicit arguments written after ``tokens[head]`` in term position (``None`` when ``..``
    fills the rest)."""
    count, j = 0, head + 1
    base = _effective_indent(tokens, head)
    line = tokens[head].line
    while j < len(tokens):
        t = tokens[j]
        if t.line != line:
            if t.line_col <= base or (t.col == t.line_col and t.text in ("_", "·", "|", "<;>")):
                break
            line = t.line
        if t.text == "..":
            return None
        if t.text in L.CLOSERS or t.text in ARG_STOPS:
            break
        if t.text in ("fun", "λ", "by", "<|"):
            return count + 1
        if t.text in L.OPENERS:
            close = L.matching_close(tokens, j)
            inner = tokens[j + 1:close]
            named = t.text == "(" and len(inner) > 2 and inner[0].kind == "ident" and \
                inner[1].text == ":="
            count += 0 if named else 1
            j = close + 1
            continue
        if t.text == "." and j + 1 < len(tokens) and tokens[j + 1].col == t.col + 1 and count:
            j += 2  # a projection `h.1` of the argument before it
            continue
        if t.text in ("@", "↑", "‹"):
            j += 1
            continue
        if t.kind in ("ident", "num") or t.text in ("_", "?_", '"'):
            count += 1
            if t.text == '"':
                j = next((k for k in range(j + 1, len(tokens)) if tokens[k].text == '"'), j) + 1
                continue
            j += 1
            continue
        break
    return count


def _effective_indent(tokens: list[L.Token], k: int) -> int:
    """Indentation of the tactic or term holding ``tokens[k]``: the column of the first token
    of its line that is not a bullet ``·``."""
    line = tokens[k].line
    first = k
    while first > 0 and tokens[first - 1].line == line:
        first -= 1
    while tokens[first].text == "·" and first < k:
        first += 1
    return tokens[first].col


def _is_head(tokens: list[L.Token], k: int) -> bool:
    prev = tokens[k - 1].text if k else ""
    if prev == "@":
        prev = tokens[k - 2].text if k >= 2 else ""
    return prev in HEAD_PRECEDERS


def check_file(module: str, path: Path, universe: Universe, rel: str) -> list[str]:
    """Every problem of one project file."""
    text = path.read_text(encoding="utf-8")
    code = L.blank_comments(text)
    problems = _import_problems(universe.project_imports.get(module, []), universe, rel)
    project_vis, index_vis = visible_modules(module, universe)
    reported: set[tuple[int, str]] = set()
    for command, tokens, scope in walk_commands(code):
        if _command_word(tokens) in COMMAND_WORDS:
            continue
        bound = bound_names(tokens)
        declared = _declared_positions(tokens) | _attribute_positions(tokens)
        for k, t in enumerate(tokens):
            if (t.kind != "ident" or t.text in bound or k in declared or _is_projection(tokens, k)
                    or _is_field_name(tokens, k) or _is_tactic(tokens, k)):
                continue
            line = command.line + t.line - 1
            for problem in _token_problems(tokens, k, scope, universe, project_vis, index_vis):
                if (line, problem) not in reported:
                    reported.add((line, problem))
                    problems.append(f"{rel}:{line}: {problem}")
    return problems


_DECLARING = {"theorem", "lemma", "def", "abbrev", "instance", "structure", "class", "inductive",
              "opaque", "axiom", "irreducible_def", "alias", "example"}


def _declared_positions(tokens: list[L.Token]) -> set[int]:
    """Indices of the names a command declares (after ``theorem``, ``def``, ``alias``, the names of
    ``alias ⟨mp, mpr⟩``): declarations, not references."""
    k = 0
    while k < len(tokens) and (tokens[k].text in ("@",) or tokens[k].text in L._MODIFIER_WORDS):
        k = L.matching_close(tokens, k + 1) + 1 if tokens[k].text == "@" else k + 1
    if k >= len(tokens) or tokens[k].text not in _DECLARING:
        return set()
    j = k + 1
    if j < len(tokens) and tokens[j].text in ("abbrev", "inductive"):
        j += 1
    if j < len(tokens) and tokens[j].text == "⟨":
        return {i for i in range(j, L.matching_close(tokens, j)) if tokens[i].kind == "ident"}
    return {j} if j < len(tokens) and tokens[j].kind == "ident" else set()


def _attribute_positions(tokens: list[L.Token]) -> set[int]:
    """Indices inside ``@[...]``: attribute names and their arguments (``simps map``, the target
    of ``to_additive``), not references to declarations."""
    inside: set[int] = set()
    for k in range(len(tokens) - 1):
        if tokens[k].text == "@" and tokens[k + 1].text == "[":
            inside.update(range(k + 1, L.matching_close(tokens, k + 1)))
    return inside


def _is_field_name(tokens: list[L.Token], k: int) -> bool:
    """A name followed by ``:=`` (a field, a named argument, a local definition), or a line
    ``name args := value`` of a ``where`` block (a field defined with arguments): not a use."""
    if k + 1 < len(tokens) and tokens[k + 1].text == ":=":
        return True
    t = tokens[k]
    if t.col != t.line_col:
        return False
    j = k + 1
    while j < len(tokens) and tokens[j].line == t.line:
        if tokens[j].text == ":=":
            return True
        if tokens[j].text in L.BINDER_KINDS:
            j = L.matching_close(tokens, j) + 1
        elif tokens[j].kind == "ident" or tokens[j].text == "_":
            j += 1
        else:
            return False
    return False


def _is_tactic(tokens: list[L.Token], k: int) -> bool:
    """A tactic name where a tactic starts (``lift x to ℕ``), not a reference to a lemma."""
    t = tokens[k]
    if t.text not in TACTICS:
        return False
    return t.col == t.line_col or (k > 0 and tokens[k - 1].text in _TACTIC_STARTS)


def _command_word(tokens: list[L.Token]) -> str:
    """The command's keyword after attributes and modifiers (``public import`` is ``import``)."""
    k = 0
    while k < len(tokens) and tokens[k].text in ("public", "private", "meta", "noncomputable"):
        k += 1
    return tokens[k].text if k < len(tokens) else ""


def _is_projection(tokens: list[L.Token], k: int) -> bool:
    """``x.foo``/``(e).foo``/``.inl``/``e |>.foo``: a name looked up in a type's namespace, not
    in scope."""
    prev = tokens[k - 1] if k else None
    if prev is not None and prev.text == "|>.":
        return True
    return bool(prev and prev.text == "." and prev.line == tokens[k].line and
                prev.col + 1 == tokens[k].col)


_BINDING_WORDS = {"fun", "λ", "∀", "∃", "∃!", "∑", "∏", "⋃", "⋂", "⨆", "⨅", "∫", "intro", "intros",
                  "rintro", "obtain", "with", "have", "let", "set", "by_contra", "by_cases",
                  "generalizing", "ext", "funext"}
_BINDING_ENDS = {"=>", "↦", ",", ":", ":=", "∈", "∉", "at", "using", "from", "in"}


def bound_names(tokens: list[L.Token]) -> set[str]:
    """Names a command binds locally (over-approximated, so that a local named like a Mathlib
    declaration is never taken for it): binder groups ``(a b : T)``, the names after ``fun``,
    ``∀``, ``∑``, ``intro``, ``obtain``, ``with``, ``have``..., the variables of ``| pat =>``
    alternatives, and fields ``name : T`` at the start of a line."""
    bound: set[str] = set()
    n = len(tokens)
    for k, t in enumerate(tokens):
        if t.text in L.BINDER_KINDS:
            j, names = k + 1, []
            while j < n and tokens[j].kind == "ident" and "." not in tokens[j].text:
                names.append(tokens[j].text)
                j += 1
            if names and j < n and tokens[j].text == ":":
                bound.update(names)
        elif t.text in _BINDING_WORDS or (t.text == "|" and t.col == t.line_col):
            bound.update(_names_until_end(tokens, k + 1, t.text == "|"))
        elif t.kind == "ident" and t.col == t.line_col and k + 1 < n and tokens[k + 1].text == ":":
            bound.add(t.text)
    return bound


def _names_until_end(tokens: list[L.Token], j: int, alternative: bool) -> list[str]:
    """Undotted names from ``tokens[j]`` to the end of the binder list (same line)."""
    names, depth, line = [], 0, tokens[j - 1].line
    while j < len(tokens) and tokens[j].line == line:
        t = tokens[j]
        if t.text in L.OPENERS:
            depth += 1
        elif t.text in L.CLOSERS:
            depth -= 1
            if depth < 0:
                break
        elif t.text == "=>" or (depth == 0 and not alternative and t.text in _BINDING_ENDS):
            break
        elif t.kind == "ident" and "." not in t.text:
            names.append(t.text)
        j += 1
    return names


def _import_problems(imports: list[str], universe: Universe, rel: str) -> list[str]:
    known_elsewhere = {m for ms in universe.index.imports.values() for m in ms}
    problems = []
    for m in imports:
        if m in universe.project_imports or m in universe.index.imports:
            continue
        if m.split(".")[0] in ("Mathlib", "Batteries", "WitCert") or m not in known_elsewhere:
            problems.append(f"{rel}: imports {m}, which is not a module at the pin")
    return problems


def _token_problems(tokens, k, scope, universe, project_vis, index_vis) -> list[str]:
    t = tokens[k]
    res = resolve(t.text, scope, universe)
    if res is None:
        head = t.text.split(".")[0]
        if "." in t.text and any(c in universe.namespaces for c in scope.candidates(head)):
            return [f"`{t.text}` is not declared at the pin (nor in formal/ or core Lean)"]
        return []
    if not res.known:
        return []
    if res.has_tail and all("T" in h.flags for h in res.known):
        # `Finset.sum_div_nonexistent`: no field notation applies to a type, so the whole dotted
        # name had to be declared
        return [f"`{t.text}` is not declared at the pin (nor in formal/ or core Lean)"]
    visible = [h for h in res.known if _is_visible(h, project_vis, index_vis)]
    if not visible:
        where = ", ".join(sorted({f"{h.name} ({h.module}:{h.line})" for h in res.known}))
        return [f"`{res.prefix}` is {where}, not in the import closure of this file"]
    if all("d" in h.flags for h in visible):
        return [f"`{res.prefix}` is deprecated at the pin ({visible[0].module}:{visible[0].line}):"
                " a warning, an error under `lake build --wfail`"]
    if res.has_tail or not _is_head(tokens, k):
        return []
    explicit = k and tokens[k - 1].text == "@"
    limits = [h.max_total if explicit else h.max_explicit for h in visible]
    if any(limit is None for limit in limits):
        return []
    given = count_arguments(tokens, k)
    if given is not None and given > max(limits):
        kind = "arguments" if explicit else "explicit arguments"
        return [f"`{res.prefix}` is applied to {given} {kind} but takes at most {max(limits)}"
                f" ({visible[0].module}:{visible[0].line})"]
    return []


def check(formal: Path = FORMAL, universe: Universe | None = None) -> list[str]:
    """Every problem of every Lean file under ``formal``."""
    universe = universe or load_universe(formal)
    problems = []
    for module, path in project_modules(formal).items():
        rel = str(path.relative_to(formal.parent))
        problems += check_file(module, path, universe, rel)
    return problems


def main() -> int:
    universe = load_universe()
    problems = check(FORMAL, universe)
    for problem in problems:
        print(f"lean_names: {problem}", file=sys.stderr)
    if not problems:
        header = universe.index.header
        print(f"lean_names: ok ({len(project_modules())} files against Mathlib {header['tag']}"
              f" at {header['mathlib'][:12]}, {len(universe.index.names)} indexed names)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
