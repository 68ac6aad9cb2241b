"""``witcert.monitor``: meter a transformers model's compressed KV cache around ``generate``, pipelines and forward calls.

::

    with witcert.monitor(model, "fp8-e4m3") as mon:
        model.generate(**inputs, max_new_tokens=16)
    print(mon.summary())            # per layer: meter, certified, true TV, violations; riskiest layers and heads
    mon.tensor("meter")             # (requests, layers, query heads, steps)

While the block is active the model runs on a compressed cache, compressed by ``scheme`` (a
registered name, any callable ``fn(x) -> x_hat``, or a codec object), and every attention read
of it is metered per (request, layer, query head, step) by the ``"witcert"`` attention
(:mod:`witcert.integrations.hf.attention`, the one attention path the observatory uses too).

Requests. A request is one ``past_key_values`` object: a forward pre-hook sees the cache each
call uses (``generate`` creates a fresh one per call; a forward call without one gets a fresh
one), and the first call that uses a cache turns it into a monitored cache in place, with fresh
stores (and, for the dithered cache, a fresh secret seed). Nothing is inferred from cache
lengths, so two ``generate`` calls never share a compressed cache. Every batch row of a cache is
its own request id.

Geometry. Head dim, query and kv heads (GQA) come from the model config, the RoPE pair
convention from the attention module's own ``rotate_half`` (Llama/Qwen2/Mistral
``rotate_half``; Cohere/GLM/Helium interleaved pairs), the bands from the head dim
(:mod:`witcert.integrations.hf.geometry`).

Safe defaults.

- ``tier="auto"``: Tier B for ``scheme="dithered-int8"`` (with the Tier A minimum), Tier A otherwise;
  the tier actually used is recorded with every cell.
- Tier B uses its probabilistic branch only inside :meth:`Monitor.non_adaptive` (the caller
  declares teacher-forced queries that do not depend on the dither) and never inside
  ``generate``; everywhere else it uses the deterministic branch, valid for every query.
- ``keep_exact=True``: the exact keys and values are kept beside the compressed ones, so every
  cell also gets its true TV (validation), and the gate repairs from memory. ``keep_exact=False``
  is production: the cache holds only the compressed keys/values (packed where the scheme allows)
  and the witness, :meth:`Monitor.memory` reports the bytes saved, there is no true TV, and a gate
  pages exact blocks from a content-checked backing store on the host (or in files).
"""
from __future__ import annotations

import contextlib
import functools
import secrets
import tempfile
import threading
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from witcert.audit.counts import requests_of
from witcert.audit.report import RequestAudit
from witcert.audit.request import AuditedRequest
from witcert.audit.settings import Audit
from witcert.core.thresholds import check_certified_tau
from witcert.gate.backing_store import BackingStore
from witcert.gate.policy import Gate
from witcert.gate.repair import Repairer
from witcert.integrations.hf import telemetry
from witcert.integrations.hf.codecs import Dither, codec_for, default_witness_bits
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.integrations.hf.geometry import geometry_of
from witcert.integrations.hf.memory import MemoryAccount, MemoryReport
from witcert.integrations.hf.pending import FLUSH_CALLS, PendingCells
from witcert.integrations.hf.quantized_cache import cache_spec_of
from witcert.integrations.hf.quantized_store import QuantizedLayerStore
from witcert.integrations.hf.sampling import MeterSampling
from witcert.integrations.hf.summary import LayerSummary
from witcert.schemes.catalog import DITHERED
from witcert.schemes.plugins import resolve_scheme
from witcert.spot.cells import SPOT_BLOCK_SIZE, spot_settings
from witcert.tier_a.query_radius import query_format_of
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS, WitnessCode
from witcert.tier_b.counters import check_seed, fresh_seed

TIERS = ("auto", "A", "B")


