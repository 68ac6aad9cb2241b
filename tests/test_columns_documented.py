"""Every column a monitored run produces is documented, and the documented list holds nothing else (issue 41 item 6).

Implementation: ``witcert.integrations.hf.telemetry.COLUMNS`` (the column reference is generated from it,
``scripts/gen_cli_reference.py``). Oracle: the columns of real cell tables of the tiny Llama under every
option that adds columns: the spot check with the spot-certified gate, a production gate, the dithered cache
with a Tier B delta sweep (as ``witcert observe`` records), sampled metering. Tolerance: exact names
(``meter_delta=<d>`` stands for every swept budget).
"""
import re

import pytest
import torch

import witcert
from witcert.integrations.hf.telemetry import COLUMNS
from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
DOCUMENTED = [name for name, _, _ in COLUMNS]


def _documented(column: str) -> bool:
    return column in DOCUMENTED or bool(re.fullmatch(r"meter_delta=[0-9.e+-]+", column))


def _columns(**options) -> set[str]:
    model = tiny("llama")
    ids, mask = prompts(2, length=24)
    sweep = options.pop("sweep", None)
    mon = witcert.monitor(model, **options)
    if sweep:
        mon.delta_sweep = sweep
    with torch.no_grad(), mon:
        if sweep:  # as the observatory does: a prefill, then a teacher-forced probe over the cache
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            with mon.non_adaptive():
                model(input_ids=ids[:1, :16], past_key_values=cache)
                model(input_ids=ids[:1, 16:], past_key_values=cache)
        else:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    return set(mon.table().columns)


RUNS = {
    "spot check and spot-certified gate": dict(scheme="kivi-2bit", certificate="spot", spot_keys=8, tau=0.04,
                                               gate=witcert.Gate(tau=0.04)),
    "production gate": dict(scheme="rtn-int4", keep_exact=False, gate=witcert.Gate(tau=0.05)),
    "tier B with a delta sweep": dict(scheme="dithered-int8", sweep={"meter_delta=0.5": 1e-3}),
    "sampled metering": dict(scheme="rtn-int8", sample=witcert.MeterSampling(every=2, seed=0)),
}


@pytest.mark.parametrize("options", RUNS.values(), ids=RUNS.keys())
def test_every_column_of_a_run_is_documented(options):
    columns = _columns(**dict(options))
    missing = sorted(c for c in columns if not _documented(c))
    assert not missing, f"document these in telemetry.COLUMNS (and run scripts/gen_cli_reference.py): {missing}"


def test_the_documented_list_names_each_column_once_and_every_one_is_produced():
    assert len(DOCUMENTED) == len(set(DOCUMENTED))
    produced = set().union(*(_columns(**dict(options)) for options in RUNS.values()))
    produced = {"meter_delta=<d>" if c.startswith("meter_delta=") else c for c in produced}
    assert set(DOCUMENTED) == produced, sorted(set(DOCUMENTED) ^ produced)
