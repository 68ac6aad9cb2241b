"""vLLM's CPU attention backend with WitCert attached (write: scheme and witness; decode: meter, gate).

The subclass calls vLLM's own cache writer and fused attention kernel unchanged and only *reads*
the cache around them, except where a scheme or the gate writes into it, again through vLLM's
writer:

- ``do_kv_cache_update``: vLLM writes the step's exact keys and values (the step attends them
  exactly, in flight); the plugin reads them back at ``slot_mapping`` (by index) and records
  ``witness_of(exact key, stored key)`` (fp16, rounded up) at the same slots of a side tensor
  ``[blocks, Hkv, block_size, B]``, plus the exact shadow (audit) and the exact store (gate).
- ``forward``: vLLM's kernel runs; the step's plan (:mod:`.step_plan`, one per step, shared by the
  layers) arranges this layer's metering state (:mod:`.sequence_state`), the written tokens enter it,
  and every metered query row of the batch is metered in one pass (:mod:`.decode_pass`); gated rows
  whose cells exceed ``tau`` get their flagged blocks' exact keys and values written back
  (:mod:`.gate`) and the step's attention is recomputed over the repaired cache and metered again.
  A request with the spot check has its cells over ``tau`` spot-checked from the exact store, and the
  gate repairs only those the check could not certify (:mod:`.spot_gate`).
  Then each request's new tokens are stored as its scheme reconstructs them (:mod:`.schemes`), through
  vLLM's writer, read back, and their witnesses replaced (in the side tensor and the state): from the
  next step on, vLLM's kernel attends the compressed keys, and the witness describes exactly what it reads.

With no scheme and no repair the outputs are bit-identical to the stock backend. The start-up
self-test (:mod:`.selftest`) runs at the first write of each configuration. Nothing here changes
torch's thread count: the pass's operations run on the threads vLLM set.
"""
import math
from dataclasses import dataclass

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from witcert.schemes.catalog import DITHERED
from witcert.tier_a.bands import BandLayout

from . import config, gate, layout, runtime, schemes, selftest, spot_gate
from .decode_pass import cell_terms, meter_cells, meter_rows, warm_up
from .exact_store import ExactStore
from .journal import WriteJournal
from .sequence_state import SequenceState
from .spot_check import SpotChecker
from .telemetry import PROBABILISTIC, PROVED, CellBatch
from .written import Written, from_cache, written

MAX_REPAIR_ROUNDS = 4  # write back, recompute, re-meter; ends earlier when nothing is left to repair


class WitCertCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with WitCert metering (registered in its place by the plugin)."""

    @staticmethod
    def get_impl_cls() -> type["WitCertCPUAttentionImpl"]:
        return WitCertCPUAttentionImpl


@dataclass(frozen=True)
class _Pending:
    """The step's writes, kept from ``do_kv_cache_update`` to ``forward``: the exact keys and values (n tokens),
    the slot mapping, the tokens with a slot (``index``) and what the meter keeps of them."""

    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    index: torch.Tensor
    kept: Written | None  # None: journaled (:mod:`.journal`), entered into the state when something reads it


@dataclass(frozen=True)
class _Queued:
    """One step's decode rows, queued for deferred metering: per state row its request, settings, position, whether
    sampling meters it, the query ``q`` (R, Hq * d) as the model gave it, its length and its own token as the cache
    held it (``own_keys`` (R, Hkv, d), ``own_witness`` (R, Hkv, B), ``own_norms`` (R, Hkv); ``None`` where no row has
    a scheme: nothing stores the token anew); with the shadow, ``true_tv`` (R, 1, Hq): the truth taken when queued
    (by the flush a finished request's blocks may hold a new request's exact keys)."""

    rows: int
    requests: list
    settings: list
    positions: list
    chosen: list
    q: torch.Tensor
    lengths: torch.Tensor
    own_keys: torch.Tensor | None
    own_witness: torch.Tensor | None
    own_norms: torch.Tensor | None
    true_tv: torch.Tensor | None
    picks: list | None = None  # per row, its audit's picked heads (Hq, 1) in this layer (None: no audit)


class WitCertCPUAttentionImpl(CPUAttentionBackendImpl):
    """:class:`CPUAttentionBackendImpl` plus schemes and the band witness on write, the meter and gate on decode."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime.get()
        self.metered = self.attn_type == AttentionType.DECODER
        self.layer_index = None
        self.witness = None  # (blocks, Hkv, block_size, B) fp16, allocated with the cache
        self.state = None  # SequenceState: what the meter reads of the running sequences
        self.shadow = None  # (blocks, Hkv, block_size, d) exact keys, shadow mode only
        self.store = None  # ExactStore of keys and values, gate only
        self.spot = None  # SpotChecker reading the store (requests with witcert_certificate "spot")
        self.tier_b = None  # dithered cache: codes, scales, valid per slot
        self.repaired = None  # (slots,) bool: made exact by the gate since the slot was written
        self.k_scale = None  # the key scale the stored witnesses were formed under
        self.cache_layout = None  # layout.CacheLayout measured by the self-test
        self._pending = None  # _Pending: the step's writes, metered and compressed in forward
        self._deferred = []  # _Queued decode rows of earlier steps, metered together (deferred metering)
        self.journal = WriteJournal()  # written slots not yet entered into the state (:mod:`.journal`)
        self._written_to = None  # (layer, kv_cache) the journal's slots were written to
        self.defer = self.runtime.config.defer if _world_size() == 1 else 1  # a worker process flushes alone
        self.head_offset, self.kv_head_offset = _tensor_parallel_offsets(self.num_heads, self.num_kv_heads)
        if self.metered:
            _refuse_unsupported(self)
            try:
                self.layout = BandLayout(self.head_size, self.runtime.config.bands)
            except ValueError as e:
                raise ValueError(f"{config.BANDS}: {e}") from None
            runtime.track_request_ids()
            self.runtime.impls.add(self)

    # -- write ---------------------------------------------------------------------------------
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.journal and self.journal.may_hold(*self._step_tokens(slot_mapping)[1:]):
            self._enter_journal(every=True)  # read back before this write reaches a journaled slot
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not self.metered:
            return
        self._prepare(layer, kv_cache, key.dtype)
        self._follow_scale(layer)
        n = slot_mapping.shape[0]
        index, slots, write, _ = self._step_tokens(slot_mapping)
        exact = key[:n].reshape(n, self.num_kv_heads, self.head_size)[index]  # (N, Hkv, d): a copy, vLLM's own
        if self.shadow is not None:
            layout.scatter_rows(self.shadow, slots, exact)
        if self._journaling():
            self.journal.add(slots, exact, write)
            self._written_to = (layer, kv_cache)
            self._pending = _Pending(key[:n], value[:n], slot_mapping, index, None)
            return
        _, kept = self._read_back(layer, kv_cache, slots, exact, self._entries(kv_cache, slots))
        if self.store is not None:
            exact_v = value[:n].reshape(n, self.num_kv_heads, self.head_size)[index]
            self.store.write(slots, exact, exact_v)
        self.repaired[slots] = False
        if self.tier_b is not None:
            self.tier_b["valid"][slots] = False
        self._pending = _Pending(key[:n], value[:n], slot_mapping, index, kept)

    def _journaling(self) -> bool:
        """Whether this step's writes go to the journal (:mod:`.journal`): nothing reads them back at once (no
        gate store or dithered cache; no request of the step stores its tokens with a scheme) and this
        process sees the engine go idle (its flush enters what is left). The same for every layer of a step."""
        rt = self.runtime
        if self.store is not None or self.tier_b is not None:
            return False
        cached = rt.journal_step
        if cached is None or cached[0] != rt.step:
            rows = len(rt.row_settings) if rt.row_settings else 1
            rt.journal_step = cached = (rt.step, runtime.idle_hook_here() and all(
                rt.settings(r).scheme == config.NONE for r in range(rows)))
        return cached[1]

    def _enter_journal(self, every: bool = False) -> None:
        """Enter the journaled writes into the witness side tensor and the state: read back at their slots, the
        witnesses formed against the exact keys the writes saw, in one call (``every``: the current step's too,
        as its witnesses only: its forward has not placed it yet)."""
        if every:
            self.journal.close()
        if not self.journal:
            return
        with torch.inference_mode():  # the side tensors were made in vLLM's forward; a flush may run outside it
            taken = self.journal.take()
            if taken is None:
                return
            slots, exact, rows, positions = taken
            layer, kv_cache = self._written_to
            _, kept = self._read_back(layer, kv_cache, slots, exact, self._entries(kv_cache, slots))
            placed = rows >= 0
            if bool(placed.all()):
                self.state.write(rows, positions, kept.keys, kept.witness, kept.key_norms)
            elif bool(placed.any()):
                self.state.write(rows[placed], positions[placed], kept.keys[placed], kept.witness[placed],
                                 kept.key_norms[placed])

    def _step_tokens(self, slot_mapping) -> tuple:
        """``(index, slots, write, before)``: the step's written tokens (``-1`` marks padding), their slots, the write's
        number and the last earlier write of any of them (:meth:`.runtime.Runtime.number_writes`): the same for every
        layer of a step (one slot mapping), so found once per step."""
        rt = self.runtime
        cached = rt.slot_cache
        if cached is None or cached[0] != rt.step or cached[1] is not slot_mapping:
            index = (slot_mapping >= 0).nonzero().squeeze(-1)
            slots = slot_mapping[index].long()
            cached = rt.slot_cache = (rt.step, slot_mapping, index, slots, *rt.number_writes(slots))
        return cached[2:]

    def _entries(self, kv_cache, slots) -> torch.Tensor:
        """Where the cache holds the keys of ``slots``, found once for every layer: a step's layers write the same
        slots (one slot mapping: the very tensor, :meth:`_step_tokens`) into caches of one shape, and their journals,
        entered one after another (a flush, the engine going idle), hold the same slots (equal tensors)."""
        rt = self.runtime
        cached = rt.entry_cache
        if cached is None or cached[0] != kv_cache.shape or not (cached[1] is slots or (
                cached[1].shape == slots.shape and torch.equal(cached[1], slots))):
            cached = rt.entry_cache = (kv_cache.shape, slots, self.cache_layout.key_entries(kv_cache, slots))
        return cached[2]

    def _read_back(self, layer, kv_cache, slots, exact, entries=None) -> tuple[torch.Tensor, Written]:
        """Read the keys at ``slots`` back, record their witnesses against ``exact``; return the stored entries (in
        the cache's storage dtype) and what the meter keeps."""
        stored = self.cache_layout.keys_at_slots(kv_cache, slots, entries)
        kept = written(exact, layout.decode_kept(stored, self.kv_cache_dtype, layer._k_scale_float), self.layout,
                       self.runtime.config.compile)
        layout.scatter_rows(self.witness, slots, kept.witness)
        return stored, kept

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
            plan = self.runtime.plan(attn_metadata, kv_cache.shape[2])
            if self._deferred and not self._continues(plan):
                self.flush()  # against the state as the queued rows left it
            self._sync(plan, layer, kv_cache, attn_metadata)
            self._count_prefill(plan, attn_metadata)
            self._meter(plan, layer, query, key, value, kv_cache, attn_metadata, output)
            self._compress_pending(plan, layer, kv_cache, attn_metadata)
            self.runtime.end_layer(self.layer_index)
        self.journal.close()
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
        self.journal = WriteJournal()  # a new cache: nothing of the old one is entered
        if cfg.shadow:
            self.shadow = torch.zeros(blocks, heads, block_size, self.head_size, dtype=model_dtype)
        if cfg.gate:
            self.store = ExactStore(blocks * block_size, heads, self.head_size, model_dtype)
            self.spot = SpotChecker(self.store, self.scale, cfg.tau)
        tier_b_groups = None
        if DITHERED in self.runtime.schemes and self.kv_cache_dtype in layout.LOSSLESS:
            groups = self.head_size // schemes.TIER_B_GROUP
            self.tier_b = {"codes": torch.zeros(blocks * block_size, heads, self.head_size, dtype=torch.int8),
                           "scales": torch.zeros(blocks * block_size, heads, groups, dtype=torch.float16),
                           "valid": torch.zeros(blocks * block_size, dtype=torch.bool)}
            # the pass's deterministic branch covers keys the kernel reads in fp32 (no final cast to a narrower
            # model dtype); elsewhere the dithered cache is metered by its Tier A witness alone
            tier_b_groups = groups if model_dtype == torch.float32 else None
        self.state = SequenceState(heads, self.head_size, self.layout.bands, tier_b_groups)
        self.layer_index = extract_layer_index(layer.layer_name)
        if cfg.compile:
            warm_up(self.layout, tier_b_groups is not None)  # before any request waits on a compilation

    def _follow_scale(self, layer) -> None:
        """A witness holds for the key scale it was formed under. If vLLM changes the scale (e.g.
        calculated KV scales), the kernel reads every older fp8 entry at the new scale, which no
        stored witness covers: make them all the trivial bound (``inf``: meter 1) from then on."""
        if layer._k_scale_float != self.k_scale:
            self._enter_journal()
            if self.kv_cache_dtype not in layout.LOSSLESS:
                self.witness.fill_(math.inf)
                if self.state is not None:
                    self.state.witness.fill_(math.inf)
            self.k_scale = layer._k_scale_float

    # -- the metering state --------------------------------------------------------------------
    def _sync(self, plan, layer, kv_cache, md) -> None:
        """Arrange the state for this step's plan: rows moved, positions read once from the cache, the step's
        written tokens entered (as the cache holds them now: exact, attended in flight)."""
        if self.journal and (plan.epoch != self.state.epoch and (plan.moves is not None or plan.fresh is not None)
                             or plan.fills):
            self._enter_journal()  # placed in the rows of earlier plans; fills read the witness side tensor
        self.state.arrange(plan.epoch, plan.rows, plan.tokens, plan.moves, plan.fresh)
        for row, batch_row, start, end in plan.fills:
            slots = gate.slots_of(md.block_table[batch_row].long(), end, kv_cache.shape[2])[start:end]
            self._state_from_cache(layer, kv_cache, torch.full_like(slots, row), torch.arange(start, end), slots)
        p = self._pending
        if p is not None and p.kept is None:
            self.journal.place(*self._placed(plan, p.index))
        elif p is not None and p.index.numel():
            self.state.write(*self._placed(plan, p.index), p.kept.keys, p.kept.witness, p.kept.key_norms)

    @staticmethod
    def _placed(plan, index) -> tuple:
        """The state rows and positions of the step's written tokens ``index`` (the same for every layer)."""
        cached = plan.cache.get("placed")
        if cached is None or cached[0] is not index:
            cached = plan.cache["placed"] = (index, plan.token_rows[index], plan.token_positions[index])
        return cached[1:]

    def _state_from_cache(self, layer, kv_cache, rows, positions, slots) -> None:
        """Enter the cache's current keys at ``slots`` into the state at ``(rows, positions)``."""
        stored = layout.decode_kept(self.cache_layout.keys_at_slots(kv_cache, slots), self.kv_cache_dtype,
                                    layer._k_scale_float)
        block_size = self.witness.shape[2]
        kept = from_cache(stored, self.witness[slots // block_size, :, slots % block_size])
        self.state.write(rows, positions, kept.keys, kept.witness, kept.key_norms, self._tier_b_scales(slots))

    def _journals_compressed(self) -> bool:
        """Whether a scheme's compressed writes go to the journal (:mod:`.journal`) instead of being read back at once:
        the state's entry of a token written this step stays the exact key it attended, which the deferred rows'
        own tokens are taken from, and nothing reads the compressed one before the journal is entered (every reader
        of the state or the witness side tensor enters it first), except the gate and the dithered cache, which
        read back at once; as for journaled steps, this process must see the engine go idle (its flush enters what
        is left)."""
        return self.store is None and self.tier_b is None and runtime.idle_hook_here()

    def _tier_b_scales(self, slots) -> torch.Tensor | None:
        """The dithered cache's scales at ``slots`` for the state (N, Hkv, n_g), ``inf`` where not valid."""
        if self.state.scales is None:
            return None
        scales = self.tier_b["scales"][slots]
        return torch.where(self.tier_b["valid"][slots][:, None, None], scales, torch.full_like(scales, math.inf))

    # -- meter and gate ------------------------------------------------------------------------
    def _meter(self, plan, layer, query, key, value, kv_cache, md, output) -> None:
        """Meter every metered query row of this step in one pass (or queue them: deferred metering); repair gated
        cells above tau."""
        rt = self.runtime
        if not plan.metered_rows:
            return
        settings, positions = self._step_rows(plan)
        picks = self._layer_picks(plan, settings, positions)
        chosen = self._chosen(plan, settings, positions, picks)
        active = self._active(plan, chosen)
        if not active:  # nothing metered in this layer: counted, nothing built per cell
            self._count_unmetered(plan, settings)
            return
        if self._deferrable(plan, settings):
            self._queue_rows(plan, query, settings, positions, chosen, md, picks)
            if len(self._deferred) >= self.defer:
                self.flush()
            return
        self._enter_journal()  # the pass reads the state
        hq, hkv = self.num_heads, self.num_kv_heads
        width = plan.query_tokens.shape[1]
        meter = torch.full((plan.metered_rows, width, hq), math.nan, dtype=torch.float64)
        risk = torch.full_like(meter, math.nan)
        raw = tv = raw_tv = repaired = None
        spot_delta = [None] * plan.metered_rows  # per row: the delta of its probabilistic bounds (None: proved)
        rows = len(active) if active == list(range(len(active))) else torch.tensor(active)
        q, lengths, spans = self._query_rows(query, plan, active)
        view = self.state.view(rows, spans)
        m, r = meter_rows(q, view["keys"], view["witness"], view["key_norms"], lengths, view["lossy"],
                          view["norm_max"], self.layout, self.scale, view["scales"], compiled=rt.config.compile)
        spot = self._spot_rows(plan, md, settings, active, chosen, lengths, width)
        lowered = torch.zeros(len(active), dtype=torch.bool)
        if spot is not None:  # spot cells over tau: min(meter, spot bound) (before any repair)
            m, lowered = self._spot_bound(spot, m, q, view, lengths, spot.first_delta())
        first_m, first_view = _by_token(m, width), view
        served_m, served_r = first_m, _by_token(r, width)
        gated = [k for k, i in enumerate(active) if settings[i].gate]
        if gated:
            rt.telemetry.count("tokens_gated", sum(int(lengths[k].max()) for k in gated))
        if gated and bool((first_m[gated] > rt.config.tau).any()):
            served_m, served_r, view, again = self._repair(plan, layer, query, key, value, kv_cache, md, output,
                                                           q, lengths, active, gated, rows, spans, first_m,
                                                           served_r, spot, m)
            lowered |= again
            raw = torch.full_like(meter, math.nan)
            raw[active] = first_m
            repaired = [False] * plan.metered_rows
            for k in gated:
                repaired[active[k]] = True
        meter[active], risk[active] = served_m, served_r
        for k in lowered.nonzero().reshape(-1).tolist():
            spot_delta[active[k]] = settings[active[k]].spot.delta
        if self.shadow is not None:
            blocks = [self._blocks_of(md, plan.batch_of_row[i], int(plan.query_lengths[i].max())) for i in active]
            tv = torch.full_like(meter, math.nan)
            tv[active] = self._true_tv(q, view, lengths, blocks, width)
            if raw is not None:
                raw_tv = torch.full_like(meter, math.nan)
                raw_tv[active] = self._true_tv(q, dict(first_view, **self._before), lengths, blocks, width)
            self._output_gaps(plan, active, q, view, kv_cache, layer, md, output)
        meter = meter.masked_fill_(~_kept_cells(chosen, settings, self.layer_index, positions, hq, hkv, picks),
                                   math.nan)
        requests = [rt.request_id(plan.batch_of_row[i]) for i in range(plan.metered_rows)]
        self._queue(requests, settings, positions, plan.query_counts, meter, risk, raw, tv, raw_tv, repaired, picks,
                    spot_delta)

    @staticmethod
    def _active(plan, chosen: list) -> list:
        """The metered rows with a chosen query token (found once per step where ``chosen`` is the step's own)."""
        cached = plan.cache.get("active")
        if cached is None or cached[0] is not chosen:
            cached = plan.cache["active"] = (chosen, [i for i in range(plan.metered_rows) if any(chosen[i])])
        return cached[1]

    def _spot_rows(self, plan, md, settings, active, chosen, lengths, width):
        """The step's :class:`~.spot_gate.SpotRows` (``None``: no active row asked for the spot check)."""
        if all(settings[i].spot is None for i in active):
            return None
        block_size = self.witness.shape[2]
        slots = [None if settings[i].spot is None else
                 gate.slots_of(md.block_table[plan.batch_of_row[i]].long(), int(lengths[k].max()), block_size)
                 for k, i in enumerate(active)]
        return spot_gate.spot_rows(settings, active, chosen, slots, width, self.num_heads // self.num_kv_heads)

    def _spot_bound(self, spot, m, q, view, lengths, delta, changed=None, earlier=None):
        """:func:`.spot_gate.bounded` on the pass's meter ``m`` (Ra, Hkv, M); the checks counted."""
        m, lowered, checked = spot_gate.bounded(self.spot, spot, m, q, view, lengths, delta, self.layout, changed,
                                                earlier)
        telemetry = self.runtime.telemetry
        telemetry.count("spot_cells", checked.cells)
        telemetry.count("spot_keys", checked.keys)
        telemetry.count("spot_bytes", checked.bytes)
        return m, lowered

    def _count_unmetered(self, plan, settings) -> None:
        """This layer's query tokens, none metered: counted in the telemetry and their audits' tallies (the same
        counts for every layer of the step, derived once)."""
        if "unmetered" not in plan.cache:
            tokens = [(i, j) for i in range(plan.metered_rows) for j in range(plan.query_counts[i])]
            requests = [self.runtime.request_id(plan.batch_of_row[i]) for i, _ in tokens]
            audited = [(requests[k], settings[i].audit) for k, (i, _) in enumerate(tokens)
                       if settings[i].audit is not None]
            plan.cache["unmetered"] = (requests, [settings[i].scheme for i, _ in tokens],
                                       [r for r, _ in audited], [a for _, a in audited])
        requests, schemes, audited, audits = plan.cache["unmetered"]
        telemetry = self.runtime.telemetry
        telemetry.add_unmetered(self.layer_index, requests, schemes, self.num_heads)
        if audited:
            telemetry.audit.add_unpicked(audited, audits, self.num_heads)

    def _step_rows(self, plan) -> tuple[list, list]:
        """The metered rows' settings and query positions (the same for every layer of the step)."""
        if "rows" not in plan.cache:
            settings = [self.runtime.settings(plan.batch_of_row[i]) for i in range(plan.metered_rows)]
            plan.cache["rows"] = settings, (plan.query_lengths - 1).tolist()
        return plan.cache["rows"]

    def _chosen(self, plan, settings, positions, picks) -> list:
        """Per metered row and query token: whether the operator's sampling or the request's audit meters it in this
        layer (with the shadow, every token of an audited request: the audit's statement is checked against every
        cell's truth; its meter is still kept on the picked cells only)."""
        if "chosen" in plan.cache:  # the step's answer, the same in every layer (below)
            return plan.cache["chosen"]
        if all(s.everything for s in settings):
            plan.cache["chosen"] = [[j < plan.query_counts[i] for j in range(len(positions[i]))]
                                    for i in range(len(settings))]
            return plan.cache["chosen"]
        if picks is None and all(not s.metering.layers for s in settings):  # every layer or none: the same in each
            plan.cache["chosen"] = [[j < plan.query_counts[i] and s.metering.meters(0, positions[i][j])
                                     for j in range(len(positions[i]))] for i, s in enumerate(settings)]
            return plan.cache["chosen"]
        layer, shadow = self.layer_index, self.shadow is not None
        any_picked = None if picks is None else self._any_picked(plan)
        if any_picked is not None and self._picks_alone(plan, settings, positions, shadow):
            return any_picked  # every row audited, nothing else metered: its picks decide, per layer
        return [[j < plan.query_counts[i] and (
                    s.metering.meters(layer, positions[i][j]) if s.audit is None else
                    shadow or any_picked[i][j]
                    or (not s.metering.everything and s.metering.meters(layer, positions[i][j])))
                 for j in range(len(positions[i]))] for i, s in enumerate(settings)]

    @staticmethod
    def _picks_alone(plan, settings, positions, shadow: bool) -> bool:
        """Whether the audit's picks alone choose this step's tokens: every row audited with no other sampling
        switch (nothing metered beyond the picks), every query token real, no shadow (the same in every layer)."""
        if "picks alone" not in plan.cache:
            plan.cache["picks alone"] = not shadow and all(
                s.audit is not None and s.metering.everything and plan.query_counts[i] == len(positions[i])
                for i, s in enumerate(settings))
        return plan.cache["picks alone"]

    def _any_picked(self, plan) -> list:
        """Per metered row and query token, whether its audit picked any head of this layer (all layers' answers
        formed once per step from the step's picks)."""
        if "any picked" not in plan.cache:
            drawn, row = plan.cache["picks"]
            anywhere = drawn.any(2).tolist()  # (L, Ra, T)
            width = drawn.shape[-1]
            plan.cache["any picked"] = [[[False] * width if k is None else per_layer[k] for k in row]
                                        for per_layer in anywhere]
        return plan.cache["any picked"][self.layer_index]

    def _layer_picks(self, plan, settings, positions) -> list | None:
        """Per metered row, its audit's picked heads of this layer at its query positions, bool (Hq, T) (``None``: no
        audit); every layer's picks of a row found once per step (:class:`.audit.PickBlocks`: drawn ahead)."""
        if "picks" not in plan.cache:
            layers = max(len(self.runtime.impls), self.layer_index + 1)
            audited = [i for i, s in enumerate(settings) if s.audit is not None]
            if not audited:
                plan.cache["picks"] = None
            else:  # every audited row's picks of every layer, (L, Ra, Hq, T)
                drawn = self.runtime.picks.step([settings[i].audit for i in audited], layers, self.num_heads,
                                                [positions[i] for i in audited], self.head_offset)
                row = dict(zip(audited, range(len(audited))))
                plan.cache["picks"] = (drawn, [row.get(i) for i in range(len(settings))])
        if plan.cache["picks"] is None:
            return None
        drawn, row = plan.cache["picks"]
        layer = drawn[self.layer_index]
        return [None if k is None else layer[k] for k in row]

    # -- deferred metering ---------------------------------------------------------------------
    def _deferrable(self, plan, settings) -> bool:
        """Deferred metering (``WITCERT_VLLM_DEFER`` steps at a time): only where nothing feeds back (no gate on
        any metered row), every metered row is a plain decode step (one query token), and this process steps
        vLLM's engine core (whose idle hook meters what is left queued; a worker process of a multiprocess
        executor never sees the engine go idle)."""
        return (self.defer > 1 and plan.query_tokens.shape[1] == 1
                and not any(s.gate or s.spot is not None for s in settings)
                and runtime.idle_hook_here())

    def _continues(self, plan) -> bool:
        """Whether this step leaves the queued rows where they were (same rows, nothing moved or read anew)."""
        queued = self._deferred[0]
        if plan.moves is not None or plan.fresh is not None or plan.fills or plan.metered_rows != queued.rows:
            return False
        if "requests" not in plan.cache:  # the same for every layer of the step
            plan.cache["requests"] = [self.runtime.request_id(plan.batch_of_row[i]) for i in range(plan.metered_rows)]
        return plan.cache["requests"] == queued.requests

    def _queue_rows(self, plan, query, settings, positions, chosen, md, picks) -> None:
        """Queue this step's decode rows (state rows ``0 .. Rm-1``) with their own token as the cache holds it now
        (a scheme stores it compressed after this step; the deferred pass must see what this step attended)."""
        rows = plan.metered_rows
        if "queued" not in plan.cache:  # the same for every layer of the step (not what it chooses: below)
            lengths = plan.query_lengths[:, 0]
            own = None if all(s.scheme == config.NONE for s in settings) else (torch.arange(rows), lengths - 1)
            plan.cache["queued"] = ([self.runtime.request_id(plan.batch_of_row[i]) for i in range(rows)], lengths,
                                    plan.query_tokens[:, 0], own, [p[0] for p in positions])
        requests, lengths, tokens, own, first = plan.cache["queued"]
        self._deferred.append(_Queued(
            rows=rows, requests=requests, settings=settings, positions=first,
            chosen=[c[0] for c in chosen],  # this layer's: an audit picks each layer's cells apart
            q=query.reshape(query.shape[0], -1)[tokens],  # (R, Hq * d): a copy (vLLM reuses its query buffer)
            lengths=lengths, own_keys=None if own is None else self.state.keys[own[0], :, own[1]],
            own_witness=None if own is None else self.state.witness[own[0], :, :, own[1]],
            own_norms=None if own is None else self.state.key_norms[own[0], :, own[1]],
            true_tv=None if self.shadow is None else self._queued_truth(plan, query, md, rows, lengths),
            picks=None if picks is None else [None if p is None else p[:, :1] for p in picks]))

    def _queued_truth(self, plan, query, md, rows: int, lengths: torch.Tensor) -> torch.Tensor:
        """Shadow: the true TV (R, 1, Hq) of a queued step's rows, now: the state holds what they attended, and the
        shadow holds their exact keys only until their blocks are freed and written again (before the flush, when
        the batch changes: the next step's writes come first)."""
        self._enter_journal()  # the state is read
        q, q_lengths, spans = self._query_rows(query, plan, list(range(rows)))
        blocks = [self._blocks_of(md, plan.batch_of_row[i], int(lengths[i])) for i in range(rows)]
        return self._true_tv(q, self.state.view(rows, spans), q_lengths, blocks, 1)

    def flush(self) -> None:
        """Meter the queued decode rows in one pass (each kv head's rows: ``G`` query heads x the queued steps a row
        meters: only its chosen steps are gathered, so sampled metering and the audit cost what they meter)."""
        queued, self._deferred = self._deferred, []
        self._enter_journal()  # the pass reads the state (and the engine may go idle)
        if not queued:
            return
        steps, rows, hkv = len(queued), queued[0].rows, self.num_kv_heads
        groups = self.num_heads // hkv
        idx, k = _chosen_steps(torch.tensor([e.chosen for e in queued], dtype=torch.bool).T)  # (R, k)

        def fold(x):  # (steps, R, Hkv, ...) -> (R, Hkv, G k, ...): row m = g k + j, as _by_token reads it
            x = x.movedim(0, 2)  # (R, Hkv, steps, ...)
            x = torch.take_along_dim(x, idx.view(rows, 1, k, *[1] * (x.dim() - 3)), dim=2)  # (R, Hkv, k, ...)
            return x.unsqueeze(2).expand(rows, hkv, groups, *x.shape[2:]).reshape(rows, hkv, groups * k, *x.shape[3:])

        q = torch.stack([e.q for e in queued]).view(steps, rows, hkv, groups, -1)  # (steps, R, Hkv, G, d)
        q = torch.take_along_dim(q.permute(1, 2, 3, 0, 4), idx.view(rows, 1, 1, k, 1), dim=3)  # (R, Hkv, G, k, d)
        q = q.reshape(rows, hkv, groups * k, -1).float()
        per_step = torch.stack([e.lengths for e in queued], dim=1)  # (R, steps)
        picked = per_step.gather(1, idx)  # (R, k)
        lengths = picked[:, None, None, :].expand(rows, 1, groups, k).reshape(rows, 1, groups * k)
        own = None
        if all(e.own_keys is not None for e in queued):
            own = tuple(fold(torch.stack([getattr(e, name) for e in queued]))
                        for name in ("own_keys", "own_witness", "own_norms"))
        elif any(e.own_keys is not None for e in queued):
            raise AssertionError("queued rows of one request set stored with and without a scheme")
        settings = [s for e in queued for s in e.settings]
        positions = [[p] for e in queued for p in e.positions]
        picks = None if all(e.picks is None for e in queued) else [
            p for e in queued for p in (e.picks if e.picks is not None else [None] * rows)]
        kept = _kept_cells([[c] for e in queued for c in e.chosen], settings, self.layer_index, positions,
                           self.num_heads, hkv, picks)  # (steps R, 1, Hq)
        # (R, Hkv, G k): the pass's query rows some kept cell reads, laid out as fold lays them out
        wanted = torch.take_along_dim(kept.view(steps, rows, hkv, groups).permute(1, 2, 3, 0),
                                      idx.view(rows, 1, 1, k), dim=3).reshape(rows, hkv, groups * k)
        view = self.state.view(rows, per_step.amax(-1))
        norm_max = view["norm_max"] if own is None else torch.maximum(view["norm_max"], own[2].amax(-1))
        m, r = meter_cells(wanted, q, view["keys"], view["witness"], view["key_norms"], lengths, view["lossy"],
                           norm_max, self.layout, self.scale, view["scales"], own, compiled=self.runtime.config.compile)
        meter, risk = _spread_steps(_by_token(m, k), idx, steps), _spread_steps(_by_token(r, k), idx, steps)
        tv = None if self.shadow is None else torch.cat([e.true_tv for e in queued], dim=1)  # (R, steps, Hq)
        def by_step(x):  # (R, steps, Hq) -> (steps R, 1, Hq): one row per queued (step, row), in queue order
            return None if x is None else x.transpose(0, 1).reshape(steps * rows, 1, -1)

        cells = by_step(meter).masked_fill_(~kept, math.nan)
        self._queue([r for e in queued for r in e.requests], settings, positions, [1] * (steps * rows), cells,
                    by_step(risk), None, by_step(tv), None, None, picks)  # folded with the step's (end_layer)

    def _query_rows(self, query, plan, active: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The pass's query rows (Ra, Hkv, G Qmax, d) fp32, their lengths (Ra, 1, G Qmax) and each row's longest (Ra,)."""
        hkv, groups, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        tokens = plan.query_tokens[active]  # (Ra, Qmax)
        ra, width = tokens.shape
        q = query.reshape(query.shape[0], -1)[tokens.flatten()].reshape(ra, width, hkv, groups, d)
        q = q.permute(0, 2, 3, 1, 4).reshape(ra, hkv, groups * width, d).float()
        lengths = plan.query_lengths[active]
        return q, lengths[:, None, None, :].expand(ra, 1, groups, width).reshape(ra, 1, groups * width), \
            lengths.amax(-1)

    def _repair(self, plan, layer, query, key, value, kv_cache, md, output, q, lengths, active, gated, rows, spans,
                meter, risk, spot=None, spot_m=None):
        """The gate (:mod:`.gate`): page flagged blocks in, write them back, recompute attention, re-meter; with
        ``spot`` rows (:mod:`.spot_gate`) their cells are paged a few blocks a round and checked again.

        ``meter``, ``risk`` (Ra, Qmax, Hq) of the active rows; gated rows are decode rows (one query token).
        ``spot_m`` (Ra, Hkv, M) the bounds before repair, as the pass lays them out. Returns them after repair, the
        state view they were metered from, and (Ra,) the rows a spot bound lowered."""
        rt = self.runtime
        tau, telemetry = rt.config.tau, rt.telemetry
        block_size = kv_cache.shape[2]
        batch_rows = [plan.batch_of_row[active[k]] for k in gated]
        lens = [int(lengths[k].max()) for k in gated]
        blocks_of = [md.block_table[r, : math.ceil(n / block_size)].long() for r, n in zip(batch_rows, lens)]
        hq = self.num_heads
        qg = q[gated].reshape(len(gated), hq, -1)  # (Rg, Hq, d): one query token per gated row (no speculation)
        view = self.state.view(rows, spans)
        pick = torch.tensor(gated)
        if self.shadow is not None:  # the cells' truth before the repair: their exact keys are still the shadow's
            self._before = {"keys": view["keys"].clone()}  # the cells' truth before the repair (shadow)
        meter_now, risk_now = meter.clone(), risk.clone()
        lowered = torch.zeros(len(active), dtype=torch.bool)
        picked = set() if spot is None else set(spot.pick.tolist())
        spot_gated = torch.tensor([k in picked for k in gated], dtype=torch.bool)
        for round_ in range(MAX_REPAIR_ROUNDS):
            over = meter_now[gated, 0] > tau  # (Rg, Hq)
            if not bool(over.any()):
                break
            scores, c = self._gate_terms(q, view, lengths, pick)  # of the cache as it is now (formed when planned)
            pager = gate.Pager(self.store, qg, blocks_of, lens, block_size, rt.config.gate_block, self.scale)
            blocks = 2 ** round_ if round_ < MAX_REPAIR_ROUNDS - 1 else None  # spot cells: 1, 2, 4 blocks, then all
            gate_plan = spot_gate.plan(scores, c, over if spot is not None else torch.ones_like(over), spot_gated,
                                       blocks, tau, rt.config.gate_block, pager)
            telemetry.count("bytes_paged", pager.bytes)
            telemetry.count("tokens_paged", pager.bytes // self.store.row_bytes)
            # a gate block may hold slots with nothing to repair: this step's own exact token, or a slot
            # already repaired (in an fp8 cache its exact key, cast to fp8, keeps a nonzero witness)
            w = self.witness[gate_plan.slots // block_size, :, gate_plan.slots % block_size]
            lossy = (w != 0).flatten(1).any(-1) & ~self.repaired[gate_plan.slots]
            slots, k_ex, v_ex = gate_plan.slots[lossy], gate_plan.k[lossy], gate_plan.v[lossy]
            if not slots.numel():
                break  # nothing left to repair: the cells stay above tau (counted unreachable)
            self._write(layer, kv_cache, slots, k_ex, v_ex)
            stored, _ = self._read_back(layer, kv_cache, slots, k_ex)
            if self.tier_b is not None:
                self.tier_b["valid"][slots] = False
            new = ~self.repaired[slots]
            self.repaired[slots] = True
            telemetry.count("repair_rounds")
            telemetry.count("blocks_repaired", gate_plan.blocks)
            telemetry.count("slots_repaired", int(new.sum()))
            if self.shadow is not None:
                self._check_repair(slots, layout.decode(stored, self.kv_cache_dtype, layer._k_scale_float))
            self._refresh(plan, layer, kv_cache, md, slots)
            # the step's attention, recomputed over the repaired cache (vLLM's kernel, all rows)
            CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, md, output)
            view = self.state.view(rows, spans)
            m, r = meter_rows(q, view["keys"], view["witness"], view["key_norms"], lengths, view["lossy"],
                              view["norm_max"], self.layout, self.scale, view["scales"], compiled=rt.config.compile)
            if spot is not None:  # spot cells over tau again where the repair changed their cache
                m, again = self._spot_bound(spot, m, q, view, lengths, spot.recheck_delta(round_ + 1),
                                            spot_gate.changed_rows(spot, slots), spot_m)
                lowered |= again
                spot_m = m
            meter_now, risk_now = _by_token(m, meter.shape[1]), _by_token(r, meter.shape[1])
        return meter_now, risk_now, view, lowered

    def _gate_terms(self, q, view, lengths, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated rows' scores and radii (Rg, Hq, S) fp64, as the pass meters them."""
        def rows(x):
            return None if x is None else x[pick]
        scores, c = cell_terms(q[pick], rows(view["keys"]), rows(view["witness"]), rows(view["key_norms"]),
                               lengths[pick], rows(view["norm_max"]), self.layout, self.scale, rows(view["scales"]))
        return scores.reshape(len(pick), self.num_heads, -1), c.reshape(len(pick), self.num_heads, -1)

    def _refresh(self, plan, layer, kv_cache, md, slots) -> None:
        """After the gate rewrote ``slots``: enter the cache's keys there into every state row that holds them."""
        block_size = kv_cache.shape[2]
        seq_lens = md.seq_lens.tolist()
        for row, batch_row in enumerate(plan.batch_of_row):
            n = seq_lens[batch_row]
            held = gate.slots_of(md.block_table[batch_row].long(), n, block_size)
            where = torch.isin(held, slots).nonzero().squeeze(-1)
            if where.numel():
                self._state_from_cache(layer, kv_cache, torch.full_like(where, row), where, held[where])

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

    def _true_tv(self, q, view, lengths, blocks, width) -> torch.Tensor:
        """Shadow: the fp64 TV (Ra, Qmax, Hq) between attention over the exact keys (the shadow's, at ``blocks``, one
        block-id list per row) and over the stored keys of ``view``."""
        block_size = self.shadow.shape[2]
        ra, hkv, _, d = q.shape
        tokens = view["keys"].shape[2]
        exact = torch.zeros(ra, hkv, tokens, d, dtype=torch.float64)
        for k, ids in enumerate(blocks):
            n = min(tokens, ids.numel() * block_size)
            exact[k, :, :n] = layout.rows_of_blocks(self.shadow, ids, n).to(torch.float64)
        scores, _ = cell_terms(q, view["keys"], view["witness"], view["key_norms"], lengths, view["norm_max"],
                               self.layout, self.scale, reference=True)  # attention over the stored keys, fp64
        keep = scores > -math.inf
        truth = (self.scale * (q.double() @ exact.transpose(-1, -2))).masked_fill(~keep, -math.inf)
        tv = 0.5 * (torch.softmax(truth, -1) - torch.softmax(scores, -1)).abs().sum(-1)  # (Ra, Hkv, M)
        return _by_token(tv, width)

    def _blocks_of(self, md, batch_row: int, n: int) -> torch.Tensor:
        """The block ids of a sequence's first ``n`` tokens."""
        return md.block_table[batch_row, : math.ceil(n / self.witness.shape[2])].long().clone()

    def _output_gaps(self, plan, active, q, view, kv_cache, layer, md, output) -> None:
        """Shadow: the kernel's output of each metered token against attention recomputed from the read-back cache."""
        block_size = kv_cache.shape[2]
        md_tokens = plan.query_tokens
        for k, i in enumerate(active):
            for j in range(plan.query_counts[i]):
                n = int(plan.query_lengths[i, j])
                token = int(md_tokens[i, j])
                r = plan.batch_of_row[i]
                blocks = md.block_table[r, : math.ceil(n / block_size)].long()
                v_hat = layout.decode(self.cache_layout.values_of_blocks(kv_cache, blocks, n), self.kv_cache_dtype,
                                      layer._v_scale_float)
                groups = self.num_heads // self.num_kv_heads
                qi = q[k].reshape(self.num_kv_heads, groups, -1, self.head_size)[:, :, j].reshape(-1, self.head_size)
                self.runtime.telemetry.add_output_gap(*_output_gap(qi, view["keys"][k, :, :n].double(), v_hat,
                                                                   self.scale, output[token], self.model_dtype))

    def _queue(self, requests, settings, positions, counts, meter, risk, raw, tv, raw_tv, repaired, picks=None,
               spot_delta=None) -> None:
        """Queue metered cells of this layer (one row per real query token: ``counts[i]`` of row ``i``'s
        ``positions[i]``) for the telemetry and the cell log; add audited rows' cells to their request's audit
        (``picks[i]`` (Hq, T): row ``i``'s picked heads); ``spot_delta[i]`` labels row ``i``'s bounds probabilistic at
        that ``delta`` (``None``: proved)."""
        every = [(i, j) for i in range(len(requests)) for j in range(counts[i])]
        if not every:
            return
        spot_delta = spot_delta or [None] * len(requests)
        for delta in dict.fromkeys(spot_delta[i] for i, _ in every):
            self._queue_cells(requests, settings, positions, meter, risk, raw, tv, raw_tv, repaired, picks,
                              [(i, j) for i, j in every if spot_delta[i] == delta], delta)

    def _queue_cells(self, requests, settings, positions, meter, risk, raw, tv, raw_tv, repaired, picks, rows,
                     delta) -> None:
        """:meth:`_queue` for ``rows`` ``(i, j)`` of one kind of bound (``delta``: probabilistic; ``None``: proved)."""
        audited = [(i, j) for i, j in rows if picks is not None and picks[i] is not None]
        if audited:
            ii, jj = torch.tensor([i for i, _ in audited]), torch.tensor([j for _, j in audited])
            self.runtime.telemetry.audit.add_rows(
                [requests[i] for i, _ in audited], [settings[i].audit for i, _ in audited], self.layer_index,
                [positions[i][j] for i, j in audited], torch.stack([picks[i][:, j] for i, j in audited]),
                meter[ii, jj], None if tv is None else tv[ii, jj], self.head_offset)
        ii = torch.tensor([i for i, _ in rows])
        jj = torch.tensor([j for _, j in rows])

        def cells(x):
            return None if x is None else x[ii, jj]

        rt = self.runtime
        batch = CellBatch(layer=self.layer_index, requests=[requests[i] for i, _ in rows],
                          schemes=[settings[i].scheme for i, _ in rows], gated=[settings[i].gate for i, _ in rows],
                          positions=[positions[i][j] for i, j in rows], meter=cells(meter), raw_meter=cells(raw),
                          true_tv=cells(tv), raw_true_tv=cells(raw_tv), risk=cells(risk),
                          repaired=None if repaired is None else [repaired[i] for i, _ in rows],
                          bound=PROVED if delta is None else PROBABILISTIC, delta=delta)
        rt.telemetry.queue(batch)
        if rt.cell_log is not None:
            rt.cell_log.add_batch(batch, head_offset=self.head_offset)

    def _count_prefill(self, plan, md) -> None:
        """Count the prefill chunks' query tokens (not metered), and whether they read keys stored lossy earlier: once
        per step (its first layer), on the first tensor-parallel worker (the workers' snapshots are summed)."""
        if "prefill counted" in plan.cache or self.head_offset:
            return
        plan.cache["prefill counted"] = True
        telemetry = self.runtime.telemetry
        block_size = self.witness.shape[2]
        for batch_row, q_len, context in plan.prefill:
            telemetry.prefill_tokens += q_len
            if context > 0:
                self._enter_journal()  # the witness side tensor is read
                blocks = md.block_table[batch_row, : math.ceil(context / block_size)].long()
                if bool((layout.rows_of_blocks(self.witness, blocks, context) != 0).any()):
                    telemetry.prefill_tokens_lossy += q_len

    # -- store compressed ----------------------------------------------------------------------
    def _compress_pending(self, plan, layer, kv_cache, md) -> None:
        """Store each request's new tokens as its scheme reconstructs them (after the step's attention).

        Requests of one scheme writing the same number of tokens (every decode step) go through the scheme in
        one call, as a batch of sequences ``(R, Hkv, n, d)`` (a scheme treats leading axes as independent
        sequences, as the transformers cache's batch axis), then through vLLM's writer, the read-back and the
        state in one write each."""
        p = self._pending
        if p is None:
            return
        if "schemes" not in plan.cache:  # the same for every layer of the step
            rt = self.runtime
            starts = md.query_start_loc.tolist()
            groups = {}
            for r in range(len(starts) - 1):
                name = rt.settings(r).scheme
                if name == config.NONE:
                    continue
                span = torch.arange(starts[r], starts[r + 1])
                span = span[p.slot_mapping[span] >= 0]
                if span.numel():
                    groups.setdefault((name, span.numel()), []).append(span)
            plan.cache["schemes"] = [(name, torch.stack(spans)) for (name, _), spans in groups.items()]
        for name, tokens in plan.cache["schemes"]:
            self._compress(plan, layer, kv_cache, name, tokens)

    def _compress(self, plan, layer, kv_cache, name: str, tokens: torch.Tensor) -> None:
        """Write tokens (R, n) of one scheme compressed, read them back, replace their witnesses."""
        p = self._pending
        flat = tokens.flatten()
        slots = p.slot_mapping[flat].long()
        hkv, d = self.num_kv_heads, self.head_size
        k = p.key[flat].reshape(*tokens.shape, hkv, d).transpose(1, 2)  # (R, Hkv, n, d) exact
        v = p.value[flat].reshape(*tokens.shape, hkv, d).transpose(1, 2)
        out = schemes.compress(self.runtime.schemes[name], k, v, layer=self.layer_index, slots=slots,
                               kv_head_offset=self.kv_head_offset, seed=self.runtime.dither_seed)
        k_hat, v_hat = (x.transpose(1, 2).reshape(-1, hkv, d) for x in (out.k, out.v))  # (N, Hkv, d)
        exact = k.transpose(1, 2).reshape(-1, hkv, d)
        self._write(layer, kv_cache, slots, k_hat, v_hat)
        if self.repaired is not None:
            self.repaired[slots] = False  # a gate block may have covered this step's own (exact) token
        if self._journals_compressed():  # read back when something reads them, all steps' at once
            self.journal.add(slots, exact, self._step_tokens(p.slot_mapping)[2])
            self.journal.place(plan.token_rows[flat], plan.token_positions[flat])
            self._written_to = (layer, kv_cache)
            return
        stored, kept = self._read_back(layer, kv_cache, slots, exact)
        scales = None
        if out.codes is not None and self.tier_b is not None:
            # the deterministic branch holds for the dequantized value; only where it was read back unchanged
            unchanged = (layout.decode(stored, self.kv_cache_dtype, layer._k_scale_float)
                         == k_hat.to(torch.float64)).flatten(1).all(-1)
            self.tier_b["codes"][slots] = out.codes.transpose(1, 2).reshape(-1, hkv, d)
            self.tier_b["scales"][slots] = out.scales.transpose(1, 2).reshape(-1, hkv, out.scales.shape[-1])
            self.tier_b["valid"][slots] = unchanged
            scales = self._tier_b_scales(slots)
        self.state.write(plan.token_rows[flat], plan.token_positions[flat], kept.keys, kept.witness, kept.key_norms,
                         scales)


def _by_token(x: torch.Tensor, width: int) -> torch.Tensor:
    """(R, Hkv, G Qmax) -> (R, Qmax, Hq): query head ``h = kv G + g`` (vLLM's order) of each query token."""
    r, hkv, m = x.shape
    return x.view(r, hkv, m // width, width).permute(0, 3, 1, 2).reshape(r, width, -1)


def _chosen_steps(chosen: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(idx, k)``: per row of ``chosen`` (R, steps) bool, the steps it meters, first ``k`` columns (R, k) int64; a
    row with fewer repeats its first (results discarded: those cells are masked unmetered). ``k`` is the most any
    row meters, rounded up to a power of two (at most ``steps``): few distinct pass shapes to compile."""
    counts = chosen.sum(1)
    most = max(int(counts.max()), 1)
    k = min(chosen.shape[1], 1 << (most - 1).bit_length())
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :k]  # chosen steps first, in order
    return torch.where(torch.arange(k) < counts.unsqueeze(1), order, order[:, :1]), k


def _spread_steps(x: torch.Tensor, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """(R, k, Hq) results of the gathered steps ``idx`` (R, k) -> (R, steps, Hq), NaN where no step was gathered."""
    out = torch.full((x.shape[0], steps, x.shape[2]), math.nan, dtype=x.dtype)
    return out.scatter_(1, idx.unsqueeze(-1).expand_as(x), x)  # a repeated step writes its own value again


def _spread(values: list, active: list, rows: int) -> list:
    out = [False] * rows
    for k, i in enumerate(active):
        out[i] = values[k]
    return out


def _kept_cells(chosen, settings, layer, positions, hq, hkv, picks=None) -> torch.Tensor:
    """bool (rows, T, Hq): the cells the operator's sampling and the request's audit meter (False: tokens not
    chosen, heads not drawn, cells not picked; reported NaN); ``picks[i]`` (Hq, T) row ``i``'s picked heads
    (``None``: no audit)."""
    if chosen and all(s.metering.everything for s in settings):  # no sampling switch: the tensors say it all
        tokens = torch.tensor(chosen, dtype=torch.bool).view(len(settings), -1, 1)  # (rows, T, 1)
        if picks is None:
            return tokens.expand(-1, -1, hq).clone()  # every head of a chosen token
        if all(p is not None for p in picks):
            return torch.stack(picks).transpose(1, 2) & tokens  # an audit's picks alone
    kept = torch.zeros(len(settings), len(chosen[0]) if chosen else 0, hq, dtype=torch.bool)
    for i, s in enumerate(settings):
        for j, picked in enumerate(chosen[i]):
            if not picked:
                continue
            audit_picks = None if picks is None or picks[i] is None else picks[i][:, j]
            keep = _kept_heads(s.metering, layer, positions[i][j], hq, hkv, audit_picks)
            kept[i, j] = True if keep is None else keep
    return kept


def _kept_heads(metering, layer, position, hq, hkv, audit_picks) -> torch.Tensor | None:
    """bool (Hq,): the metered heads of a chosen query token (``None``: every one). With an audit, its picks plus
    what an explicit sampling switch meters; without one, the sampling's heads."""
    if audit_picks is None:
        if metering.sample is None:
            return None
        heads = metering.heads(layer, position, hq, hkv)
        if heads is None:
            return None
        keep = torch.zeros(hq, dtype=torch.bool)
        keep[heads] = True
        return keep
    keep = audit_picks.clone()
    if not metering.everything and metering.meters(layer, position):
        sampled = _kept_heads(metering, layer, position, hq, hkv, None)
        keep |= True if sampled is None else sampled
    return keep


def _world_size() -> int:
    """Tensor-parallel workers (1 without distributed state)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError, ImportError):
        return 1


def _tensor_parallel_offsets(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """This worker's first query head and kv head counter offset (tensor parallelism; 0 and 0 alone)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError, ImportError):
        rank = 0  # no distributed state (a unit test building the impl)
    return rank * num_heads, rank * num_kv_heads


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


def _speculative() -> bool:
    """Whether the engine drafts tokens (speculative decoding)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    return vllm_config is not None and vllm_config.speculative_config is not None


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
    if impl.runtime.config.gate and _speculative():
        reasons.append(f"speculative decoding with {config.GATE}=1 (the gate repairs one query token per request "
                       "and step)")
    if reasons:
        raise ValueError("WitCert vLLM plugin cannot meter this attention layer ("
                         + ", ".join(reasons) + f"); unset {config.ENABLE} to serve without the meter")
