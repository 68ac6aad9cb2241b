"""vLLM's CPU attention backend with the Tier A meter attached (write: witness; decode: meter).

The subclass calls vLLM's own cache writer and fused attention kernel unchanged (outputs are
bit-identical to the stock backend) and only *reads* the cache around them:

- ``do_kv_cache_update``: after vLLM wrote the new keys, read them back at ``slot_mapping`` and
  store ``witness_of(exact key, stored key)`` (fp16, rounded up) at the same slots of a
  side tensor ``[blocks, Hkv, block_size, B]``; block reuse overwrites it with the cache entry,
  and prefix-shared blocks carry their witness with them.
- ``forward``: for every decode row (one query token), gather its stored keys and witnesses
  through ``block_table`` and meter each query head (:mod:`.metering`).

The start-up self-test (:mod:`.selftest`) runs at the first write of each configuration.
"""
import contextlib
import math

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import witness_of

from . import config, layout, runtime, selftest
from .metering import meter_decode


class WitCertCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with WitCert metering (registered in its place by the plugin)."""

    @staticmethod
    def get_impl_cls() -> type["WitCertCPUAttentionImpl"]:
        return WitCertCPUAttentionImpl


class WitCertCPUAttentionImpl(CPUAttentionBackendImpl):
    """:class:`CPUAttentionBackendImpl` plus the band witness on write and the meter on decode."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime.get()
        self.metered = self.attn_type == AttentionType.DECODER
        self.layer_index = None
        self.witness = None  # (blocks, Hkv, block_size, B) fp16, allocated with the cache
        self.shadow = None  # (blocks, Hkv, block_size, d) exact keys, shadow mode only
        self.k_scale = None  # the key scale the stored witnesses were formed under
        if self.metered:
            _refuse_unsupported(self)
            try:
                self.layout = BandLayout(self.head_size, self.runtime.config.bands)
            except ValueError as e:
                raise ValueError(f"{config.BANDS}: {e}") from None
            runtime.track_request_ids()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not self.metered:
            return
        self._prepare(layer, kv_cache, key.dtype)
        self._follow_scale(layer)
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0  # -1 marks padding
        slots = slot_mapping[keep].long()
        exact = key[:n].reshape(n, self.num_kv_heads, self.head_size)[keep]  # (N, Hkv, d)
        key_cache, _ = layout.split_cache(kv_cache)
        with _one_thread():
            stored = layout.decode(layout.keys_at_slots(key_cache, slots), self.kv_cache_dtype, layer._k_scale_float)
            layout.scatter_rows(self.witness, slots, _witness(exact, stored, self.layout))
            if self.shadow is not None:
                layout.scatter_rows(self.shadow, slots, exact)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if self.metered and attn_metadata is not None and self.witness is not None:
            self._follow_scale(layer)
            self._meter(layer, query, kv_cache, attn_metadata, output)
        return result

    def _prepare(self, layer, kv_cache: torch.Tensor, model_dtype: torch.dtype) -> None:
        """Self-test the configuration and allocate the side tensors (once per layer)."""
        if self.witness is not None and self.witness.shape[0] == kv_cache.shape[0]:
            return
        blocks, heads, block_size, _ = kv_cache.shape
        result = selftest.check_cache(
            isa=layer.isa, model_dtype=model_dtype, storage_dtype=kv_cache.dtype,
            kv_cache_dtype=self.kv_cache_dtype, num_heads=self.num_heads, num_kv_heads=heads,
            head_size=self.head_size, block_size=block_size, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, scale=self.scale)
        self.runtime.telemetry.selftest = result
        self.witness = torch.zeros(blocks, heads, block_size, self.layout.bands, dtype=torch.float16)
        self.k_scale = layer._k_scale_float
        if self.runtime.config.shadow:
            self.shadow = torch.zeros(blocks, heads, block_size, self.head_size, dtype=model_dtype)
        self.layer_index = extract_layer_index(layer.layer_name)

    def _follow_scale(self, layer) -> None:
        """A witness holds for the key scale it was formed under. If vLLM changes the scale (e.g.
        calculated KV scales), the kernel reads every older fp8 entry at the new scale, which no
        stored witness covers: make them all the trivial bound (``inf``: meter 1) from then on."""
        if layer._k_scale_float != self.k_scale:
            if self.kv_cache_dtype not in layout.LOSSLESS:
                self.witness.fill_(math.inf)
            self.k_scale = layer._k_scale_float

    def _meter(self, layer, query, kv_cache, md, output) -> None:
        """Meter every decode row (one query token) of this step for this layer."""
        starts, lengths = md.query_start_loc.tolist(), md.seq_lens.tolist()
        rows = [r for r in range(len(lengths)) if starts[r + 1] - starts[r] == 1]  # prefill chunks: not metered
        if not rows:
            return
        key_cache, value_cache = layout.split_cache(kv_cache)
        block_size = key_cache.shape[2]
        lens = [lengths[r] for r in rows]
        shape = (len(rows), self.num_kv_heads, max(lens))
        k_hat = torch.zeros(*shape, self.head_size, dtype=torch.float64)
        w = torch.zeros(*shape, self.layout.bands, dtype=torch.float16)
        exact = None if self.shadow is None else torch.zeros(*shape, self.head_size, dtype=self.shadow.dtype)
        blocks_of = [md.block_table[r, : math.ceil(n / block_size)].long() for r, n in zip(rows, lens)]
        with _one_thread():
            for i, (blocks, n) in enumerate(zip(blocks_of, lens)):
                k_hat[i, :, :n] = layout.decode(layout.keys_of_blocks(key_cache, blocks, n), self.kv_cache_dtype,
                                                layer._k_scale_float)
                w[i, :, :n] = layout.rows_of_blocks(self.witness, blocks, n)
                if exact is not None:
                    exact[i, :, :n] = layout.rows_of_blocks(self.shadow, blocks, n)
            tokens = torch.tensor([starts[r] for r in rows])
            q = query[tokens].reshape(len(rows), self.num_heads, self.head_size)
            cell_log = self.runtime.cell_log
            cells = meter_decode(q, k_hat, w, torch.tensor(lens), self.layout, self.scale, exact,
                                 with_risk=cell_log is not None)
            telemetry = self.runtime.telemetry
            for i, (r, n) in enumerate(zip(rows, lens)):
                request = self.runtime.request_id(r)
                true_tv = None if cells.true_tv is None else cells.true_tv[i]
                telemetry.add(request, self.layer_index, cells.meter[i], true_tv)
                if cell_log is not None:
                    cell_log.add(request, self.layer_index, n - 1, n, cells.meter[i], cells.risk[i], true_tv)
                if exact is not None:
                    v_hat = layout.decode(layout.values_of_blocks(value_cache, blocks_of[i], n), self.kv_cache_dtype,
                                          layer._v_scale_float)
                    telemetry.add_output_gap(_output_gap(q[i], k_hat[i, :, :n], v_hat, self.scale, output[starts[r]]))
        self.runtime.end_layer(self.layer_index)


