"""The names Mathlib's ``@[to_additive]`` and ``@[to_dual]`` give the declarations they generate.

A port of ``Mathlib/Tactic/Translate/GuessName.lean`` (``splitCase``, ``applyNameDict``,
``fixAbbreviation``, ``guessName``) and of ``targetName`` in ``Mathlib/Tactic/Translate/Core.lean``
at the pinned commit, with the dictionaries of ``Translate/ToAdditive.lean`` and
``Translate/ToDual.lean``. ``scripts/mathlib_index.py`` uses it to list the generated names
(``Finset.prod_range_div`` -> ``Finset.sum_range_sub``, ``one_le`` with the explicit target
``zero_le``). The ``guessName`` examples of ``MathlibTest/Attribute/ToAdditive/Basic.lean`` are
its test oracle (tests/test_lean_names.py). Lean's ``Char.isUpper``/``toLower`` are ASCII only,
and so are the ones here.
"""
from __future__ import annotations

from dataclasses import dataclass

END_CAPITAL_NAMES: dict[str, list[str]] = {
    "LE": [""], "LT": [""], "GE": [""], "GT": [""], "WF": [""], "Coe": ["TC", "T", "HTCT"]}

ADDITIVE_NAMES: dict[str, list[str]] = {
    "one": ["Zero"], "mul": ["Add"], "smul": ["VAdd"], "inv": ["Neg"], "div": ["Sub"],
    "sdiv": ["VSub"], "prod": ["Sum"], "hmul": ["HAdd"], "hsmul": ["HVAdd"], "hdiv": ["HSub"],
    "hpow": ["HSMul"], "finprod": ["Finsum"], "tprod": ["TSum"], "pow": ["NSMul"],
    "npow": ["NSMul"], "zpow": ["ZSMul"], "mabs": ["Abs"], "monoid": ["Add", "Monoid"],
    "submonoid": ["Add", "Submonoid"], "group": ["Add", "Group"], "subgroup": ["Add", "Subgroup"],
    "semigroup": ["Add", "Semigroup"], "torsor": ["Add", "Torsor"], "magma": ["Add", "Magma"],
    "haar": ["Add", "Haar"], "prehaar": ["Add", "Prehaar"], "unit": ["Add", "Unit"],
    "units": ["Add", "Units"], "cyclic": ["Add", "Cyclic"], "semigrp": ["Add", "Semigrp"],
    "grp": ["Add", "Grp"], "commute": ["Add", "Commute"], "semiconj": ["Add", "Semiconj"],
    "conjugates": ["Add", "Conjugates"], "conj": ["Add", "Conj"],
    "commutator": ["Add", "Commutator"], "rootable": ["Divisible"], "zpowers": ["ZMultiples"],
    "powers": ["Multiples"], "multipliable": ["Summable"], "gpfree": ["APFree"],
    "quantale": ["Add", "Quantale"], "square": ["Even"], "mconv": ["Conv"],
    "irreducible": ["Add", "Irreducible"], "mlconvolution": ["LConvolution"]}

ADDITIVE_ABBREVIATIONS: dict[str, str] = {
    "isCancelAdd": "IsCancelAdd", "isLeftCancelAdd": "IsLeftCancelAdd",
    "isRightCancelAdd": "IsRightCancelAdd", "cancelAdd": "AddCancel",
    "leftCancelAdd": "AddLeftCancel", "rightCancelAdd": "AddRightCancel",
    "cancelCommAdd": "AddCancelComm", "commAdd": "AddComm", "zero_le": "Nonneg",
    "zeroLE": "Nonneg", "zero_lt": "Pos", "zeroLT": "Pos", "lezero": "Nonpos",
    "le_zero": "Nonpos", "ltzero": "Neg", "lt_zero": "Neg", "addSingle": "Single",
    "addSupport": "Support", "addTSupport": "TSupport", "addPointed": "Pointed",
    "addSpanning": "Spanning", "addIndicator": "Indicator", "isEven": "Even",
    "isRegular": "IsAddRegular", "isLeftRegular": "IsAddLeftRegular",
    "isRightRegular": "IsAddRightRegular", "hasFundamentalDomain": "HasAddFundamentalDomain",
    "quotientMeasure": "AddQuotientMeasure", "negFun": "InvFun", "uniqueProds": "UniqueSums",
    "orderOf": "AddOrderOf", "zeroLePart": "PosPart", "leZeroPart": "NegPart",
    "isScalarTower": "VAddAssocClass", "isOfFinOrder": "IsOfFinAddOrder",
    "isCentralScalar": "IsCentralVAdd", "function_addSemiconj": "Function_semiconj",
    "function_addCommute": "Function_commute", "divisionAddMonoid": "SubtractionMonoid",
    "subNegZeroAddMonoid": "SubNegZeroMonoid", "modularCharacter": "AddModularCharacter",
    "addShift": "Shift", "addSubshift": "Subshift",
    "isQuotientCoveringMap": "IsAddQuotientCoveringMap", "addExact": "Exact",
    "isMonHom": "IsAddMonHom", "mapMon": "MapAddMon", "monObj": "AddMonObj",
    "isModHom": "IsAddModHom", "mapMod": "MapAddMod", "modObj": "AddModObj",
    "yonedaMon": "YonedaAddMon", "conGen": "AddConGen"}

