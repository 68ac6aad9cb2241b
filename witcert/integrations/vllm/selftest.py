"""Start-up self-test: the cache layout and cast the plugin assumes, measured once per config.

Through vLLM's own C++ writer and attention kernel, on a scratch cache of the layer's exact
configuration (ISA, model dtype, cache dtype, heads, block size, scales):

0. the order of the entries in a block is measured through the writer (:func:`.layout.measure`);
1. only the written slots change (nothing lands outside them);
2. every key and value read back through that :class:`~.layout.CacheLayout` is the written one up
   to the cast (exactly equal for an ``auto`` cache; within the fp8 format's relative step otherwise);
3. the kernel's attention output for one decode query equals attention recomputed in fp64 from
   the read-back keys and values, to the model dtype's accuracy.

(3) is the one that matters for soundness: it shows the values the witness is formed from are
the values the kernel attends over. Any failure raises :class:`CacheLayoutError` and the engine
does not start; unset ``WITCERT_VLLM`` to serve without the meter.
"""
from dataclasses import dataclass

import torch

from . import layout
from .layout import CacheLayout

# |read back - written| <= REL |written| + ABS * scale for a correct cast (any rounding direction)
_CAST_TOLERANCE = {"auto": (0.0, 0.0), "fp8": (2.0**-3, 2.0**-9), "fp8_e4m3": (2.0**-3, 2.0**-9),
                   "fp8_e5m2": (2.0**-2, 2.0**-16)}
# kernel output vs fp64 recomputation, relative to max |v|: the model dtype's accumulation
_OUTPUT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class CacheLayoutError(RuntimeError):
    """vLLM's KV cache is not laid out or cast the way the WitCert plugin reads it."""


@dataclass(frozen=True)
class CheckedCache:
    """A configuration that passed: the layout measured for it and what the checks measured."""

    layout: CacheLayout
    report: dict


_PASSED: dict = {}


def check_cache(*, isa: str, model_dtype: torch.dtype, storage_dtype: torch.dtype, kv_cache_dtype: str,
                num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                k_scale: float, v_scale: float, scale: float) -> CheckedCache:
    """Measure the layout and run the checks once per configuration (or raise :class:`CacheLayoutError`)."""
    key = (isa, model_dtype, storage_dtype, kv_cache_dtype, num_heads, num_kv_heads, head_size,
           block_size, k_scale, v_scale, scale)
    if key not in _PASSED:
        _PASSED[key] = _run(*key)
    return _PASSED[key]


def _writer(ops, isa: str, kv_cache_dtype: str, k_scale: float, v_scale: float):
    """vLLM's C++ cache writer as ``write(keys, values, kv_cache, slots)``."""
    def write(keys, values, kv_cache, slots):
        key_cache, value_cache = layout.split_cache(kv_cache)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa,
                                       k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    return write


def _run(isa, model_dtype, storage_dtype, kv_cache_dtype, num_heads, num_kv_heads, head_size, block_size,
         k_scale, v_scale, scale) -> CheckedCache:
    from vllm import _custom_ops as ops

    what = (f"isa={isa} model dtype={model_dtype} cache={kv_cache_dtype}/{storage_dtype} "
            f"head_size={head_size} block_size={block_size}")
    if kv_cache_dtype not in _CAST_TOLERANCE:
        raise CacheLayoutError(f"WitCert cannot read back kv_cache_dtype={kv_cache_dtype!r} ({what})")
    write = _writer(ops, isa, kv_cache_dtype, k_scale, v_scale)
    lossy = kv_cache_dtype not in layout.LOSSLESS  # an fp8 code of 1 is the scale
    try:
        cache_layout = layout.measure(write, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                                      model_dtype=model_dtype, storage_dtype=storage_dtype,
                                      k_unit=k_scale if lossy else 1.0, v_unit=v_scale if lossy else 1.0)
    except layout.LayoutError as e:
        raise CacheLayoutError(f"the cache writer's layout could not be measured ({what}): {e}") from None
    report = _check(ops, write, cache_layout, what, isa, model_dtype, storage_dtype, kv_cache_dtype, num_heads,
                    num_kv_heads, head_size, block_size, k_scale, v_scale, scale)
    return CheckedCache(layout=cache_layout, report=report)


