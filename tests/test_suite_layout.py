"""The test suite's own layout: pytest imports test files by basename (no packages under tests/), so two files
with one basename in different folders stop the whole run at collection ("import file mismatch")."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_test_file_has_a_unique_basename():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert len(names) > 50  # the walk found the suite
    assert [name for name, count in names.items() if count > 1] == []
