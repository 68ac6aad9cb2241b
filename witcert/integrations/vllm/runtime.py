"""Process-wide state of the enabled plugin: config, telemetry, request ids of the running step."""
import atexit
import functools
import logging
import os
import shutil
import math
import tempfile
import time
import weakref
from collections import OrderedDict

import torch

from witcert.schemes.catalog import DITHERED

from . import config
from .audit import PickBlocks
from .step_plan import Planner, StepPlan
from .telemetry import CellLog, Telemetry

logger = logging.getLogger("vllm.witcert")  # the package's logger (one object by name; no import of the package)

PUBLISH_S = 0.5  # at most two snapshots a second while the engine runs
LOG_S = 10.0  # the aggregate logged at most every 10 s (vLLM's own stats interval), and when the engine goes idle


class Runtime:
    """Everything one process shares between its attention layers."""

    def __init__(self, cfg: config.PluginConfig):
        from . import schemes

        self.config = cfg
        self.schemes = schemes.load(cfg)  # every scheme a request may choose, loaded and probed once
        self.dither_seed = None
        if DITHERED in self.schemes:
            from witcert.tier_b.counters import fresh_seed

            self.dither_seed = fresh_seed()  # secret, per process (the deterministic branch needs no secrecy)
        self.telemetry = Telemetry(tau=cfg.tau, max_requests=cfg.max_requests, shadow=cfg.shadow, gate=cfg.gate)
        self.cell_log = CellLog(cfg.jsonl) if cfg.jsonl else None
        self.request_ids: list[str] = []
        self.row_settings: list[config.RequestSettings] = []
        self.prompt_lens: list[int] = []  # prompt tokens of each batch row (a verification step starts past them)
        self.step = 0  # engine steps seen (the model runner's input preparation)
        self.planner = Planner()
        self.slot_cache = None  # (step, slot mapping, tokens, slots, write number, last earlier write) of the step
        self.writes = 0  # writes numbered so far (number_writes)
        self.written_by = torch.full((0,), -1, dtype=torch.long)  # per slot, the number of its last write (-1: none)
        self.entry_cache = None  # (cache shape, slots, key entries) of the slots last read back (backend._entries)
        self.journal_step = None  # (step, whether its writes are journaled): the same for every layer
        self.picks = PickBlocks()  # the audited requests' picks, drawn ahead (the same picks, fewer calls)
        self.impls = weakref.WeakSet()  # this process's metered attention layers (their deferred rows)
        self.last_layer = -1
        self._published = -math.inf  # when the snapshot was last written
        self._logged = (-math.inf, 0)  # when the aggregate was last logged, and its cells then
        self._default = config.default_settings(cfg)

    def number_writes(self, slots: torch.Tensor) -> tuple[int, int]:
        """Number a write of ``slots`` (every layer's write of one step shares it): ``(number, before)``, ``before`` the
        number of the last earlier write of any of ``slots`` (``-1``: none), which tells a layer's journal whether it
        may hold one of them (:meth:`.journal.WriteJournal.may_hold`)."""
        self.writes += 1
        if not slots.numel():
            return self.writes, -1
        top = int(slots.max()) + 1
        if top > self.written_by.numel():
            grown = torch.full((max(top, 2 * self.written_by.numel()),), -1, dtype=torch.long)
            grown[: self.written_by.numel()] = self.written_by
            self.written_by = grown
        before = int(self.written_by[slots].max())
        self.written_by[slots] = self.writes
        return self.writes, before

    def request_id(self, row: int) -> str:
        """The request in batch row ``row`` of the running step (``row<i>`` if unknown)."""
        return self.request_ids[row] if row < len(self.request_ids) else f"row{row}"

    def settings(self, row: int) -> config.RequestSettings:
        """Scheme and gate of the request in batch row ``row`` (the engine defaults if unknown)."""
        return self.row_settings[row] if row < len(self.row_settings) else self._default

    def plan(self, md, block_size: int) -> StepPlan:
        """This step's :class:`~.step_plan.StepPlan` (made by the first layer that asks, shared by the others)."""
        return self.planner.plan(self.step, self.request_ids, self.prompt_lens, md, block_size)

    def flush(self) -> None:
        """Meter every layer's deferred rows now, then fold and publish (engine idle, a snapshot, exit)."""
        for impl in list(self.impls):
            impl.flush()
        self.telemetry.fold()
        self.telemetry.publish(self.config.metrics_dir)
        if self.cell_log is not None:
            self.cell_log.flush()
        self.log(time.monotonic(), every=0.0)

    def log(self, now: float, every: float = LOG_S) -> None:
        """Log the aggregate (:meth:`.telemetry.Telemetry.log_line`) if ``every`` seconds have passed since the last
        line and the cells changed since."""
        last, cells = self._logged
        if now - last >= every and self.telemetry.cells + self.telemetry.unmetered != cells:
            self._logged = (now, self.telemetry.cells + self.telemetry.unmetered)
            logger.info(self.telemetry.log_line())

    def finish(self, requests=None) -> None:
        """Form the audit verdicts of the finished ``requests`` (ids; ``None``: every open one, the engine being
        idle or the process exiting), their deferred rows metered first."""
        for impl in list(self.impls):  # a deferred row may be a finished request's first audited cells
            impl.flush()  # (no extra pass: the batch changes next step, which flushes them anyway)
        self.telemetry.fold()
        ledger = self.telemetry.audit
        ledger.finish(list(ledger.open) if requests is None else requests)

    def idle(self) -> None:
        """The engine has no request left (or the process exits): meter what is deferred, close every audit,
        publish."""
        self.finish()
        self.flush()

    def snapshot(self) -> dict:
        """The telemetry's snapshot with every deferred row metered first."""
        self.flush()
        return self.telemetry.snapshot()

    def end_layer(self, layer: int) -> None:
        """After each metered layer: once the step's last layer is done, fold the queued cells in and publish, at
        most every ``PUBLISH_S`` seconds (a scrape reads the last snapshot; the engine going idle, a snapshot and
        the exit publish at once)."""
        if layer >= self.last_layer:
            self.last_layer = layer
            now = time.monotonic()
            if now - self._published >= PUBLISH_S or not idle_hook_here():  # no idle hook: publish every step
                self._published = now
                self.telemetry.fold()
                self.telemetry.publish(self.config.metrics_dir)
                if self.cell_log is not None:
                    self.cell_log.flush()
                self.log(now)


