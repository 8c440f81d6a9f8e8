# ckptzip on a CUDA runtime: PyTorch, nvCOMP and ckptzip[gpu-cu13]; the default command runs the demo.
#   docker build -t ckptzip .
#   docker run --rm --gpus all ckptzip                      # ckptzip demo on the GPU
#   docker run --rm --gpus all -v "$PWD:/data" ckptzip ckptzip compress /data/model.pt /data/model.ckz
# For CUDA 12: --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 --build-arg CKPTZIP_EXTRAS=gpu
# plus a TORCH_SPEC naming a CUDA 12 build of torch (pip arguments, e.g. "--index-url URL torch==X").
# The install steps are docker/install.sh (tested in CI).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# Triton (the fused byte-plane kernels) compiles its launcher with gcc against Python's headers.
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/ckptzip
COPY pyproject.toml setup.py README.md ./
COPY src src
COPY docker/install.sh docker/install.sh
ARG TORCH_SPEC="torch==2.13.0"
ARG CKPTZIP_EXTRAS=gpu-cu13
RUN PYTHON=/opt/venv/bin/python TORCH_SPEC="$TORCH_SPEC" CKPTZIP_EXTRAS="$CKPTZIP_EXTRAS" docker/install.sh /opt/ckptzip
# Triton's cache key, kept in the image: a container's first save does not hash Triton (0.5-1.4 s)
ENV CKPTZIP_CACHE_DIR=/opt/ckptzip-cache
RUN ckptzip warmup

WORKDIR /data
CMD ["ckptzip", "demo"]
