# Two commands do the whole set-up on a fresh machine (README): `make demo` and `make test`.
# `make install` installs the exact pins of requirements.txt into .venv, then this checkout in
# editable mode without dependencies (pyproject.toml declares ranges for `pip install .[extras]`);
# it reruns only when requirements.txt or pyproject.toml changed (the stamp file).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
STAMP  := $(VENV)/.installed

.PHONY: demo test install fuzz study clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	grep -v 'no-deps' requirements.txt | $(PIP) -r /dev/stdin
	grep 'no-deps' requirements.txt | $(PIP) --no-deps -r /dev/stdin
	$(PIP) --no-deps --no-build-isolation -e .
	DISABLE_CUDA=1 $(PIP) --no-deps --no-build-isolation -r requirements-quant.txt && { $(PY) -c "from optimum.quanto.library.extensions import get_extension as g; g('quanto_cpp').lib" >/dev/null || echo "optimum-quanto: C++ extension not prebuilt (compiled on first use)"; }
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/witcert observe --demo

test: $(STAMP)
	$(PY) -m pytest -q

fuzz: $(STAMP)
	$(VENV)/bin/witcert fuzz --trials 500000

# the full study (README "The study"): about 17 min on the 2 shared cores it was measured on
study: $(STAMP)
	$(VENV)/bin/witcert study --out docs/study

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
