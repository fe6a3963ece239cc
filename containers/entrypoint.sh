#!/bin/sh
# Container entrypoint: pick the kernel tuning table for this GPU stack, run the pre-start
# check, then exec stratad (PID 1 stays stratad: it gets SIGTERM and drains).
#   docker run ... strata:rocm                    -> tables select, check, stratad
#   docker run ... strata:rocm --port 9000        -> the same, with stratad's own flags
#   docker run ... strata:rocm stratactl status   -> that command only (also sh, bash, python)
set -eu

case "${1:-}" in
    stratactl | stratad | sh | bash | python | python3)
        exec "$@"
        ;;
esac

echo "entrypoint: selecting the kernel tuning table"
rc=0
stratactl tables select || rc=$?
case "$rc" in
    0) ;;
    3) echo "entrypoint: WARNING: no tuning table matches this GPU stack; stratad runs with" \
            "default kernel launch settings (slower). See docs/AMD_HIP.md." >&2 ;;
    *) echo "entrypoint: WARNING: could not detect the GPU stack (stratactl tables select" \
            "exit $rc): are /dev/kfd and /dev/dri (or --gpus) passed to the container?" >&2 ;;
esac

echo "entrypoint: stratactl check"
rc=0
stratactl check || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "entrypoint: stratactl check failed (exit $rc): not starting stratad" >&2
    exit "$rc"
fi

exec stratad "$@"
