"""Every code block of the README and the documentation site runs as written, or is checked as a command.

Implementation: the fenced blocks of ``README.md`` and ``docs/**/*.md`` (generated pages excluded).
Oracles, by the fence's language:

* ``python``: executed alone in a fresh namespace, in a temporary working directory, on one torch
  thread; the block's own assertions are the oracle (a block that loads the embedded model is
  marked ``model``);
* ``bash``: each command is checked without being run (a ``witcert`` command line parses with the
  command's own parser, a ``make`` target exists in the Makefile, a ``python -m`` module or a
  ``python script`` path exists, an exact ``pip install`` pin equals the project's pin); any other
  program must be one of :data:`EXTERNAL` (documented, never run here);
* ``toml``: parses;
* ``text``: output or a diagram, nothing to run.

A fence without a language fails: every block is classified. Tolerance: exact.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"docs/theorem_map.md", "docs/reference/cli.md", "docs/reference/columns.md", "docs/study/report.md",
             "docs/results.md"}
EXTERNAL = {"curl", "cd", "git", "lake", "elan", "vllm", "export"}  # documented commands of other tools
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LANGUAGES = {"python", "bash", "toml", "text"}


def doc_files() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if str(p.relative_to(ROOT)) not in GENERATED]


def blocks(language: str | None = None) -> list[tuple[str, str, str]]:
    """(where, language, code) of every fenced block, ``where`` as ``file:line``."""
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            lang = match.group(1).strip().split(" ")[0]
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            if language is None or lang == language:
                found.append((where, lang, match.group(2)))
    return found


def _params(language: str):
    return [pytest.param(code, id=where, marks=[pytest.mark.model] if "load_model" in code else [])
            for where, _, code in blocks(language)]


def test_every_block_names_a_language_this_test_knows():
    unknown = [f"{where}: {lang or '(none)'}" for where, lang, _ in blocks() if lang not in LANGUAGES]
    assert not unknown, unknown


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("code", _params("python"))
def test_python_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<docs block>", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("code", _params("toml"))
def test_toml_block_parses(code):
    tomllib.loads(code)


@pytest.mark.parametrize("code", _params("bash"))
def test_bash_block_commands_exist_as_written(code):
    for line in _command_lines(code):
        _check_command(shlex.split(line, comments=True))


def _command_lines(code: str) -> list[str]:
    """Commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _check_command(argv: list[str]) -> None:
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if "|" in argv:
        argv = argv[:argv.index("|")]
    program, args = Path(argv[0]).name, argv[1:]
    if program == "witcert":
        from witcert.cli import build_parser

        build_parser().parse_args(args)  # SystemExit (a failure) on anything the parser rejects
    elif program == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        assert set(args) <= targets, f"make {' '.join(args)}: no such target"
    elif program.startswith("python"):
        _check_python(args)
    elif program == "pip":
        _check_pins(args)
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), f"bash {args[0]}: no such script"
    else:
        assert program in EXTERNAL, f"{program}: not a command this test can check (add it to EXTERNAL if it is another tool's)"


def _check_python(args: list[str]) -> None:
    if args[:1] == ["-m"]:
        module = args[1]
        if module == "pip":
            return _check_pins(args[2:])
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
    elif args and args[0] != "-c":
        assert (ROOT / args[0]).is_file(), f"python {args[0]}: no such script"


def _check_pins(args: list[str]) -> None:
    pins = {}
    for name in ("requirements.txt", "requirements-quant.txt", "requirements-vllm.txt"):
        for line in (ROOT / name).read_text().splitlines():
            spec = line.split("#", 1)[0].strip()
            if "==" in spec:
                package, version = spec.split("==")
                pins.setdefault(package.lower(), set()).add(version.strip())
    for arg in args:
        if "==" in arg and not arg.startswith("-"):
            package, version = arg.split("==")
            assert version in pins.get(package.lower(), set()), f"pip install {arg}: not the project's pin"
