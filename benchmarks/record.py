"""Writing a benchmark's record: one JSON file under ``benchmarks/results/`` (the results page renders it)."""
import json
from pathlib import Path


def write_json(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` (its directory made if missing), indented as the committed records are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
