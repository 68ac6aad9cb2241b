"""Capacity by accounting is the bytes a monitored generation holds (issue 44 item 4).

Implementations: :func:`witcert.integrations.hf.footprint.footprint` (what ``benchmarks/capacity.py`` and
``witcert schemes --memory`` report) and the benchmark's accounting rows. Oracles: ``mon.memory()`` of a
production ``witcert.monitor`` run over the same scheme (itself the bytes of the tensors held,
``tests/test_memory_account.py``), and the byte counts the codes imply (int4: half a byte per value, plus
2 bytes per 32-value group in bf16; the witness 16 one-byte band norms plus 3 bytes of value statistics, or,
derived from the codec's error bound, the 2-byte value norm alone).
Domain: a tiny Llama (head dim 32, fp32) prefilling 64 tokens; head dims 64 and 128 in bf16.
Tolerance: none (bytes are exact).
"""
import re

import pytest
import torch

import witcert
from benchmarks.capacity import UserInt4, accounting_rows
from tiny_models import tiny
from witcert.cli import main
from witcert.integrations.hf.footprint import footprint


@pytest.mark.parametrize("scheme", ["rtn-int4", "rtn-int8", "kivi-2bit", "fp8-e4m3", UserInt4()],
                         ids=lambda s: s if isinstance(s, str) else "user-int4")
def test_the_accounting_is_what_a_monitored_prefill_holds(scheme):
    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), witcert.monitor(model, scheme, keep_exact=False) as mon:
        model(input_ids=ids)  # one prefill: the steady state the accounting describes
    total = mon.memory().total
    per_token = 64 * 2 * 2  # tokens x layers x kv heads
    expected = footprint(scheme, 32, dtype=torch.float32)
    assert total.compressed / per_token == expected.raw
    assert total.witness / per_token == expected.witness
    assert total.exact_cache / per_token == expected.exact


@pytest.mark.parametrize("head_dim, raw, monitored", [(64, 72, 91), (128, 144, 163)])
def test_bf16_int4_bytes_are_the_codes_statistics_and_the_one_byte_witness(head_dim, raw, monitored):
    """rtn-int4 per token and kv head, keys and values: d/2 code bytes + 2 bytes per 32 channels each, then the
    witness of 16 one-byte band norms and 3 bytes of value statistics."""
    f = footprint("rtn-int4", head_dim, witness_bits=8)
    assert (f.raw, f.monitored, f.exact) == (raw, monitored, 4 * head_dim)
    assert f.capacity() == 4 * head_dim / monitored
    (row,) = accounting_rows(("rtn-int4",), layers=30, kv_heads=3, head_dim=head_dim)
    derived = raw + 2  # the default for rtn-int4: the witness derived from the codes' scales, the value norm kept
    assert row["witness_bits"] == 0 and row["bytes_per_token_monitored"] == 90 * derived
    assert row["tokens_in_budget"]["monitored"] == 2**30 // (90 * derived)
    assert row["capacity_monitored_derived_witness"] == 4 * head_dim / derived


def test_witcert_schemes_lists_the_bytes_with_memory(capsys):
    assert main(["schemes", "--memory", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^rtn-int4 +72 +74 +3\.46x +3\.46x ", out, re.M)  # derived by default
    assert re.search(r"^rtn-int8 +136 +147 +1\.74x +1\.86x ", out, re.M)  # a 4-bit fraction by default
    assert re.search(r"^kivi-2bit +48 +67 +3\.82x +5\.12x ", out, re.M)  # the byte by default, derived opt-in
    assert re.search(r"^hf-quanto-int4 .* n/a ", out, re.M) or "extra 'quant'" in out
    assert main(["schemes"]) == 0
    assert "--memory" in capsys.readouterr().out  # the plain listing says where the bytes are
    with pytest.raises(SystemExit):
        main(["schemes", "--memory", "--head-dim", "63"])
