"""Lean 4 source read as text: comments and strings blanked, tokens, commands, binders.

The static checks of ``formal/`` (``scripts/mathlib_index.py`` builds an index of the pinned
Mathlib from its source, ``scripts/lean_names.py`` checks the project against it) run without a
Lean toolchain, so they read Lean at the level of its concrete syntax: what an identifier is
(Lean's ``isIdFirst``/``isIdRest``, letter-like and subscript characters included), where a
command starts, what a declaration's binders are and how many explicit arguments its statement
can take. Nothing here elaborates: notation, coercions, implicit arguments filled by
unification and anything a tactic or ``simp`` does are invisible to it (docs/verification.md,
"The static check against the pinned Mathlib").
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# --- characters ----------------------------------------------------------------------------


def is_letter_like(ch: str) -> bool:
    """Lean's ``isLetterLike``: Greek (but ``λ``, ``Π``, ``Σ``), Coptic, letter-like symbols
    (``ℝ``, ``ℕ``), mathematical alphanumerics."""
    v = ord(ch)
    return ((0x3B1 <= v <= 0x3C9 and v != 0x3BB) or (0x391 <= v <= 0x3A9 and v not in (0x3A0, 0x3A3))
            or 0x3CA <= v <= 0x3FB or 0x1F00 <= v <= 0x1FFE or 0x2100 <= v <= 0x214F
            or 0x1D49C <= v <= 0x1D59F)


def is_subscript_alnum(ch: str) -> bool:
    """Lean's ``isSubScriptAlnum``: subscript digits and letters (``₀``, ``ᵢ``, ``ⱼ``)."""
    v = ord(ch)
    return 0x2080 <= v <= 0x2089 or 0x2090 <= v <= 0x209C or 0x1D62 <= v <= 0x1D6A or v == 0x2C7C


def is_id_first(ch: str) -> bool:
    """Lean's ``isIdFirst`` (``isAlpha`` is ASCII only)."""
    return ("a" <= ch <= "z") or ("A" <= ch <= "Z") or ch == "_" or is_letter_like(ch)


def is_id_rest(ch: str) -> bool:
    """Lean's ``isIdRest``."""
    return (is_id_first(ch) or "0" <= ch <= "9" or ch in "'!?" or is_subscript_alnum(ch))


# --- comments and strings --------------------------------------------------------------------


_COMMENT_OR_LITERAL = re.compile(r"--|/-|\"|'")
_NOT_NEWLINE = re.compile(r"[^\n]")


def blank_comments(text: str) -> str:
    """``text`` with ``--`` and (nested) ``/- -/`` comments blanked and the contents of string and
    character literals blanked (quotes kept), newlines kept, so offsets and lines are those of the
    source. Docstrings are comments here."""
    out: list[str] = []
    n, i, kept = len(text), 0, 0
    while True:
        match = _COMMENT_OR_LITERAL.search(text, i)
        if match is None:
            break
        i, token = match.start(), match.group()
        if token == "--":
            a = i
            b = resume = n if text.find("\n", i) < 0 else text.find("\n", i)
        elif token == "/-":
            a, b = i, _block_comment_end(text, i)
            resume = b
        elif token == '"':
            b = i + 1
            while b < n and text[b] != '"':
                b += 2 if text[b] == "\\" else 1
            a, b, resume = i + 1, min(b, n), min(b + 1, n)
        else:
            end = _char_literal_end(text, i) if i == 0 or not is_id_rest(text[i - 1]) else 0
            if not end:
                i += 1
                continue
            a, b, resume = i + 1, end - 1, end
        out.append(text[kept:a])
        out.append(_NOT_NEWLINE.sub(" ", text[a:b]))
        kept, i = b, resume
    out.append(text[kept:])
    return "".join(out)


def _block_comment_end(text: str, i: int) -> int:
    """The offset after the (nested) block comment opening at ``text[i:i + 2] == "/-"``."""
    depth, j, n = 1, i + 2, len(text)
    while depth and j < n:
        a, b = text.find("/-", j), text.find("-/", j)
        if b < 0:
            return n
        if 0 <= a < b:
            depth, j = depth + 1, a + 2
        else:
            depth, j = depth - 1, b + 2
    return j


