"""Print the four-implementation table (kernel, torch, mpmath golden, independent) as markdown.

docs/design.md "Verification chain": every certificate quantity computed four ways. The machinery is
``contracts/four_impl.py`` (also asserted by ``contracts/test_four_implementations.py``); this
script only prints it, with the budgets the kernel column is held to.

Usage: ``.venv/bin/python scripts/four_impl_table.py [--seed 31]``. Runs on the CPU under the
Triton interpreter (a few seconds).
"""
import argparse
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "contracts"))

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # Triton's CPU interpreter; read when the first kernel module is imported

from four_impl import SCHEMES, kernel_a_budget, kernel_budget, markdown, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args()
    start = time.perf_counter()
    budget = kernel_budget()
    for scheme in SCHEMES:
        quantities = table(args.seed, scheme)
        print(f"### Tier A keys: {scheme} (Tier B rows: dithered INT8 of the same keys)\n")
        print(markdown(quantities))
        d_max = max(float(v) for v in quantities[0].values["kernel"])
        print(f"\nkernel bounds: c_t <= golden (1 + {2 * budget['kappa_c']:.3g}), Tier B radius <= golden "
              f"(1 + {2 * budget['kappa_b']:.3g}), A - 1 <= golden (1 + {kernel_a_budget(d_max):.3g}), "
              f"meter <= golden (1 + {2 * kernel_a_budget(d_max):.3g}); never below golden.\n")
    print("golden: spec (mpmath, 50 digits); independent: decimal at 60 digits from the definitions.")
    print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
