#!/bin/bash
# Builds and runs the GPU model tests and the GPU runtime's decode benchmark on the lent GPU
# machine, logs under $OUT. Run from the repository root after `source .devdeps/unpack-deps.sh`.
#   PHASES: any of "test decode generate prefill longprefill chunks halves aggregate rows
#     graphs" (default "test decode"); chunks: the prompt rate at chunks of 512 and 2048 tokens
#     (Mixtral, Qwen3, 8 layers);
#     prefill: the prompt rate with and without expert streaming (Qwen3, Mixtral); longprefill:
#     a 32K prompt spilling into P and U (G capped at 4K tokens), its U attended by the CPU and
#     by the GPU; halves: decode batches in layer halves against whole layers (Qwen3 128K x 16,
#     experts split and all on the GPU); aggregate: the largest aggregate context of 128K-token
#     sequences each model of AGG_MODELS (default all three; ~2-3 min each) holds at its full
#     depth under the 32 GiB VRAM budget, decoding
#   rows: decode with the host experts split by rows with the GPU against the CPU alone
#     (Mixtral and Qwen3, 8 layers, 8K, batches 1 and 4); graphs: decode at full depth, 32K x 1,
#     with CUDA graphs and with every kernel launched, alternating (Qwen3 and DeepSeek; the
#     files are many: tar them under $OUT, at most 8 files come back);
#   router: 4-layer decode (context 1024, batches 1 and 4, every expert on the GPU) with the
#     router kernel (--fused-router) and without it, alternating, ROUTER_ROUNDS rounds (default 3);
#   profile: the kernels of decode steps timed one by one under Nsight Compute (PROFILE_MODELS,
#     default the three; 4 layers, batch 1, every expert on the GPU and half of them, kernels
#     launched one by one), summed per kernel by tests/bench/kernel_times.py, beside the same
#     steps' times without the profiler (PROFILE_SHARES: the expert shares, default "1 0.5";
#     PROFILE_BATCH, PROFILE_CONTEXT: default 1 and 1024, e.g. 32768 for attention over a long G;
#     PROFILE_ARGS: more model-decode arguments, e.g. --fused-router);
#   GPU_TESTS: the GPU test programs the test phase runs (default: test-gpu-model-ops
#     test-gpu-runtime test-gpu; test-cpu-model always runs there)
#   DECODE_ARGS: extra arguments for model-decode (default: the three models, context 1024)
#   DECODE_MODES: ";"-separated model-decode modes (default: device-side, without graphs, staged, half the experts)
#   GENERATE_ARGS: arguments for generate (its default depth is the most layers each
#     configuration's host memory holds: one model per call keeps a call within 10 minutes, e.g.
#     GENERATE_ARGS="--models qwen3-30b-a3b --steps 4 --json $OUT/generate-qwen3-30b-a3b.json";
#     a full Mixtral (five depths) takes ~11 minutes: run its 128K x 16 apart with
#     "--contexts 128K --batches 16", the rest with "--batches 1,4" and "--batches 16 --contexts 8K,32K";
#     `writescope-bench generate --plan` prints the depths without a GPU)
# Times on the H200 machine: build ~90 s, tests ~2 min, decode ~1 min per mode. A machine idle
# for 30 s is given back, and the next call builds again.
set -u
OUT=${OUT:-/tmp/ws-out}
mkdir -p "$OUT"
PHASES=${PHASES:-"test decode"}
B=${BUILD_DIR:-/tmp/ws-gpu-build}
t0=$(date +%s)
# The test binaries only when the tests run (a bench-only call builds less).
targets=(writescope-bench)
# test-cpu-model too: the H200's host has AMX, which the CI machines lack (its tile path).
if [[ $PHASES == *test* ]]; then targets+=(test-gpu test-gpu-model-ops test-gpu-runtime test-cpu-model); fi
if ! cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_DAEMON=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 ||
   ! ninja -C "$B" "${targets[@]}" >> "$OUT/build.log" 2>&1; then
  grep -E "error|warning" "$OUT/build.log" | head -30
  tail -10 "$OUT/build.log"
  exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