_DUAL_PAIRS = [
    ("top", "Bot"), ("bot", "Top"), ("inf", "Sup"), ("sup", "Inf"), ("inf₂", "Sup₂"),
    ("sup₂", "Inf₂"), ("sinf", "SSup"), ("ssup", "SInf"), ("min", "Max"), ("max", "Min"),
    ("untop", "Unbot"), ("unbot", "Untop"), ("minimal", "Maximal"), ("maximal", "Minimal"),
    ("lower", "Upper"), ("upper", "Lower"), ("below", "Above"), ("above", "Below"),
    ("least", "Greatest"), ("greatest", "Least"), ("glb", "LUB"), ("lub", "GLB"),
    ("cofinal", "Coinitial"), ("coinitial", "Cofinal"), ("succ", "Pred"), ("pred", "Succ"),
    ("disjoint", "Codisjoint"), ("codisjoint", "Disjoint"), ("atom", "Coatom"),
    ("coatom", "Atom"), ("lfp", "Gfp"), ("gfp", "Lfp"), ("ioi", "Iio"), ("iio", "Ioi"),
    ("ici", "Iic"), ("iic", "Ici"), ("ioc", "Ico"), ("ico", "Ioc"), ("next", "Prev"),
    ("prev", "Next"), ("heyting", "Coheyting"), ("coheyting", "Heyting"), ("frame", "Coframe"),
    ("coframe", "Frame"), ("epigraph", "Hypograph"), ("hypograph", "Epigraph"), ("epi", "Mono"),
    ("terminal", "Initial"), ("initial", "Terminal"), ("precompose", "Postcompose"),
    ("postcompose", "Precompose"), ("cone", "Cocone"), ("cocone", "Cone"), ("cones", "Cocones"),
    ("cocones", "Cones"), ("fan", "Cofan"), ("cofan", "Fan"), ("limit", "Colimit"),
    ("colimit", "Limit"), ("limits", "Colimits"), ("colimits", "Limits"),
    ("product", "Coproduct"), ("coproduct", "Product"), ("products", "Coproducts"),
    ("coproducts", "Products"), ("pushout", "Pullback"), ("pullback", "Pushout"),
    ("pushouts", "Pullbacks"), ("pullbacks", "Pushouts"), ("span", "Cospan"),
    ("cospan", "Span"), ("kernel", "Cokernel"), ("cokernel", "Kernel"),
    ("kernels", "Cokernels"), ("cokernels", "Kernels"), ("unit", "Counit"),
    ("counit", "Unit"), ("monad", "Comonad"), ("comonad", "Monad"), ("monadic", "Comonadic"),
    ("comonadic", "Monadic"), ("section", "Retraction"), ("retraction", "Section")]
DUAL_NAMES: dict[str, list[str]] = {src: [tgt] for src, tgt in _DUAL_PAIRS}

DUAL_ABBREVIATIONS: dict[str, str] = {
    "wellFoundedLT": "WellFoundedGT", "wellFoundedGT": "WellFoundedLT", "nhdsLT": "NhdsGT",
    "nhdsGT": "NhdsLT", "nhdsLE": "NhdsGE", "nhdsGE": "NhdsLE", "relIsoLT": "RelIsoGT",
    "relIsoGT": "RelIsoLT", "succColimit": "SuccLimit", "predColimit": "PredLimit",
    "codirectedOrder": "DirectedOrder", "directedOrder": "CodirectedOrder",
    "galoisInsertion": "GaloisCoinsertion", "galoisCoinsertion": "GaloisInsertion",
    "leftOrdContinuous": "RightOrdContinuous", "rightOrdContinuous": "LeftOrdContinuous",
    "neTop": "NeBot", "decidableSucc": "DecidablePred"}


@dataclass(frozen=True)
class Dictionaries:
    """The word dictionary and the abbreviation fixes of one translation attribute."""

    names: dict[str, list[str]]
    abbreviations: dict[str, str]


