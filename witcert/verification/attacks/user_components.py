"""Attack class: the components a user hands ``witcert.monitor`` (schemes and codecs), in both ``keep_exact`` modes.

The monitor trusts nothing it is given, so each case below is a valid but hostile user component,
run through :class:`witcert.integrations.hf.monitoring.Monitor` on the tiny random Llama of
:mod:`~witcert.verification.attacks.model_dtypes` (2 layers, GQA), one prefill and three decode
calls, with the exact cache kept (validation) or not (production):

- a scheme that writes its result into one workspace per shape (a fused or graph-captured
  quantize kernel): one instance serves every layer, so the next layer overwrites the last output
  (issue 28: 2,291 of 2,430 SmolLM2 cells above their meter while stores held it by reference);
  per role, or one workspace shared by keys and values;
- a codec whose ``encode`` quantizes its input in place and returns workspace tensors, and whose
  ``decode`` writes into a workspace;
- a stateful scheme (a running amax over every call: the step depends on the history) and a
  non-deterministic one (stochastic rounding from its own generator);
- codecs with a ``join``: a lossless one (concatenation, judged like the others) and a KIVI-style
  one that re-quantizes every held token with per-channel scales (it must be refused with a clear
  error: a production cache would read keys no witness describes);
- a 4D additive attention mask as users write one (:func:`soft_mask`: ``-1e9`` for hidden keys,
  soft values and large biases on the rest): transformers passes it through and sdpa adds it to
  the scores (issue 28: hidden keys and soft values were ignored by the meter).

Oracle, per cell (layer, query head, query): the fp64 TV between softmax over the exact keys the
model wrote (recorded as the component received them, one private copy per write) and softmax over
the keys attention actually read, causal (:func:`~witcert.verification.attacks.model_dtypes.oracle_tv`).
The library's own ``true_tv`` is not used, so production cells are judged as validation cells are.
The bound is the cell's reported meter.

A case is a function ``case(g) -> Trial`` listed in :data:`CASES`; a new sub-case (another kind of
component or input) is one more function there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.verification.attacks import AttackTally
from witcert.verification.attacks.model_dtypes import VOCAB, Call, oracle_tv, tiny_llama

NAME = "user components"
SHARE = 0.0001  # one trial: a prefill and three decode calls on a tiny model (~0.3 s on one core)
RECORDER = "witcert-user-components-recorder"
ROWS, DECODE_CALLS = 2, 3


@dataclass
class Trial:
    """One hostile user component and how the monitor may answer it.

    ``component``: a scheme ``fn(x, role) -> x_hat`` or a codec object; ``refusable``: the monitor may
    refuse it with a ``ValueError`` (counted as rejected) instead of reporting cells.
    """

    component: object
    refusable: bool = False
    mask: bool = False  # the run passes a soft_mask as attention_mask


# ----------------------------------------------------------------------------- the components


def _rtn(x: torch.Tensor, levels: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest per token onto ``levels`` steps of its amax (into ``out`` when given)."""
    step = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / levels
    out = torch.empty_like(x) if out is None else out
    torch.round(x / step, out=out)
    return out.mul_(step)


@dataclass
class WorkspaceScheme:
    """RTN into one output buffer per shape (and per role unless ``shared_roles``), reused by every call."""

    levels: float
    shared_roles: bool
    buffers: dict = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, role: str = "key") -> torch.Tensor:
        slot = (tuple(x.shape), x.dtype, None if self.shared_roles else role)
        return _rtn(x, self.levels, self.buffers.setdefault(slot, torch.empty_like(x)))


@dataclass
class RunningAmaxScheme:
    """Stateful: the step is the largest amax seen over every call so far, over ``levels``."""

    levels: float
    amax: float = 0.0

    def __call__(self, x: torch.Tensor, role: str = "key") -> torch.Tensor:
        self.amax = max(self.amax, float(x.abs().max()))
        step = max(self.amax, 1e-6) / self.levels
        return torch.round(x / step) * step


@dataclass
class StochasticScheme:
    """Non-deterministic: stochastic rounding onto a per-token grid, from the scheme's own generator."""

    levels: float
    generator: torch.Generator

    def __call__(self, x: torch.Tensor, role: str = "key") -> torch.Tensor:
        step = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / self.levels
        noise = torch.rand(x.shape, generator=self.generator, dtype=x.dtype)
        return torch.floor(x / step + noise) * step


