"""The declared dependencies agree with the exact pins: ``pyproject.toml`` ranges admit ``requirements.txt``.

Implementation under test: ``[project] dependencies`` and ``optional-dependencies`` of
``pyproject.toml``. Oracle: ``requirements.txt``, the one place of exact pins (what ``make install``
installs and the suite is run against), read with ``packaging``. Tolerance: exact.
"""
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# Where each extra is pinned: the main venv's files, except the vLLM plugin's own venv (its pins differ).
PIN_FILES = {"vllm": ["requirements-vllm.txt"]}
MAIN_PIN_FILES = ["requirements.txt", "requirements-quant.txt"]  # the core pins, then the 'quant' extra's


def _pins(where: str = "core") -> dict[str, str]:
    pins = {}
    lines = [line for name in PIN_FILES.get(where, MAIN_PIN_FILES) for line in (ROOT / name).read_text().splitlines()]
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"pin files pin exactly: {line}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared() -> list[tuple[str, Requirement]]:
    found = [("core", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra, reqs in PROJECT["optional-dependencies"].items():
        found += [(extra, Requirement(r)) for r in reqs]
    return [(where, req) for where, req in found if canonicalize_name(req.name) != "witcert"]


def test_every_declared_dependency_is_pinned_and_its_range_admits_the_pin():
    for where, req in _declared():
        pins, name = _pins(where), canonicalize_name(req.name)
        assert name in pins, f"{req} ({where}) has no exact pin in {PIN_FILES.get(where, MAIN_PIN_FILES)}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req} ({where}) excludes the pin {pins[name]}"


def test_torch_is_pinned_exactly():
    # a range admitting a newer release would let pip fetch a multi-GB CUDA build instead of the CPU wheel
    (torch,) = [req for _, req in _declared() if req.name == "torch"]
    assert str(torch.specifier) == "==2.13.0"


def test_extras_refer_only_to_extras_that_exist():
    extras = set(PROJECT["optional-dependencies"])
    for where, reqs in PROJECT["optional-dependencies"].items():
        for r in map(Requirement, reqs):
            if canonicalize_name(r.name) == "witcert":
                assert r.extras <= extras, f"{where}: unknown extras {r.extras - extras}"
