#!/usr/bin/env bash
# Build llama.cpp's own benchmark tools (llama-bench, llama-batched-bench) from source for
# this machine, as the peer the GPU benchmarks compare with.
#
#   bench/llamacpp_build.sh SOURCE BUILD_DIR [cuda|cpu]
#
# SOURCE: a llama.cpp source tree or tarball (.tar.gz / .tar.xz; the llama-cpp-python sdist
# carries one as vendor/llama.cpp). cuda (default): -DGGML_CUDA=ON for the GPU found here
# (CUDA_ARCH, default 90: Hopper); cpu: the host's own instruction set (GGML_NATIVE; AMX off,
# its tiles fault in some VMs). Only the two targets are built (about 3 minutes on 16 cores
# with CUDA). The tools land in BUILD_DIR/bin; the build's log in BUILD_DIR/build.log.
set -euo pipefail
SRC=${1:?usage: bench/llamacpp_build.sh SOURCE BUILD_DIR [cuda|cpu]}
BUILD=${2:?usage: bench/llamacpp_build.sh SOURCE BUILD_DIR [cuda|cpu]}
KIND=${3:-cuda}
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
if [[ -f $SRC ]]; then
    mkdir -p "$BUILD/src"
    tar xf "$SRC" -C "$BUILD/src"
    # a llama.cpp tree at the archive's root, or in one top folder (the sdist: in its
    # vendor/llama.cpp)
    top=$BUILD/src
    [[ -f $top/CMakeLists.txt ]] || top=$(find "$BUILD/src" -mindepth 1 -maxdepth 1 -type d | head -1)
    [[ -d $top/vendor/llama.cpp ]] && top=$top/vendor/llama.cpp
    SRC=$top
fi
[[ -f $SRC/CMakeLists.txt && -d $SRC/ggml ]] || { echo "no llama.cpp tree at $SRC" >&2; exit 1; }
flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF)
case $KIND in
    cuda) flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" -DGGML_NATIVE=ON) ;;
    cpu) flags+=(-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "kind must be cuda or cpu, not $KIND" >&2; exit 1 ;;
esac
start=$SECONDS
{
    cmake -S "$SRC" -B "$BUILD" "${flags[@]}"
    cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench
} >"$BUILD/build.log" 2>&1 || { tail -n 40 "$BUILD/build.log" >&2; exit 1; }
echo "llama.cpp ($KIND) built in $((SECONDS - start)) s: $BUILD/bin/llama-bench, $BUILD/bin/llama-batched-bench"
