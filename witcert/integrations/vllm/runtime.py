"""Process-wide state of the enabled plugin: config, telemetry, request ids of the running step."""
import atexit
import functools
import os
import shutil
import tempfile

from . import config
from .telemetry import CellLog, Telemetry


class Runtime:
    """Everything one process shares between its attention layers."""

    def __init__(self, cfg: config.PluginConfig):
        self.config = cfg
        self.telemetry = Telemetry(tau=cfg.tau, max_requests=cfg.max_requests, shadow=cfg.shadow)
        self.cell_log = CellLog(cfg.jsonl) if cfg.jsonl else None
        self.request_ids: list[str] = []
        self.last_layer = -1

    def request_id(self, row: int) -> str:
        """The request in batch row ``row`` of the running step (``row<i>`` if unknown)."""
        return self.request_ids[row] if row < len(self.request_ids) else f"row{row}"

    def end_layer(self, layer: int) -> None:
        """After each metered layer: publish once the last layer of the step is done."""
        if layer >= self.last_layer:
            self.last_layer = layer
            self.telemetry.publish(self.config.metrics_dir)
            if self.cell_log is not None:
                self.cell_log.flush()


_RUNTIME: Runtime | None = None


def get() -> Runtime:
    """The process's runtime (created from the environment on first use)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime(config.PluginConfig.from_env())
    return _RUNTIME


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
        get().request_ids = list(self.input_batch.req_ids)
        return original(self, *args, **kwargs)

    _prepare_inputs._witcert = True
    GPUModelRunner._prepare_inputs = _prepare_inputs