def _char_literal_end(text: str, i: int) -> int:
    """The offset after a character literal starting at ``text[i] == "'"``, or 0."""
    if text.startswith("\\", i + 1):
        j = text.find("'", i + 3)
        return j + 1 if 0 < j <= i + 12 else 0
    return i + 3 if text[i + 2:i + 3] == "'" and text[i + 1:i + 2] not in ("", "\n") else 0


# --- tokens --------------------------------------------------------------------------------

_SYMBOLS = (":=", "=>", "<|>", "<|", "|>.", "|>", "<;>", "..", "?_", "←", "→", "↔", "⟨", "⟩",
            "⦃", "⦄", "{{", "}}")


@dataclass(frozen=True)
class Token:
    """One token of comment-free Lean text: ``kind`` is ``ident``, ``num`` or ``sym``."""

    kind: str
    text: str
    line: int  # 1-based
    col: int  # 0-based column of the token's first character
    line_col: int  # column of the first token of its line (its indentation)


_ID_FIRST = ("A-Za-z_\u03b1-\u03ba\u03bc-\u03c9\u0391-\u039f\u03a1\u03a2\u03a4-\u03a9"
             "\u03ca-\u03fb\u1f00-\u1ffe\u2100-\u214f\U0001d49c-\U0001d59f")
_ID_REST = _ID_FIRST + "0-9'!?\u2080-\u2089\u2090-\u209c\u1d62-\u1d6a\u2c7c"
_ATOM = f"(?:«[^»\\n]*»|[{_ID_FIRST}][{_ID_REST}]*)"
IDENT_PATTERN = f"{_ATOM}(?:\\.{_ATOM})*"
_TOKEN_RE = re.compile(
    f"(?P<nl>\\n)|(?P<ws>[ \\t\\r\\f]+)|(?P<ident>{IDENT_PATTERN})|(?P<num>[0-9][0-9A-Za-z_]*(?:\\.[0-9]+)?)"
    "|(?P<sym>" + "|".join(re.escape(s) for s in _SYMBOLS) + "|.)")


def tokenize(code: str) -> list[Token]:
    """Tokens of comment-free text (``blank_comments``), each with its line and indentation."""
    tokens: list[Token] = []
    line, line_start, line_col = 1, 0, -1
    for match in _TOKEN_RE.finditer(code):
        kind = match.lastgroup
        if kind == "nl":
            line, line_start, line_col = line + 1, match.end(), -1
            continue
        if kind == "ws":
            continue
        if kind == "ident" and match.group() == "_":
            kind = "sym"  # a hole, not a name
        col = match.start() - line_start
        if line_col < 0:
            line_col = col
        tokens.append(Token(kind, match.group(), line, col, line_col))
    return tokens


OPENERS = {"(": ")", "[": "]", "{": "}", "⟨": "⟩", "⦃": "⦄", "{{": "}}"}
CLOSERS = {v: k for k, v in OPENERS.items()}


def matching_close(tokens: list[Token], i: int) -> int:
    """Index of the bracket closing ``tokens[i]`` (an opener), or ``len(tokens)``."""
    depth = 0
    for j in range(i, len(tokens)):
        t = tokens[j].text
        if t in OPENERS:
            depth += 1
        elif t in CLOSERS:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens)


# --- commands ------------------------------------------------------------------------------

# A line at column 0 that starts with one of these continues the command above it.
_CONTINUATIONS = ("|", "where", "termination_by", "decreasing_by", "deriving", ")", "]", "}", "⟩",
                  ":=", "with", "else", "then", "·", "<;>", ".", ",")


@dataclass(frozen=True)
class Command:
    """One top-level command: its first line (1-based) and its comment-free text."""

    line: int
    text: str


_MODIFIER_WORDS = {"private", "protected", "noncomputable", "nonrec", "partial", "unsafe", "scoped",
                   "local", "public", "meta"}


def _prefix_only(text: str) -> bool:
    """Whether ``text`` holds only attributes (``@[...]``) and modifiers: the start of a
    declaration whose keyword is on a later line."""
    head = text.lstrip()
    if not head.startswith("@[") and head.split(None, 1)[:1] != [w for w in head.split(None, 1)[:1]
                                                                  if w in _MODIFIER_WORDS]:
        return False
    tokens = tokenize(text)
    i = 0
    while i < len(tokens):
        if tokens[i].text == "@" and i + 1 < len(tokens) and tokens[i + 1].text == "[":
            i = matching_close(tokens, i + 1) + 1
        elif tokens[i].text in _MODIFIER_WORDS:
            i += 1
        else:
            return False
    return True


