#!/bin/bash
# Builds writescoped and writescopectl on the lent GPU machine and serves the built-in model
# there: the GPU engine and the GPU model runtime (placement in the status), a few greedy
# completions through writescopectl, the status and the metrics, written under $OUT. Run from
# the repository root after `source .devdeps/unpack-deps.sh`, with .devdeps fetched (the tool
# library's fetch-deps.sh) with the text layer's libraries too: fetch-deps.sh libpcre2-dev
# libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libicu-dev libicu72
#   MODEL: the built-in preset or a checkpoint directory (default qwen3-30b-a3b); LAYERS
#   (default 2; 0: all); TOKENS (default 64); GPU: hardware.gpu as TOML, e.g. GPU='"auto"' or GPU=0
#   (default: the profile's, "auto");
#   PROMPT_TOKENS: the completions' prompt length (default 8; long prompts exercise the prefill's
#   expert streaming when experts are left on the CPU)
#   VRAM_BUDGET, VRAM_KV_BUDGET: hardware.vram_budget and vram_kv_budget (default: the
#   profile's); a small VRAM_BUDGET leaves experts on the CPU (and a first start measures the
#   routing). RESTARTS: start the daemon this many times over the same state (default 1).
#   FAULT_AT_STEP: builds with -DWRITESCOPE_FAULT_INJECTION=ON and makes decode step N fault the
#   GPU (WRITESCOPE_INJECT_GPU_FAULT=N, a real illegal-address fault): completion 1 must end
#   before it; completions 2 and 3 run at once over it and must both fail with 503 naming
#   cudaErrorIllegalAddress; then the daemon must stop on its own with exit status 1.
set -u
OUT=${OUT:-/tmp/ws-out}
mkdir -p "$OUT"
B=${BUILD_DIR:-/tmp/ws-gpu-daemon}
MODEL=${MODEL:-qwen3-30b-a3b}
LAYERS=${LAYERS:-2}
TOKENS=${TOKENS:-64}
# ICU's .pc files write "prefix = /usr" (spaces), which unpack-deps.sh's rewrite misses.
sed -i 's#^prefix *= */usr$#prefix=/opt/deps/usr#' /opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
t0=$(date +%s)
if ! cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DWRITESCOPE_DAEMON_GPU_MODEL=ON -DWRITESCOPE_FAULT_INJECTION=${FAULT_AT_STEP:+ON} \
    > "$OUT/daemon-build.log" 2>&1 ||
   ! ninja -C "$B" writescoped writescopectl >> "$OUT/daemon-build.log" 2>&1; then
  grep -E "error|Could NOT|not found" "$OUT/daemon-build.log" | head -20
  tail -5 "$OUT/daemon-build.log"
  exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
S=/tmp/ws-state
rm -rf "$S"; mkdir -p "$S"
cat > "$S/profile.toml" <<TOML
[model]
source = "$MODEL"
layers = $LAYERS
TOML
if [[ -n ${VRAM_BUDGET:-} || -n ${VRAM_KV_BUDGET:-} || -n ${GPU:-} ]]; then
  echo "[hardware]" >> "$S/profile.toml"
  [[ -n ${GPU:-} ]] && echo "gpu = $GPU" >> "$S/profile.toml"
  [[ -n ${VRAM_BUDGET:-} ]] && echo "vram_budget = \"$VRAM_BUDGET\"" >> "$S/profile.toml"
  [[ -n ${VRAM_KV_BUDGET:-} ]] && echo "vram_kv_budget = \"$VRAM_KV_BUDGET\"" >> "$S/profile.toml"
fi
CTL="$B/daemon/writescopectl --socket $S/writescoped.sock"
for run in $(seq 1 "${RESTARTS:-1}"); do
echo "start $run"
WRITESCOPE_INJECT_GPU_FAULT=${FAULT_AT_STEP:-} "$B/daemon/writescoped" --config "$S/profile.toml" --state-dir "$S" --socket "$S/writescoped.sock" \
  > "$OUT/daemon.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  $CTL health > /dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "the daemon exited"; tail -20 "$OUT/daemon.log"; exit 1; }
  sleep 0.5
done
echo "ready after $(( $(date +%s) - t0 )) s"
$CTL status > "$OUT/daemon-status.txt" 2>&1
$CTL --json status > "$OUT/daemon-status.json" 2>&1
# The prompt's ids stay inside the vocabulary (a checkpoint directory's config.json, else 30000).
VOCAB=30000
[[ -f $MODEL/config.json ]] &&
  VOCAB=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
IDS=$(python3 -c "print(','.join(str(1 + (i * 7919) % ($VOCAB - 1)) for i in range(${PROMPT_TOKENS:-8})))")
# One greedy completion of the prompt, its answer in $OUT/complete-$1.json.
run_completion() {
  $CTL --json complete --prompt-ids "$IDS" --max-tokens "$TOKENS" --temperature 0 \
    --ignore-eos > "$OUT/complete-$1.json" 2>&1
}
if [[ -n ${FAULT_AT_STEP:-} ]]; then
  run_completion 1
  echo "completion 1 (before the fault): rc $?"
  clients=()
  for i in 2 3; do
    run_completion $i &
    clients+=($!)
  done
  wait "${clients[@]}"
  for i in 2 3; do
    echo "completion $i (over the fault): $(head -c 400 "$OUT/complete-$i.json")"
  done
  $CTL status > "$OUT/daemon-status-fault.txt" 2>&1
  echo "status after the fault: rc $?, $(grep -i fault "$OUT/daemon-status-fault.txt" | head -2)"
  for _ in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  if kill -0 $pid 2>/dev/null; then
    echo "the daemon did not stop on its own within 30 s"; kill -TERM $pid
  fi
  wait $pid
  echo "daemon exit $? (on its own)"
  grep -E "fault|error|stopp" "$OUT/daemon.log" | head -20
  mv "$OUT/daemon.log" "$OUT/daemon-$run.log"
  continue
fi
for i in 1 2 3; do
  s=$(date +%s.%N)
  run_completion $i
  echo "completion $i: rc $?, $(python3 -c "print(round($(date +%s.%N) - $s, 3))") s for $TOKENS tokens"
done
$CTL --json status > "$OUT/daemon-status-after.json" 2>&1
$CTL status > "$OUT/daemon-status-after.txt" 2>&1
python3 -c "import json; m=json.load(open('$OUT/daemon-status-after.json'))['model']; print('prompt chunk:', m.get('prefill_chunk_tokens'), 'tokens; prefill:', json.dumps(m['placement'].get('prefill')))" 2>&1
kill -TERM $pid; wait $pid
echo "daemon exit $?"
grep -E "model\.|engine\.|error|warning" "$OUT/daemon.log" | head -20
mv "$OUT/daemon.log" "$OUT/daemon-$run.log"
done
