"""The plugin under ``tensor_parallel_size=2``: every (layer, query head) metered once across workers.

SmolLM2-135M has 9 query heads and 3 kv heads, which vLLM cannot split over two workers
(``heads_dividing`` gives its reason; the first test records it). The TP run uses SmolLM2 cut to
2 kv heads and their 6 query heads (``sliced_model``): vLLM's CPU build runs it with one worker
process per rank, each bound to one core. Oracles: the token count (decode steps x 30 layers x 6
query heads cells, summed over the workers' snapshots), the exact shadow (0 violations, and every
repaired slot read back exact), and the per-cell log (each (layer, global query head, step) of a
request exactly once, heads 0-2 from rank 0 and 3-5 from rank 1).
"""
import collections
import glob
import json

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, heads_dividing, run_engine, sliced_model

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)


def test_full_smollm2_cannot_be_split_in_two(smollm2):
    assert heads_dividing(smollm2, 2) == \
        "Total number of attention heads (9) must be divisible by tensor parallel size (2)."


def test_tp2_meters_every_head_once_with_a_lossy_scheme_and_the_gate(smollm2, tmp_path_factory):
    model = sliced_model(smollm2, tmp_path_factory.getbasetemp() / "smollm2-6q-2kv")
    assert heads_dividing(model, 2) is None
    jsonl = tmp_path_factory.mktemp("tp") / "cells.jsonl"
    tokens = 6
    summary = run_engine("--tp", "2", "--plugin", "--shadow", "--gate", "--scheme", "rtn-int4",
                         "--dtype", "float32", "--max-tokens", str(tokens), "--jsonl", str(jsonl),
                         "--prompts", "The capital of France is", "def add(a, b):", model=model)
    snap = summary["witcert"]
    assert snap["engines"] == 2
    steps = sum(len(o["token_ids"]) - 1 for o in summary["outputs"])
    assert steps == 2 * (tokens - 1)
    assert snap["schemes"]["rtn-int4"]["cells"] == snap["cells"]
    assert snap["shadow_cells"] == snap["cells"]
    assert snap["shadow_violations"] == 0
    assert snap["gate_counts"]["shadow_repair_mismatches"] == 0
    assert snap["schemes"]["rtn-int4"]["max_true_tv"] > 0  # lossy, not a witness-0 cache

    seen = collections.Counter()
    for path in glob.glob(str(jsonl) + ".*"):
        for line in open(path):
            row = json.loads(line)
            seen[(row["request"], row["layer"], row["step"], row["head"])] += 1
            assert row["true_tv"] <= row["meter"]
    assert len(seen) == snap["cells"] and set(seen.values()) == {1}  # the snapshots' sum: each cell once
    assert {key[3] for key in seen} == set(range(6))
    # the engine ids are the returned ids plus a suffix; cells of no returned id: the warm-up request
    ours = [key for key in seen if key[0].rsplit("-", 1)[0] in summary["request_ids"]]
    assert len(ours) == steps * 30 * 6