def split_commands(code: str) -> list[Command]:
    """Top-level commands of comment-free text: a command starts at a non-blank line at column
    0 unless that line continues a declaration (a ``|`` alternative, ``where``, ``deriving``...)
    or the lines before it are only attributes and modifiers (``@[simp]`` on its own line)."""
    commands: list[Command] = []
    start, buf = 0, []
    for number, line in enumerate(code.split("\n"), 1):
        starts = bool(line) and not line[0].isspace() and not line.startswith(_CONTINUATIONS)
        if starts and buf and not _prefix_only("\n".join(buf)):
            commands.append(Command(start, "\n".join(buf)))
            buf = []
        if starts or buf:
            if not buf:
                start = number
            buf.append(line)
    if buf:
        commands.append(Command(start, "\n".join(buf)))
    return commands


def scopes_closed_by_end(name: str, open_names: list[str]) -> int:
    """How many of the open scopes (``namespace``/``section`` names, innermost last) ``end name``
    closes: one for a bare ``end``, else as many innermost scopes as ``name`` has components
    (``end Finset.Filter`` closes ``namespace Finset`` and ``section Filter``)."""
    if not name:
        return min(1, len(open_names))
    wanted, closed, count = len(name.split(".")), 0, 0
    for scope in reversed(open_names):
        if closed >= wanted:
            break
        closed += len(scope.split(".")) if scope else 0
        count += 1
    return count


# --- binders and statements ---------------------------------------------------------------

BINDER_KINDS = {"(": "e", "{": "i", "[": "c", "⦃": "s", "{{": "s"}
"""Binder kind codes: ``e`` explicit, ``o`` explicit with a default (``:=`` or autoParam),
``i`` implicit, ``s`` strict implicit, ``c`` instance implicit."""


@dataclass(frozen=True)
class Binder:
    """One bound name (``None`` for an anonymous instance binder), its kind code and type text."""

    name: str | None
    kind: str
    type_text: str


def _split_top(tokens: list[Token], sep: str) -> list[list[Token]]:
    """``tokens`` split at ``sep`` tokens outside brackets."""
    parts: list[list[Token]] = [[]]
    depth = 0
    for t in tokens:
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            depth -= 1
        if depth == 0 and t.text == sep:
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def _text(tokens: list[Token]) -> str:
    return " ".join(t.text for t in tokens)


def binder_group(tokens: list[Token]) -> list[Binder]:
    """The binders of one bracketed group ``tokens[0] … tokens[-1]``: ``(a b : T)``,
    ``{x}``, ``[inst : C α]``, ``[C α]``, ``(h : p := by tac)``."""
    kind = BINDER_KINDS[tokens[0].text]
    inner = tokens[1:-1]
    colon = next((k for k, t in enumerate(inner) if t.text == ":" and
                  not any(u.text in OPENERS for u in inner[:k])), None)
    if kind == "c":
        if colon is not None and all(t.kind == "ident" for t in inner[:colon]) and colon == 1:
            return [Binder(inner[0].text, kind, _text(inner[2:]))]
        return [Binder(None, kind, _text(inner))]
    names = inner if colon is None else inner[:colon]
    type_tokens = [] if colon is None else inner[colon + 1:]
    if not names or not all(t.kind == "ident" or t.text == "_" for t in names):
        return []
    defaulted = kind == "e" and any(t.text == ":=" for t in _flatten_top(type_tokens))
    code = "o" if defaulted or _is_auto_param(type_tokens) else kind
    return [Binder(t.text, code, _text(type_tokens)) for t in names]


def _flatten_top(tokens: list[Token]) -> list[Token]:
    """The tokens of ``tokens`` outside brackets."""
    out, depth = [], 0
    for t in tokens:
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            depth -= 1
        elif depth == 0:
            out.append(t)
    return out


def _is_auto_param(tokens: list[Token]) -> bool:
    return any(t.text in ("optParam", "autoParam") for t in tokens[:1])


def header_binders(tokens: list[Token], i: int) -> tuple[list[Binder], int]:
    """The binders of a declaration header starting at ``tokens[i]``, and the index of the first
    token after them (``:``, ``:=``, ``where``, ``|`` or the end)."""
    binders: list[Binder] = []
    while i < len(tokens):
        t = tokens[i]
        if t.text in BINDER_KINDS:
            j = matching_close(tokens, i)
            binders += binder_group(tokens[i:j + 1])
            i = j + 1
        elif t.kind == "ident" and t.text not in ("where", "extends", "deriving") or t.text == "_":
            binders.append(Binder(t.text, "e", ""))
            i += 1
        else:
            break
    return binders, i


