"""Provenance and writing of the spot-check benchmark records (``benchmarks/results/spot_*.json``)."""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from benchmarks import machine


def provenance(module: str, argv=None) -> dict:
    """``date`` (UTC), ``machine`` (one torch thread, shared), the exact ``command`` of a run of ``module`` and the
    machine's load average at its start (``load_at_start``: 1, 5, 15 minutes; the cores are shared, so a ratio
    measured at a load well above the core count is noisier)."""
    info = machine.describe(1)
    return {"load_at_start": [round(x, 2) for x in os.getloadavg()],"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{info['cpu']} ({info['logical_cpus']} logical CPUs, shared with other engineers' jobs), "
                       "1 torch thread",
            "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)}


def write(record: dict, out: Path) -> None:
    """``record`` as indented JSON at ``out`` (folders made), and say so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
