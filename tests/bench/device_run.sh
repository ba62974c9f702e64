#!/bin/bash
# Builds and runs the CPU attention tests and the cpu-attention benchmark on the lent machine's
# CPU, writing logs and JSON under $OUT (docs/perf.md records what came back). Run from the
# repository root after `source .devdeps/unpack-deps.sh`.
#   PHASES: any of "test full variants scaling" (default: all)
set -u
OUT=${OUT:-/tmp/ws-out}
mkdir -p "$OUT"
PHASES=${PHASES:-"test full variants scaling"}
THREADS=${THREADS:-$(nproc)}
B=build/device
{ date -u; lscpu; echo "nproc: $(nproc)"; free -g;
  echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"; g++ --version | head -1; } \
  > "$OUT/machine.txt" 2>&1
grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L2|L3|NUMA node\(s\)" "$OUT/machine.txt"

cfg="-G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_WERROR=ON"
# At most 8 files come back from $OUT: configure and build share one log.
if ! cmake -S . -B $B $cfg -DWRITESCOPE_CUDA=OFF -DWRITESCOPE_BUILD_DAEMON=OFF \
    > "$OUT/build.log" 2>&1; then
  echo "whole-tree configure failed (tail below); using tests/bench/standalone"
  tail -5 "$OUT/build.log"
  B=build/device-standalone
  cmake -S tests/bench/standalone -B $B $cfg >> "$OUT/build.log" 2>&1 || {
    tail -30 "$OUT/build.log"; exit 1; }
fi
t0=$(date +%s)
cmake --build $B --target test-cpu writescope-bench -j"$(nproc)" >> "$OUT/build.log" 2>&1 || {
  grep -E "error|warning" "$OUT/build.log" | head -30; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
BENCH=$(find $B -name writescope-bench -type f | head -1)
TEST=$(find $B -name test-cpu -type f | head -1)

if [[ $PHASES == *test* ]]; then
  "$TEST" > "$OUT/test.log" 2>&1
  echo "test-cpu rc=$?"
  grep -E "AMX|passed|failed|FAILED" "$OUT/test.log" | head -20
fi
if [[ $PHASES == *full* ]]; then
  "$BENCH" cpu-attention --threads "$THREADS" --json "$OUT/full.json" > "$OUT/full.log" 2>&1
  echo "full rc=$?"; cat "$OUT/full.log"
fi
if [[ $PHASES == *variants* ]]; then
  # A/B of the choices, each on the two qwen3 32K points (and MLA for AMX).
  q="--models qwen3-30b-a3b --tokens 32768 --batches 1,16 --no-hot --threads $THREADS"
  {
  for v in "" "--no-amx" "--amx-pv" "--no-prefetch" "--no-huge-pages"; do
    echo "== variant: ${v:-defaults}"
    "$BENCH" cpu-attention $q $v 2>&1 | grep -E "read bandwidth|^qwen3|kernel|check|error"
  done
  m="--models deepseek-v2-lite,mixtral-8x7b --tokens 32768 --batches 1,16 --threads $THREADS"
  for v in "--no-amx" "--amx-pv"; do
    echo "== variant: MLA, Mixtral $v"
    "$BENCH" cpu-attention $m $v 2>&1 | grep -E "read bandwidth|^deepseek|^mixtral|kernel|check|error|per core"
  done
  } > "$OUT/variants.log" 2>&1
  cat "$OUT/variants.log"
fi
if [[ $PHASES == *scaling* ]]; then
  "$BENCH" cpu-attention --models qwen3-30b-a3b --tokens 8192 --batches 1 --no-hot --scaling \
    --threads "$THREADS" --json "$OUT/scaling.json" > "$OUT/scaling.log" 2>&1
  echo "scaling rc=$?"; sed -n '/thread scaling/,$p' "$OUT/scaling.log"
fi