_RUNTIME: Runtime | None = None
_IDLE_HOOK_HERE = False  # whether this process steps vLLM's engine core (flush_when_idle's hook runs here)


def get() -> Runtime:
    """The process's runtime (created from the environment on first use; its deferred rows flushed at exit)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime(config.PluginConfig.from_env())
        atexit.register(_RUNTIME.idle)
    return _RUNTIME


def flush_when_idle() -> None:
    """Meter the deferred rows once the engine core has no request left, and form the audit verdicts of the
    requests that ended in a step (its step wraps vLLM's; idempotent).

    The engine core steps the model runner in this process for a single worker; a tensor-parallel worker
    defers nothing (:class:`~.config.PluginConfig` ``defer``)."""
    from vllm.v1.engine.core import EngineCore

    for name in ("step", "step_with_batch_queue"):
        original = getattr(EngineCore, name)
        if getattr(original, "_witcert", False):
            continue

        def wrapped(self, *args, _original=original, **kwargs):
            global _IDLE_HOOK_HERE
            _IDLE_HOOK_HERE = True
            out = _original(self, *args, **kwargs)
            if _RUNTIME is not None:
                finished = getattr(self.scheduler, "finished_req_ids", None)
                if finished:  # requests that ended in this step: their audit verdicts
                    _RUNTIME.finish(list(finished))
                if not self.scheduler.has_requests():
                    _RUNTIME.idle()
            return out

        wrapped = functools.wraps(original)(wrapped)
        wrapped._witcert = True
        setattr(EngineCore, name, wrapped)


def idle_hook_here() -> bool:
    """Whether this process steps vLLM's engine core, so that :func:`flush_when_idle` meters and publishes what is
    left when the engine goes idle. A worker process of a multiprocess executor (``vllm serve``'s default on CPU,
    tensor parallelism) never sees that: it defers nothing and publishes after every step."""
    return _IDLE_HOOK_HERE


def ensure_metrics_dir() -> str:
    """The snapshot directory, created (and exported to child processes) when unset."""
    directory = os.environ.get(config.METRICS_DIR)
    if not directory:
        directory = tempfile.mkdtemp(prefix="witcert-vllm-")
        os.environ[config.METRICS_DIR] = directory  # engine processes inherit it
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def track_request_ids() -> None:
    """Record the batch's request ids at each step (vLLM's attention metadata carries none).

    Wraps the model runner's ``_prepare_inputs``, called once per step after the batch is put
    in its final order (the order of ``query_start_loc`` rows). Idempotent.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if getattr(original, "_witcert", False):
        return

    @functools.wraps(original)
    def _prepare_inputs(self, *args, **kwargs):
        rt = get()
        finished = getattr(args[0] if args else kwargs.get("scheduler_output"), "finished_req_ids", None)
        if finished:
            rt.finish(finished)  # before this step's layers touch the state the deferred rows were queued against
        rt.request_ids = list(self.input_batch.req_ids)
        rt.prompt_lens = self.input_batch.num_prompt_tokens[:len(rt.request_ids)].tolist()
        rt.row_settings = [_settings_of(rt, rid, self.requests.get(rid)) for rid in rt.request_ids]
        rt.step += 1
        return original(self, *args, **kwargs)

    _prepare_inputs._witcert = True
    GPUModelRunner._prepare_inputs = _prepare_inputs


_SETTINGS: OrderedDict = OrderedDict()  # request id -> RequestSettings (bounded: requests come and go)


def _settings_of(rt: Runtime, request_id: str, state) -> config.RequestSettings:
    """A request's settings, read once from its ``SamplingParams.extra_args``."""
    settings = _SETTINGS.get(request_id)
    if settings is None:
        params = getattr(state, "sampling_params", None)
        settings = config.request_settings(rt.config, getattr(params, "extra_args", None))
        _SETTINGS[request_id] = settings
        while len(_SETTINGS) > 4096:
            _SETTINGS.popitem(last=False)
    return settings


def validate_request_args() -> None:
    """Check the per-request keys where vLLM checks a request (``SamplingParams``), so a bad
    ``witcert_scheme`` or ``witcert_gate`` is a client error (HTTP 400) naming the key, not a
    failure inside the engine. Idempotent."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._verify_args
    if getattr(original, "_witcert", False):
        return
    cfg = config.PluginConfig.from_env()

    @functools.wraps(original)
    def _verify_args(self):
        original(self)
        try:
            config.request_settings(cfg, self.extra_args)
        except ValueError as err:
            raise VLLMValidationError(str(err), parameter="extra_args") from None

    _verify_args._witcert = True
    SamplingParams._verify_args = _verify_args
