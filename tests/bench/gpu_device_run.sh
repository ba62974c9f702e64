#!/bin/bash
# Builds and runs the GPU tests and the hybrid-step benchmark on the lent GPU machine, writing
# logs and JSON under $OUT (docs/perf/attention-step.md records what came back). Run from the
# repository root (or a copy of it) after `source .devdeps/unpack-deps.sh`.
#   PHASES: any of "test kernel anatomy full" (default: "test full"); kernel = gpu-attention
#   BENCH_ARGS: extra arguments for every attention-step run (e.g. "--models qwen3-30b-a3b")
#   KERNEL_ARGS: arguments for the gpu-attention run
# Times on the H200 machine: build ~50 s, test ~40 s, anatomy ~20 s per model, full ~4 min.
set -u
OUT=${OUT:-/tmp/ws-out}
mkdir -p "$OUT"
PHASES=${PHASES:-"test full"}
BENCH_ARGS=${BENCH_ARGS:-}
B=${BUILD_DIR:-/tmp/ws-gpu-build}

t0=$(date +%s)
if ! cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_DAEMON=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 ||
   ! ninja -C "$B" test-gpu writescope-bench >> "$OUT/build.log" 2>&1; then
  grep -E "error|warning" "$OUT/build.log" | head -30
  tail -10 "$OUT/build.log"
  exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
BENCH="$B/tests/bench/writescope-bench"

if [[ $PHASES == *test* ]]; then
  "$B/tests/gpu/test-gpu" > "$OUT/gpu-tests.txt" 2>&1
  echo "test-gpu rc=$?"
  tail -2 "$OUT/gpu-tests.txt"
fi
if [[ $PHASES == *kernel* ]]; then
  # shellcheck disable=SC2086
  "$BENCH" gpu-attention ${KERNEL_ARGS:-} > "$OUT/gpu-attention.txt" 2>&1
  echo "gpu-attention rc=$?"
  cat "$OUT/gpu-attention.txt"
fi
if [[ $PHASES == *anatomy* ]]; then
  # shellcheck disable=SC2086
  "$BENCH" attention-step --anatomy --reps 5 --contexts 8K,128K --batches 1,16 $BENCH_ARGS \
    > "$OUT/anatomy.txt" 2>&1
  echo "anatomy rc=$?"
  grep -E "^pool|ceilings" "$OUT/anatomy.txt"
fi
if [[ $PHASES == *full* ]]; then
  # shellcheck disable=SC2086
  "$BENCH" attention-step --reps 5 --cpu-load --json "$OUT/attention-step.json" $BENCH_ARGS \
    > "$OUT/attention-step.txt" 2>&1
  echo "attention-step rc=$?"
  grep -E "ceilings|summary" "$OUT/attention-step.txt"
fi
