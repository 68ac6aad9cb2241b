"""Dither counter layouts for Tier B: which Philox counter and word each cache element uses.

Two layouts (docs/design.md "Dither counter"):

* standalone ``(request, layer, kv_head, token, channel)`` for offline harnesses;
* paged ``(layer, kv_head, slot, channel)`` for a paged pool (slots are stable under
  prefix sharing, positions are not).

Packing (bit 0 = least significant; every field is checked against its range)::

    key    k0 = seed bits 0..31            k1 = seed bits 32..63      (== tl.philox(seed))
    word c0 = token        (standalone)  | slot bits 0..31  (paged)
    word c1 = channel >> 2 in bits 0..11 | kv_head in bits 12..21 | layer in bits 22..31
    word c2 = request      (standalone)  | slot bits 32..61 (paged)
    word c3 = side in bit 30 (0 = K, 1 = V) | layout in bit 31 (0 = standalone, 1 = paged);
              bits 0..29 reserved (zero)
    output word used by the element = channel & 3

so one Philox call serves four consecutive channels.

Why distinct tuples never share a (counter, output word): within a layout every field sits
in its own bit range of one word (ranges disjoint, values range-checked), so the fields can
be read back from ``(c0, c1, c2, c3)`` and the output word index: the packing is injective.
The two layouts differ in bit 31 of ``c3`` and the two sides in bit 30, so no standalone
counter equals a paged one and K never shares a stream with V. The key only carries the seed.
(Philox is a bijection of the counter for a fixed key; independence of distinct counters'
outputs is the generator's modelling assumption, not a theorem.) ``tests/test_counters.py``
checks injectivity by decoding and by exhaustive uniqueness on small grids.

The seed is secret by default. Tier B's probabilistic branch needs queries independent of the
dither; with a public seed (say 0) anyone can compute every dither value and build a query
aligned with the quantization errors. So ``seed=None`` (the default) draws 64 bits from the
operating system's cryptographic source (``secrets``) when the counter is built; the drawn
value is the counter's ``seed`` field (record it to replay a run, and read a store back with the
same counter). A fixed seed is an explicit opt-in for tests and replay.

Every sequence of a batch needs its own tuple: give ``request`` one id per batch row (an int64
tensor broadcastable to the leading dims), never one id for the whole batch, or the rows share
every dither value and their quantization errors are fully correlated.
"""
import secrets
from dataclasses import dataclass

import torch

from witcert.tier_b.philox import philox4x32_10

CHANNEL_BITS, KV_HEAD_BITS, LAYER_BITS = 12, 10, 10
MAX_CHANNELS = 4 << CHANNEL_BITS  # channel >> 2 must fit in 12 bits: head_dim <= 16384
MAX_KV_HEADS = 1 << KV_HEAD_BITS
MAX_LAYERS = 1 << LAYER_BITS
MAX_WORD = 1 << 32
MAX_SLOT = 1 << 62
SIDE_BIT, LAYOUT_BIT = 30, 31
SIDES = {"k": 0, "v": 1}


def _as_index(name: str, value, upper: int) -> torch.Tensor:
    """An int64 tensor of indices in [0, upper), or a ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int or int64 tensor, got bool")
    if isinstance(value, int):
        value = torch.tensor(value, dtype=torch.int64)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        raise ValueError(f"{name}: expected an int or an int64 tensor")
    if value.numel() and (value.min() < 0 or value.max() >= upper):
        raise ValueError(f"{name}: values must lie in [0, {upper})")
    return value


def fresh_seed() -> int:
    """A 64-bit Philox seed from the operating system's cryptographic source (``secrets``)."""
    return secrets.randbits(64)


def _draw_seed_if_unset(counter) -> None:
    """``seed=None`` on a frozen counter: draw a fresh secret seed and store it in the field."""
    if counter.seed is None:
        object.__setattr__(counter, "seed", fresh_seed())


def _key_of(seed: int) -> torch.Tensor:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: expected an int in [0, 2^64), got {seed!r}")
    return torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64)


def check_seed(seed) -> int:
    """``seed`` if it is a valid Philox seed (an int in [0, 2^64)), else ValueError."""
    _key_of(seed)
    return seed