def statement_tokens(tokens: list[Token], i: int) -> list[Token]:
    """The type of a declaration whose header binders end at ``tokens[i]``: from after the
    top-level ``:`` to the top-level ``:=``, ``where``, pattern-matching ``| ... =>`` line or the
    end (empty if none)."""
    if i >= len(tokens) or tokens[i].text != ":":
        return []
    out, depth = [], 0
    for k in range(i + 1, len(tokens)):
        t = tokens[k]
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            depth -= 1
        if depth == 0 and (t.text in (":=", "where") or _is_alternative(tokens, k)):
            break
        out.append(t)
    return out


def _is_alternative(tokens: list[Token], k: int) -> bool:
    """Whether ``tokens[k]`` starts a pattern-matching alternative ``| pattern => rhs``."""
    if tokens[k].text != "|" or tokens[k].col != tokens[k].line_col:
        return False
    line = tokens[k].line
    return any(t.text == "=>" for t in tokens[k + 1:] if t.line == line)


# Binder notations whose body extends as far as possible: once one of them starts at the top
# level, the rest of the term is its body. (Big operators `∑ x ∈ s, f x`, `∫ x, f x ∂μ`, `⨆ i, f i`
# parse their body at precedence 67, so a relation after them is still at the top level.)
_BINDER_NOTATION = {"fun", "λ", "∃", "∃!", "∀", "Π", "∀ᶠ", "∃ᶠ", "let", "have", "show", "if", "match"}
# A statement whose top-level relation is one of these is a proposition that is not a function:
# applying a proof of it to one more argument is an error ("function expected"). `≠`, `¬`,
# `∈`, `⊆` and predicates (`Monotone f`, `Tendsto ...`) may unfold to a `∀` and are left open.
_CLOSED_RELATIONS = {"=", "≤", "<", "≥", ">", "↔", "∧", "∨", "∣", "≡"}
# Orders that unfold to a `∀` on functions, sets, filters, measures (`f ≤ g`, `pure ≤ 𝓝`):
# closed only when each side is known to live in a scalar type (``_order_sides_closed``).
_ORDERS = {"≤", "<", "≥", ">"}
SCALAR_TYPES = {"ℝ", "ℕ", "ℤ", "ℚ", "ℂ", "ℝ≥0", "ℝ≥0∞", "Real", "Nat", "Int", "Rat", "NNReal",
                "ENNReal", "EReal"}


_BIG_OPERATORS = {"∑", "∏", "⋃", "⋂", "⨆", "⨅", "∫", "∫⁻", "∮", "∑'", "∏'"}
_RELATION_RANK = {"↔": 0, "∨": 1, "∧": 2, "¬": 3}
_OPEN_RELATIONS = {"≠", "∈", "∉", "⊆", "⊂", "¬"}


def _relation_head(tokens: list[Token]) -> tuple[str, int] | None:
    """The top-level relation of a proposition's tokens and its index (the one of lowest
    precedence: ``↔``, then ``∨``, ``∧``, ``¬``, then the comparisons), skipping the binders of
    big operators (the ``∈`` of ``∑ i ∈ s,``) and stopping at a binder notation that takes the
    rest."""
    depth, i = 0, 0
    found: tuple[int, str, int] | None = None
    while i < len(tokens):
        t = tokens[i].text
        if t in OPENERS:
            depth += 1
        elif t in CLOSERS:
            depth -= 1
        elif t in _BIG_OPERATORS:
            i = _next_top_comma(tokens, i)
        elif depth == 0:
            if t in _BINDER_NOTATION:
                break
            if t in _CLOSED_RELATIONS or t in _OPEN_RELATIONS:
                rank = _RELATION_RANK.get(t, 4)
                if found is None or rank < found[0]:
                    found = (rank, t, i)
        i += 1
    return (found[1], found[2]) if found else None


def _next_top_comma(tokens: list[Token], i: int) -> int:
    """Index of the first ``,`` after ``tokens[i]`` at the bracket depth of ``tokens[i]``."""
    depth = 0
    for j in range(i + 1, len(tokens)):
        t = tokens[j].text
        if t in OPENERS:
            depth += 1
        elif t in CLOSERS:
            depth -= 1
            if depth < 0:
                return j - 1
        elif depth == 0 and t == ",":
            return j
    return len(tokens)


