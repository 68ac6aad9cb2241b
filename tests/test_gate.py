"""Gate, block decomposition and persistent repair (docs/design.md "Gating and repair"; registry T1, L4).

Implementations: ``witcert.gate.policy.Gate``, ``witcert.gate.blocks``, ``witcert.gate.repair``.
Oracles: the 50-digit spec (``witcert.spec.bounds.softmax`` / ``tv``) for the true TV between
attention over exact logits and over the repaired logits; an mpmath sum for ``A - 1`` and the
per-block shares; replays of the gate's page sequence for its stopping rule.
Domain: cells of 1-24 tokens (``tests.oracles`` scores with ties and masks, radii in [0, 12]
plus edge radii 1e-30..700), errors at box vertices, block sizes 1/4/16, tau in (0, 1) for the
certified gate, tau >= 1 for the risk-ranked one. Tolerance: ``TV <= after`` up to
``BOUND_REL_TOL`` (50-digit values); block shares to 1e-12 relative (fp64).
Validation is per cell and adversarial (vertex errors), never in aggregate.
"""
import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracles import BOUND_REL_TOL, box_errors, radius_lists, score_lists
from witcert.gate.backing_store import BackingStore
from witcert.gate.blocks import block_excess, block_mass, expand_block_radius, log_block_excess
from witcert.gate.policy import Gate, PageIn
from witcert.gate.repair import LayerPager, Repairer
from witcert.spec import bounds as spec

D_MODEL_BYTES = 64 * 2  # bytes per token reported by the table pager (d = 64, fp16 K)

# ----------------------------------------------------------------------------- oracle machinery


class TablePager:
    """Pager over known exact logits (..., S): returns a block's slice; counts bytes per token."""

    def __init__(self, exact: torch.Tensor, block_size: int):
        self.exact, self.block_size, self.calls = exact, block_size, []

    def __call__(self, cell, block):
        self.calls.append((cell, block))
        lo = block * self.block_size
        row = self.exact[cell][lo : lo + self.block_size]
        return PageIn(logits=row.clone(), nbytes=row.shape[0] * D_MODEL_BYTES)


@st.composite
def gated_cells(draw, max_size: int = 24):
    """Exact logits, compressed logits at a box vertex, and radii covering the true fp64 error."""
    scores = draw(score_lists(min_size=1, max_size=max_size))
    c = draw(radius_lists(len(scores)))
    eps = draw(box_errors(c, vertex=draw(st.booleans())))
    exact = [s - e if math.isfinite(s) else s for s, e in zip(scores, eps)]
    # the true error is compressed - exact as stored in fp64: cover its rounding (one ulp up)
    radii = [max(r, math.nextafter(abs(s - x), math.inf)) if math.isfinite(s) else r for s, x, r in zip(scores, exact, c)]
    return (
        torch.tensor(exact, dtype=torch.float64),
        torch.tensor(scores, dtype=torch.float64),
        torch.tensor(radii, dtype=torch.float64),
    )


def golden_tv(exact: torch.Tensor, used: torch.Tensor) -> mpmath.mpf:
    """TV(softmax(exact), softmax(used)) at 50 digits, from the definition."""
    with mpmath.workdps(50):
        return spec.tv(spec.softmax(exact.tolist()), spec.softmax(used.tolist()))


def at_most(value: mpmath.mpf, bound: float) -> bool:
    with mpmath.workdps(50):
        return value <= mpmath.mpf(bound) * (1 + BOUND_REL_TOL) + BOUND_REL_TOL


def golden_block_shares(scores: torch.Tensor, c: torch.Tensor, block_size: int) -> list[mpmath.mpf]:
    """``X_j = sum_{t in j} p~_t (e^{c_t} - 1)`` at 50 digits."""
    with mpmath.workdps(50):
        p = spec.softmax(scores.tolist())
        terms = [pt * mpmath.expm1(mpmath.mpf(ct)) if pt > 0 else mpmath.mpf(0) for pt, ct in zip(p, c.tolist())]
        return [mpmath.fsum(terms[lo : lo + block_size]) for lo in range(0, len(terms), block_size)]