def batch_requests(requests, batch: int) -> torch.Tensor:
    """Request ids (int64, (batch,)) of the rows of a batch: one distinct id per sequence.

    ``requests=None`` numbers the rows ``0 .. batch-1``; otherwise a sequence of ``batch``
    distinct ints in [0, 2^32). Distinct ids give the rows distinct dither streams; a row keeps
    its stream when the batch is reordered together with its id.
    """
    if requests is None:
        return torch.arange(batch, dtype=torch.int64)
    if isinstance(requests, torch.Tensor):
        requests = requests.tolist()
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
        raise ValueError(f"requests: expected a sequence of ints (one per batch row), got {requests!r}")
    if len(requests) != batch:
        raise ValueError(f"requests: expected {batch} ids (one per batch row), got {len(requests)}")
    if any(isinstance(r, bool) or not isinstance(r, int) for r in requests):
        raise ValueError(f"requests: expected ints, got {list(requests)!r}")
    if len(set(requests)) != len(requests):
        raise ValueError(f"requests: every batch row needs its own id (rows sharing an id share the dither), got {list(requests)}")
    return _as_index("requests", torch.tensor(list(requests), dtype=torch.int64), MAX_WORD)


def _side_of(side: str) -> int:
    if side not in SIDES:
        raise ValueError(f"side: expected 'k' or 'v', got {side!r}")
    return SIDES[side]


