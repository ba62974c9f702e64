#!/bin/bash
# The hidden stress case of test-gpu-runtime ("the rows split's runtimes, repeated") on a GPU
# machine, optionally beside busy loops that load every CPU (a wider window for any race
# between the host's threads and the stream). Run from the repository root after a build.
#   TEST      the test binary (default build/release/tests/gpu/test-gpu-runtime)
#   SECONDS_EACH  seconds per variant (default 60)
#   VARIANTS  any of: default no-graphs no-pdl rows-off (default: default)
#   HOGS      busy loops beside it (default 0)
#   OUT       where the logs go (default /tmp/ws-stress)
# Prints one line per variant: the prompts past the bound of all the runtimes it ran.
set -u
TEST=${TEST:-build/release/tests/gpu/test-gpu-runtime}
OUT=${OUT:-/tmp/ws-stress}
mkdir -p "$OUT"
export WRITESCOPE_SOURCE_DIR=${WRITESCOPE_SOURCE_DIR:-$PWD}
pids=()
# shellcheck disable=SC2317  # called by the trap
cleanup() { [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq "${HOGS:-0}"); do
  (while :; do :; done) &
  pids+=($!)
done
rc=0
for v in ${VARIANTS:-default}; do
  WRITESCOPE_STRESS_VARIANT=$v WRITESCOPE_STRESS_SECONDS=${SECONDS_EACH:-60} \
    "$TEST" "[gpu-stress]" > "$OUT/stress-$v.txt" 2>&1 || rc=1
  grep "failing prompts" "$OUT/stress-$v.txt" || echo "$v: no summary (see $OUT/stress-$v.txt)"
  grep BAD "$OUT/stress-$v.txt" | head -5
done
exit $rc