@dataclass
class WorkspaceCodec:
    """A codec that quantizes its input in place and hands out workspace tensors from ``encode`` and ``decode``."""

    levels: float
    buffers: dict = field(default_factory=dict)

    def encode(self, x: torch.Tensor, role: str, start: int = 0):
        step = self.buffers.setdefault(("step", x.shape[:-1]), torch.empty(*x.shape[:-1], 1, dtype=x.dtype))
        torch.div(x.abs().amax(-1, keepdim=True).clamp(min=1e-6), self.levels, out=step)
        return x.div_(step).round_(), step  # the codes are the input itself, the step a workspace

    def decode(self, packed, dtype: torch.dtype) -> torch.Tensor:
        codes, step = packed
        out = self.buffers.setdefault(("out", codes.shape, dtype), torch.empty(codes.shape, dtype=dtype))
        return torch.mul(codes, step, out=out)

    def nbytes(self, packed) -> int:
        return sum(t.numel() * t.element_size() for t in packed)


@dataclass
class ChannelCodec:
    """KIVI-style keys: int codes with one scale per channel over the chunk's tokens.

    ``requantize``: ``join`` decodes both chunks and quantizes every held token again with scales
    over all of them (what re-grouping caches do); otherwise ``join`` concatenates (lossless).
    """

    levels: float
    requantize: bool

    def encode(self, x: torch.Tensor, role: str, start: int = 0):
        scale = x.abs().amax(-2, keepdim=True).clamp(min=1e-6) / self.levels  # (B, H, 1, d)
        return torch.round(x / scale), scale.expand_as(x).clone()

    def decode(self, packed, dtype: torch.dtype) -> torch.Tensor:
        codes, scale = packed
        return (codes * scale).to(dtype)

    def nbytes(self, packed) -> int:
        return sum(t.numel() * t.element_size() for t in packed)

    def join(self, first, second):
        if self.requantize:
            held = torch.cat([self.decode(first, first[0].dtype), self.decode(second, second[0].dtype)], dim=-2)
            return self.encode(held, "key")
        return tuple(torch.cat(pair, dim=-2) for pair in zip(first, second))


def _levels(g: torch.Generator) -> float:
    return float(2 ** int(torch.randint(1, 5, (1,), generator=g)) - 1)  # int2 .. int5 grids


def _workspace_scheme(g):
    return Trial(WorkspaceScheme(_levels(g), shared_roles=False))


def _workspace_scheme_shared_roles(g):
    return Trial(WorkspaceScheme(_levels(g), shared_roles=True))


def _workspace_codec(g):
    return Trial(WorkspaceCodec(_levels(g)))


def _running_amax_scheme(g):
    return Trial(RunningAmaxScheme(_levels(g)))


def _stochastic_scheme(g):
    seed = int(torch.randint(2**31, (1,), generator=g))
    return Trial(StochasticScheme(_levels(g), torch.Generator().manual_seed(seed)))


def _lossless_join_codec(g):
    return Trial(ChannelCodec(_levels(g), requantize=False))


def _requantizing_join_codec(g):
    return Trial(ChannelCodec(_levels(g), requantize=True), refusable=True)


@dataclass
class DecodeOnlyScheme:
    """Exact on the prefill's write, RTN on each decode write: a mask that hides or outweighs the exact
    tokens leaves the model attending only damaged ones."""

    levels: float

    def __call__(self, x: torch.Tensor, role: str = "key") -> torch.Tensor:
        return x.clone() if x.shape[-2] > 1 else _rtn(x, self.levels)


def _soft_mask_over_a_scheme(g):
    return Trial(DecodeOnlyScheme(_levels(g) * 8), mask=True)


def soft_mask(rows: int, length: int, g: torch.Generator) -> torch.Tensor:
    """(rows, 1, T, T) fp32 additive mask: causal by ``-1e9``, about a third of the earlier keys hidden by
    ``-1e9`` too (never a query's own), soft values of a drawn spread (0.5 to 10) and ``+20`` on a fifth of
    the keys, or also on the decoded ones (they take the mass the model sees: with the old reading of masks,
    13 of 1,440 cells of 30 trials above their meter)."""
    causal = torch.ones(length, length).tril().bool()
    hidden = (torch.rand(rows, 1, length, length, generator=g) < 0.3) & ~torch.eye(length, dtype=torch.bool)
    spread = (0.5, 3.0, 10.0)[int(torch.randint(3, (1,), generator=g))]
    favoured = torch.rand(rows, 1, 1, length, generator=g) < 0.2
    soft = torch.randn(rows, 1, length, length, generator=g) * spread + 20.0 * favoured
    if bool(torch.randint(2, (1,), generator=g)):  # or the last keys (the decoded ones) favoured
        soft = soft + 20.0 * (torch.arange(length) >= length - DECODE_CALLS)
    return torch.where(causal & ~hidden, soft, torch.tensor(-1e9))


CASES = (_workspace_scheme, _workspace_scheme_shared_roles, _workspace_codec, _running_amax_scheme,
         _stochastic_scheme, _lossless_join_codec, _requantizing_join_codec, _soft_mask_over_a_scheme)


# ----------------------------------------------------------------------------- the recorded run


