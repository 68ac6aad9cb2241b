"""Prefix caching never serves one scheme's keys to another (the scheme and gate are part of the cache salt).

vLLM shares full prompt blocks between requests whose tokens hash alike. One engine (plugin on, exact shadow,
prefix caching on, ``rtn-int4`` loadable per request) serves one prompt three times, one request after the
other: ``rtn-int4``, then ``none``, then ``rtn-int4`` again. Oracles: the shadow's fp64 true TV of every cell
(the ``none`` request must attend exact keys: true TV 0 and a meter at the score rounding), vLLM's own prefix
cache counters (the third request reuses the first one's blocks: the sharing still works within a scheme),
and the first request's cells (the third, whose prefix comes from the cache, meters the same cells, and in layer 0
the same first decode step).
"""
import json

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, run_engine

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

PROMPT = " ".join(["The lighthouse keeper climbed the winding stairs each night and lit the great lamp."] * 30)


def test_a_request_attends_the_keys_of_its_own_scheme_with_prefix_caching_on(tmp_path):
    jsonl = tmp_path / "cells.jsonl"
    xargs = [{"witcert_scheme": "rtn-int4"}, {"witcert_scheme": "none"}, {"witcert_scheme": "rtn-int4"}]
    summary = run_engine("--plugin", "--shadow", "--prefix-caching", "--schemes", "rtn-int4", "--max-tokens", "4",
                         "--jsonl", str(jsonl), "--xargs", json.dumps(xargs), "--prompts", PROMPT, PROMPT, PROMPT)
    snap, counters = summary["witcert"], summary["vllm_metrics"]
    assert summary["outputs"][0]["prompt_tokens"] > 300  # several full cache blocks to share
    assert snap["shadow_violations"] == 0
    none, lossy = snap["schemes"]["none"], snap["schemes"]["rtn-int4"]
    assert none["max_true_tv"] == 0.0 and none["max_meter"] < 1e-9  # exact keys, not the rtn-int4 request's
    assert lossy["max_true_tv"] > 0  # the lossy requests attend compressed keys
    assert counters["vllm:prefix_cache_hits"] >= summary["outputs"][0]["prompt_tokens"] // 2  # shared within a scheme
    ids, cells = summary["request_ids"], {}
    for path in jsonl.parent.glob(jsonl.name + ".*"):
        for row in map(json.loads, open(path)):
            base = next((i for i in ids if row["request"] == i or row["request"].startswith(i + "-")), None)
            if base is not None:  # not the warm-up request
                cells.setdefault(base, {})[(row["layer"], row["head"], row["step"])] = row["meter"]
    first, third = cells[ids[0]], cells[ids[2]]
    assert len(first) == 3 * 30 * 9 and first.keys() == third.keys()
    # layer 0's keys and its first decode query depend on the tokens alone (deeper layers' tail keys do not: the
    # third request's tail prefill attends the cached prefix as stored, rtn-int4, the first attended it exact)
    step = min(k[2] for k in first)
    same = [k for k in first if k[0] == 0 and k[2] == step]
    assert len(same) == 9
    assert all(abs(first[k] - third[k]) <= 1e-6 * first[k] + 1e-12 for k in same)  # the prefix read from the cache