BENCH="$B/tests/bench/writescope-bench"
if [[ $PHASES == *test* ]]; then
  for t in ${GPU_TESTS:-test-gpu-model-ops test-gpu-runtime test-gpu}; do
    "$B/tests/gpu/$t" > "$OUT/$t.txt" 2>&1
    echo "$t rc=$?"
    tail -n 2 "$OUT/$t.txt"
  done
  "$B/tests/cpu_model/test-cpu-model" > "$OUT/test-cpu-model.txt" 2>&1
  echo "test-cpu-model rc=$? ($(grep -m1 -o 'amx[a-z0-9-]*' "$OUT/test-cpu-model.txt" || echo 'no AMX'))"
  tail -n 2 "$OUT/test-cpu-model.txt"
fi
if [[ $PHASES == *decode* ]]; then
  modes=("--gpu 1" "--gpu 1 --no-graphs" "--gpu 1 --staged" "--gpu 0.5")
  if [[ -n ${DECODE_MODES:-} ]]; then IFS=';' read -r -a modes <<< "$DECODE_MODES"; fi
  for mode in "${modes[@]}"; do
    tag=$(echo "$mode" | tr -d ' -' )
    # shellcheck disable=SC2086
    "$BENCH" model-decode $mode ${DECODE_ARGS:-} --json "$OUT/model-decode-$tag.json" \
      > "$OUT/model-decode-$tag.txt" 2>&1
    echo "model-decode $mode rc=$?"
    grep -E "ms/step|attention|step / limit|ceiling" "$OUT/model-decode-$tag.txt"
  done
fi
if [[ $PHASES == *generate* ]]; then
  # shellcheck disable=SC2086
  "$BENCH" generate ${GENERATE_ARGS:-} > "$OUT/generate.txt" 2>&1
  echo "generate rc=$?"
  tail -n 40 "$OUT/generate.txt"
fi
if [[ " $PHASES " == *" prefill "* ]]; then
  "$BENCH" generate --models qwen3-30b-a3b,mixtral-8x7b --layers 2 --contexts 8K --batches 1 \
    --modes writescope --steps 4 --prefill 2048 > "$OUT/generate-prefill.txt" 2>&1
  echo "prefill rc=$?"
  grep -E "prefill|placement" "$OUT/generate-prefill.txt"
fi
if [[ $PHASES == *chunks* ]]; then
  # The prompt chunk (model.prefill_chunk_tokens): 512 against 2048 tokens, 8 layers, the host
  # experts streamed once per layer and chunk whatever its length.
  for m in mixtral-8x7b qwen3-30b-a3b; do
    for c in 512 2048; do
      "$BENCH" generate --models "$m" --layers 8 --contexts 8K --batches 1 --modes writescope \
        --steps 1 --prefill 4096 --prefill-chunk $c > "$OUT/generate-chunk-$m-$c.txt" 2>&1
      echo "prompt chunk $c, $m rc=$?"
      grep -E "prefill 4096|prefill's host" "$OUT/generate-chunk-$m-$c.txt" | cut -c1-300
    done
  done
fi
if [[ $PHASES == *longprefill* ]]; then
  for u in cpu gpu; do
    "$BENCH" generate --models qwen3-30b-a3b --layers 2 --contexts 8K --batches 1 \
      --modes writescope --steps 2 --prefill 32768 --prefill-g-tokens 4096 --prompt-u $u \
      > "$OUT/generate-longprefill-u-$u.txt" 2>&1
    echo "longprefill U on the $u rc=$?"
    grep -E "tok/s|stored" "$OUT/generate-longprefill-u-$u.txt" | cut -c1-300
  done
fi
if [[ $PHASES == *aggregate* ]]; then
  for m in ${AGG_MODELS:-qwen3-30b-a3b mixtral-8x7b deepseek-v2-lite}; do
    "$BENCH" generate --models "$m" --contexts 8K --batches 1 --modes writescope --steps 2 \
      --prefill 512 --aggregate max --json "$OUT/generate-aggregate-$m.json" \
      > "$OUT/generate-aggregate-$m.txt" 2>&1
    echo "aggregate $m rc=$?"
    grep -E "layers per|largest" "$OUT/generate-aggregate-$m.txt" | cut -c1-400
  done
