#!/usr/bin/env bash
# GPU tests and benchmarks (issues 4, 11, 16). Each step runs under its own time limit and logs to $OUT (default
# ./gpu-logs); a failing step does not stop the others. The exit status is the number of steps that failed.
# Usage: bash ci/gpu.sh [steps...]   (steps: info tests allreduce dispatch train_lm digits send_tests send, which
# need 2 GPUs, and tests1 compiled train_lm_compiled, which run on one GPU)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
steps=${*:-info tests allreduce dispatch train_lm digits send_tests send}
failed=0
run() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
for step in $steps; do
    case $step in
        info) run info 60 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'" ;;
        tests) run tests 420 $PY -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_actors.py -rA -p no:cacheprovider ;;
        allreduce) run allreduce 300 $PY bench/allreduce.py ;;
        dispatch) run dispatch 300 $PY bench/dispatch.py --device cuda ;;
        train_lm) run train_lm 300 $PY bench/train_lm.py ;;
        digits) run digits 300 $PY examples/train_digits.py --device cuda --workers 2 ;;
        send_tests) run send_tests 420 $PY -m pytest -q -m gpu tests/test_gpu_send.py -rA -p no:cacheprovider ;;
        send) run send 300 $PY bench/send.py --device cuda ;;
        tests1) run tests1 420 $PY -m pytest -q -m gpu tests/test_gpu_compile.py tests/test_gpu_release.py tests/test_gpu_sharing.py tests/test_gpu_dashboard.py -rA -p no:cacheprovider ;;
        compiled) run compiled 300 $PY bench/compiled.py --device cuda ;;
        train_lm_compiled) run train_lm_compiled 420 $PY bench/train_lm.py --compiled ;;
        *) echo "unknown step $step"; failed=$((failed + 1)) ;;
    esac
done
exit $failed
