"""Shared pytest set-up for ``tests/`` and ``contracts/``.

* Hypothesis profiles ``dev`` (default) and ``ci`` (derandomized, selected by ``CI=true``).
* The Triton backend. Product code never changes the process environment, so the test run
  chooses it here: without CUDA the kernels run under Triton's CPU interpreter
  (``TRITON_INTERPRET=1``). Triton reads the variable when a ``@triton.jit`` decorator runs, i.e.
  when a kernel module is first imported; pytest loads this root ``conftest.py`` before it
  collects any test module, so the setting holds whichever test imports a kernel first. An
  explicit setting in the environment wins; with CUDA the kernels compile for the GPU.
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def one_thread():
    """Run the test on one torch thread (model tests: stable timing on a shared machine), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_monitor_scope_leaks():
    """State never leaks between tests: after each one, no monitored forward call is left open on this thread
    (a leaked scope would make the next model's attention read another call's cache)."""
    yield
    attention = sys.modules.get("witcert.integrations.hf.attention")
    if attention is not None and len(attention._ACTIVE):
        open_scopes = len(attention._ACTIVE)
        attention._ACTIVE.stack.clear()
        pytest.fail(f"{open_scopes} monitored forward call(s) left open by this test")


def pytest_runtest_logstart(nodeid, location):
    """``WITCERT_LAST_TEST=path``: the test about to run, written before it starts, so a run killed by a signal
    (an abort inside a compiled kernel) still says where it died (``make test`` prints it)."""
    path = os.environ.get("WITCERT_LAST_TEST")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write(nodeid + "\n")