fi
if [[ $PHASES == *rows* ]]; then
  # Host experts split by rows with the GPU (it reads its rows in place) against the CPU alone:
  # decode at batches 1 and 4, 8 layers (ROWS_MODELS, ROWS_ARGS to change them).
  for m in ${ROWS_MODELS:-mixtral-8x7b qwen3-30b-a3b}; do
    for rows in off always auto; do
      # shellcheck disable=SC2086
      "$BENCH" generate --models "$m" --layers 8 --contexts 8K --batches 1,4 --modes writescope \
        --steps 6 --prefill 512 --expert-rows $rows ${ROWS_ARGS:-} \
        --json "$OUT/generate-rows-$m-$rows.json" > "$OUT/generate-rows-$m-$rows.txt" 2>&1
      echo "rows $rows, $m rc=$?"
      grep -E "ctx|split by rows|host experts per step" "$OUT/generate-rows-$m-$rows.txt" | cut -c1-260
    done
  done
fi
if [[ $PHASES == *halves* ]]; then
  for lp in always off; do
    "$BENCH" generate --models qwen3-30b-a3b --layers 2 --contexts 128K --batches 16 \
      --modes writescope,writescope-all-gpu --steps 4 --prefill 512 --layer-parts $lp \
      > "$OUT/generate-halves-$lp.txt" 2>&1
    echo "halves $lp rc=$?"
    grep -E "ctx|tracked" "$OUT/generate-halves-$lp.txt"
  done
fi
if [[ $PHASES == *router* ]]; then
  for r in $(seq "${ROUTER_ROUNDS:-3}"); do
    for v in fused unfused; do
      flag=""
      if [[ $v == fused ]]; then flag="--fused-router"; fi
      # shellcheck disable=SC2086
      "$BENCH" model-decode --models qwen3-30b-a3b,deepseek-v2-lite,mixtral-8x7b --layers 4 \
        --batch 1,4 --context 1024 --gpu 1 --steps 16 $flag > "$OUT/router-$v-$r.txt" 2>&1
      echo "router $v round $r rc=$?"
      grep -E "ms/step" "$OUT/router-$v-$r.txt" | cut -c1-160
    done
  done
fi
if [[ $PHASES == *graphs* ]]; then
  # Decode at full depth with CUDA graphs (split layers recorded around their host part)
  # against every kernel launched, in the order on, off, off, on so that the host memory's
  # drift falls on both (GRAPHS_MODELS, GRAPHS_ARGS to change them; ~45 s a Qwen3 run).
  for m in ${GRAPHS_MODELS:-qwen3-30b-a3b deepseek-v2-lite}; do
    i=0
    for g in on off off on; do
      i=$((i + 1))
      flag=""
      if [[ $g == off ]]; then flag="--no-graphs"; fi
      # shellcheck disable=SC2086
      "$BENCH" generate --models "$m" --contexts 32K --batches 1 --modes writescope --steps 6 \
        --prefill 512 $flag ${GRAPHS_ARGS:-} --json "$OUT/generate-graphs-$m-$i-$g.json" \
        > "$OUT/generate-graphs-$m-$i-$g.txt" 2>&1
      echo "graphs $g ($i), $m rc=$?"
      grep -E "ceilings|tok/s" "$OUT/generate-graphs-$m-$i-$g.txt" | cut -c1-260
    done
  done
fi
if [[ $PHASES == *profile* ]]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for m in ${PROFILE_MODELS:-qwen3-30b-a3b mixtral-8x7b deepseek-v2-lite}; do
    for share in ${PROFILE_SHARES:-1 0.5}; do
      # shellcheck disable=SC2206
      args=(model-decode --models "$m" --layers 4 --batch "${PROFILE_BATCH:-1}"
        --context "${PROFILE_CONTEXT:-1024}"
        --gpu "$share" --no-graphs --steps 4 ${PROFILE_ARGS:-})
      "$BENCH" "${args[@]}" > "$OUT/profile-$m-$share-plain.txt" 2>&1
      grep -E "ms/step" "$OUT/profile-$m-$share-plain.txt" | cut -c1-120
      "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv "$BENCH" "${args[@]}" > "$OUT/profile-$m-$share-ncu.csv" 2> "$OUT/profile-$m-$share-ncu.err"
      echo "ncu $m --gpu $share rc=$?"
      python3 tests/bench/kernel_times.py "$OUT/profile-$m-$share-ncu.csv" 4 4 \
        > "$OUT/profile-$m-$share-kernels.txt" 2>&1
      head -n 30 "$OUT/profile-$m-$share-kernels.txt"
    done
  done
fi
