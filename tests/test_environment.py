"""Product code leaves the process environment alone; the kernels fail clearly without a backend.

Implementation under test: importing every module of the ``witcert`` package (``witcert.kernels``
and ``witcert.spec`` included) and launching a kernel. Oracle: ``os.environ`` before and after
those imports, in a fresh interpreter started without ``TRITON_INTERPRET``; the third-party
modules the product imports are imported *before* the first snapshot, so what a dependency does
on import (transformers sets ``TORCHINDUCTOR_CACHE_DIR``) is not counted against WitCert.
Tolerance: exact (no key added, removed or changed). Domain: every product module except the
``kernel fp32 range`` fuzz attack, which runs the kernels under the interpreter by design and
selects it itself, and modules whose optional dependency is not installed.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = ["witcert.verification.attacks.kernel_range"]  # `witcert fuzz` selects the interpreter itself

_PROBE = r"""
import importlib, json, os, pkgutil, sys
exempt, third_party = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in third_party:  # what dependencies do on import happens before the snapshot
    try:
        importlib.import_module(name)
    except Exception:
        pass
before = dict(os.environ)
import witcert, witcert.kernels, witcert.spec
# kernels/ and spec/ are mapped into the package (package-dir): walk each tree
names = {i.name for pkg in (witcert, witcert.kernels, witcert.spec)
         for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")}
imported, skipped = [], []
for name in sorted(names - set(exempt)):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:  # an optional integration whose extra is not installed
        if err.name and not err.name.startswith("witcert"):
            skipped.append(name)
            continue
        raise
    imported.append(name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
launch = None
import torch
if not torch.cuda.is_available():
    from witcert.kernels import KernelBackendError
    from witcert.kernels.philox import philox4x32_10
    try:
        philox4x32_10(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64))
        launch = "ran"
    except KernelBackendError as err:
        launch = str(err)
print(json.dumps({"imported": imported, "skipped": skipped, "changed": changed, "launch": launch}))
"""


def _third_party_imports() -> list[str]:
    """Every non-witcert module named by an import statement in the product source trees."""
    found = set()
    for folder in ("witcert", "kernels", "spec"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
    return sorted(n for n in found if n.split(".")[0] != "witcert")


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-c", _PROBE, json.dumps(EXEMPT), json.dumps(_third_party_imports())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_product_package_changes_no_environment_variable(probe):
    assert "witcert.kernels.decode_attention" in probe["imported"]  # the kernels really were imported
    assert "witcert.cli.observe" in probe["imported"]
    assert probe["changed"] == [], f"importing witcert changed the environment: {probe['changed']}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA a compiled kernel launches")
def test_a_kernel_launched_without_gpu_or_interpreter_says_what_to_do(probe):
    assert probe["launch"] is not None and "TRITON_INTERPRET=1" in probe["launch"], probe["launch"]
