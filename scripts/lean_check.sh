#!/usr/bin/env bash
# CI step for the Lean development (docs/design.md "Verification chain").
# - When `lake` is on PATH: build the dependency-free layer and the Mathlib layer with warnings
#   as errors, then check that every registered theorem uses only the standard axioms.
# - Otherwise: say in one line that the proofs were NOT checked.
# - Always: the static audit (forbidden tokens, registry names declared in formal/, docstrings,
#   scope: every formal/ name a file uses is declared in it or in a module it imports, no import
#   cycle, every module reachable from formal/WitCert.lean; docs/theorem_map.md and
#   formal/Export.lean in sync with spec/registry.py), the build pins (scripts/lean_pins.py:
#   no bare `import Mathlib`; lake-manifest.json pins Mathlib at the commit of the lakefile's tag
#   and each dependency at the revision Mathlib's own manifest names), and the check against the
#   pinned Mathlib (scripts/lean_names.py, with the committed index
#   formal/mathlib-index-<tag>.tsv.xz: every import exists at the pin, every Mathlib name is
#   declared in the file's import closure and not deprecated, no lemma applied to more explicit
#   arguments than it takes). These read text; they do not elaborate (docs/verification.md).
# Exit status: non-zero when the audit or (if run) the Lean build / axiom check fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

if command -v lake >/dev/null 2>&1; then
  lake exe cache get >/dev/null 2>&1 || echo "lean_check: no Mathlib cache fetched; building from source"
  lake build --wfail WitCertCore
  lake build --wfail WitCert
  report="$(lake env lean formal/Export.lean 2>&1)"
  echo "$report" | grep "axioms" || true
  if echo "$report" | grep -q "error:"; then
    echo "lean_check: formal/Export.lean failed" >&2
    exit 1
  fi
  bad="$(echo "$report" | grep "depends on axioms" \
    | sed -e 's/.*depends on axioms: \[//' -e 's/\]//' | tr ',' '\n' | sed 's/ //g' \
    | grep -v -x -e propext -e Classical.choice -e Quot.sound -e '' || true)"
  if [[ -n "$bad" ]]; then
    echo "lean_check: disallowed axioms: $bad" >&2
    exit 1
  fi
else
  echo "Lean proofs were NOT checked: lake not found on PATH"
fi

"$PY" scripts/lean_pins.py
"$PY" scripts/lean_names.py
"$PY" scripts/gen_theorem_map.py --check