def extra_explicit_arity(tokens: list[Token], kinds: dict[str, str] | None = None,
                         explicit_before: int = 0) -> int | None:
    """How many more explicit arguments a proof of this statement (a theorem's type after its
    binders) accepts: the explicit ``∀`` binders and ``→`` premises in front of a closed
    conclusion (``=``, ``↔``, ``∧``, ``∃``, or an order between scalars). ``None`` when unknown:
    the conclusion may unfold to a function (``¬``, ``≠``, ``⊆``, a predicate, an order on
    functions, sets, filters or measures), so no over-application is ever reported for it.

    ``kinds`` maps binder names to ``scalar`` (a type of ``SCALAR_TYPES``) or ``typevar`` (a
    type variable); an order is closed when each side is a numeral, a compound term, a scalar
    binder, or a type-variable binder of a lemma whose earlier explicit arguments cannot fix that
    type to a function type (``explicit_before`` of them, none: ``zero_le : 0 ≤ a``)."""
    count = 0
    while tokens:
        first = tokens[0].text
        if first in ("∀", "Π"):
            comma = next((k for k, t in enumerate(tokens) if t.text == "," and
                          not _inside_brackets(tokens, k)), None)
            if comma is None:
                return None
            count += _forall_explicit(tokens[1:comma])
            tokens = tokens[comma + 1:]
            continue
        parts = _split_top(tokens, "→")
        if len(parts) > 1:
            if any(t.text in _BINDER_NOTATION for t in _flatten_top(parts[0])):
                return None
            count += len(parts) - 1
            tokens = parts[-1]
            continue
        break
    if not tokens:
        return None
    if tokens[0].text in ("∃", "∃!", "True"):
        return count
    if tokens[0].text == "(" and matching_close(tokens, 0) == len(tokens) - 1:
        inner = extra_explicit_arity(tokens[1:-1], kinds, explicit_before + count)
        return None if inner is None else count + inner
    found = _relation_head(tokens)
    if found is None or found[0] not in _CLOSED_RELATIONS:
        return None
    relation, at = found
    if relation in _ORDERS and not _order_sides_closed(tokens[:at], tokens[at + 1:], kinds or {},
                                                       explicit_before + count):
        return None
    return count


def _order_sides_closed(left: list[Token], right: list[Token], kinds: dict[str, str],
                        explicit_before: int) -> bool:
    """Whether both sides of an order are known not to be functions, sets, filters, measures."""
    for side in (left, right):
        if len(side) != 1 or side[0].kind == "num":
            continue
        kind = kinds.get(side[0].text)
        if kind == "scalar" or (kind == "typevar" and explicit_before == 0):
            continue
        return False
    return True


def binder_kinds_of_types(binders: list[Binder]) -> dict[str, str]:
    """``scalar``/``typevar`` for the binders whose type is a scalar type or a type variable."""
    typevars = {b.name for b in binders if b.name and
                b.type_text.split(" ")[0] in ("Type", "Type*", "Sort", "Sort*")}
    kinds = {}
    for b in binders:
        if not b.name:
            continue
        text = b.type_text.replace(" ", "")
        if text in SCALAR_TYPES:
            kinds[b.name] = "scalar"
        elif text in typevars:
            kinds[b.name] = "typevar"
    return kinds


def _inside_brackets(tokens: list[Token], k: int) -> bool:
    depth = 0
    for t in tokens[:k]:
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            depth -= 1
    return depth > 0


def _forall_explicit(tokens: list[Token]) -> int:
    """Explicit arguments of one ``∀`` binder list (``x y``, ``(x : T)``, ``{x}``, ``x ∈ s``)."""
    count, i, names = 0, 0, 0
    while i < len(tokens):
        t = tokens[i]
        if t.text in BINDER_KINDS:
            j = matching_close(tokens, i)
            count += sum(b.kind in "eo" for b in binder_group(tokens[i:j + 1]))
            i = j + 1
        elif t.kind == "ident" or t.text == "_":
            names += 1
            i += 1
        elif t.text == ":":
            break
        else:  # a binder predicate: `∀ x ∈ s`, `∀ ε > 0` adds one premise per name
            return count + 2 * names
    return count + names

