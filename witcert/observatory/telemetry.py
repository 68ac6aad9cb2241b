"""The observatory's telemetry is the monitor's: :mod:`witcert.integrations.hf.telemetry` (one implementation).

Re-exported here so that ``witcert.observatory.telemetry`` keeps naming the cell table and the
JSONL format the observatory writes.
"""
from witcert.integrations.hf.telemetry import CellTable, cell_table, concat, read_jsonl, write_jsonl

__all__ = ["CellTable", "cell_table", "concat", "read_jsonl", "write_jsonl"]