def pack_c1(layer: torch.Tensor, kv_head: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """Word 1: ``channel >> 2 | kv_head << 12 | layer << 22`` (ranges checked by callers)."""
    return (channel >> 2) | (kv_head << CHANNEL_BITS) | (layer << (CHANNEL_BITS + KV_HEAD_BITS))


def pack_standalone(request, layer, kv_head, token, channel, side: str = "k") -> torch.Tensor:
    """Counters (..., 4) of standalone tuples (all fields broadcast together)."""
    request = _as_index("request", request, MAX_WORD)
    layer = _as_index("layer", layer, MAX_LAYERS)
    kv_head = _as_index("kv_head", kv_head, MAX_KV_HEADS)
    token = _as_index("token", token, MAX_WORD)
    channel = _as_index("channel", channel, MAX_CHANNELS)
    request, layer, kv_head, token, channel = torch.broadcast_tensors(
        request, layer, kv_head, token, channel)
    c3 = torch.full_like(token, _side_of(side) << SIDE_BIT)
    return torch.stack((token, pack_c1(layer, kv_head, channel), request, c3), dim=-1)


def pack_paged(layer, kv_head, slot, channel, side: str = "k") -> torch.Tensor:
    """Counters (..., 4) of paged tuples (all fields broadcast together)."""
    layer = _as_index("layer", layer, MAX_LAYERS)
    kv_head = _as_index("kv_head", kv_head, MAX_KV_HEADS)
    slot = _as_index("slot", slot, MAX_SLOT)
    channel = _as_index("channel", channel, MAX_CHANNELS)
    layer, kv_head, slot, channel = torch.broadcast_tensors(layer, kv_head, slot, channel)
    c3 = torch.full_like(slot, (_side_of(side) << SIDE_BIT) | (1 << LAYOUT_BIT))
    return torch.stack((slot & 0xFFFFFFFF, pack_c1(layer, kv_head, channel), slot >> 32, c3), dim=-1)


def stream_words(counter: torch.Tensor, key: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """The uint32 Philox word of each element: output word ``channel & 3`` of its counter."""
    words = philox4x32_10(counter, key)  # (..., 4)
    return torch.gather(words, -1, (channel & 3).unsqueeze(-1)).squeeze(-1)


def grouped_words(counter_layout, key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Words (*shape) with one Philox call per four channels (equal to ``stream_words``).

    Channel ``4j + w`` takes output word ``w`` of the counter of channel ``4j``.
    """
    head_dim = shape[-1]
    n_groups = -(-head_dim // 4)
    group_shape = tuple(shape[:-1]) + (n_groups,)
    counters = counter_layout.counters(group_shape, channel_stride=4)  # (*lead, H, S, G, 4)
    words = philox4x32_10(counters, key)  # (*lead, H, S, G, 4)
    return words.reshape(*shape[:-1], 4 * n_groups)[..., :head_dim]


def _grid(shape: tuple[int, ...], channel_stride: int = 1) -> tuple[torch.Tensor, ...]:
    """Head, token and channel index grids for a cache tensor of shape (*lead, H, S, d)."""
    if len(shape) < 3:
        raise ValueError(f"x: expected shape (..., H, S, d), got {tuple(shape)}")
    n_heads, n_tokens, head_dim = shape[-3:]
    head = torch.arange(n_heads, dtype=torch.int64).view(n_heads, 1, 1)
    token = torch.arange(n_tokens, dtype=torch.int64).view(1, n_tokens, 1)
    channel = channel_stride * torch.arange(head_dim, dtype=torch.int64).view(1, 1, head_dim)
    return head, token, channel


def _lead(value, shape: tuple[int, ...]) -> torch.Tensor:
    """A per-leading-index field (int or tensor broadcastable to shape[:-3]) as (*lead, 1, 1, 1)."""
    value = torch.as_tensor(value, dtype=torch.int64) if isinstance(value, int) else value
    return value.reshape(*value.shape, 1, 1, 1)


class _WordStream:
    """The words of a counter layout: subclasses define ``seed`` and ``counters(shape)``."""

    def words(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The uint32 word (*shape) of every element (one Philox call per four channels)."""
        _grid(shape)
        return grouped_words(self, _key_of(self.seed), tuple(shape))

    def words_per_element(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Same as ``words`` with one Philox call per element (the literal definition)."""
        _, _, channel = _grid(shape)
        return stream_words(self.counters(shape), _key_of(self.seed), channel.expand(shape))


@dataclass(frozen=True)
class StandaloneCounter(_WordStream):
    """Standalone dither stream ``(request, layer, kv_head, token, channel)`` (Tier B, "L2").

    A cache tensor of shape (*lead, H, S, d) maps index ``(..., h, t, c)`` to the tuple
    ``(request, layer, kv_head_offset + h, token_offset + t, c)``. ``request`` and ``layer``
    are ints or int64 tensors broadcastable to ``lead``; a batch of sequences needs a distinct
    request per row. ``seed=None`` (default) draws a secret seed from ``secrets`` (module
    docstring); pass an int only to replay a run or in tests.
    """

    request: int | torch.Tensor
    layer: int | torch.Tensor
    seed: int | None = None
    side: str = "k"
    token_offset: int = 0
    kv_head_offset: int = 0

    def __post_init__(self):
        _draw_seed_if_unset(self)
        _key_of(self.seed)
        _side_of(self.side)
        _as_index("request", self.request, MAX_WORD)
        _as_index("layer", self.layer, MAX_LAYERS)
        _as_index("token_offset", self.token_offset, MAX_WORD)
        _as_index("kv_head_offset", self.kv_head_offset, MAX_KV_HEADS)

    def counters(self, shape: tuple[int, ...], channel_stride: int = 1) -> torch.Tensor:
        """Counters (*shape, 4) of a cache tensor (*lead, H, S, d); channel = stride * index."""
        head, token, channel = _grid(shape, channel_stride)
        return pack_standalone(_lead(self.request, shape), _lead(self.layer, shape),
                               head + self.kv_head_offset, token + self.token_offset,
                               channel, self.side).expand(*shape, 4)


@dataclass(frozen=True)
class PagedCounter(_WordStream):
    """Paged dither stream ``(layer, kv_head, slot, channel)`` (Tier B, "L2").

    A cache tensor of shape (*lead, H, S, d) maps index ``(..., h, t, c)`` to
    ``(layer, kv_head_offset + h, slots[..., t], c)``; ``slots`` is an int64 tensor
    broadcastable to (*lead, S): the pool slot holding each token (stable under prefix
    sharing and batch reordering, unlike positions). ``seed=None`` (default) draws a secret
    seed from ``secrets`` (module docstring).
    """

    layer: int | torch.Tensor
    slots: torch.Tensor
    seed: int | None = None
    side: str = "k"
    kv_head_offset: int = 0

    def __post_init__(self):
        _draw_seed_if_unset(self)
        _key_of(self.seed)
        _side_of(self.side)
        _as_index("layer", self.layer, MAX_LAYERS)
        _as_index("slots", self.slots, MAX_SLOT)
        _as_index("kv_head_offset", self.kv_head_offset, MAX_KV_HEADS)

    def counters(self, shape: tuple[int, ...], channel_stride: int = 1) -> torch.Tensor:
        """Counters (*shape, 4) of a cache tensor (*lead, H, S, d); channel = stride * index."""
        head, _, channel = _grid(shape, channel_stride)
        slots = self.slots.unsqueeze(-2).unsqueeze(-1)  # (*lead, 1, S, 1)
        return pack_paged(_lead(self.layer, shape), head + self.kv_head_offset, slots,
                          channel, self.side).expand(*shape, 4)
