"""Tier B through the HF integration: model dtypes, batched streams, secret seeds (issue 16 items 2, 3, 8).

Implementations: ``witcert.monitor`` (the ``"witcert"`` attention) over the dithered codec of
``witcert.integrations.hf.codecs`` in ``witcert.integrations.hf.compressed_cache.CompressedLayer``,
``witcert.integrations.hf.cells.tighten_with_tier_b``, the telemetry of
``witcert.integrations.hf.telemetry``, and the attack classes ``witcert.verification.attacks.model_dtypes`` /
``witcert.verification.attacks.batched_dither``. Oracles: the fp64 TV over the exact keys of the model cache
(``model_dtypes.oracle_tv``, causal mask built independently), single-row quantization with the
row's own request id, and bitwise comparison of reconstructions. Domain: tiny random Llama models
(head dim 32, GQA) in fp32, fp16 and bf16, batches of 2-5 rows. Tolerance: none.
"""
import numpy as np
import pytest
import torch

from witcert import DitheredInt8, Monitor
from witcert.tier_b.counters import StandaloneCounter
from witcert.integrations.hf import telemetry
from witcert.integrations.hf.codecs import Dither
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.integrations.hf.monitoring import DITHERED
from witcert.verification.attacks import ATTACKS, batched_dither, model_dtypes
from witcert.tier_a.bands import BandLayout

LAYOUT = BandLayout(head_dim=32, bands=8, rope="rotate_half")


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- item 2: half-precision models


@pytest.mark.parametrize("tier", ["auto", "B"])  # the monitor's default resolves to Tier B for this cache
def test_bf16_model_adaptive_cells_cover_the_cast_of_the_keys(tier):
    """A spiky bf16 model, three copies of one token, adaptive probe: the configuration where the
    fp32-only deterministic branch gave meter < TV (2 cells, TV/meter = 1.25 before the fix)."""
    model = model_dtypes.spiky_llama(torch.bfloat16, 31, 14.41218646547984, 24.67829895260539)
    monitor = Monitor(model, DITHERED, tier=tier, bands=8, seed=1255200654889945937)
    calls = model_dtypes.recorded_run(model, monitor, torch.full((4, 3), 14), 2, adaptive_probe=True)
    assert len(calls) == 2
    for call in calls:
        assert call.k_hat.dtype == torch.bfloat16
        tv = model_dtypes.oracle_tv(call)
        assert (tv <= call.meter).all(), f"TV {tv[tv > call.meter]} above meter {call.meter[tv > call.meter]}"


def test_model_dtypes_attack_finds_no_violation():
    tally = model_dtypes.run(3, torch.Generator().manual_seed(11))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


# ---------------------------------------------------------------- item 3: one stream per batch row


class _Layer:
    """A dithered layer store and the keys it reads back."""

    def __init__(self, requests=None, seed=99):
        self.codec = Dither(DitheredInt8(rope="rotate_half"), layer=1, seed=seed, requests=requests)
        self.store = CompressedLayer(self.codec, LAYOUT)

    def append(self, x):
        self.store.append(x, x)

    @property
    def k_hat(self):
        return self.store.read()[0]


def _layer_keys(requests=None, x=None, seed=99):
    x = torch.randn(1, 2, 6, 32, generator=torch.Generator().manual_seed(3)).expand(3, -1, -1, -1) if x is None else x
    layer = _Layer(requests, seed)
    layer.append(x)
    return layer, x


def test_batch_rows_with_identical_keys_get_distinct_dither():
    """Before the fix every row of a batch used one request id: identical rows were reconstructed
    identically (fully correlated errors). Now no (row pair, head, token) shares a reconstruction."""
    layer, _ = _layer_keys()
    k_hat = layer.k_hat
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert not (k_hat[a] == k_hat[b]).all(-1).any()
        assert (k_hat[a] == k_hat[b]).float().mean() < 0.01
    assert layer.codec.row_requests == (0, 1, 2)