def replay_values(gate: Gate, scores, c, exact, pages):
    """Gated value before each page of one cell, replaying the gate's own page sequence."""
    s, r, values = scores.clone(), c.clone(), []
    for _, block in pages:
        values.append(float(gate.value(s, r)))
        lo, hi = block * gate.block_size, (block + 1) * gate.block_size
        s[lo:hi] = torch.where(torch.isneginf(s[lo:hi]), s[lo:hi], exact[lo:hi])
        r[lo:hi] = 0.0
    return values


TAUS_CERTIFIED = st.sampled_from((0.01, 0.05, 0.2, 0.5, 0.9))
GOLDEN_EXAMPLES = settings(max_examples=120)  # 50-digit oracle per example: keep the suite fast
BLOCK_SIZES = st.sampled_from((1, 4, 16))

# ----------------------------------------------------------------------------- soundness (T1)


@GOLDEN_EXAMPLES
@given(cell=gated_cells(), tau=TAUS_CERTIFIED, block_size=BLOCK_SIZES)
def test_certified_after_bounds_true_tv_per_cell(cell, tau, block_size):
    """After repair, the recomputed meter bounds the true TV (exact vs repaired) at every cell."""
    exact, scores, c = cell
    result = Gate(tau, block_size=block_size)(scores, c, pager=TablePager(exact, block_size))
    assert result.certified and result.label.startswith("certified")
    tv = golden_tv(exact, result.scores)
    assert at_most(tv, float(result.after))
    if result.reached:
        assert at_most(tv, tau)


@GOLDEN_EXAMPLES
@given(cell=gated_cells(), tau=TAUS_CERTIFIED, block_size=BLOCK_SIZES)
def test_greedy_stops_at_the_first_page_below_tau(cell, tau, block_size):
    """Every page-in was needed when made; the gate stops below tau or with nothing left."""
    exact, scores, c = cell
    gate = Gate(tau, block_size=block_size)
    result = gate(scores, c, pager=TablePager(exact, block_size))
    assert all(v > tau for v in replay_values(gate, scores, c, exact, result.pages))
    assert float(gate.value(result.scores, result.c)) == float(result.after)
    if not result.reached:
        assert torch.isneginf(log_block_excess(result.scores, result.c, block_size)).all()
    assert len({block for _, block in result.pages}) == len(result.pages)  # no block twice
    assert int(result.blocks) == len(result.pages)
    assert result.bytes_paged == sum((min(block_size, len(c) - b * block_size)) * D_MODEL_BYTES for _, b in result.pages)


@GOLDEN_EXAMPLES
@given(cell=gated_cells(), tau=TAUS_CERTIFIED, block_size=BLOCK_SIZES)
def test_exact_logits_in_memory_are_sound_and_stop_at_the_first_page_below_tau(cell, tau, block_size):
    """``exact=`` (the prefix-batched repair): the true TV is below ``after`` and every page was needed."""
    exact, scores, c = cell
    gate = Gate(tau, block_size=block_size)
    result = gate(scores, c, exact=exact)
    assert at_most(golden_tv(exact, result.scores), float(result.after))
    assert all(v > tau for v in replay_values(gate, scores, c, exact, result.pages))
    assert float(gate.value(result.scores, result.c)) == float(result.after)
    if not result.reached:
        assert torch.isneginf(log_block_excess(result.scores, result.c, block_size)).all()
    assert len({block for _, block in result.pages}) == len(result.pages) == int(result.blocks)
    assert result.bytes_paged == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_logits_in_memory_page_what_the_pager_pages(dtype):
    """The prefix-batched repair (``exact=``) and the round-by-round loop (a pager) give the same
    pages in the same order, the same repaired cells and the same recomputed meter."""
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        cells, seq = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(1, 150, (1,), generator=g))
        scores = torch.randn(cells, seq, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 8)
        exact = scores + torch.randn(cells, seq, generator=g, dtype=torch.float64) * 0.3
        c = (exact - scores).abs() * (1 + torch.rand(cells, seq, generator=g, dtype=torch.float64)) + 1e-12
        if trial % 3 == 0:
            mask = torch.rand(cells, seq, generator=g) < 0.2
            mask[:, 0] = False
            scores = scores.masked_fill(mask, -math.inf)
        block_size = int(torch.randint(1, 33, (1,), generator=g))
        gate = Gate(float(torch.rand(1, generator=g)) * 0.5, block_size=block_size)
        exact = exact.to(dtype)  # no cast slack on either path
        in_memory = gate(scores.to(dtype), c.to(dtype), exact=exact)
        paged = gate(scores.to(dtype), c.to(dtype), pager=TablePager(exact, block_size))
        assert in_memory.pages == paged.pages
        assert torch.equal(in_memory.scores, paged.scores) and torch.equal(in_memory.c, paged.c)
        assert torch.equal(in_memory.after, paged.after) and torch.equal(in_memory.reached, paged.reached)


