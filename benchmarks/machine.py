"""A description of the machine the benchmarks ran on (written to ``results/machine.md``)."""
import os
import platform
import subprocess
import sys

import torch


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 -- absent or broken: say so
        return "not installed"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def describe(threads: int) -> dict:
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "commit": _commit(),
    }


def markdown(info: dict) -> str:
    lines = ["# Machine", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "The machine is shared (up to 8 processes on 2 cores): timings are medians of interleaved",
              "repetitions, and every cost figure is a ratio measured in the same run."]
    return "\n".join(lines) + "\n"
