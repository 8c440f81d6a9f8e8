# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The torch of .venv: a CPU build is enough for the demo and the tests. PyPI's Linux wheel is the
# CUDA build (several GB of CUDA libraries besides), so on Linux torch alone comes from PyTorch's
# CPU index (TORCH_INDEX; a wheel pip finds locally, through find-links, serves as well); its
# other requirements come from PyPI with ckptzip's. TORCH= keeps the torch $(PYTHON) has: .venv is
# then made with --system-site-packages, so that it sees it.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= $(if $(filter Linux,$(shell uname -s)),https://download.pytorch.org/whl/cpu)
BIN := $(VENV)/bin

.PHONY: demo test install torch kernels

$(BIN)/python:
	$(if $(TORCH),,$(PYTHON) -c "import torch" 2>/dev/null || { echo "TORCH= keeps the torch of $(PYTHON), which has none; leave TORCH out to install a CPU build"; exit 1; })
	$(PYTHON) -m venv $(if $(TORCH),,--system-site-packages) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch before ckptzip, so that ckptzip's `torch>=2.3` is met by it and asks no index for another;
# with TORCH=, only a check that .venv sees a torch (one made without TORCH= does not)
torch: $(BIN)/python
	$(if $(TORCH),$(BIN)/python -m pip install --no-deps $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --retries 1) "$(TORCH)",$(BIN)/python -c "import torch" 2>/dev/null || { echo "TORCH=: $(VENV) sees no torch: it sees the torch of $(PYTHON)'s installation, not a virtual environment's own, and one made before without TORCH= sees none (remove it)"; exit 1; })

install: torch
	$(BIN)/python -m pip install -q -e ".[test]"
	# the benchmark harness, a distribution of its own (bench/pyproject.toml): `ckptzip bench`
	$(BIN)/python -m pip install -q --no-deps -e bench
	# torchtitan without its requirements, which would replace the CPU torch above (its tests need none of them)
	$(BIN)/python -c "import sys; sys.exit(sys.version_info < (3, 11))" && $(BIN)/python -m pip install -q --no-deps "torchtitan==0.3.0" || true
	# torchtitan 0.2 (the one torch 2.11 runs) in a folder of its own, for its tests (they put it first on the path)
	$(BIN)/python -c "import sys; sys.exit(sys.version_info < (3, 11))" && $(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/torchtitan-0.2 "torchtitan==0.2.2" "torchdata==0.11.0" || true

demo: torch
	$(BIN)/python -m pip install -q -e .
	$(BIN)/ckptzip demo

test: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy  # strict on src/ckptzip and bench/ckptzip_bench ([tool.mypy] in pyproject.toml)
	$(BIN)/python -m pytest -q
	# the engine again and the ckz-huff coder, their Triton kernels run by Triton's interpreter on the CPU
	$(if $(wildcard $(VENV)/lib/python*/site-packages/triton),TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/engine/test_engine.py tests/kernels/test_parts_sum.py tests/kernels/test_ckzhuff_kernels.py)

# The GPU kernels compiled ahead of time for the GPUs in ckptzip/kernels/_build.py's ARCHS (Triton's
# compiler, no GPU needed): run after changing a Triton kernel; a test fails until then.
kernels: install
	$(BIN)/python -m ckptzip.kernels._build