@GOLDEN_EXAMPLES
@given(cell=gated_cells(), tau=st.sampled_from((1.0, 2.0, 5.0)), block_size=BLOCK_SIZES)
def test_risk_ranked_gates_on_the_raw_score(cell, tau, block_size):
    exact, scores, c = cell
    gate = Gate(tau, block_size=block_size)
    result = gate(scores, c, pager=TablePager(exact, block_size))
    assert not result.certified and "no guarantee" in result.label
    assert torch.equal(result.before, gate.value(scores, c))
    assert bool(result.fired) == bool(result.before > tau)
    assert result.reached or torch.isneginf(log_block_excess(result.scores, result.c, block_size)).all()
    assert at_most(golden_tv(exact, result.scores), float(Gate(0.5).value(result.scores, result.c)))


def test_risk_gate_pages_an_overflowing_massive_activation_first():
    exact = torch.zeros(64, dtype=torch.float64)
    c = torch.full((64,), 0.01, dtype=torch.float64)
    c[37] = 1000.0  # e^1000 overflows: raw score inf
    pager = TablePager(exact, 16)
    result = Gate(5.0)(exact.clone(), c, pager=pager)
    assert math.isinf(float(result.before))
    assert result.pages == (((), 2),) and result.reached


# ----------------------------------------------------------------------------- block decomposition (L4)


@GOLDEN_EXAMPLES
@given(cell=gated_cells(), block_size=BLOCK_SIZES)
def test_block_shares_match_golden_and_sum_to_a_minus_one(cell, block_size):
    _, scores, c = cell
    ours = block_excess(scores, c, block_size)
    golden = golden_block_shares(scores, c, block_size)
    for x, g in zip(ours.tolist(), golden):
        assert x == pytest.approx(float(g), rel=1e-12, abs=1e-300)
    with mpmath.workdps(60):
        p = spec.softmax(scores.tolist())
        a_minus_one = spec.a_plus(p, c.tolist()) - 1  # absolute accuracy ~1e-59 at 60 digits
    assert float(ours.sum()) == pytest.approx(float(a_minus_one), rel=1e-11, abs=1e-45)