def test_each_row_is_read_back_from_its_own_request_stream():
    """Write/read identity per row: row ``b`` equals a single-row quantization keyed by its id."""
    x = torch.randn(3, 2, 6, 32, generator=torch.Generator().manual_seed(4))
    layer, _ = _layer_keys(requests=(40, 7, 12), x=x)
    quantizer = DitheredInt8(rope="rotate_half")
    for row, request in enumerate((40, 7, 12)):
        counter = StandaloneCounter(request=torch.tensor([request]), layer=1, seed=99)
        alone = quantizer.dequantize(quantizer.quantize(x[row:row + 1], counter), counter)
        assert torch.equal(layer.k_hat[row:row + 1], alone)


def test_rows_keep_their_stream_across_batch_orders_and_decode_steps():
    x = torch.randn(3, 2, 7, 32, generator=torch.Generator().manual_seed(5))
    layer, _ = _layer_keys(requests=(40, 7, 12), x=x)
    order = [2, 0, 1]
    moved, _ = _layer_keys(requests=(12, 40, 7), x=x[order])
    assert torch.equal(moved.k_hat, layer.k_hat[order])
    stepwise, _ = _layer_keys(requests=(40, 7, 12), x=x[..., :5, :])
    stepwise.append(x[..., 5:, :])  # two decode steps appended one chunk later
    assert torch.equal(stepwise.k_hat, layer.k_hat)


def test_batch_requests_are_validated():
    x = torch.zeros(2, 1, 2, 32)
    with pytest.raises(ValueError, match="own id"):
        _Layer(requests=(5, 5), seed=1).append(x)
    with pytest.raises(ValueError, match="expected 2"):
        _Layer(requests=(5,), seed=1).append(x)


def test_batched_dither_attack_finds_no_violation():
    tally = batched_dither.run(3, torch.Generator().manual_seed(12))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


# ---------------------------------------------------------------- item 8: the seed is secret


def test_monitor_draws_a_secret_seed_per_request():
    """Every request (cache) of a monitor gets a fresh seed from the OS; a fixed seed is an explicit opt-in."""
    model = model_dtypes.tiny_llama(torch.float32)
    ids = torch.randint(0, model_dtypes.VOCAB, (1, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), Monitor(model, DITHERED, bands=8) as monitor:
        for _ in range(6):
            model(ids)
    seeds = {r.seed for r in monitor.requests}
    assert len(seeds) == 6 and 0 not in seeds
    with torch.no_grad(), Monitor(model, DITHERED, bands=8, seed=7) as fixed:
        model(ids)
        model(ids)
    assert [r.seed for r in fixed.requests] == [7, 7]  # tests, replay
    assert Monitor(model, "rtn-int4", bands=8).dithered is False
    with pytest.raises(ValueError, match="seed"):
        Monitor(model, DITHERED, seed=-1)
    assert Dither(DitheredInt8(), layer=0).seed != Dither(DitheredInt8(), layer=0).seed


def test_cells_record_seed_and_request_so_a_run_replays():
    """Telemetry carries the drawn seed and each row's request id; a monitor fixed to that seed
    reproduces every meter bit for bit."""
    model = model_dtypes.tiny_llama(torch.float32)
    ids = torch.randint(0, model_dtypes.VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    monitor = Monitor(model, DITHERED, tier="B", bands=8)
    model_dtypes.recorded_run(model, monitor, ids, 10)
    table = telemetry.cell_table(monitor.batches)
    assert (table["seed"] == np.uint64(monitor.requests[0].seed)).all()
    assert set(table["request"][table["batch"] == 0]) == {0} and set(table["request"][table["batch"] == 1]) == {1}
    replay = Monitor(model, DITHERED, tier="B", bands=8, seed=int(table["seed"][0]))
    model_dtypes.recorded_run(model, replay, ids, 10)
    assert np.array_equal(telemetry.cell_table(replay.batches)["meter"], table["meter"])
    tier_a = Monitor(model, "rtn-int4", bands=8)
    model_dtypes.recorded_run(model, tier_a, ids, 10)
    assert "seed" not in telemetry.cell_table(tier_a.batches).columns


def test_attack_classes_are_registered():
    assert {"model_dtypes", "batched_dither"} <= set(ATTACKS)
