#!/usr/bin/env bash
# The container's install steps: PyTorch, then ckptzip with its GPU extra (nvCOMP), then a check
# that both import. The Dockerfile runs it; tests/test_container.py runs it into a fresh virtual
# environment with a CPU torch, so the recipe is tested where no container engine runs.
#
#   docker/install.sh SOURCE_DIR
#
# Environment: PYTHON (default python3), TORCH_SPEC (pip arguments for torch, default
# "torch==2.13.0", the CUDA build on Linux), CKPTZIP_EXTRAS (default "gpu-cu13"; "gpu" for CUDA 12).
set -euo pipefail
src="${1:?usage: docker/install.sh SOURCE_DIR}"
python="${PYTHON:-python3}"
read -r -a torch_spec <<< "${TORCH_SPEC:-torch==2.13.0}"
extras="${CKPTZIP_EXTRAS:-gpu-cu13}"

"$python" -m pip install --upgrade pip
"$python" -m pip install "${torch_spec[@]}"
"$python" -m pip install "$src[$extras]"
"$python" - <<'PY'
import importlib.metadata as md

import torch

import ckptzip

cuda = torch.version.cuda
nvcomp = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("nvidia-libnvcomp-cu")]
print(f"ckptzip {ckptzip.__version__}, torch {torch.__version__} (CUDA {cuda}), nvCOMP: {nvcomp or 'none'}")
if cuda and nvcomp and not nvcomp[0].endswith(f"cu{cuda.split('.')[0]}"):
    raise SystemExit(f"torch is built for CUDA {cuda} but {nvcomp[0]} is installed: set CKPTZIP_EXTRAS to match")
PY
