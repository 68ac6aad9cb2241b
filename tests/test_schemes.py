"""Scheme registry, built-in quantizers, and per-query Tier A soundness for every scheme.

Implementations: ``witcert.register_scheme`` / ``schemes`` / ``get_scheme``,
``witcert.schemes.registry.apply_scheme``, the built-ins of ``witcert.schemes.builtin``, and the full Tier A
path ``witcert.observe`` (witness ``L1``, logit bound ``T2``, meter ``T1``/``P1``/``MN``).
Oracles: per-element error formulas of each quantizer (fp64); the fp64 true TV, true logit
error and true output error computed from the exact keys. Domain: ``tests.tier_a_oracles``
(Gaussian and massive-activation keys; random and residual-aligned adversarial queries).
Tolerance: none -- every cell must satisfy its bound.
"""
import pytest
import torch

import witcert
from tests.tier_a_oracles import KEY_FAMILIES, QUERY_KINDS, workload
from witcert.schemes.registry import _REGISTRY, apply_scheme

BUILTINS = (
    "fp8-e4m3", "fp8-e4m3-scaled", "fp8-e5m2", "kivi-2bit", "kvquant-4bit",
    "rtn-int2", "rtn-int4", "rtn-int8", "sign-1bit",
)
DTYPES = (torch.float16, torch.float32, torch.float64)

# ----------------------------------------------------------------------------- oracle machinery


