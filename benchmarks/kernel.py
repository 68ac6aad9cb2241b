"""The Triton decode kernel with the certificate on vs off: ``benchmarks/bench_decode_kernel.py``
(owned by the kernels engineer) run as a subprocess. Without CUDA it only smoke-runs under the
Triton interpreter and reports no timings (interpreter timings are not timings)."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("bench_decode_kernel.py")


def run(timeout_s: int = 600) -> dict:
    if not SCRIPT.is_file():
        return dict(status="absent", note=f"{SCRIPT.name} not found")
    try:
        done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(status="timeout", note=f"no result within {timeout_s} s")
    out = done.stdout.strip()
    result = dict(status="ok" if done.returncode == 0 else f"exit {done.returncode}", stdout=out[-4000:],
                  stderr=done.stderr.strip()[-2000:])
    start = out.find("{")
    if start >= 0:
        try:
            result["timings"] = json.loads(out[start: out.rfind("}") + 1])
        except json.JSONDecodeError:
            pass
    return result
