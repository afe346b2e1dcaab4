#!/bin/sh
# diag_cost.sh — what the diagnosis adds to a compare at real scale:
# gemma3-1b-shape, 640 tokens (a prompt of 600, 40 decode steps), full
# dumps of the reference and of the chunked engine with a bug, then
# `kvdiff compare` with KVDIFF_DIAG_TIME=1, which prints the diagnosis's
# own seconds. Bugs: the window hard-coded to 256 (diverges at 256, the
# engine then scores the places after it on every kind of layer) and
# decode steps blind to the prefill (at 600, the first decode step).
# Appends one row per bug to OUT in bench/results.tsv's columns (time,
# commit, bench, model, dtype, threads, figure, seconds).
# Usage: sh bench/diag_cost.sh [OUT.tsv] [KVDIFF] [DIR]
set -eu
out=${1:-bench/results.tsv}
kvdiff=${2:-./kvdiff}
dir=${3:-$(mktemp -d)}
mkdir -p "$dir"
common="--model gemma3-1b-shape --prompt-random 600 --seed 3 --max-new 40 --ignore-eos"
"$kvdiff" run $common --dump "$dir/ref.h5" > /dev/null
for bug in "--cache ring --inject window=256" "--cache split --inject split-decode-blind"; do
    name=$(echo "$bug" | sed 's/.*--inject //')
    "$kvdiff" run $common --engine chunked --chunk 64 $bug --dump "$dir/bug.h5" > /dev/null
    t0=$(date +%s.%N)
    KVDIFF_DIAG_TIME=1 "$kvdiff" compare "$dir/ref.h5" "$dir/bug.h5" > "$dir/out.txt" 2> "$dir/err.txt" || true
    t1=$(date +%s.%N)
    d=$(sed -n 's/^diagnosis: \([0-9.]*\) s$/\1/p' "$dir/err.txt")
    total=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
    grep -A1 '^DIAGNOSIS' "$dir/out.txt" | cut -c1-160
    echo "$name: diagnosis $d s of a $total s compare"
    printf '%s\t%s\tdiagnosis\tgemma3-1b-shape\tf32\t%s\tdiag_seconds_640_%s\t%s\n' \
        "$(date -u +%FT%T)" "$(git rev-parse --short HEAD 2>/dev/null || echo -)" "$(nproc)" \
        "$name" "$d" >> "$out"
    rm -f "$dir/bug.h5"
done
rm -f "$dir/ref.h5" "$dir/out.txt" "$dir/err.txt"