def rtn_error_bound(x: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """Per-element bound of symmetric RTN: half a step, ``amax / qmax / 2``, per 32-channel group."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.double().unflatten(-1, (-1, group)).abs().amax(-1, keepdim=True)
    return (amax / qmax / 2).expand(*x.shape[:-1], x.shape[-1] // group, group).flatten(-2)


@pytest.fixture
def scratch_names():
    """Registers test schemes under unique names and removes them afterwards."""
    names = []
    yield names
    for name in names:
        _REGISTRY.pop(name, None)


# ----------------------------------------------------------------------------- registry


def test_builtins_registered_with_one_line_source_docstrings():
    assert set(BUILTINS) <= set(witcert.list_schemes())
    assert witcert.list_schemes() == sorted(witcert.list_schemes())
    for name in BUILTINS:
        doc = (witcert.get_scheme(name).__doc__ or "").strip().splitlines()
        assert doc and len(doc[0]) > 20, name


def test_unknown_scheme_lists_known_names():
    with pytest.raises(ValueError, match="unknown scheme 'nope'.*rtn-int8"):
        witcert.get_scheme("nope")


def test_register_and_use_custom_scheme(scratch_names):
    @witcert.register_scheme("test-halve")
    def halve(x):
        """Toy scheme: x / 2."""
        return x / 2

    scratch_names.append("test-halve")
    assert "test-halve" in witcert.list_schemes()
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(witcert.get_scheme("test-halve")(x), x / 2)
    with pytest.raises(ValueError, match="already registered"):
        witcert.register_scheme("test-halve")(lambda x: x)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda x: x[..., :-1, :], "not shape-preserving"),  # eviction: drops a token
        (lambda x: x.mean(-2, keepdim=True), "not shape-preserving"),  # pooling
        (lambda x: x.half() if x.dtype != torch.float16 else x.float(), "changed dtype"),
        (lambda x: x * float("nan"), "NaN/Inf"),
        (lambda x: x.tolist(), "must return a plain torch.Tensor"),
    ],
)
def test_non_cache_preserving_schemes_rejected(fn, match, scratch_names):
    witcert.register_scheme("test-bad")(fn)
    scratch_names.append("test-bad")
    with pytest.raises(ValueError, match=match):
        witcert.get_scheme("test-bad")(torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match=match):
        apply_scheme(fn, torch.randn(2, 6, 8))


def test_bad_registration_arguments():
    with pytest.raises(ValueError, match="non-empty"):
        witcert.register_scheme("")
    with pytest.raises(ValueError, match="callable"):
        witcert.register_scheme("test-x")(3)
    with pytest.raises(ValueError, match="role"):
        apply_scheme("rtn-int8", torch.zeros(2, 8), role="query")


# ----------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("role", ("key", "value"))
def test_quantizer_shape_dtype_and_zero_groups(name, dtype, role):
    """Same shape and dtype; all-zero and all -0 heads map to zeros (no NaN), also next to a
    head with a zero channel group and a zero token; outputs finite on large input."""
    gen = torch.Generator().manual_seed(0)
    fn = witcert.get_scheme(name)
    x = (torch.randn(3, 70, 64, generator=gen) * 4).to(dtype)
    x[0], x[1] = 0.0, -0.0
    x[2, :, :32], x[2, 5] = 0.0, -0.0
    x_hat = fn(x, role=role)
    assert x_hat.shape == x.shape and x_hat.dtype == dtype
    assert torch.isfinite(x_hat).all()
    assert (x_hat[:2] == 0).all()
    big = torch.full((1, 3, 64), 6.0e4 if dtype == torch.float16 else 1.0e6, dtype=dtype)
    assert torch.isfinite(fn(big, role=role)).all()


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_rtn_error_within_half_step(bits):
    """Oracle: |x - x^| <= amax/qmax/2 per 32-channel group (plus fp32 rounding, 1e-6 rel)."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 40, 128, generator=gen) * torch.rand(3, 40, 1, generator=gen) * 10
    err = (witcert.get_scheme(f"rtn-int{bits}")(x).double() - x.double()).abs()
    assert (err <= rtn_error_bound(x, bits) * (1 + 1e-6)).all()


def test_fp8_raw_casts_clamp_to_finite_range():
    x = torch.tensor([[1e6, -1e6, 500.0, 1.0]])
    torch.testing.assert_close(witcert.get_scheme("fp8-e4m3")(x), torch.tensor([[448.0, -448.0, 448.0, 1.0]]))
    y = witcert.get_scheme("fp8-e5m2")(torch.tensor([[1e6, -7e4, 3.0, 0.0]]))
    torch.testing.assert_close(y, torch.tensor([[57344.0, -57344.0, 3.0, 0.0]]))
    scaled = witcert.get_scheme("fp8-e4m3-scaled")(torch.tensor([[1e6, 1.0]]))
    assert scaled[0, 0] == 1e6  # the amax entry maps to 448 * s exactly


def test_kivi_roles_and_exact_tail():
    """Keys: per-channel over 32-token groups, the S mod 32 tail exact; values per-token."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 70, 64, generator=gen)
    keys, values = witcert.get_scheme("kivi-2bit")(x, role="key"), witcert.get_scheme("kivi-2bit")(x, role="value")
    assert torch.equal(keys[:, 64:], x[:, 64:]) and not torch.equal(keys[:, :64], x[:, :64])
    assert not torch.equal(keys, values)
    # 2-bit asymmetric: at most 4 distinct levels per (channel, 32-token group)
    assert max(len(torch.unique(keys[0, :32, c])) for c in range(64)) <= 4
    assert max(len(torch.unique(values[0, t, :32])) for t in range(70)) <= 4


def test_kvquant_keeps_outliers_exact():
    """The ceil(0.5%) smallest and largest entries per channel are exact (1% in all, the
    outlier included); the rest lie within half a step of the grid between the thresholds."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1000, 64, generator=gen)
    x[0, 7, 3] = 400.0  # a massive outlier must not blow up its channel's scale
    x_hat = witcert.get_scheme("kvquant-4bit")(x)
    ordered = x.sort(dim=-2).values  # (1, 1000, 64)
    lo, hi = ordered[:, 5:6], ordered[:, -6:-5]  # m = 5 per tail
    outlier = (x < lo) | (x > hi)
    assert outlier.sum() == 10 * 64 and torch.equal(x_hat[outlier], x[outlier])
    half_step = ((hi - lo) / 15 / 2).expand_as(x)
    assert ((x_hat - x).abs()[~outlier] <= half_step[~outlier] * (1 + 1e-5)).all()
    assert (hi - lo).max() < 10  # the 400 outlier stayed out of the grid


# ----------------------------------------------------------------------------- per-query soundness

HKV, GROUPS, TQ, S, HEAD_DIM = 2, 4, 375, 48, 64
CELLS_PER_SCHEME = len(KEY_FAMILIES) * len(QUERY_KINDS) * HKV * GROUPS * TQ
assert CELLS_PER_SCHEME * len(BUILTINS) >= 100_000  # the floor, over all built-ins


@pytest.mark.parametrize("name", BUILTINS)
def test_per_query_soundness(name):
    """Every (query head, query) cell: true TV <= meter, ||y - y^|| <= output bound, and every
    token |eps_t| <= c_t; the aligned adversary attains |eps_{t*}| = c_{t*} up to fp16 round-up."""
    layout = witcert.BandLayout(HEAD_DIM, 16)
    scale = HEAD_DIM**-0.5
    cells = 0
    for i, family in enumerate(KEY_FAMILIES):
        for j, kind in enumerate(QUERY_KINDS):
            w = workload(name, family, kind, layout, HKV, GROUPS, TQ, S, seed=100 * i + j, sm_scale=scale)
            obs = witcert.observe(w.q, w.k, w.v, name, layout, sm_scale=scale, k_hat=w.k_hat, v_hat=w.v_hat)
            assert (obs.true_tv <= obs.meter).all(), (family, kind, (obs.true_tv - obs.meter).max())
            assert (obs.true_output_error <= obs.output_bound).all(), (family, kind)
            eps = scale * w.q.double().unflatten(0, (HKV, GROUPS)) @ (w.k_hat - w.k).double()[:, None].transpose(-1, -2)
            assert (eps.reshape(obs.c.shape).abs() <= obs.c).all(), (family, kind)
            if kind == "aligned":
                tight = torch.gather(obs.c, -1, w.target[..., None])[..., 0]
                at_target = torch.gather(eps.reshape(obs.c.shape).abs(), -1, w.target[..., None])[..., 0]
                live = at_target > 0  # tokens the scheme left exact have eps = 0
                assert (tight[live] / at_target[live]).max() < 1 + 2.0**-9  # fp16 round-up only
            cells += obs.meter.numel()
    assert cells == CELLS_PER_SCHEME


def test_table_script_smoke(capsys):
    """scripts/tier_a_table.py runs end to end and reports 0 violations and recall 1.0."""
    from scripts.tier_a_table import main

    main(["--tq", "8", "--s", "40", "--head-dim", "64", "--schemes", "rtn-int4", "kivi-2bit"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rtn-int4") or line.startswith("| kivi")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "0" and cells[6].startswith(("1.000", "nan"))
