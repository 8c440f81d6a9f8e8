# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# A CPU build is enough for the demo and the tests; set TORCH= to keep the torch you have.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test install kernels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[test]"
	# torchtitan without its requirements, which would replace the CPU torch above (its tests need none of them)
	$(BIN)/python -c "import sys; sys.exit(sys.version_info < (3, 11))" && $(BIN)/python -m pip install -q --no-deps "torchtitan==0.3.0" || true
	# torchtitan 0.2 (the one torch 2.11 runs) in a folder of its own, for its tests (they put it first on the path)
	$(BIN)/python -c "import sys; sys.exit(sys.version_info < (3, 11))" && $(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/torchtitan-0.2 "torchtitan==0.2.2" "torchdata==0.11.0" || true

demo: $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e .
	$(BIN)/ckptzip demo

test: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy  # strict on src/ckptzip and bench/ckptzip_bench ([tool.mypy] in pyproject.toml)
	$(BIN)/python -m pytest -q
	# the engine again, its Triton kernels run by Triton's interpreter on the CPU
	$(if $(wildcard $(VENV)/lib/python*/site-packages/triton),TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/engine/test_engine.py tests/kernels/test_parts_sum.py)

# The GPU kernels compiled ahead of time for the GPUs in ckptzip/kernels/_build.py's ARCHS (Triton's
# compiler, no GPU needed): run after changing a Triton kernel; a test fails until then.
kernels: install
	$(BIN)/python -m ckptzip.kernels._build