@contextlib.contextmanager
def _one_thread():
    """Meter on one thread: the tensors are tiny, and OpenMP fork/join on a busy machine costs
    far more than the work (measured: a (3, 3, 64) x (3, 64, 30) fp64 matmul 20 ms on 2 threads
    of a loaded 2-core machine, 0.05 ms on one).

    vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op once it has pinned its OpenMP
    threads to cores, so this calls the original, ``torch._C.set_num_threads``. OpenMP keeps its
    pooled (pinned) threads while a region asks for fewer, and vLLM's count is restored on exit;
    ``tests/vllm/test_engine.py`` checks the outputs stay bit-identical to the plugin off.
    """
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)


def _witness(exact: torch.Tensor, stored: torch.Tensor, band_layout) -> torch.Tensor:
    """fp16 rounded-up band witnesses (N, Hkv, B); ``inf`` (the trivial bound) for a non-finite key."""
    finite = torch.isfinite(exact).all(-1) & torch.isfinite(stored).all(-1)  # (N, Hkv)
    w = torch.full((*exact.shape[:-1], band_layout.bands), math.inf, dtype=torch.float16)
    if finite.any():
        w[finite] = witness_of(exact[finite], stored[finite], band_layout)
    return w


def _output_gap(q, k_hat, v_hat, scale, kernel_out) -> float:
    """max |kernel output - fp64 attention over the read-back keys and values| for one token."""
    hkv, _, d = k_hat.shape
    qg = q.to(torch.float64).reshape(hkv, -1, d)  # (Hkv, G, d)
    p = torch.softmax(scale * qg @ k_hat.transpose(-1, -2), dim=-1)
    expected = (p @ v_hat).reshape(-1)
    return float((kernel_out.reshape(-1).to(torch.float64) - expected).abs().max())


def _refuse_unsupported(impl) -> None:
    """The meter assumes plain causal softmax attention over the cache; refuse anything else."""
    reasons = []
    if impl.sliding_window != -1:
        reasons.append(f"sliding window {impl.sliding_window}")
    if impl.logits_soft_cap:
        reasons.append(f"logit soft cap {impl.logits_soft_cap}")
    if impl.alibi_slopes is not None:
        reasons.append("ALiBi")
    if impl.sinks is not None:
        reasons.append("attention sinks")
    if impl.kv_sharing_target_layer_name is not None:
        reasons.append("KV sharing across layers")
    if impl.kv_cache_dtype not in layout.READABLE:
        reasons.append(f"kv_cache_dtype {impl.kv_cache_dtype!r}")
    if reasons:
        raise ValueError("WitCert vLLM plugin cannot meter this attention layer ("
                         + ", ".join(reasons) + f"); unset {config.ENABLE} to serve without the meter")
