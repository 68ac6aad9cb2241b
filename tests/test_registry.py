"""The registry (spec/registry.py) names real objects: every spec mirror, torch implementation,
kernel and test file it lists exists. (The Lean side and docs/theorem_map.md are kept in sync by
tests/test_formal_audit.py.)"""
from importlib import import_module
from pathlib import Path

import pytest

from witcert.spec.registry import THEOREMS, by_key

ROOT = Path(__file__).resolve().parents[1]


def _resolve(dotted: str):
    module, _, attribute = dotted.rpartition(".")
    return getattr(import_module(module), attribute)


@pytest.mark.parametrize("theorem", THEOREMS, ids=lambda t: t.key)
def test_named_objects_exist(theorem):
    for field in ("spec", "torch", "kernel"):
        dotted = getattr(theorem, field)
        if dotted is not None:
            assert callable(_resolve(dotted)), f"{theorem.key}.{field} = {dotted} is not callable"


@pytest.mark.parametrize("theorem", THEOREMS, ids=lambda t: t.key)
def test_named_tests_exist_and_none_is_missing(theorem):
    assert theorem.tests, f"{theorem.key} names no test"
    for path in theorem.tests:
        assert (ROOT / path).is_file(), f"{theorem.key} names missing test file {path}"


@pytest.mark.parametrize("theorem", THEOREMS, ids=lambda t: t.key)
def test_spec_mirrors_name_their_lean_declaration(theorem):
    if theorem.lean and theorem.spec and theorem.spec.startswith("witcert.spec.bounds"):
        assert theorem.lean in (_resolve(theorem.spec).__doc__ or ""), (
            f"{theorem.spec} docstring should name {theorem.lean}")


def test_keys_are_unique_and_lookup_works():
    keys = [t.key for t in THEOREMS]
    assert len(keys) == len(set(keys))
    assert by_key("T1").lean == "WitCert.tv_le_eform"
    with pytest.raises(KeyError):
        by_key("nope")
