# The two device calls of the G-share runs (2026-12-03), as run: exp/call-gshare.sh, then exp/call-auto.sh.
# ---- call-gshare.sh
#!/bin/bash
# Device call (2026-12-03 evening): the G share's prediction, Qwen3 at full depth.
set -u
t0=$(date +%s)
B=/tmp/ws-gpu-build
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_DAEMON=OFF -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 &&
ninja -C $B writescope-bench >> "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
BENCH=$B/tests/bench/writescope-bench
run() { # tag g ctx batch steps
  timeout 200 $BENCH generate --models qwen3-30b-a3b --contexts $3 --batches $4 --modes writescope,gpu-only \
    --steps $5 --g-share $2 --json "$OUT/gen-$1.json" > "$OUT/gen-$1.txt" 2>&1
  echo "== $1 rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "placement|tok/s|profiled|-> |host experts" "$OUT/gen-$1.txt" | head -12
}
run 128k1-g45 0.45 128K 1 6
run 128k1-g25 0.25 128K 1 6
run 32k4-g45 0.45 32K 4 4
run 32k4-g25 0.25 32K 4 4
cd "$OUT" && tar czf logs.tgz *.txt *.log 2>/dev/null; ls
# ---- call-auto.sh
#!/bin/bash
# Device call (2026-12-03 evening): the auto KV's engine test on the GPU, and a short-context
# workload with G at the old daemon default (~16 GiB, share 0.60) against what "auto" gives it.
set -u
t0=$(date +%s)
B=/tmp/ws-gpu-build
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_DAEMON=OFF -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 &&
ninja -C $B writescope-bench test-gpu >> "$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -30; tail -5 "$OUT/build.log"; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
$B/tests/gpu/test-gpu "the engine on a GPU*" > "$OUT/test-gpu-engine.txt" 2>&1
echo "test-gpu engine rc=$?"; grep -E "auto KV|seed|passed|failed" "$OUT/test-gpu-engine.txt" | head -12
BENCH=$B/tests/bench/writescope-bench
for g in 0.06 0.60; do
  timeout 240 $BENCH generate --models qwen3-30b-a3b --contexts 4K --batches 1,4 --modes writescope \
    --steps 6 --g-share $g --json "$OUT/gen-4k-g$g.json" > "$OUT/gen-4k-g$g.txt" 2>&1
  echo "== g $g rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "ceilings|placement|tok/s|profiled|host experts per" "$OUT/gen-4k-g$g.txt" | head -12
done
cd "$OUT" && tar czf logs.tgz *.txt *.log 2>/dev/null; ls
#!/bin/bash
# Device call: Mixtral 128K x 1 at full depth (31 layers), G share 0.57 (G holds the KV) against 0.25.
set -u
t0=$(date +%s)
B=/tmp/ws-gpu-build
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_DAEMON=OFF -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 &&
ninja -C $B writescope-bench >> "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
for g in 0.57 0.25; do
  timeout 270 $B/tests/bench/writescope-bench generate --models mixtral-8x7b --contexts 128K --batches 1 \
    --modes writescope --steps 4 --g-share $g --json "$OUT/gen-mixtral-128k1-g$g.json" > "$OUT/gen-mixtral-128k1-g$g.txt" 2>&1
  echo "== g $g rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "ceilings|placement|tok/s|profiled|host experts per" "$OUT/gen-mixtral-128k1-g$g.txt" | head -10
done
