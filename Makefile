# Two commands do the whole set-up on a fresh machine (README): `make demo` and `make test`.
# `make install` installs the exact pins of requirements.txt into .venv, then this checkout in
# editable mode without dependencies (pyproject.toml declares ranges for `pip install .[extras]`);
# it reruns only when requirements.txt or pyproject.toml changed (the stamp file).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
STAMP  := $(VENV)/.installed

.PHONY: demo test install fuzz study bench bench-long docs clean test-vllm test-other-cpu

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	grep -v 'no-deps' requirements.txt | $(PIP) -r /dev/stdin
	grep 'no-deps' requirements.txt | $(PIP) --no-deps -r /dev/stdin
	$(PIP) --no-deps --no-build-isolation -e .
	DISABLE_CUDA=1 $(PIP) --no-deps --no-build-isolation -r requirements-quant.txt && { $(PY) -c "from optimum.quanto.library.extensions import get_extension as g; g('quanto_cpp').lib" >/dev/null || echo "optimum-quanto: C++ extension not prebuilt (compiled on first use)"; }
	touch $(STAMP)

# one torch thread: on 2 shared cores a second thread oversubscribes (2026-12-06, Intel Xeon, 2 CPUs shared with
# other work at load 10-15: one spot-checked fp8-e4m3 needle case, `witcert observe --scheme fp8-e4m3 --certificate
# spot --cases 1 --threads N`, took 149 s and 211 s with 1 thread, over 600 s (stopped) twice with 2)
DEMO_THREADS ?= 1

demo: $(STAMP)
	$(VENV)/bin/witcert observe --demo --threads $(DEMO_THREADS)

# A run that dies (a signal, not a failed test) names the test it was in: the log's tail is often all one sees.
# Inductor's compiled kernels go to this checkout's build/ (a fresh clone compiles its own, never a stale /tmp cache).
LAST_TEST := build/pytest-last-test
test: $(STAMP)
	mkdir -p build
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor WITCERT_LAST_TEST=$(LAST_TEST) $(PY) -m pytest -q || \
		{ rc=$$?; echo "pytest exited with $$rc; the test running at its end: $$(cat $(LAST_TEST) 2>/dev/null)"; exit $$rc; }
	$(MAKE) test-vllm

# The tests that compare two computation paths (batched against per step, compiled against eager, kernel against
# reference), run again with the math libraries held to AVX2 kernels: another CPU's summation order (an AVX2-only
# Intel, or an AMD EPYC, where MKL takes other paths). A test that passes only in one order fails here (CI runs it).
# Inductor's compiled kernels go to a cache of their own: its files are built for the ISA a run picks.
OTHER_CPU := MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-avx2
PATH_TESTS := tests/test_deferred_metering.py tests/test_meter_sampling.py tests/test_fast_radius.py \
	tests/test_fast_tier_b.py tests/test_fastpath.py tests/test_attention_inputs.py \
	contracts/test_kernel_vs_reference.py contracts/test_four_implementations.py tests/test_formats.py \
	tests/test_packed_decode.py tests/test_group_check.py tests/test_spot_groups.py tests/test_spot_store_checksum.py \
	tests/test_pair_statistics.py tests/test_compiled_sweep.py tests/test_audit_exact.py tests/test_audit_exact_spec.py \
	tests/test_guarded_call.py

test-other-cpu: $(STAMP)
	$(OTHER_CPU) $(PY) -m pytest -q -p no:cacheprovider $(PATH_TESTS)

fuzz: $(STAMP)
	$(VENV)/bin/witcert fuzz --trials 500000

# the documentation site (docs/, mkdocs.yml) into build/site; the test suite builds it too
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# the full study (docs/guides/study.md): 200 cases per repair configuration, 64 per layer-sweep
# configuration; 41 min on one torch thread of the 2 shared cores it was measured on
study: $(STAMP)
	$(VENV)/bin/witcert study --cases 200 --sweep-cases 64 --out docs/study

bench: $(STAMP)
	$(PY) -m benchmarks.run

# decode at 4k and 16k context (SmolLM2) and one 7B-class attention layer up to 32k: about 15 min on one thread
bench-long: $(STAMP)
	$(PY) -m benchmarks.long_context --contexts 4096 16384 --reps 5 --long-reps 3 --new-tokens 8 \
		--layer-contexts 4096 16384 32768 --layer-reps 7

# vLLM plugin: its own venv (requirements-vllm.txt says why), the model converted once by the main venv.
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed

$(VSTAMP): requirements-vllm.txt pyproject.toml
	test -x $(VPY) || python3 -m venv $(VVENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-vllm.txt
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(VSTAMP)

test-vllm: $(STAMP) $(VSTAMP)
	$(PY) -c "from witcert.integrations.hf.default_model import load_model; load_model()"
	$(VPY) -m pytest -q tests/vllm

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info .pytest_cache .hypothesis
