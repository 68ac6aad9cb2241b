"""benchmarks/long_context.py at tiny sizes: both parts run and the record holds positive finite figures."""
import json
import math

import pytest

pytest.importorskip("transformers")

from benchmarks import long_context  # noqa: E402


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_long_context_tiny(tmp_path):
    out = tmp_path / "long_context.json"
    argv = ["--contexts", "64", "--layer-contexts", "128", "--reps", "1", "--layer-reps", "1",
            "--new-tokens", "2", "--no-compiled", "--out", str(out)]
    assert long_context.main(argv) == 0
    record = json.loads(out.read_text())
    for key in ("date", "machine", "command", "decode", "layer"):
        assert key in record
    assert "--contexts 64" in record["command"]
    (decode,) = record["decode"]
    assert decode["context"] == 64 and decode["new_tokens"] == 2 and decode["reps"] == 1
    assert set(decode["tokens_per_s"]) == {"stock", "monitored", "observed"}
    for field in ("tokens_per_s", "ms_per_token", "first_step_s", "wall_s_n_plus_1"):
        assert all(_positive_finite(v) for v in decode[field].values()), field
    assert all(_positive_finite(v) for v in decode["ratio_to_stock"].values())
    (layer,) = record["layer"]
    assert layer["context"] == 128
    assert set(layer["ms_per_layer_step"]) == {"sdpa", "stock step", "meter", "meter, in step"}
    assert all(_positive_finite(v) for v in layer["ms_per_layer_step"].values())
    assert _positive_finite(layer["ratio_sdpa_plus_meter_over_sdpa"])
    assert layer["final_lengths"]["meter"] > 128