@given(
    radius=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5),
    scores=score_lists(min_size=1, max_size=60),
    block_size=st.sampled_from((4, 16)),
)
def test_tier_b_share_is_mass_times_expm1_radius(radius, scores, block_size):
    """Lemma 4: with a shared block radius u_j, X_j = mass_j (e^{u_j} - 1)."""
    scores = torch.tensor(scores, dtype=torch.float64)
    n_blocks = -(-scores.shape[0] // block_size)
    u = torch.tensor((radius * n_blocks)[:n_blocks], dtype=torch.float64)
    c = expand_block_radius(u, block_size, scores.shape[0])
    expected = block_mass(scores, block_size) * torch.expm1(u)
    # X_j is computed as exp(log X_j): below the smallest normal float it keeps only subnormal precision
    tiny = torch.finfo(torch.float64).tiny
    assert torch.allclose(block_excess(scores, c, block_size), expected, rtol=1e-12, atol=tiny)


def test_gate_accepts_tier_b_radius_like_expanded_c():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(3, 40, generator=g, dtype=torch.float64) * 3
    radius = torch.rand(3, 3, generator=g, dtype=torch.float64)
    c = expand_block_radius(radius, 16, 40)
    scores = exact + c * torch.sign(torch.randn(3, 40, generator=g, dtype=torch.float64))
    by_radius = Gate(0.1)(scores, radius=radius, pager=TablePager(exact, 16))
    by_c = Gate(0.1)(scores, c, pager=TablePager(exact, 16))
    assert by_radius.pages == by_c.pages and torch.equal(by_radius.after, by_c.after)


# ----------------------------------------------------------------------------- granularity, leading dims


def synthetic_heads(shape=(2, 3, 48), seed=0, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    c = torch.rand(*shape, generator=g, dtype=torch.float64) * spread
    scores = exact + c * torch.sign(torch.randn(*shape, generator=g, dtype=torch.float64))
    return exact, scores, c


def test_leading_dims_match_per_cell_calls():
    exact, scores, c = synthetic_heads()
    batched = Gate(0.2)(scores, c, pager=TablePager(exact, 16))
    for cell in [(i, j) for i in range(2) for j in range(3)]:
        single = Gate(0.2)(scores[cell], c[cell], pager=TablePager(exact[cell], 16))
        assert torch.equal(single.after, batched.after[cell])
        assert [b for cl, b in batched.pages if cl == cell] == [b for _, b in single.pages]
    in_memory = Gate(0.2)(scores, c, exact=exact)  # the same policy without a pager: same repair
    assert in_memory.pages == batched.pages and torch.equal(in_memory.after, batched.after)
    assert torch.equal(in_memory.scores, batched.scores) and torch.equal(in_memory.c, batched.c)
    assert int(in_memory.paged.sum()) == len(batched.pages) and in_memory.bytes_paged == 0


def test_request_granularity_fires_every_cell_and_whole_pages_everything():
    exact, scores, c = synthetic_heads(spread=0.05)
    c[1, 2, 5] = 4.0  # one hot cell
    head = Gate(0.2)(scores, c, pager=TablePager(exact, 16))
    assert head.fired.sum() == 1 and head.fired[1, 2]
    request = Gate(0.2, granularity="request", repair="whole")(scores, c, pager=TablePager(exact, 16))
    assert request.fired.all()
    assert int(request.blocks.sum()) == 6 * 3  # every block of every cell
    assert torch.equal(request.scores, exact) and (request.c == 0).all()
    assert request.bytes_paged > 10 * head.bytes_paged


# ----------------------------------------------------------------------------- persistent repair


def store_setup(h_kv=2, group=2, s=40, d=8, seed=0):
    """Exact keys in a backing store, a compressed cache, queries for ``h_kv * group`` heads."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h_kv, s, d, generator=g).half()
    k_hat = (k.float() + 0.3 * torch.randn(h_kv, s, d, generator=g)).half()
    q = torch.randn(h_kv * group, d, generator=g) * 3
    scale = d**-0.5
    kv = torch.arange(h_kv * group) // group
    scores = torch.einsum("hsd,hd->hs", k_hat.double()[kv], q.double()) * scale
    c = scale * q.double().norm(dim=-1, keepdim=True) * (k_hat.double() - k.double())[kv].norm(dim=-1) * (1 + 1e-12)
    store = BackingStore(block_size=8)
    store.write("L0", k[:, :30])
    store.write("L0", k[:, 30:])
    return k, k_hat, q, scale, scores, c, store


def test_persistent_repair_writes_back_and_never_pages_a_slot_twice():
    k, k_hat, q, scale, scores, c, store = store_setup()
    repairer = Repairer(store)
    cache, witness = k_hat.clone(), torch.ones(2, 40, 4)
    pager = LayerPager(repairer, "L0", q, scale, group=2, k_cache=cache, witness=witness)
    first = Gate(0.1, block_size=8)(scores, c, pager=pager)
    assert first.fired.any() and first.bytes_paged > 0
    repaired = repairer.repaired_tokens("L0")  # (2, 40)
    assert torch.equal(cache[repaired], k[repaired]) and torch.equal(cache[~repaired], k_hat[~repaired])
    assert (witness[repaired] == 0).all() and (witness[~repaired] == 1).all()
    totals = repairer.totals()
    assert totals.bytes == totals.repaired_slots * 8 * 2 == int(repaired.sum()) * 16
    # next step, persistent: repaired slots masked -> the gate never selects them again
    masked = repairer.mask_repaired("L0", c, group=2)
    second = Gate(0.1, block_size=8)(first.scores, masked, pager=pager)
    assert repairer.totals().page_ins == totals.page_ins and second.bytes_paged == 0
    # without the mask the repair cache answers: hits, zero new bytes
    third = Gate(0.1, block_size=8)(first.scores, c, pager=pager)
    assert third.bytes_paged == 0 and repairer.totals().cache_hits > totals.cache_hits
    per_head = repairer.telemetry
    assert set(per_head) <= {("L0", (0,)), ("L0", (1,))}
    assert sum(t.repaired_slots for t in per_head.values()) == int(repaired.sum())


def test_naive_repair_pages_again_every_time():
    *_, scores, c, store = store_setup()
    q, scale = store_setup()[2], store_setup()[3]
    naive = Repairer(store, persistent=False)
    pager = LayerPager(naive, "L0", q, scale, group=2)
    once = Gate(0.1, block_size=8)(scores, c, pager=pager).bytes_paged
    twice = Gate(0.1, block_size=8)(scores, c, pager=pager).bytes_paged
    assert once > 0 and twice == once and naive.totals().bytes == 2 * once


def test_grown_block_delivers_only_new_slots():
    k, *_ = store_setup()
    store = BackingStore(block_size=8)
    store.write("L", k[:, :5])
    repairer = Repairer(store)
    _, first = repairer.fetch("L", (0,), 0)
    store.write("L", k[:, 5:7])
    paged, second = repairer.fetch("L", (0,), 0)
    _, third = repairer.fetch("L", (0,), 0)
    assert (first, second, third) == (5 * 16, 2 * 16, 0)
    assert torch.equal(paged.k, k[0, :7])


def test_decode_appends_never_deliver_a_slot_twice():
    """Decode loop with request-granular whole repair: each slot is delivered at most once."""
    k, k_hat, q, scale, *_ = store_setup(h_kv=2, group=1, s=40, d=8, seed=3)
    store, cache = BackingStore(block_size=8), k_hat.clone()
    store.write("L0", k[:, :30])
    repairer = Repairer(store)
    gate = Gate(0.05, granularity="request", repair="whole", block_size=8)
    for n in range(31, 41):
        store.write("L0", k[:, n - 1 : n])
        pager = LayerPager(repairer, "L0", q, scale, k_cache=cache[:, :n])
        scores = torch.einsum("hsd,hd->hs", cache[:, :n].double(), q.double()) * scale
        c = scale * q.double().norm(dim=-1, keepdim=True) * (cache[:, :n].double() - k[:, :n].double()).norm(dim=-1)
        c = repairer.mask_repaired("L0", c * (1 + 1e-12))
        gate(scores, c, pager=pager)
    totals = repairer.totals()
    assert totals.page_ins > 2 * 4  # re-fired after the first whole repair (new tokens)
    assert 0 < totals.repaired_slots <= 2 * 40
    assert totals.bytes == totals.repaired_slots * 8 * 2
    assert totals.repaired_slots == int(repairer.repaired_tokens("L0").sum())


def test_block_size_mismatch_is_refused():
    *_, scores, c, store = store_setup()
    pager = LayerPager(Repairer(store), "L0", torch.ones(4, 8), 0.5, group=2)
    with pytest.raises(ValueError, match="block_size"):
        Gate(0.1, block_size=16)(scores, c, pager=pager)


def test_lossy_write_back_is_refused():
    k, k_hat, q, scale, scores, c, _ = store_setup()
    store = BackingStore(block_size=8)
    store.write("L0", k.float() + 1e-4)  # not representable in the fp16 cache
    pager = LayerPager(Repairer(store), "L0", q, scale, group=2, k_cache=k_hat.clone())
    with pytest.raises(ValueError, match="lossy"):
        Gate(0.1, block_size=8)(scores, c, pager=pager)


# ----------------------------------------------------------------------------- bad input


def test_bad_gate_input_raises_value_error():
    exact, scores, c = synthetic_heads((2, 20))
    pager = TablePager(exact, 16)
    for kwargs, match in [
        ({"tau": float("nan")}, "tau"),
        ({"tau": -0.1}, "tau"),
        ({"tau": 0.5, "mode": "risk"}, "contradicts"),
        ({"tau": 5.0, "mode": "certified"}, "contradicts"),
        ({"tau": 0.5, "mode": "sure"}, "mode"),
        ({"tau": 0.5, "granularity": "layer"}, "granularity"),
        ({"tau": 0.5, "repair": "some"}, "repair"),
        ({"tau": 0.5, "block_size": 0}, "block_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            Gate(**kwargs)
    gate = Gate(0.2)
    with pytest.raises(ValueError, match="exactly one"):
        gate(scores, pager=pager)
    with pytest.raises(ValueError, match="exactly one"):
        gate(scores, c, radius=c[..., :2], pager=pager)
    with pytest.raises(ValueError, match="NaN"):
        gate(scores, torch.full_like(c, float("nan")), pager=pager)
    with pytest.raises(ValueError, match=">= 0"):
        gate(scores, -c, pager=pager)
    with pytest.raises(ValueError, match="blocks"):
        gate(scores, radius=c[..., :1], pager=pager)
    with pytest.raises(ValueError, match="logits"):
        gate(scores, c + 1.0, pager=lambda cell, block: PageIn(torch.zeros(1), 0))
    with pytest.raises(ValueError, match="non-finite"):
        gate(scores, c + 1.0, pager=lambda cell, block: PageIn(torch.full((16,), math.nan), 0))
    with pytest.raises(ValueError, match="exactly one of pager"):
        gate(scores, c, pager=pager, exact=exact)
    with pytest.raises(ValueError, match="exactly one of pager"):
        gate(scores, c)
    with pytest.raises(ValueError, match="exact has shape"):
        gate(scores, c, exact=exact[:1])
    with pytest.raises(ValueError, match="non-finite"):
        gate(scores, c + 1.0, exact=torch.full_like(exact, math.inf))


# ----------------------------------------------------------------------------- the measurement script


def test_gate_table_script_runs_sound_on_a_tiny_config(tmp_path, capsys):
    """scripts/gate_table.py end to end on a tiny config: every certified cell checked per query."""
    import json

    from tests.scripts_loader import load_script

    module = load_script("gate_table")
    out = tmp_path / "table.json"
    argv = ["--heads", "2", "--tokens", "96", "--queries", "4", "--dim", "64", "--decode-steps", "3", "--json", str(out)]
    assert module.main(argv) == 0
    table = json.loads(out.read_text())
    certified = [row for row in table["errors"] if row["regime"] == "certified"]
    assert certified and all(row["sound_per_cell"] for row in certified)
    assert all(row["reached"] == row["fired"] for row in table["traffic"])
    naive, filtered, blocks = (row["bytes"] for row in table["decode"])
    assert filtered <= naive and blocks <= naive
    assert "certified" in capsys.readouterr().out


@GOLDEN_EXAMPLES
@given(
    exact=st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=20),
    radius=st.floats(1e-6, 3.0),
    tau=TAUS_CERTIFIED,
    signs=st.lists(st.sampled_from((-1.0, 1.0)), min_size=20, max_size=20),
)
def test_fp32_scores_with_fp64_pager_stay_sound(exact, radius, tau, signs):
    """fp32 scores, fp64 exact logits: the cast of repaired logits is covered, not assumed exact."""
    exact64 = torch.tensor(exact, dtype=torch.float64)
    scores = (exact64 + radius * torch.tensor(signs[: len(exact)], dtype=torch.float64)).float()
    gap = (scores.double() - exact64).abs()
    c = torch.nextafter(gap.float(), torch.tensor(math.inf)).clamp_min(0.0)  # >= the true fp32 error
    assert (c.double() >= gap).all()
    result = Gate(tau, block_size=4)(scores, c, pager=TablePager(exact64, 4))
    in_memory = Gate(tau, block_size=4)(scores, c, exact=exact64)
    assert torch.equal(in_memory.c, result.c) and torch.equal(in_memory.scores, result.scores)
    assert result.scores.dtype == torch.float32
    assert at_most(golden_tv(exact64, result.scores.double()), float(result.after))
    if result.reached:
        assert at_most(golden_tv(exact64, result.scores.double()), tau)


def test_batched_pages_bound_their_logits_and_deliver_as_single_pages():
    """LayerPager.pages (one batched fp64 pass for a round's pages, partial last block included): each page's
    logits are within its stated error of the exact q . k scale (fractions, no rounding), the bytes and the
    write-back equal what one call per page delivers."""
    from fractions import Fraction

    k, k_hat, q, scale, *_, store = store_setup()
    cells, blocks = [(0,), (1,), (2,), (3,), (1,)], [0, 4, 4, 2, 1]  # query heads 0-3 over kv heads 0-1; block 4 short
    batched = LayerPager(Repairer(store), "L0", q, scale, group=2, k_cache=k_hat.clone())
    single = LayerPager(Repairer(store), "L0", q, scale, group=2, k_cache=k_hat.clone())
    pages = batched.pages(cells, blocks)
    one_by_one = [single(cell, block) for cell, block in zip(cells, blocks)]
    assert torch.equal(batched.k_cache, single.k_cache)
    for (cell, block), page, alone in zip(zip(cells, blocks), pages, one_by_one):
        keys = k[cell[0] // 2, block * 8:(block + 1) * 8].double()
        assert page.logits.shape == (keys.shape[0],) and page.nbytes == alone.nbytes
        exact = [sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(row, q[cell].double())) * Fraction(scale)
                 for row in keys]
        for value, error, truth in zip(page.logits.tolist(), page.error.tolist(), exact):
            assert abs(Fraction(value) - truth) <= Fraction(error)


def test_repaired_output_recomputes_fired_cells_only_against_an_fp64_reference():
    """The gate's output after repair (witcert.integrations.hf.cells._repaired_output, GQA): each fired cell is
    softmax(repaired logits) over the compressed values with the exact ones on repaired tokens (fp64 reference,
    within the fp32 output's rounding); every other cell keeps the model's output bit for bit."""
    from types import SimpleNamespace

    from witcert.integrations.hf.cells import _repaired_output

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, tq, s, d = 2, 6, 2, 3, 40, 8
    scores = torch.randn(b, hq, tq, s, generator=g, dtype=torch.float64)
    v_hat = torch.randn(b, hkv, s, d, generator=g)
    exact_v = v_hat + 0.1 * torch.randn(b, hkv, s, d, generator=g)
    repaired = torch.rand(b, hq, tq, s, generator=g) < 0.3
    fired = torch.rand(b, hq, tq, generator=g) < 0.5
    output = torch.randn(b, tq, hq, d, generator=g)
    out = _repaired_output(SimpleNamespace(c=torch.zeros(b, hq, tq, s)), v_hat, exact_v, scores, repaired, fired,
                           output)
    kv = torch.arange(hq) // (hq // hkv)
    values = torch.where(repaired[..., None], exact_v.double()[:, kv, None], v_hat.double()[:, kv, None])
    reference = (torch.softmax(scores, -1)[..., None] * values).sum(-2).transpose(1, 2)  # (B, Tq, Hq, d)
    on = fired.transpose(1, 2)
    assert torch.allclose(out[on].double(), reference[on], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[~on], output[~on])