ADDITIVE = Dictionaries(ADDITIVE_NAMES, ADDITIVE_ABBREVIATIONS)
DUAL = Dictionaries(DUAL_NAMES, DUAL_ABBREVIATIONS)


def _is_upper(ch: str) -> bool:
    return "A" <= ch <= "Z"


def _lower(s: str) -> str:
    return "".join(chr(ord(c) + 32) if _is_upper(c) else c for c in s)


def split_case(s: str) -> list[str]:
    """``String.splitCase``: split at ``_`` (kept as its own part), after a name of
    ``END_CAPITAL_NAMES`` and between a lower-case and an upper-case letter."""
    parts: list[str] = []
    i0 = 0
    while True:
        i1 = i0 + 1
        if i1 >= len(s):
            parts.append(s)
            return parts
        if s[i0] == "_" or s[i1] == "_":
            parts.append(s[:i1])
            s, i0 = s[i1:], 0
            continue
        if _is_upper(s[i1]):
            tails = END_CAPITAL_NAMES.get(s[:i1])
            hit = next((x for x in tails if s[i1:].startswith(x)), None) if tails else None
            if hit is not None:
                parts.append(s[:i1] + hit)
                s, i0 = s[i1 + len(hit):], 0
                continue
            if not _is_upper(s[i0]):
                parts.append(s[:i1])
                s, i0 = s[i1:], 0
                continue
        i0 = i1


def decapitalize_seq(s: str) -> str:
    """Lower-case the leading run of upper-case letters."""
    k = 0
    while k < len(s) and _is_upper(s[k]):
        k += 1
    return _lower(s[:k]) + s[k:]


def decapitalize_like(r: str, s: str) -> str:
    """``s`` as is when ``r`` starts upper-case (an empty ``r`` counts as upper-case, as
    Lean's ``get`` past the end returns ``'A'``), else ``decapitalize_seq(s)``."""
    return s if not r or _is_upper(r[0]) else decapitalize_seq(s)


def apply_name_dict(d: Dictionaries, parts: list[str]) -> list[str]:
    """Translate every part through the word dictionary, keeping its capitalisation."""
    out: list[str] = []
    for x in parts:
        z = d.names.get(_lower(x))
        if z is None:
            out.append(x)
        else:
            out += [decapitalize_like(x, z[0])] + z[1:]
    return out


def fix_abbreviation(d: Dictionaries, parts: list[str]) -> str:
    """``fixAbbreviation``: join the parts, replacing runs found in the abbreviation table."""
    out: list[str] = []
    l, s = list(parts), []
    while True:
        if not l:
            if not s:
                return "".join(out)
            out.append(s[0])
            l, s = s[1:], []
            continue
        pre, rest = l[0], l[1:]
        s2 = s + [pre]
        t = "".join(s2)
        if pre == "_" and (not t or _is_upper(t[0])):
            out.append(s2[0])
            l, s = s2[1:] + rest, []
            continue
        post = d.abbreviations.get(decapitalize_seq(t))
        if post is not None:
            out.append(decapitalize_like(t, post))
            l, s = rest, []
        else:
            l, s = rest, s2


def guess_name(d: Dictionaries, s: str) -> str:
    """``guessName``: translate one name component, each ``'``-separated token separately."""
    return "'".join(fix_abbreviation(d, apply_name_dict(d, split_case(tok))) for tok in s.split("'"))


def target_name(d: Dictionaries, src: str, explicit: str | None,
                translations: dict[str, str]) -> str:
    """``targetName``: the generated declaration's full name. The last component of ``src`` is
    guessed; its namespace is mapped through the known translations (longest translated prefix
    first, ``Name.mapPrefix``). An explicit target with fewer components than ``src`` keeps the
    translated namespace's leading components; ``_root_.`` disables that."""
    namespace, _, last = src.rpartition(".")
    translated_ns = map_prefix(namespace, translations)
    if explicit is None:
        return f"{translated_ns}.{guess_name(d, last)}" if translated_ns else guess_name(d, last)
    if explicit.startswith("_root_."):
        return explicit.removeprefix("_root_.")
    keep = translated_ns.split(".") if translated_ns else []
    drop = explicit.count(".")
    keep = keep[:len(keep) - drop] if drop else keep
    return ".".join([*keep, explicit])


def map_prefix(name: str, translations: dict[str, str]) -> str:
    """``Name.mapPrefix``: replace the longest prefix of ``name`` that has a translation."""
    if not name:
        return name
    if name in translations:
        return translations[name]
    head, _, last = name.rpartition(".")
    mapped = map_prefix(head, translations)
    return f"{mapped}.{last}" if mapped else last
