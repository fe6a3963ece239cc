# syntax=docker/dockerfile:1
# Strata on NVIDIA GPUs (CUDA). Build from the repository root:
#   docker build -f containers/cuda.Dockerfile -t strata:cuda .
# Run (needs the NVIDIA Container Toolkit; docs/operations.md explains each flag):
#   docker run -d --name stratad --gpus all \
#     --ulimit memlock=-1 --shm-size 8g \
#     -p 8080:8080 \
#     -v /srv/models:/models:ro -v strata-state:/var/lib/strata \
#     -e STRATA_MODEL=/models/model.gguf \
#     strata:cuda
# CUDA_VERSION picks the base image and TORCH_INDEX the matching torch build; the kernel
# tuning table is chosen at start from the CUDA actually installed (stratactl tables select).
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/strata/venv/bin:${PATH}

# Triton compiles a small C launcher at run time: it needs a compiler and Python's headers.
# The distribution's current packages, as the base image pins its release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential pkg-config libsystemd-dev cmake \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 strata \
    && useradd --system --uid 10001 --gid strata --home-dir /var/lib/strata --shell /usr/sbin/nologin strata \
    && install -d -o strata -g strata -m 0750 /var/lib/strata /var/lib/strata/tables /run/strata

COPY . /opt/strata/src
# torch for CUDA first, then the project's own install script (it keeps that torch).
RUN python3 -m venv /opt/strata/venv \
    && /opt/strata/venv/bin/pip install --index-url "${TORCH_INDEX}" torch \
    && VENV=/opt/strata/venv /opt/strata/src/scripts/install.sh

COPY containers/stratad.container.toml /etc/strata/stratad.toml
COPY containers/entrypoint.sh /usr/local/bin/strata-entrypoint

USER 10001:10001
WORKDIR /var/lib/strata
EXPOSE 8080
# A large model loads and pins for minutes: the start period covers it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["/opt/strata/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]
ENTRYPOINT ["/usr/local/bin/strata-entrypoint"]
CMD []