def monitor(model, scheme, *, tier: str = "auto", gate: Gate | None = None, keep_exact: bool = True,
            bands: int | None = None, rope: str | None = None, delta_loc: float = 1e-7, seed: int | None = None,
            backing_dir: str | Path | None = None, tau: float = 0.2, meter: str = "fused",
            certificate: str = "deterministic", spot_keys: int = 256, spot_delta=1e-6,
            sample: MeterSampling | None = None, witness_bits: int | None = None,
            query_format=None, audit: Audit | None = None) -> "Monitor":
    """A :class:`Monitor` of ``model`` under ``scheme``: use it as a context manager.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A decoder whose attention goes through transformers' attention interface (Llama, Qwen2,
        Mistral, Cohere, GLM, ...).
    scheme : str, callable or codec
        A registered scheme name (``witcert.list_schemes()``), ``"dithered-int8"`` (the Tier B
        cache), any callable ``fn(x) -> x_hat`` (a cache tensor (..., S, d) to its
        reconstruction, same shape and dtype; it may take ``role="key"/"value"``), or a codec
        object with ``encode(x, role, start)``/``decode(packed, dtype)``/``nbytes(packed)`` (optionally
        ``join(first, second)``; :mod:`witcert.integrations.hf.codecs`), or
        transformers' own ``QuantizedCache`` layers: a name of
        :data:`~witcert.integrations.hf.quantized_cache.HF_CACHE_SCHEMES` (``"hf-quanto-int4"``,
        ``"hf-hqq-int8"``, ...) or a :class:`~witcert.integrations.hf.quantized_cache.QuantizedCacheSpec`
        (maintained witnesses, ``WM``; needs the ``quant`` extra).
    tier : {"auto", "A", "B"}
        ``"auto"``: Tier B for the dithered cache, Tier A otherwise. ``"B"`` needs the dithered cache.
    gate : witcert.Gate, optional
        Repair every cell above ``gate.tau`` by paging exact blocks in.
    keep_exact : bool
        Keep the exact cache beside the compressed one (true TV per cell). ``False``: production
        mode (memory saved; the gate pages from a host backing store).
    bands : int, optional
        Witness bands (default: the largest divisor of ``head_dim / 2`` not above 16).
    witness_bits : {16, 8, 4, 0}, optional
        Bits per stored band norm (:mod:`witcert.tier_a.witness_code`): fp16, or one byte (e5m3), each
        rounded up so the meter stays sound; 8 bits also keeps the value residual in a byte and the value
        norm in fp16. ``0``: no stored band norm, the witness is derived at every read from the codec's
        elementwise error bound (``error_bound``, checked against the exact tokens on write:
        :mod:`witcert.tier_a.derived_witness`), 2 bytes per token and kv head (the value norm). ``4``: each band
        norm stored as a 4-bit fraction of that derived witness (11 bytes at 16 bands). Default, per scheme
        (``witcert.integrations.hf.codecs.default_witness_bits``, from rtn-int8's coverage at tau 0.2 on SmolLM2):
        ``0`` for ``rtn-int4`` and ``rtn-int2`` (their meters saturate with any witness; 8 with
        ``certificate="spot"`` or an ``audit``, whose spot checks read the meter's per-key radii), ``4`` for
        ``rtn-int8`` (0.965 against 0.980 in fp16), 8 otherwise (kivi, fp8 and user codecs: their bounds need a
        decode at every read).
    rope : {"rotate_half", "interleaved"}, optional
        Override the probed RoPE pair convention.
    delta_loc : float
        Tier B failure budget per (layer, head, step) (``witcert.tier_b.certificate.delta_local``).
    seed : int, optional
        Fix the dither seed (replay and tests only: a known seed voids Tier B's guarantee).
    backing_dir : str or Path, optional
        Production gate or spot check: keep the backing store in memory-mapped files under this directory
        (created mode 0700 if missing): one directory per request (mode 0700, files 0600, the request's exact
        keys and values), removed when the request's cache is released or the monitor closes.
    tau : float
        Threshold of the summary's coverage column (and of ``pass_K``), strictly between 0 and 1
        (:func:`witcert.core.thresholds.check_certified_tau`; the gate's own threshold is ``gate.tau``).
    meter : {"fused", "full"}
        ``"fused"`` (default): each layer's cells from one fp32 pass under an a-priori rounding
        budget, ``min(1, T1, P1, MN, CS, MS)`` (:mod:`witcert.fastpath`; MS on four low sets; compiled with
        ``WITCERT_COMPILE=1``). ``"full"``: the eager reference's meter, per-operation directed
        rounding and MS over twelve thresholds (as tight or a little tighter, several times slower
        per cell). Both are sound.
    certificate : {"deterministic", "spot"}
        ``"spot"``: every cell whose meter exceeds ``tau`` is spot-checked, all cells of a layer-step at
        once, reading up to ``spot_keys`` exact keys in rounds (32, 128, 512, ...) drawn with the monitor's own
        randomness (OS-seeded) and stopping at a bound ``<= tau``; its reported meter is
        ``min(meter, spot bound)``, valid with probability ``1 - spot_delta`` per checked cell for
        adaptive queries and any scheme (:mod:`witcert.spot`). Exact keys come from the exact cache
        (``keep_exact=True``) or, in production, from the content-checked host backing store. With a
        gate, the gate decides on that meter and re-checks the cells it repairs (both modes). Extra
        columns: ``meter_before_spot``, ``spot_bound``, ``spot_keys``, ``spot_rounds``, ``spot_bytes``,
        ``spot_delta`` (:mod:`witcert.spot.cells`).
    spot_keys : int
        The most exact keys a checked cell reads.
    spot_delta : float or callable
        Each checked cell's failure probability, or a request budget ``(step, cells) -> delta`` of the
        request's metered decode step (:class:`witcert.spot.budget.RequestBudget`: ``6 / (pi^2 k^2)`` of
        ``delta_req`` at step ``k``, so a whole ``generate`` stays within ``delta_req``). With a gate, half goes
        to the check before repair and half to the gate's re-checks.
    sample : witcert.MeterSampling, optional
        Meter fewer cells, by choice (default ``None``: every cell): every ``every``-th step and a random
        ``heads`` fraction of each kv head's query heads (:mod:`witcert.integrations.hf.sampling`). The
        cells left out are reported with NaN measurements and ``metered=False``, never as certified. Not
        with a gate or a spot check (they need every cell's meter).
    query_format : str, QueryFormat or callable, optional
        The attention kernel quantizes the query (default ``None``: it reads the exact query). ``"fp8-e4m3"``:
        vLLM's static per-tensor FP8 query (scale 1.0; ``witcert.tier_a.query_radius.Fp8Query(scale)`` for a
        calibrated one), as FlashAttention-3 reads it with an fp8 cache; or any ``fn(q) -> q'``. The model's
        attention then runs with ``q'`` (the kernel, simulated), every cell's compressed logits are ``q'``'s and
        its radius gains ``|sm (q' - q) . k^_t|`` (``QR``, :mod:`witcert.tier_a.query_radius`); the exact
        reference and the true TV keep ``q``. Not with the Tier B certificate (refused).
    audit : witcert.Audit, optional
        The request audit (:mod:`witcert.audit`, default ``None``): each cell is picked independently with
        probability ``audit.rate`` by the monitor's own secret randomness. With ``audit.keys=None`` (the
        default) a picked cell is bounded by its true TV, from every exact key it sees (the exact cache, or in
        production a host backing store), nothing is metered (with ``sample``, the sampled cells only) and no
        witness is kept; with ``audit.keys`` an int, only picked cells are metered and a picked cell is bounded
        by its meter where that is at most ``audit.tau``, else by a spot check of at most ``audit.keys`` exact
        keys. A picked cell is flagged when its bound exceeds ``audit.tau``. :meth:`Monitor.audit` states per
        request, with probability at least ``1 - audit.delta``: at most ``M_upper`` of its ``N`` cells have TV
        above ``audit.tau``. Unpicked cells are reported unmetered, never certified. Extra columns:
        ``metered``, ``audited``, ``flagged``, ``audit_bound``, ``audit_check_delta``, ``audit_keys``. Not with
        a gate or ``certificate="spot"``.
    """
    return Monitor(model, scheme, tier=tier, gate=gate, keep_exact=keep_exact, bands=bands, rope=rope,
                   delta_loc=delta_loc, seed=seed, backing_dir=backing_dir, tau=tau, meter=meter,
                   certificate=certificate, spot_keys=spot_keys, spot_delta=spot_delta, sample=sample,
                   witness_bits=witness_bits, query_format=query_format, audit=audit)


