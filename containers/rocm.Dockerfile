# syntax=docker/dockerfile:1
# Strata on AMD GPUs (ROCm). Build from the repository root:
#   docker build -f containers/rocm.Dockerfile -t strata:rocm .
# Run (docs/operations.md explains each flag):
#   docker run -d --name stratad \
#     --device /dev/kfd --device /dev/dri \
#     --group-add "$(getent group video | cut -d: -f3)" \
#     --group-add "$(getent group render | cut -d: -f3)" \
#     --ulimit memlock=-1 --shm-size 8g \
#     -p 8080:8080 \
#     -v /srv/models:/models:ro -v strata-state:/var/lib/strata \
#     -e STRATA_MODEL=/models/model.gguf \
#     strata:rocm
# ROCM_VERSION picks the base image and TORCH_INDEX the matching torch build; the kernel
# tuning table is chosen at start from the ROCm actually installed (stratactl tables select).
ARG ROCM_VERSION=6.4.1
FROM rocm/dev-ubuntu-24.04:${ROCM_VERSION}

ARG TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/strata/venv/bin:${PATH}

# The distribution's current packages, as the base image pins its release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential pkg-config libsystemd-dev cmake \
    && rm -rf /var/lib/apt/lists/*

# The service user; render and video own /dev/kfd and /dev/dri on the host (pass their host
# GIDs with --group-add: the names inside the image need not match).
RUN groupadd --system --gid 10001 strata \
    && useradd --system --uid 10001 --gid strata --home-dir /var/lib/strata --shell /usr/sbin/nologin strata \
    && install -d -o strata -g strata -m 0750 /var/lib/strata /var/lib/strata/tables /run/strata

COPY . /opt/strata/src
# torch for ROCm first, then the project's own install script (it keeps that torch).
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
