"""Speculative decoding: every query token of a verification step is metered; prefill counts prompts only.

A verification step feeds a request's last token and its drafted tokens (ngram speculation here) as one query
of several tokens; each is a decode cell attending the lossy cache with its own causal length. One engine
(plugin on, exact shadow, ``rtn-int4``, ngram drafts of 3) generates from a repetitive prompt (drafts get
proposed and accepted). Oracles: vLLM's own counters (every verification step meters ``1 + drafts`` query
tokens: cells = (generated - 1 + drafts - accepted) x 30 layers x 9 heads over all requests, the warm-up
included, plus at most the drafts of each request's last step, whose tokens ``max_tokens`` may cut off), each request's generated positions (all metered, per layer and head), the prompts' token counts
(the prefill count), the shadow's fp64 true TV of every cell.
"""
import json

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, run_engine

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

PROMPTS = (", ".join(str(i % 7) for i in range(90)), "one two three four one two three four one two three")
LAYERS, HEADS = 30, 9


def test_every_verification_row_is_metered_and_sound(tmp_path):
    jsonl = tmp_path / "cells.jsonl"
    summary = run_engine("--plugin", "--shadow", "--scheme", "rtn-int4", "--speculative-ngram", "3",
                         "--max-tokens", "24", "--jsonl", str(jsonl), "--prompts", *PROMPTS)
    snap, counters = summary["witcert"], summary["vllm_metrics"]
    drafts, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and accepted > 0  # speculation ran, and some drafts were verified in one step
    requests = [summary["warmup"]] + [{"prompt_tokens": o["prompt_tokens"], "generated_tokens": len(o["token_ids"])}
                                      for o in summary["outputs"]]
    assert snap["prefill_tokens"] == sum(r["prompt_tokens"] for r in requests)  # verification steps are not prefill
    query_tokens = sum(r["generated_tokens"] - 1 for r in requests) + drafts - accepted
    # plus the rows of a request's last verification step whose accepted tokens max_tokens cut off (computed and
    # attended, so metered; at most the 3 drafts per request)
    cut = snap["cells"] / (LAYERS * HEADS) - query_tokens
    assert cut == int(cut) and 0 <= cut <= 3 * len(summary["outputs"]), cut
    assert snap["shadow_cells"] == snap["cells"] and snap["shadow_violations"] == 0
    assert snap["schemes"]["rtn-int4"]["max_true_tv"] > 0  # lossy: the check is not vacuous
    seen = {}
    for path in jsonl.parent.glob(jsonl.name + ".*"):
        for row in map(json.loads, open(path)):
            seen.setdefault((row["request"], row["layer"], row["head"]), []).append(row["step"])
            assert row["true_tv"] <= row["meter"]
    for rid, out in zip(summary["request_ids"], summary["outputs"]):
        positions = [v for (r, layer, head), v in seen.items() if r.startswith(rid) and layer == 0 and head == 0]
        assert len(positions) == 1
        wanted = set(range(out["prompt_tokens"], out["prompt_tokens"] + len(out["token_ids"]) - 1))
        assert wanted <= set(positions[0])  # every generated token's position is metered