class ExactKeys:
    """The exact keys each layer wrote, as its component received them (a private copy per write).

    A component is called once per layer and write, keys first, just before that layer's attention,
    so each attention call takes the one pending write for its layer.
    """

    def __init__(self):
        self.pending: list[torch.Tensor] = []
        self.layers: dict[int, torch.Tensor] = {}

    def saw(self, x: torch.Tensor, role: str) -> None:
        if role == "key":
            self.pending.append(x.detach().clone())

    def take(self, layer: int) -> torch.Tensor:
        if len(self.pending) != 1:
            raise RuntimeError(f"layer {layer}: expected one key write before attention, saw {len(self.pending)}")
        new = self.pending.pop()
        self.layers[layer] = new if layer not in self.layers else torch.cat([self.layers[layer], new], dim=-2)
        return self.layers[layer]


def recorded(component, exact: ExactKeys):
    """``component`` with every key it receives recorded in ``exact`` (a scheme or a codec alike)."""
    if callable(getattr(component, "encode", None)):
        return _RecordedCodec(component, exact)

    def scheme(x, role="key"):
        exact.saw(x, role)
        return component(x, role=role)

    return scheme


class _RecordedCodec:
    def __init__(self, codec, exact: ExactKeys):
        self.codec, self.exact = codec, exact
        self.decode, self.nbytes = codec.decode, codec.nbytes
        if callable(getattr(codec, "join", None)):
            self.join = codec.join

    def encode(self, x, role, start=0):
        self.exact.saw(x, role)
        return self.codec.encode(x, role, start)


_RECORDING: list = []  # [(monitor, exact keys, calls)] while a recorded run is active


def _recording_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from witcert.integrations.hf import attention

    monitor, exact, calls = _RECORDING[-1]
    before = len(monitor.batches)
    written = exact.take(module.layer_idx)
    out = attention.witcert_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                              dropout=dropout, **kwargs)
    if len(monitor.batches) > before:  # a measured call: ``key`` is what attention read
        scale = module.scaling if scaling is None else scaling
        calls.append(Call(module.layer_idx, query.detach().clone(), written.clone(), key.detach().clone(),
                          float(scale), monitor.batches[-1].meter))
    return out


def recorded_run(model, component, keep_exact: bool, ids: torch.Tensor, prefill: int,
                 mask: torch.Tensor | None = None) -> list[Call]:
    """Prefill ``ids[:, :prefill]``, then one forward call per remaining token, under ``witcert.monitor``
    with ``component`` (recorded); returns the measured calls. Tier A: adaptive-safe, so the
    teacher-forced tokens stand for any the model could have generated. ``mask`` (B, 1, T, T): each
    call's slice of it is its ``attention_mask``."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from witcert.integrations.hf.monitoring import Monitor

    AttentionInterface.register(RECORDER, _recording_forward)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)
    exact = ExactKeys()
    monitor = Monitor(model, recorded(component, exact), keep_exact=keep_exact, bands=8)
    calls: list[Call] = []
    _RECORDING.append((monitor, exact, calls))
    try:
        with torch.no_grad(), monitor:
            model.set_attn_implementation(RECORDER)  # the monitor restores the model's own on exit
            cache = DynamicCache(config=model.config)
            def slice_of(rows: slice):
                return None if mask is None else mask[:, :, rows, : rows.stop]

            model(ids[:, :prefill], past_key_values=cache, use_cache=True, attention_mask=slice_of(slice(0, prefill)))
            for t in range(prefill, ids.shape[1]):
                model(ids[:, t : t + 1], past_key_values=cache, use_cache=True,
                      attention_mask=slice_of(slice(t, t + 1)))
    finally:
        _RECORDING.pop()
    return calls


def run_case(case, keep_exact: bool, g: torch.Generator, tally: AttackTally) -> None:
    """One trial of ``case`` in one ``keep_exact`` mode: every measured cell against the oracle TV."""
    trial = case(g)
    prefill = int(torch.randint(4, 17, (1,), generator=g))
    ids = torch.randint(0, VOCAB, (ROWS, prefill + DECODE_CALLS), generator=g)
    mask = soft_mask(ROWS, ids.shape[1], g) if trial.mask else None
    try:
        calls = recorded_run(tiny_llama(torch.float32), trial.component, keep_exact, ids, prefill, mask)
    except ValueError:
        if not trial.refusable:
            raise
        tally.rejected += 1
        return
    for call in calls:
        s, tq = call.key.shape[-2], call.query.shape[-2]
        tally.add(oracle_tv(call, None if mask is None else mask[:, :, s - tq : s, :s]), call.meter)


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` trials: a case of :data:`CASES` and a ``keep_exact`` mode drawn per trial."""
    tally = AttackTally(NAME)
    for _ in range(n):
        case = CASES[int(torch.randint(len(CASES), (1,), generator=g))]
        run_case(case, bool(torch.randint(2, (1,), generator=g)), g, tally)
    return tally
