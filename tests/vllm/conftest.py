"""Shared set-up of the vLLM tests: one in-process engine per session, the model converted once.

The engine tests run in the vLLM venv (``make test-vllm``); elsewhere they skip with the reason.
The pure tests (layout, metering, telemetry, config) run in both venvs.
"""
import os
from pathlib import Path

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, model_path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = model_path()
    if not (path / "config.json").is_file():
        pytest.skip(f"no SmolLM2 safetensors copy at {path}: `make test-vllm` converts it with the main venv")
    return path


@pytest.fixture(scope="session")
def engine(smollm2, tmp_path_factory):
    """One in-process engine, plugin on with the exact shadow and the per-cell log, fp32 model."""
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    out = tmp_path_factory.mktemp("witcert-vllm")
    switches = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WITCERT_VLLM": "1", "WITCERT_VLLM_SHADOW": "1",
                "WITCERT_VLLM_JSONL": str(out / "cells.jsonl"), "WITCERT_VLLM_METRICS_DIR": str(out)}
    saved = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        from vllm import LLM

        llm = LLM(str(smollm2), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  kv_cache_memory_bytes=128 << 20)
    finally:  # the plugin read its switches at start-up; engines started later get their own
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return llm, out
