"""vLLM's CPU attention backend with WitCert attached (write: scheme and witness; decode: meter, gate).

The subclass calls vLLM's own cache writer and fused attention kernel unchanged and only *reads*
the cache around them, except where a scheme or the gate writes into it, again through vLLM's
writer:

- ``do_kv_cache_update``: vLLM writes the step's exact keys and values (the step attends them
  exactly, in flight); the plugin reads them back at ``slot_mapping`` and stores
  ``witness_of(exact key, stored key)`` (fp16, rounded up) at the same slots of a side tensor
  ``[blocks, Hkv, block_size, B]``, plus the exact shadow (audit) and the exact store (gate).
- ``forward``: vLLM's kernel runs; every decode row (one query token) is metered per query head
  over its stored keys and witnesses (:mod:`.metering`); gated rows whose cells exceed ``tau``
  get their flagged blocks' exact keys and values written back (:mod:`.gate`) and the step's
  attention is recomputed over the repaired cache and metered again. Then each request's new
  tokens are stored as its scheme reconstructs them (:mod:`.schemes`), through vLLM's writer,
  read back, and their witnesses replaced: from the next step on, vLLM's kernel attends the
  compressed keys, and the witness describes exactly what it reads.

With no scheme and no repair the outputs are bit-identical to the stock backend. The start-up
self-test (:mod:`.selftest`) runs at the first write of each configuration.
"""
import contextlib
import math

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from witcert.core.metering import meter, risk_score
from witcert.schemes.catalog import DITHERED
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import witness_of

from . import config, gate, layout, runtime, schemes, selftest
from .exact_store import ExactStore
from .metering import TierBKeys, decode_terms, true_tv_of

MAX_REPAIR_ROUNDS = 4  # write back, recompute, re-meter; ends earlier when nothing is left to repair


class WitCertCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with WitCert metering (registered in its place by the plugin)."""

    @staticmethod
    def get_impl_cls() -> type["WitCertCPUAttentionImpl"]:
        return WitCertCPUAttentionImpl


class WitCertCPUAttentionImpl(CPUAttentionBackendImpl):
    """:class:`CPUAttentionBackendImpl` plus schemes and the band witness on write, the meter and gate on decode."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime.get()
        self.metered = self.attn_type == AttentionType.DECODER
        self.layer_index = None
        self.witness = None  # (blocks, Hkv, block_size, B) fp16, allocated with the cache
        self.shadow = None  # (blocks, Hkv, block_size, d) exact keys, shadow mode only
        self.store = None  # ExactStore of keys and values, gate only
        self.tier_b = None  # dithered cache: codes, scales, valid per slot
        self.repaired = None  # (slots,) bool: made exact by the gate since the slot was written
        self.k_scale = None  # the key scale the stored witnesses were formed under
        self.cache_layout = None  # layout.CacheLayout measured by the self-test
        self._pending = None  # the step's (key, value, slot_mapping), compressed after its attention
        self.head_offset, self.kv_head_offset = _tensor_parallel_offsets(self.num_heads, self.num_kv_heads)
        if self.metered:
            _refuse_unsupported(self)
            try:
                self.layout = BandLayout(self.head_size, self.runtime.config.bands)
            except ValueError as e:
                raise ValueError(f"{config.BANDS}: {e}") from None
            runtime.track_request_ids()

    # -- write ---------------------------------------------------------------------------------
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
        with _one_thread():
            self._witness_written(layer, kv_cache, slots, exact)
            if self.shadow is not None:
                layout.scatter_rows(self.shadow, slots, exact)
            if self.store is not None:
                exact_v = value[:n].reshape(n, self.num_kv_heads, self.head_size)[keep]
                self.store.write(slots, exact, exact_v)
            self.repaired[slots] = False
            if self.tier_b is not None:
                self.tier_b["valid"][slots] = False
        self._pending = (key[:n], value[:n], slot_mapping)

    def _witness_written(self, layer, kv_cache, slots, exact) -> torch.Tensor:
        """Read the keys at ``slots`` back and store the witness of ``exact - stored``; return them."""
        stored = layout.decode(self.cache_layout.keys_at_slots(kv_cache, slots), self.kv_cache_dtype,
                               layer._k_scale_float)
        layout.scatter_rows(self.witness, slots, _witness(exact, stored, self.layout))
        return stored

    def _write(self, layer, kv_cache, slots, k, v) -> None:
        """Write rows ``k``, ``v`` (N, Hkv, d) at ``slots`` through vLLM's own writer."""
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, k.contiguous(), v.contiguous(), kv_cache,
                                                   slots.to(torch.int64))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if self.metered and attn_metadata is not None and self.witness is not None:
            self._follow_scale(layer)
            with _one_thread():
                self._meter(layer, query, key, value, kv_cache, attn_metadata, output)
                self._compress_pending(layer, kv_cache, attn_metadata)
            self.runtime.end_layer(self.layer_index)
        self._pending = None
        return result

    def _prepare(self, layer, kv_cache: torch.Tensor, model_dtype: torch.dtype) -> None:
        """Self-test the configuration and allocate the side tensors (once per layer)."""
        if self.witness is not None and self.witness.shape[0] == kv_cache.shape[0]:
            return
        blocks, heads, block_size, _ = kv_cache.shape
        checked = selftest.check_cache(
            isa=layer.isa, model_dtype=model_dtype, storage_dtype=kv_cache.dtype,
            kv_cache_dtype=self.kv_cache_dtype, num_heads=self.num_heads, num_kv_heads=heads,
            head_size=self.head_size, block_size=block_size, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, scale=self.scale)
        self.runtime.telemetry.selftest = checked.report
        self.cache_layout = checked.layout  # where the writer put each entry, measured for this configuration
        cfg = self.runtime.config
        self.witness = torch.zeros(blocks, heads, block_size, self.layout.bands, dtype=torch.float16)
        self.k_scale = layer._k_scale_float
        self.model_dtype = model_dtype
        self.repaired = torch.zeros(blocks * block_size, dtype=torch.bool)
        if cfg.shadow:
            self.shadow = torch.zeros(blocks, heads, block_size, self.head_size, dtype=model_dtype)
        if cfg.gate:
            self.store = ExactStore(blocks * block_size, heads, self.head_size, model_dtype)
        if DITHERED in self.runtime.schemes and self.kv_cache_dtype in layout.LOSSLESS:
            groups = self.head_size // schemes.TIER_B_GROUP
            self.tier_b = {"codes": torch.zeros(blocks * block_size, heads, self.head_size, dtype=torch.int8),
                           "scales": torch.zeros(blocks * block_size, heads, groups, dtype=torch.float16),
                           "valid": torch.zeros(blocks * block_size, dtype=torch.bool)}
        self.layer_index = extract_layer_index(layer.layer_name)

    def _follow_scale(self, layer) -> None:
        """A witness holds for the key scale it was formed under. If vLLM changes the scale (e.g.
        calculated KV scales), the kernel reads every older fp8 entry at the new scale, which no
        stored witness covers: make them all the trivial bound (``inf``: meter 1) from then on."""
        if layer._k_scale_float != self.k_scale:
            if self.kv_cache_dtype not in layout.LOSSLESS:
                self.witness.fill_(math.inf)
            self.k_scale = layer._k_scale_float

    # -- meter and gate ------------------------------------------------------------------------
    def _meter(self, layer, query, key, value, kv_cache, md, output) -> None:
        """Meter every decode row (one query token) of this step; repair gated cells above tau."""
        starts, lengths = md.query_start_loc.tolist(), md.seq_lens.tolist()
        rt = self.runtime
        rows = []
        for r in range(len(lengths)):
            q_len = starts[r + 1] - starts[r]
            if q_len == 1:
                rows.append(r)
            elif q_len > 1:  # a prefill chunk: not metered; count it, and whether it read lossy keys
                self._count_prefill(md, r, q_len, lengths[r])
        if not rows:
            return
        block_size = kv_cache.shape[2]
        lens = [lengths[r] for r in rows]
        blocks_of = [md.block_table[r, : math.ceil(n / block_size)].long() for r, n in zip(rows, lens)]
        q = query[torch.tensor([starts[r] for r in rows])].reshape(len(rows), self.num_heads, self.head_size)
        view = self._read(layer, kv_cache, blocks_of, lens)
        scores, c = decode_terms(q, view["k_hat"], view["w"], torch.tensor(lens), self.layout, self.scale,
                                 view["tier_b"])
        raw = meter(scores, c)  # (R, Hq)
        raw_tv = None if view["exact"] is None else true_tv_of(q, view["exact"], scores, torch.tensor(lens),
                                                               self.scale)
        settings = [rt.settings(r) for r in rows]
        final, final_tv, final_scores, final_c = raw, raw_tv, scores, c
        gated = [i for i, s in enumerate(settings) if s.gate]
        if gated and bool((raw[gated] > rt.config.tau).any()):
            final, final_tv, final_scores, final_c, view = self._repair(
                layer, query, key, value, kv_cache, md, output, q, rows, lens, blocks_of, gated, scores, c, raw,
                raw_tv)
        cell_log, telemetry = rt.cell_log, rt.telemetry
        risk = risk_score(final_scores, final_c) if cell_log is not None else None
        for i, (r, n) in enumerate(zip(rows, lens)):
            request, scheme, repaired = rt.request_id(r), settings[i].scheme, final is not raw and i in gated
            tv = None if final_tv is None else final_tv[i]
            raw_args = {"raw_meter": raw[i], "raw_true_tv": None if raw_tv is None else raw_tv[i]} if repaired else {}
            telemetry.add(request, self.layer_index, final[i], tv, scheme=scheme, gated=settings[i].gate, **raw_args)
            if cell_log is not None:
                cell_log.add(request, self.layer_index, n - 1, n, final[i], risk[i], tv, scheme=scheme,
                             head_offset=self.head_offset, **raw_args)
            if view["exact"] is not None:
                v_hat = layout.decode(self.cache_layout.values_of_blocks(kv_cache, blocks_of[i], n),
                                      self.kv_cache_dtype, layer._v_scale_float)
                telemetry.add_output_gap(*_output_gap(q[i], view["k_hat"][i, :, :n], v_hat, self.scale,
                                                      output[starts[r]], self.model_dtype))

    def _read(self, layer, kv_cache, blocks_of, lens) -> dict:
        """What the kernel reads for each decode row, padded to the longest: keys, witnesses, Tier B, shadow."""
        block_size = kv_cache.shape[2]
        shape = (len(lens), self.num_kv_heads, max(lens))
        k_hat = torch.zeros(*shape, self.head_size, dtype=torch.float64)
        w = torch.zeros(*shape, self.layout.bands, dtype=torch.float16)
        exact = None if self.shadow is None else torch.zeros(*shape, self.head_size, dtype=self.shadow.dtype)
        tier_b = None
        if self.tier_b is not None:
            groups = self.tier_b["scales"].shape[-1]
            tier_b = TierBKeys(codes=torch.zeros(*shape, self.head_size, dtype=torch.int8),
                               scales=torch.zeros(*shape, groups, dtype=torch.float16),
                               valid=torch.zeros(shape, dtype=torch.bool), key_dtype=self.model_dtype,
                               group=schemes.TIER_B_GROUP)
        for i, (blocks, n) in enumerate(zip(blocks_of, lens)):
            k_hat[i, :, :n] = layout.decode(self.cache_layout.keys_of_blocks(kv_cache, blocks, n),
                                            self.kv_cache_dtype, layer._k_scale_float)
            w[i, :, :n] = layout.rows_of_blocks(self.witness, blocks, n)
            if exact is not None:
                exact[i, :, :n] = layout.rows_of_blocks(self.shadow, blocks, n)
            if tier_b is not None:
                slots = gate.slots_of(blocks, n, block_size)
                tier_b.codes[i, :, :n] = self.tier_b["codes"][slots].transpose(0, 1)
                tier_b.scales[i, :, :n] = self.tier_b["scales"][slots].transpose(0, 1)
                tier_b.valid[i, :, :n] = self.tier_b["valid"][slots].unsqueeze(0)
        return {"k_hat": k_hat, "w": w, "exact": exact, "tier_b": tier_b}

    def _repair(self, layer, query, key, value, kv_cache, md, output, q, rows, lens, blocks_of, gated, scores, c,
                raw, raw_tv):
        """The gate (:mod:`.gate`): page flagged blocks in, write them back, recompute attention, re-meter."""
        rt = self.runtime
        tau, telemetry = rt.config.tau, rt.telemetry
        block_size = kv_cache.shape[2]
        idx = torch.tensor(gated)
        lens_t = torch.tensor(lens)
        meter_now, scores_now, c_now, view = raw, scores, c, None
        for _ in range(MAX_REPAIR_ROUNDS):
            over = meter_now[idx] > tau  # (Rg, Hq)
            if not bool(over.any()):
                break
            pager = gate.Pager(self.store, q[idx], [blocks_of[i] for i in gated], [lens[i] for i in gated],
                               block_size, rt.config.gate_block, self.scale)
            plan = gate.plan(scores_now[idx], c_now[idx], tau, rt.config.gate_block, pager)
            telemetry.count("bytes_paged", pager.bytes)
            # a gate block may hold slots with nothing to repair: this step's own exact token, or a slot
            # already repaired (in an fp8 cache its exact key, cast to fp8, keeps a nonzero witness)
            lossy = (self.witness[plan.slots // block_size, :, plan.slots % block_size] != 0).flatten(1).any(-1)
            lossy &= ~self.repaired[plan.slots]
            slots, k_ex, v_ex = plan.slots[lossy], plan.k[lossy], plan.v[lossy]
            if not slots.numel():
                break  # nothing left to repair: the cells stay above tau (counted unreachable)
            self._write(layer, kv_cache, slots, k_ex, v_ex)
            stored = self._witness_written(layer, kv_cache, slots, k_ex)
            if self.tier_b is not None:
                self.tier_b["valid"][slots] = False
            new = ~self.repaired[slots]
            self.repaired[slots] = True
            telemetry.count("repair_rounds")
            telemetry.count("blocks_repaired", plan.blocks)
            telemetry.count("slots_repaired", int(new.sum()))
            if self.shadow is not None:
                self._check_repair(slots, stored)
            # the step's attention, recomputed over the repaired cache (vLLM's kernel, all rows)
            with _vllm_threads():
                CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, md, output)
            view = self._read(layer, kv_cache, blocks_of, lens)
            scores_now, c_now = decode_terms(q, view["k_hat"], view["w"], lens_t, self.layout, self.scale,
                                             view["tier_b"])
            meter_now = meter(scores_now, c_now)
        if view is None:
            return raw, raw_tv, scores, c, self._read(layer, kv_cache, blocks_of, lens)
        tv_now = None if view["exact"] is None else true_tv_of(q, view["exact"], scores_now, lens_t, self.scale)
        return meter_now, tv_now, scores_now, c_now, view

    def _check_repair(self, slots, stored) -> None:
        """Shadow: a repaired slot must read back as the exact key (up to the cache dtype's cast)."""
        block_size = self.shadow.shape[2]
        exact = self.shadow[slots // block_size, :, slots % block_size].to(torch.float64)  # (N, Hkv, d)
        if self.kv_cache_dtype in layout.LOSSLESS:
            bad = (stored != exact).flatten(1).any(-1)
        else:  # an fp8 cache holds the exact key cast to fp8: within the format's relative step
            rel, absolute = selftest._CAST_TOLERANCE[self.kv_cache_dtype]
            bad = ((stored - exact).abs() > rel * exact.abs() + absolute * self.k_scale).flatten(1).any(-1)
        self.runtime.telemetry.count("shadow_repair_checked", slots.numel())
        self.runtime.telemetry.count("shadow_repair_mismatches", int(bad.sum()))

    def _count_prefill(self, md, row: int, q_len: int, seq_len: int) -> None:
        """Count a prefill chunk's query tokens, and whether they read keys stored lossy earlier."""
        telemetry = self.runtime.telemetry
        telemetry.prefill_tokens += q_len
        context = seq_len - q_len
        if context > 0:
            block_size = self.witness.shape[2]
            blocks = md.block_table[row, : math.ceil(context / block_size)].long()
            if bool((layout.rows_of_blocks(self.witness, blocks, context) != 0).any()):
                telemetry.prefill_tokens_lossy += q_len

    # -- store compressed ----------------------------------------------------------------------
    def _compress_pending(self, layer, kv_cache, md) -> None:
        """Store each request's new tokens as its scheme reconstructs them (after the step's attention)."""
        if self._pending is None:
            return
        key, value, slot_mapping = self._pending
        rt = self.runtime
        starts = md.query_start_loc.tolist()
        for r in range(len(starts) - 1):
            name = rt.settings(r).scheme
            if name == config.NONE:
                continue
            span = slice(starts[r], starts[r + 1])
            keep = slot_mapping[span] >= 0
            if not bool(keep.any()):
                continue
            slots = slot_mapping[span][keep].long()
            k = key[span].reshape(-1, self.num_kv_heads, self.head_size)[keep]  # (n, Hkv, d) exact
            v = value[span].reshape(-1, self.num_kv_heads, self.head_size)[keep]
            out = schemes.compress(rt.schemes[name], k.transpose(0, 1), v.transpose(0, 1), layer=self.layer_index,
                                   slots=slots, kv_head_offset=self.kv_head_offset, seed=rt.dither_seed)
            k_hat, v_hat = out.k.transpose(0, 1), out.v.transpose(0, 1)  # (n, Hkv, d)
            self._write(layer, kv_cache, slots, k_hat, v_hat)
            stored = self._witness_written(layer, kv_cache, slots, k)
            self.repaired[slots] = False  # a gate block may have covered this step's own (exact) token
            if out.codes is not None and self.tier_b is not None:
                # the deterministic branch holds for the dequantized value; only where it was read back unchanged
                unchanged = (stored == k_hat.to(torch.float64)).flatten(1).all(-1)
                self.tier_b["codes"][slots] = out.codes.transpose(0, 1)
                self.tier_b["scales"][slots] = out.scales.transpose(0, 1)
                self.tier_b["valid"][slots] = unchanged


def _tensor_parallel_offsets(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """This worker's first query head and kv head counter offset (tensor parallelism; 0 and 0 alone)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError, ImportError):
        rank = 0  # no distributed state (a unit test building the impl)
    return rank * num_heads, rank * num_kv_heads


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
    global _VLLM_THREADS
    threads = torch.get_num_threads()
    if threads != 1 or _VLLM_THREADS is None:
        _VLLM_THREADS = threads
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)


_VLLM_THREADS = None  # vLLM's thread count outside the meter (its scheduler metadata is built for it)


@contextlib.contextmanager
def _vllm_threads():
    """Inside :func:`_one_thread`: vLLM's own thread count back, for a call of its kernel (whose
    scheduler metadata checks the thread count it was built for)."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(_VLLM_THREADS or threads)
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


def _output_gap(q, k_hat, v_hat, scale, kernel_out, model_dtype) -> tuple[float, float]:
    """For one token: max |kernel output - fp64 attention over the read-back keys and values|, and what the
    kernel's own rounding in ``model_dtype`` allows it to be (:func:`_kernel_allowance`)."""
    hkv, _, d = k_hat.shape
    qg = q.to(torch.float64).reshape(hkv, -1, d)  # (Hkv, G, d)
    p = torch.softmax(scale * qg @ k_hat.transpose(-1, -2), dim=-1)
    expected = (p @ v_hat).reshape(-1)
    gap = float((kernel_out.reshape(-1).to(torch.float64) - expected).abs().max())
    return gap, _kernel_allowance(qg, k_hat, v_hat, scale, model_dtype)


def _kernel_allowance(qg, k_hat, v_hat, scale, model_dtype) -> float:
    """How far a kernel computing in ``model_dtype`` over these keys and values may land from exact attention.

    Its logits may be off by ``eta_t = (eps + d 2^-24) scale sum_i |q_i k_ti|`` (the query or the scaled
    query rounded to the model dtype, ``eps = 2u``, and an fp32 accumulation; vLLM's AMX kernels round the
    scaled query to bf16), so its probabilities are within TV ``tanh(max eta / 2)`` of the exact ones (the
    max-norm bound, MN) and its output within ``2 TV max |v|``; the probabilities, values and output may each
    be rounded once more (``3 eps max |v|``). Diagnostic only: it does not enter the meter, which certifies
    exact-arithmetic attention over the read-back keys.
    """
    eps = torch.finfo(model_dtype).eps
    eta = (eps + k_hat.shape[-1] * 2.0**-24) * scale * float((qg.abs() @ k_hat.abs().transpose(-1, -2)).max())
    return float(v_hat.abs().max()) * (2 * math.tanh(eta / 2) + 3 * eps)


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
