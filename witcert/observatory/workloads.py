"""Offline workloads for the observatory: needle-in-a-haystack retrieval, natural text, code.

Everything is generated or read from files every Python install (or Debian) carries, so no
network is needed:

- natural text: ``/usr/share/common-licenses/GPL-3`` (Debian), else the English prose of the
  Python reference manual shipped in the standard library (``pydoc_data.topics``);
- code: Python standard library sources (``json``, ``argparse``, ``dataclasses``, ...);
- needle: a passkey (or several keyed passkeys) hidden at a chosen depth of a natural-text
  haystack, asked for at the end and scored by exact match of the digits generated;
- prompt: the user's own text, prefilled and continued greedily (nothing to score).
"""
from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

_GPL = Path("/usr/share/common-licenses/GPL-3")
_CODE_MODULES = ("json.decoder", "argparse", "dataclasses", "functools", "textwrap", "string")
_KEY_NAMES = ("red", "blue", "green", "amber", "violet", "silver", "orange", "black")
DOMAINS = ("needle", "text", "code")


@dataclass(frozen=True)
class NeedleCase:
    """One retrieval prompt: ``context`` (haystack with needles) then ``question``.

    The answer digits must be the first number of the model's continuation (exact match).
    """

    context: str
    question: str
    answer: str
    depth: float  # where the needle sits, as a fraction of the haystack
    keys: int  # 1: single passkey; > 1: multi-key, one of them asked for

    def __post_init__(self):
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1], got {self.depth}")
        if not self.answer.isdigit():
            raise ValueError(f"answer must be digits, got {self.answer!r}")
        if self.keys < 1:
            raise ValueError(f"keys must be >= 1, got {self.keys}")

    @property
    def prompt(self) -> str:
        return self.context + self.question

    def score(self, continuation: str) -> bool:
        """Exact match: the first digit run of the continuation equals the answer."""
        found = re.search(r"\d+", continuation)
        return found is not None and found.group(0) == self.answer


@dataclass(frozen=True)
class TextCase:
    """A teacher-forced case: ``context`` is prefilled, ``continuation`` is scored token by token."""

    domain: str
    context: str
    continuation: str
    source: str = field(default="")

    def __post_init__(self):
        if not self.context or not self.continuation:
            raise ValueError("context and continuation must be non-empty")


@dataclass(frozen=True, eq=False)
class PromptCase:
    """The user's own prompt: every token but the last is prefilled, the last is the probe, then greedy decoding.

    Build it with :func:`prompt_case` (the split is made on token ids, so nothing is re-tokenized).
    Nothing is scored: its quality figures are the KL and top-1 agreement of the probe token.
    """

    prompt: str
    context_ids: object  # (1, n - 1) LongTensor
    probe_ids: object  # (1, 1) LongTensor