@dataclass
class RequestRecord:
    """One monitored cache: its request ids, dither seed and the bytes it held (updated after each call)."""

    first: int  # request id of batch row 0
    rows: int
    seed: int | None
    memory: MemoryAccount = field(default_factory=MemoryAccount)

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.rows))


@dataclass(eq=False)
class _Live:
    """What a live cache needs during its forward calls (dropped with the cache)."""

    record: RequestRecord
    layers: list
    repairer: Repairer | None
    backing: BackingStore | None  # production gate or spot check: the content-checked exact keys
    adaptive: bool = False  # it served an adaptive call: its tokens may have been chosen through the dither
    steps: int = 0  # forward calls that read the compressed cache (metered steps; a spot request budget spends by them)
    pending: PendingCells | None = None  # calls recorded for deferred metering (witcert.integrations.hf.pending)
    audit: AuditedRequest | None = None  # the request's audit (witcert.audit), when the monitor audits
    release: weakref.finalize | None = None  # closes the backing store (files removed) when the cache is released


class _ThreadState(threading.local):
    """A monitor's state on one thread: its forward calls in progress and the ``generate`` and
    :meth:`Monitor.non_adaptive` blocks open there (another thread's blocks say nothing about this one's calls)."""

    def __init__(self):
        self.scopes: list = []
        self.generating = 0
        self.non_adaptive = 0


