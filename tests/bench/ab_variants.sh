#!/bin/bash
# A/B of code variants in one device call: the working tree ("base") and each variant (the tree
# with a patch applied) are built side by side, then one writescope-bench command runs for each
# in turn, AB_ROUNDS times, so that the host's drift falls on every variant alike (a shared
# host's memory rate moves by a third between runs: docs/perf.md). Run from the repository root
# on the lent machine after `source .devdeps/unpack-deps.sh`; logs under $OUT.
#   AB_PATCHES  space-separated name=file.patch (-p1, against the working tree), e.g.
#               "paced=exp/paced.patch" (the files travel with the tree when git does not
#               ignore them, or by the call's carry)
#   AB_BENCH    the writescope-bench arguments, e.g. "cpu-attention --models deepseek-v2-lite
#               --tokens 32768 --batches 1,16 --reps 5"
#   AB_GREP     the lines of its output to keep (an extended regex; default: every line)
#   AB_ROUNDS   default 2; AB_CUDA=1 builds the CUDA backend too (for generate, model-decode)
# Example (as in the 2026-12-03 MLA prefetch A/B, docs/perf.md):
#   AB_PATCHES="paced=exp/pace.patch" AB_GREP="^deepseek|^read" \
#     AB_BENCH="cpu-attention --models deepseek-v2-lite --tokens 32768,131072 --batches 1,16" \
#     tests/bench/ab_variants.sh
set -u
OUT=${OUT:-/tmp/ws-out}
mkdir -p "$OUT"
: "${AB_BENCH:?AB_BENCH: the writescope-bench arguments}"
rounds=${AB_ROUNDS:-2}
cuda=OFF
[[ ${AB_CUDA:-0} == 1 ]] && cuda=ON
root=$PWD
names=(base)
declare -A src=([base]="$root")
for spec in ${AB_PATCHES:-}; do
  name=${spec%%=*} patch=${spec#*=}
  if [[ $name == "$spec" || -z $name || ! -f $patch ]]; then
    echo "ab_variants: '$spec' is not name=file.patch of an existing file" >&2
    exit 2
  fi
  dir=/tmp/ab-src-$name
  rm -rf "$dir" && mkdir -p "$dir"
  tar cf - --exclude=./.devdeps --exclude=./tests/text/node_modules . | tar xf - -C "$dir"
  if ! (cd "$dir" && patch -s -p1 < "$root/$patch"); then
    echo "ab_variants: $patch does not apply to the working tree" >&2
    exit 2
  fi
  names+=("$name")
  src[$name]=$dir
done
jobs=$(( $(nproc) / ${#names[@]} ))
(( jobs < 1 )) && jobs=1
for name in "${names[@]}"; do
  (cmake -S "${src[$name]}" -B "/tmp/ab-build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DWRITESCOPE_CUDA=$cuda -DWRITESCOPE_BUILD_DAEMON=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
     > "$OUT/build-$name.log" 2>&1 &&
   ninja -C "/tmp/ab-build-$name" -j "$jobs" writescope-bench >> "$OUT/build-$name.log" 2>&1
   echo "build $name rc=$?") &
done
wait
for name in "${names[@]}"; do
  if [[ ! -x /tmp/ab-build-$name/tests/bench/writescope-bench ]]; then
    echo "ab_variants: $name did not build ($OUT/build-$name.log)" >&2
    tail -n 5 "$OUT/build-$name.log" >&2
    exit 1
  fi
done
for ((round = 1; round <= rounds; ++round)); do
  for name in "${names[@]}"; do
    echo "== $name (round $round, $(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/ab.txt"
    # shellcheck disable=SC2086
    "/tmp/ab-build-$name/tests/bench/writescope-bench" $AB_BENCH 2>&1 |
      grep -E "${AB_GREP:-.}" | tee -a "$OUT/ab.txt"
  done
done