def _check(ops, write, cache_layout, what, isa, model_dtype, storage_dtype, kv_cache_dtype, num_heads, num_kv_heads,
           head_size, block_size, k_scale, v_scale, scale) -> dict:
    """Checks 1-3 on a scratch cache written through ``write`` and read through ``cache_layout``."""
    g = torch.Generator().manual_seed(0)
    length = block_size + 5  # spans two blocks, given out of order
    block_ids = torch.tensor([2, 0])
    positions = torch.arange(length)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    keys = torch.randn(length, num_kv_heads, head_size, generator=g).to(model_dtype)
    values = torch.randn(length, num_kv_heads, head_size, generator=g).to(model_dtype)
    cache = torch.zeros(3, num_kv_heads, block_size, 2 * head_size, dtype=storage_dtype)
    write(keys, values, cache, slots)

    untouched = ~cache_layout.entries_at_slots(cache, slots)
    if cache.view(torch.uint8).view(*cache.shape, -1)[untouched].any():
        raise CacheLayoutError(f"the cache writer changed entries outside the written slots ({what}): "
                               "the layout the plugin reads back is not the one vLLM uses")

    k_back = layout.decode(cache_layout.keys_of_blocks(cache, block_ids, length), kv_cache_dtype, k_scale)
    v_back = layout.decode(cache_layout.values_of_blocks(cache, block_ids, length), kv_cache_dtype, v_scale)
    by_slot = layout.decode(cache_layout.keys_at_slots(cache, slots), kv_cache_dtype, k_scale)
    if not torch.equal(by_slot.transpose(0, 1), k_back):
        raise CacheLayoutError(f"reading keys by slot and by block disagree ({what})")
    for name, back, written, s in (("key", k_back, keys, k_scale), ("value", v_back, values, v_scale)):
        rel, absolute = _CAST_TOLERANCE[kv_cache_dtype]
        exact = written.to(torch.float64).transpose(0, 1)  # (Hkv, S, d)
        if not ((back - exact).abs() <= rel * exact.abs() + absolute * s).all():
            raise CacheLayoutError(f"stored {name}s read back differ from the written ones by more than "
                                   f"the {kv_cache_dtype} cast allows ({what})")

    key_cache, value_cache = layout.split_cache(cache)
    gap = _kernel_gap(ops, isa, model_dtype, kv_cache_dtype, num_heads, num_kv_heads, head_size, key_cache,
                      value_cache, block_ids, length, k_back, v_back, k_scale, v_scale, scale, g)
    limit = _OUTPUT_TOLERANCE.get(model_dtype, 3e-2) * float(v_back.abs().max())
    if not gap <= limit:
        raise CacheLayoutError(f"the attention kernel's output differs from attention over the read-back "
                               f"cache by {gap:.3g} (> {limit:.3g}, {what}): the plugin would meter other "
                               "keys than the kernel reads")
    return {"config": what, "passed": True, "kernel_gap": gap, "kernel_gap_limit": limit}


def _kernel_gap(ops, isa, model_dtype, kv_cache_dtype, num_heads, num_kv_heads, head_size, key_cache,
                value_cache, block_ids, length, k_back, v_back, k_scale, v_scale, scale, g) -> float:
    """max |kernel output - fp64 attention over the read-back cache| for one decode query."""
    if isa == "amx":  # AMX tiles need the process's permission first (vLLM's engine has it by now; a bare process not)
        torch.cpu._init_amx()
    query = torch.randn(1, num_heads, head_size, generator=g).to(model_dtype)
    output = torch.zeros(1, num_heads, head_size, dtype=model_dtype)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
    block_table = block_ids.to(torch.int32).view(1, -1)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, seq_lens=seq_lens,
        dtype=model_dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=kv_cache_dtype)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table, softcap=0, scheduler_metadata=meta, s_aux=None,
        dynamic_causal=None, k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    groups = num_heads // num_kv_heads
    q = query.to(torch.float64).view(num_kv_heads, groups, head_size)
    p = torch.softmax(scale * q @ k_back.transpose(-1, -2), dim=-1)  # (Hkv, G, S)
    expected = (p @ v_back).reshape(num_heads, head_size)
    return float((output.to(torch.float64)[0] - expected).abs().max())