def prompt_case(tokenizer, prompt: str) -> PromptCase:
    """A :class:`PromptCase` of ``prompt``; ``ValueError`` unless it is at least two tokens long."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] < 2:
        raise ValueError(f"prompt: {prompt!r} is {ids.shape[1]} token(s) with this model's tokenizer; give at least "
                         "two (the last is the first metered query)")
    return PromptCase(prompt=prompt, context_ids=ids[:, :-1], probe_ids=ids[:, -1:])


def generates(case) -> bool:
    """Whether a case is followed by greedy decoding (a needle's answer, a prompt's continuation)."""
    return isinstance(case, (NeedleCase, PromptCase))


def natural_text() -> tuple[str, str]:
    """(text, source) of English prose available offline."""
    if _GPL.is_file():
        return _GPL.read_text(encoding="utf-8"), str(_GPL)
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (Python reference manual)"


def code_text() -> tuple[str, str]:
    """(text, source) of Python standard library code."""
    parts, sources = [], []
    for name in _CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            parts.append(Path(spec.origin).read_text(encoding="utf-8"))
            sources.append(name)
    if not parts:
        raise RuntimeError("no Python standard library source found for the code workload")
    return "\n\n".join(parts), "Python stdlib: " + ", ".join(sources)


def _token_window(tokenizer, text: str, start: int, length: int) -> str:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < start + length:
        raise ValueError(f"source has {len(ids)} tokens, fewer than start+length={start + length}")
    return tokenizer.decode(ids[start : start + length])


def text_cases(tokenizer, domain: str, context_tokens: int, continuation_tokens: int, count: int = 1) -> list[TextCase]:
    """``count`` teacher-forcing cases from the ``domain`` source ("text", "code" or a file path)."""
    if domain == "text":
        source_text, source = natural_text()
    elif domain == "code":
        source_text, source = code_text()
    else:
        path = Path(domain)
        if not path.is_file():
            raise ValueError(f"task: {domain!r} is neither needle/text/code nor a readable file")
        source_text, source = path.read_text(encoding="utf-8", errors="replace"), str(path)
    ids = tokenizer(source_text, add_special_tokens=False).input_ids
    span = context_tokens + continuation_tokens
    if len(ids) < span:
        raise ValueError(f"{source} has {len(ids)} tokens, fewer than context+continuation={span}")
    stride = max(1, (len(ids) - span) // max(1, count))
    cases = []
    for i in range(count):
        start = i * stride
        cases.append(
            TextCase(
                domain=domain if domain in ("text", "code") else "file",
                context=tokenizer.decode(ids[start : start + context_tokens]),
                continuation=tokenizer.decode(ids[start + context_tokens : start + span]),
                source=source,
            )
        )
    return cases


def needle_cases(
    tokenizer,
    context_tokens: int,
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    keys: tuple[int, ...] = (1, 4),
    seed: int = 0,
) -> list[NeedleCase]:
    """Passkey prompts of about ``context_tokens`` tokens, one per (keys, depth).

    The haystack is natural text; the needle sentence(s) are inserted at ``depth``; with
    ``keys > 1`` the other keyed passkeys are scattered uniformly and one key is asked for.
    """
    rng = random.Random(seed)
    hay_text, _ = natural_text()
    hay_ids = tokenizer(hay_text, add_special_tokens=False).input_ids
    cases = []
    for n_keys in keys:
        for depth in depths:
            cases.append(_needle_case(tokenizer, hay_ids, context_tokens, depth, n_keys, rng))
    return cases


def _needle_case(tokenizer, hay_ids, context_tokens, depth, n_keys, rng) -> NeedleCase:
    names = rng.sample(_KEY_NAMES, n_keys)
    codes = [str(rng.randint(10000, 99999)) for _ in names]
    asked = rng.randrange(n_keys)
    if n_keys == 1:
        needles = [f" The pass key is {codes[0]}. Remember it. {codes[0]} is the pass key. "]
        question = " What is the pass key? The pass key is"
    else:
        needles = [f" The {n} pass key is {c}. Remember it. {c} is the {n} pass key. " for n, c in zip(names, codes)]
        question = f" What is the {names[asked]} pass key? The {names[asked]} pass key is"
    intro = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
    budget = context_tokens - len(tokenizer(intro + question + "".join(needles)).input_ids)
    if budget < 16:
        raise ValueError(f"context_tokens={context_tokens} too small for the needle prompt")
    hay = list(hay_ids[:budget])
    # the asked needle goes at `depth`; the others at random depths
    spots = [rng.random() for _ in needles]
    spots[asked] = depth
    pieces, cursor = [], 0
    for spot, needle in sorted(zip(spots, needles)):
        cut = int(spot * len(hay))
        pieces.append(tokenizer.decode(hay[cursor:cut]))
        pieces.append(needle)
        cursor = cut
    pieces.append(tokenizer.decode(hay[cursor:]))
    return NeedleCase(
        context=intro + "".join(pieces), question=question, answer=codes[asked], depth=depth, keys=n_keys
    )
