#!/usr/bin/env bash
# Build llama.cpp's own benchmark tools (llama-bench, llama-batched-bench) from source for
# this machine, as the peer the GPU benchmarks compare with.
#
#   bench/llamacpp_build.sh SOURCE BUILD_DIR [cuda|cpu]
#
# SOURCE: a llama.cpp source tree or tarball (.tar.gz / .tar.xz; the llama-cpp-python sdist
# carries one as vendor/llama.cpp). cuda (default): -DGGML_CUDA=ON for the GPU found here
# (CUDA_ARCH, default 90: Hopper); cpu: the x86 vector extensions this host's CPU flags list
# (AVX, AVX2, FMA, F16C, BMI2, AVX-512 F/VBMI/VNNI/BF16, AVX-VNNI), switched on one by one with
# GGML_NATIVE off; never AMX: -march=native would define AMX's macros on a CPU that has it,
# and ggml would then use tiles that fault in VMs whose kernel does not grant them (SIGILL).
# Only the two targets are built (about 3 minutes on 16 cores with CUDA). The tools land in
# BUILD_DIR/bin; the build's log in BUILD_DIR/build.log.
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
    cpu)
        flags+=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
        for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 \
                    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
                    avx_vnni:AVX_VNNI; do
            [[ $have == *" ${pair%%:*} "* ]] && on=ON || on=OFF
            flags+=("-DGGML_${pair#*:}=$on")
        done
        ;;
    *) echo "kind must be cuda or cpu, not $KIND" >&2; exit 1 ;;
esac
start=$SECONDS
{
    cmake -S "$SRC" -B "$BUILD" "${flags[@]}"
    cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench
} >"$BUILD/build.log" 2>&1 || { tail -n 40 "$BUILD/build.log" >&2; exit 1; }
echo "llama.cpp ($KIND) built in $((SECONDS - start)) s: $BUILD/bin/llama-bench, $BUILD/bin/llama-batched-bench"
