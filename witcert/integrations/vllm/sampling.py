"""An operator's choice to meter fewer cells of a request: every k-th step, some query heads, some layers.

The step and head choice is :class:`witcert.MeterSampling` (the transformers integration's, reused as is:
a query token at position ``p`` is metered when ``p`` is a multiple of ``every``; in a metered call,
``ceil(heads G)`` of each kv head's ``G`` query heads, drawn per (layer, call) from the seed, replayable).
:class:`Metering` adds the layers. Nothing is inferred about the cells left out: they are counted as
*unmetered* (never certified) in the telemetry and have no line in the cell log. The gate needs every
cell's meter and is refused with sampling (as :func:`witcert.monitor` refuses it).

Switches (``SamplingParams.extra_args``, over the OpenAI API ``vllm_xargs``; engine defaults from the
environment, :mod:`.config`): ``witcert_meter_every`` (int >= 1), ``witcert_meter_heads`` (fraction in
(0, 1]), ``witcert_meter_layers`` (layer indices ``"0-3,10"``; ``"none"``: no layer, the request is
counted and meters nothing), ``witcert_meter_seed`` (int, for replay).
"""
import secrets
from dataclasses import dataclass

import torch

from witcert.integrations.hf.sampling import MeterSampling

EVERY, HEADS, LAYERS, SEED = "witcert_meter_every", "witcert_meter_heads", "witcert_meter_layers", "witcert_meter_seed"
KEYS = (EVERY, HEADS, LAYERS, SEED)
NO_LAYER = "none"  # witcert_meter_layers: meter no layer (what the plugin costs a request that asks for nothing)


@dataclass(frozen=True)
class Metering:
    """Which cells of one request are metered: ``sample`` (steps and heads; ``None``: all) and ``layers``
    (a frozenset of layer indices; ``None``: all)."""

    sample: MeterSampling | None = None
    layers: frozenset | None = None

    @property
    def everything(self) -> bool:
        return self.sample is None and self.layers is None

    def meters(self, layer: int, position: int) -> bool:
        """Whether the query token at ``position`` is metered in ``layer``."""
        if self.layers is not None and layer not in self.layers:
            return False
        return self.sample is None or self.sample.metered_call(position, position + 1)

    def heads(self, layer: int, position: int, hq: int, hkv: int) -> torch.Tensor | None:
        """The metered query heads of a metered token (``None``: every one)."""
        return None if self.sample is None else self.sample.heads_of(layer, position, position + 1, hq, hkv)


def metering_of(every, heads, layers, seed) -> Metering:
    """A :class:`Metering` from raw switch values (``None`` where unset), checked: ``ValueError`` naming the key."""
    every = _integer(EVERY, every, 1)
    heads = _fraction(HEADS, heads)
    layer_set = parse_layers(layers)
    sample = None
    if every != 1 or heads != 1.0:
        seed = secrets.randbits(62) if seed in (None, "") else _integer(SEED, seed, 0)
        try:
            sample = MeterSampling(every=every, heads=heads, seed=seed)
        except ValueError as err:
            raise ValueError(f"{SEED}: {err}") from None
    return Metering(sample=sample, layers=layer_set)


def parse_layers(value) -> frozenset | None:
    """``"0-3,10"`` (or an int, or a list of ints) as a frozenset of layer indices; ``None``/``""``: every layer;
    ``"none"``: no layer (the empty set: the request's cells are counted unmetered)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().lower() == NO_LAYER:
        return frozenset()
    if isinstance(value, bool):
        raise ValueError(f"{LAYERS} must name layer indices such as '0-3,10' (or 'none'), got {value!r}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise ValueError(f"{LAYERS} must name layer indices such as '0-3,10' (or 'none'), got {value!r}")
    out = set()
    try:
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last) if last else int(first)
            if lo < 0 or hi < lo:
                raise ValueError
            out.update(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"{LAYERS} must name layer indices such as '0-3,10' (or 'none'), got {value!r}") from None
    return frozenset(out)


def _integer(name: str, value, default: int) -> int:
    if value is None or value == "":
        return default
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == EVERY else 0):
        raise ValueError(f"{name} must be an integer >= {1 if name == EVERY else 0}, got {value!r}")
    return value


def _fraction(name: str, value) -> float:
    if value is None or value == "":
        return 1.0
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a fraction in (0, 1] of each kv head's query heads, got {value!r}")
    return float(value)