class Monitor:
    """Meter a model's compressed KV cache: a context manager, then the results (see :func:`monitor`).

    Results: :meth:`table` (one row per cell), :meth:`tensor` (a field per (request, layer,
    head, step)), :meth:`summary` (per layer), :meth:`to_pandas`, :meth:`write_jsonl`,
    :meth:`memory`. They stay available after the block.
    """

    def __init__(self, model, scheme, *, tier: str = "auto", gate: Gate | None = None, keep_exact: bool = True,
                 bands: int | None = None, rope: str | None = None, delta_loc: float = 1e-7, seed: int | None = None,
                 backing_dir: str | Path | None = None, tau: float = 0.2, meter: str = "fused",
                 certificate: str = "deterministic", spot_keys: int = 256, spot_delta=1e-6,
                 sample: MeterSampling | None = None, witness_bits: int | None = None,
                 query_format=None, audit: Audit | None = None):
        if meter not in ("fused", "full"):
            raise ValueError(f"meter must be 'fused' or 'full', got {meter!r}")
        self.meter = meter
        _check_eager(model)
        self.model = model
        self.geometry = geometry_of(model, rope)
        self.layout = self.geometry.layout(bands)
        self.witness_code = WitnessCode(DEFAULT_WITNESS_BITS if witness_bits is None else witness_bits)  # checked now
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.dithered = isinstance(scheme, str) and scheme == DITHERED
        self.hf_cache = cache_spec_of(scheme)  # transformers' own QuantizedCache layers (quanto, HQQ)
        if tier == "B" and not self.dithered:
            raise ValueError(f"tier B certifies the {DITHERED!r} cache only, not scheme {scheme!r}")
        self.tier = "B" if self.dithered and tier != "A" else "A"  # the tier used, never "auto"
        self.query_format = query_format_of(query_format)
        if self.query_format is not None and self.tier == "B":
            raise ValueError("query_format: a quantized query is metered with Tier A radii (QR); the Tier B "
                             f"certificate of {DITHERED!r} does not carry the query term (use tier='A')")
        if self.hf_cache is not None:
            self.hf_cache.layer()  # ImportError naming the extra, now rather than at the first forward call
        elif not self.dithered:
            # a plugin or module:function name loads here; an unknown name lists every known one
            named = resolve_scheme(scheme) if isinstance(scheme, str) else scheme
            packed = codec_for(named, packed=True)  # validates the object
            if witness_bits is None:
                # a spot check reads the per-key radii (the exact audit reads none)
                spot = certificate == "spot" or (isinstance(audit, Audit) and not audit.exact)
                self.witness_code = WitnessCode(default_witness_bits(packed, spot=spot))
            # a derived witness reads the packed codes' bounds, so validation mode holds them too (the same meter)
            self._codec = packed if not keep_exact or self.witness_code.derived else codec_for(named, packed=False)
        codec = getattr(self, "_codec", None)
        if self.witness_code.derived and not any(callable(getattr(codec, name, None))
                                                 for name in ("error_bound", "group_error_bound")):
            raise ValueError(f"witness_bits={self.witness_code.bits} derives the witness from the codec's elementwise "
                             f"error bound: scheme "
                             f"{scheme!r} has no codec with error_bound (the built-in rtn, kivi and fp8 schemes and "
                             "user codecs that declare one do); store the witness instead (witness_bits=8 or 16)")
        if gate is not None and not isinstance(gate, Gate):
            raise ValueError(f"gate must be a witcert.Gate or None, got {type(gate).__name__}")
        if not isinstance(keep_exact, bool):
            raise ValueError(f"keep_exact must be a bool, got {keep_exact!r}")
        if not 0.0 < delta_loc < 1.0:
            raise ValueError(f"delta_loc must lie in (0, 1), got {delta_loc!r}")
        if seed is not None:
            check_seed(seed)
        if backing_dir is not None and (keep_exact or (gate is None and certificate != "spot" and audit is None)):
            raise ValueError("backing_dir is where the production gate and spot check read exact keys from, and the "
                             "audit: it needs keep_exact=False and a gate, certificate='spot' or an audit")
        tau = check_certified_tau(tau)  # the one range of a meter threshold (the CLI's --tau too)
        self.scheme, self.gate, self.keep_exact, self.seed, self.tau = scheme, gate, keep_exact, seed, tau
        self.delta_loc = delta_loc
        self.spot = spot_settings(certificate, spot_keys, spot_delta, tau, gated=gate is not None)  # None: deterministic
        self.sample = _checked_sampling(sample, gate, self.spot)
        self.audit_settings = _checked_audit(audit, gate, self.spot)
        # an exact audit reads exact keys, and with nothing else metered no store forms a witness
        self.statistics = not (self.audit_settings is not None and self.audit_settings.exact and self.sample is None)
        # the picks' key: secret unless the caller opts into replay (a known key lets the queries know the picks)
        self.audit_seed = None if audit is None else (secrets.randbits(63) if audit.seed is None else audit.seed)
        self.delta_sweep: dict = {}  # column name -> delta_loc: extra Tier B meters (the observatory's sweep)
        self.backing_dir = None if backing_dir is None else Path(backing_dir)
        # deferred metering where the meter feeds nothing back: Tier A, no gate; a spot check only at a fixed
        # delta per cell (a request budget's share depends on each call's metered step)
        self.defer = self.tier == "A" and gate is None and (self.spot is None or not callable(self.spot.delta))
        # a query format that is not elementwise (a scale over the whole call) gives another q' over a fold of calls
        self.defer &= self.query_format is None or self.query_format.elementwise
        self._batches: list = []
        # requests with recorded calls and their caches (held until metered: a cache's release closes its backing
        # files, which the flush still reads)
        self._unflushed: list[tuple[_Live, object]] = []
        self.requests: list[RequestRecord] = []
        self._live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Live
        self._hooks: list = []
        self._thread = _ThreadState()  # this monitor's calls in progress and open blocks, per thread
        self._lock = threading.Lock()  # request ids and live caches, shared by the threads
        self._previous_attn = None

    # -- the context manager -------------------------------------------------------------------
    def __enter__(self) -> "Monitor":
        attention = _transformers_side()
        if self._hooks:
            raise ValueError("this monitor is already active")
        if self.model.config._attn_implementation == attention.ATTN_NAME:
            raise ValueError("the model is already monitored (its attention implementation is 'witcert')")
        attention.register()
        self._previous_attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(attention.ATTN_NAME)
        self._hooks = [self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       self.model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True)]
        had_own = "generate" in vars(self.model)
        original = vars(self.model)["generate"] if had_own else None
        bound = original if had_own else type(self.model).generate.__get__(self.model)

        @functools.wraps(bound)
        def generate(*args, **kwargs):  # queries inside generate depend on earlier (dithered) tokens: adaptive
            self._thread.generating += 1
            try:
                return bound(*args, **kwargs)
            finally:
                self._thread.generating -= 1
                self.flush()  # a request's cells are complete when generate returns

        self.model.generate = generate
        self._restore_generate = (lambda: setattr(self.model, "generate", original)) if had_own else (
            lambda: vars(self.model).pop("generate", None))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._drop_open_scopes()
        self._restore_generate()
        self.model.set_attn_implementation(self._previous_attn)
        self.flush()
        self._record_live_memory()  # what the live caches held, their backing stores included, at the close
        self._release_backing()

    @property
    def batches(self) -> list:
        """Every :class:`~witcert.integrations.hf.cells.CellBatch` recorded (deferred calls metered first)."""
        self.flush()
        return self._batches

    def flush(self) -> None:
        """Meter every call recorded for deferred metering (:mod:`witcert.integrations.hf.pending`) now.

        The monitor calls it itself (end of ``generate``, every ``FLUSH_CALLS`` forward calls of a request,
        every read of the results, the end of the block); a caller streaming results mid-request may too.
        """
        with self._lock:
            waiting, self._unflushed = self._unflushed, []
        for live, _ in waiting:
            self._flush_request(live)

    def _flush_request(self, live: "_Live") -> None:
        live.pending.flush()
        live.record.memory = sum((layer.store.memory() for layer in live.layers), MemoryAccount())

    @contextlib.contextmanager
    def non_adaptive(self):
        """Declare the forward calls in this block non-adaptive: their queries do not depend on the dither.

        Teacher-forced scoring of given text is; anything whose input tokens were chosen by the
        monitored model is not. Only here does Tier B use its probabilistic branch (never inside
        ``generate``, which stays deterministic-only even within this block), and only over a cache
        that has served no adaptive call: once a cache was read inside ``generate`` or outside this
        block, its tokens may have been chosen through the dither, and its later cells use the
        deterministic branch too. The block is per thread.
        """
        self._thread.non_adaptive += 1
        try:
            yield self
        finally:
            self._thread.non_adaptive -= 1

    # -- hooks -----------------------------------------------------------------------------------
    def _before_forward(self, module, args, kwargs):
        from transformers import DynamicCache

        from witcert.integrations.hf import attention

        if len(args) > 1:
            raise ValueError("call a monitored model with keyword arguments after input_ids (past_key_values=..., "
                             "attention_mask=...): the monitor must see the cache of every call")
        cache = kwargs.get("past_key_values")
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.model.config, "use_cache", True) if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = DynamicCache(config=self.model.config)
            kwargs["past_key_values"] = cache
        with self._lock:
            live = None if cache is None else self._live_of(cache, _batch_size(args, kwargs))
        adaptive = self._thread.generating > 0 or self._thread.non_adaptive == 0
        if live is not None:  # once a cache served an adaptive call, its tokens may depend on the dither: adaptive since
            adaptive = live.adaptive = live.adaptive or adaptive
        scope = attention.CallScope(
            layout=self.layout, tier=self.tier, adaptive=adaptive,
            truth=self.keep_exact, record=self._batches.append, gate=self.gate, delta_loc=self.delta_loc,
            delta_sweep=dict(self.delta_sweep), fused=self.meter == "fused", spot=self.spot, sample=self.sample,
            query_format=self.query_format,
        )
        if live is not None:
            scope.cache, scope.layers, scope.rows, scope.repairer = cache, live.layers, live.record.ids, live.repairer
            scope.backing = live.backing
            scope.seed = live.record.seed
            if live.layers and live.layers[0].store.length > 0:  # this call reads compressed keys: a metered step
                live.steps += 1
                scope.spot_step = live.steps
            if self.spot is not None and self.gate is None:  # in-step checks (a request budget): at the call's end
                scope.spot_pending = self.spot.pending(scope.tau_k, scope.tau_v, scope.spot_step)
            scope.audit = live.audit
            scope.pending = self._pending_of(live, scope)
        attention._ACTIVE.append(scope)
        self._thread.scopes.append(scope)
        return args, kwargs

    def _after_forward(self, module, args, kwargs, output):
        from witcert.integrations.hf import attention

        scopes = self._thread.scopes
        if not scopes or not attention._ACTIVE or attention._ACTIVE[-1] is not scopes[-1]:
            return output  # the pre-hook raised before pushing this call's scope
        scope = scopes.pop()
        attention._ACTIVE.pop()
        if scope.spot_pending is not None:
            scope.spot_pending.run()
        if scope.audit is not None:  # the audit's checks of the cells this call metered in its step
            scope.audit.run_checks()
        if scope.layers is not None:
            live = self._live.get(kwargs.get("past_key_values"))
            if live is not None and (scope.pending is None or not len(scope.pending)):  # (nothing left to meter
                live.record.memory = sum((layer.store.memory() for layer in live.layers), MemoryAccount())  # later)
            elif live is not None and len(scope.pending) >= FLUSH_CALLS:  # bound the queries a request holds
                with self._lock:
                    self._unflushed = [held for held in self._unflushed if held[0] is not live]
                self._flush_request(live)
        return output

    def _pending_of(self, live: "_Live", scope) -> PendingCells | None:
        """The request's recorded calls when its calls are metered later (``None``: metered in their step)."""
        if not self.defer or not all(getattr(layer.store, "append_only", False) for layer in live.layers):
            return None
        with self._lock:
            if live.pending is None:
                # without the call's cache: _live maps the cache weakly to `live`, which must not hold it (the
                # request, its host store and backing files are released with the cache once it is metered)
                cache = weakref.ref(scope.cache)
                live.pending = PendingCells(replace(scope, cache=None, spot_pending=None), live.layers,
                                            waiting=lambda: self._waiting(live, cache()))
        return live.pending

    def _waiting(self, live: "_Live", cache) -> None:
        """``live`` has recorded calls: hold it and its cache (alive: a call of it is running) until they are
        metered."""
        with self._lock:
            if not any(held is live for held, _ in self._unflushed):
                self._unflushed.append((live, cache))

    def _drop_open_scopes(self) -> None:
        """Remove this thread's scopes of this monitor that no after-hook popped (torch skips ``always_call``
        hooks when a compiled trace raises): after the block, no attention call may find them."""
        from witcert.integrations.hf import attention

        stale = {id(scope) for scope in self._thread.scopes}
        attention._ACTIVE.stack[:] = [scope for scope in attention._ACTIVE.stack if id(scope) not in stale]
        self._thread.scopes.clear()

    def _live_of(self, cache, batch: int) -> _Live:
        from witcert.integrations.hf.cache_layer import adopt

        live = self._live.get(cache)
        if live is not None:
            return live
        record = RequestRecord(first=sum(r.rows for r in self.requests), rows=batch,
                               seed=(fresh_seed() if self.seed is None else self.seed) if self.dithered else None)
        backing = repairer = None
        needs_exact = self.gate is not None or self.spot is not None or self.audit_settings is not None
        if not self.keep_exact and needs_exact:  # exact keys live on the host
            directory = None
            if self.backing_dir is not None:  # mkdtemp: a fresh directory, mode 0700
                directory = tempfile.mkdtemp(prefix=f"request-{record.first}-", dir=self._backing_root())
            block_size = self.gate.block_size if self.gate is not None else SPOT_BLOCK_SIZE
            backing = BackingStore(block_size=block_size, directory=directory)
            repairer = Repairer(backing) if self.gate is not None else None
        layers = adopt(cache, lambda index: self._store(index, record, backing), self.geometry.layers)
        live = _Live(record, layers, repairer, backing)
        if backing is not None:  # the request's exact keys go with its cache (or with the monitor, whichever first)
            live.release = weakref.finalize(cache, backing.close)
        if self.audit_settings is not None:
            live.audit = AuditedRequest(self.audit_settings, self.audit_seed, record.ids, self.geometry.layers,
                                        self.geometry.query_heads)
        self._live[cache] = live
        self.requests.append(record)
        return live

    def _backing_root(self) -> Path:
        self.backing_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # made here: owner only
        return self.backing_dir

    @property
    def backing_values(self) -> bool:
        """Whether the host backing store keeps the exact values too: the gate repairs with them, the spot check
        counts their pages; the audit (never with a gate or ``certificate="spot"``) reads exact keys only."""
        return self.audit_settings is None

    def _record_live_memory(self) -> None:
        for live in list(self._live.values()):
            live.record.memory = sum((layer.store.memory() for layer in live.layers), MemoryAccount())

    def _release_backing(self) -> None:
        """Close every live request's backing store (its files removed): the monitor is closing, and no call
        after it pages exact keys in; the stores stop writing to it."""
        for live in list(self._live.values()):
            if live.release is not None:
                live.release()
                for layer in live.layers:
                    layer.store.backing = None

    def _store(self, index: int, record: RequestRecord, backing: BackingStore | None):
        values = self.backing_values
        if self.hf_cache is not None:
            return QuantizedLayerStore(self.hf_cache, self.layout, keep_exact=self.keep_exact, backing=backing,
                                       backing_key=index, witness_code=self.witness_code, backing_values=values)
        if self.dithered:
            from witcert.tier_b.quantizer import DitheredInt8

            codec = Dither(DitheredInt8(rope=self.layout.rope), layer=index, seed=record.seed, requests=record.ids)
        else:
            codec = self._codec
        return CompressedLayer(codec, self.layout, keep_exact=self.keep_exact, backing=backing, backing_key=index,
                               witness_code=self.witness_code, backing_values=values, statistics=self.statistics)

    # -- results ---------------------------------------------------------------------------------
    def table(self) -> telemetry.CellTable:
        """Every measured cell, one row each (:mod:`witcert.integrations.hf.telemetry` columns)."""
        return telemetry.cell_table(self.batches)

    def tensor(self, name: str = "meter") -> torch.Tensor:
        """``name`` per (request, layer, query head, step), fp64; NaN where a request has no such step.

        A request's steps are its measured query positions in order (the probe chunk's queries,
        then one per decoded token); :meth:`positions` gives them.
        """
        return self._grid(name)[0]

    def positions(self) -> torch.Tensor:
        """Absolute query position of each (request, step), -1 past a request's last step."""
        return self._grid("meter")[1]

    def _grid(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table()
        n_requests = sum(r.rows for r in self.requests)
        shape = (n_requests, self.geometry.layers, self.geometry.query_heads)
        if not len(table):
            return torch.full((*shape, 0), torch.nan, dtype=torch.float64), torch.full((n_requests, 0), -1)
        if name not in table.columns:
            raise ValueError(f"unknown field {name!r}; the table has {sorted(table.columns)}")
        request, pos = table["request"].astype(np.int64), table["pos"].astype(np.int64)
        key = request * (int(pos.max()) + 1) + pos  # (request, position) pairs, in order
        pairs, step_of = np.unique(key, return_inverse=True)
        pair_request = pairs // (int(pos.max()) + 1)
        first = np.searchsorted(pair_request, np.arange(n_requests))
        step = np.arange(len(pairs)) - first[pair_request]  # rank of the position within its request
        n_steps = int(step.max()) + 1
        grid = np.full((*shape, n_steps), np.nan)
        grid[request, table["layer"].astype(np.int64), table["head"].astype(np.int64), step[step_of]] = table[name]
        where = np.full((n_requests, n_steps), -1)
        where[pair_request, step] = pairs % (int(pos.max()) + 1)
        return torch.from_numpy(grid), torch.from_numpy(where)

    def summary(self, tau: float | None = None) -> "LayerSummary":
        """Per-layer summary of every cell (see :class:`LayerSummary`), with each request's audit when auditing."""
        table = self.table()
        audits = () if self.audit_settings is None else requests_of(table.columns, self.audit_settings,
                                                                    self.audit_seed)
        return LayerSummary.of(table, self.tau if tau is None else tau, self.tier, memory=self.memory(),
                                audits=audits)

    def audit(self) -> tuple[RequestAudit, ...]:
        """Each request's audit (:class:`witcert.audit.RequestAudit`), in request order: with probability at least
        ``1 - delta``, at most ``M_upper`` (``fraction_upper = M_upper / N``) of its ``N`` cells have attention TV
        above ``tau``; with the cells picked and flagged, the flagged cells' (layer, head, pos) and an estimate
        with its interval. Needs ``audit=`` (:class:`witcert.Audit`)."""
        if self.audit_settings is None:
            raise ValueError("audit: this monitor does not audit; pass audit=witcert.Audit(rate, tau, delta) to "
                             "witcert.monitor")
        return requests_of(self.table().columns, self.audit_settings, self.audit_seed)

    def plot_audit(self, path: str | Path | None = None, requests: int = 4):
        """The audit's picked and flagged cells over (layer, step), one panel per request (the first ``requests``)
        (:func:`witcert.observatory.run_plot.plot_audit`; needs matplotlib). Returns the ``Figure``."""
        from witcert.observatory.run_plot import plot_audit

        return plot_audit(self.table(), self.audit(), path, requests)

    def plot(self, path: str | Path | None = None, tau: float | None = None):
        """A picture of the run: meter and true TV per (layer, step), saturated and repaired cells marked, and
        every cell's meter against its true TV (:func:`witcert.observatory.run_plot.plot_run`; needs matplotlib).
        Returns the ``Figure``; saved as PNG to ``path`` when given."""
        from witcert.observatory.run_plot import plot_run

        return plot_run(self.table(), self.tau if tau is None else tau, path)

    def to_pandas(self):
        """The cell table as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas
        except ImportError:
            raise ImportError("Monitor.to_pandas needs pandas (pip install 'witcert[observatory]', or pip install "
                              "pandas); Monitor.table() needs nothing") from None
        return pandas.DataFrame(self.table().columns)

    def write_jsonl(self, path: str | Path, run: dict | None = None) -> int:
        """Append one JSON line per cell to ``path`` (``run``: tags added to every line); returns the count."""
        name = self.scheme if isinstance(self.scheme, str) else getattr(self.scheme, "name", None)
        tags = {"scheme": name or getattr(self.scheme, "__name__", "callable"), "keep_exact": self.keep_exact}
        if self.audit_settings is not None:  # what witcert.audit.requests_of needs beside the cell columns
            a = self.audit_settings
            tags |= {"audit_rate": a.rate, "audit_tau": a.tau, "audit_delta": a.delta, "audit_keys_budget": a.keys,
                     "audit_seed": self.audit_seed}
        tags |= run or {}
        return telemetry.write_jsonl(Path(path), self.table(), tags)

    def memory(self) -> "MemoryReport":
        """Bytes the monitored caches held (each live one now, each released one at its last call) against exact
        caches of the same tokens (:class:`~witcert.integrations.hf.memory.MemoryReport`)."""
        self.flush()
        if self._hooks:  # active: the live caches as they are now (after the block: as they were when it closed)
            self._record_live_memory()
        return MemoryReport(total=sum((r.memory for r in self.requests), MemoryAccount()),
                            requests=tuple(r.memory for r in self.requests))


def _transformers_side():
    """The modules that need transformers (imported on first use: ``import witcert`` does not need it)."""
    try:
        from witcert.integrations.hf import attention
    except ImportError as err:
        raise ImportError(f"witcert.monitor needs transformers (pip install 'witcert[hf]'): {err}") from None
    return attention


def _checked_sampling(sample, gate, spot) -> MeterSampling | None:
    """``sample`` if it is a :class:`MeterSampling` the monitor can honour (``None``: every cell metered)."""
    if sample is None:
        return None
    if not isinstance(sample, MeterSampling):
        raise ValueError(f"sample must be a witcert.MeterSampling or None, got {type(sample).__name__}")
    if gate is not None or spot is not None:
        raise ValueError("sample: sampled metering leaves cells unmetered, and a gate or spot check decides on every "
                         "cell's meter; use sample=None with gate= or certificate='spot'")
    return sample


def _checked_audit(audit, gate, spot) -> Audit | None:
    """``audit`` if it is an :class:`Audit` the monitor can honour (``None``: no audit)."""
    if audit is None:
        return None
    if not isinstance(audit, Audit):
        raise ValueError(f"audit must be a witcert.Audit or None, got {type(audit).__name__}")
    if gate is not None:
        raise ValueError("audit: a gate would act on the audit's outcomes (it repairs the metered cells, and only the "
                         "picked cells are metered), so the request's later cells would depend on the picks and the "
                         "binomial statement would not hold. Acting after a request ends (alert, retry, discard) keeps "
                         "it; gating within the request needs a sequential statement over the picks in order, which "
                         "the audit does not make. Audit an ungated run, or gate without an audit")
    if spot is not None:
        raise ValueError("audit: certificate='spot' spot-checks every cell above tau, the audit only its picked cells "
                         "(with audit.keys exact keys each); use the default certificate with audit=")
    return audit


def _check_eager(model) -> None:
    """Refuse a ``torch.compile``d model: the monitor's hooks and attention run eagerly (its own passes compile
    with ``WITCERT_COMPILE=1``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule) or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError("model: a torch.compile'd model cannot be monitored; pass the eager model "
                         "(WITCERT_COMPILE=1 compiles the meter's own passes)")


def _batch_size(args, kwargs) -> int:
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[0])
    raise ValueError("a monitored forward call needs input_ids or inputs_embeds of shape (batch, tokens, ...)")
