#!/bin/sh
# The line users feel at real scale: gemma3-1b-shape with bf16 weights, a
# 2,000-token prompt and one generated token, every stage dumped: the wall
# time of kvdiff's reference (`kvdiff run --dump`) against llama.cpp's
# recording of the same prompt on the same weights (`kvdiff-llama --dump`,
# the GGUF `kvdiff gen --gguf` writes). Each is run twice and keeps its
# best; both dumps are written to DIR (some 3 GB each) and removed.
#
# Usage: bench/real_scale.sh OUT.tsv [DIR]
# Environment: REAL_PRESET (gemma3-1b-shape), REAL_TOKENS (2000),
#   REAL_THREADS (2), KVDIFF (./kvdiff), KVDIFF_LLAMA_BIN (./kvdiff-llama;
#   without it kvdiff is timed alone and that is said).
set -eu
tsv=$1
dir=${2:-${TMPDIR:-/tmp}}
preset=${REAL_PRESET:-gemma3-1b-shape}
n=${REAL_TOKENS:-2000}
threads=${REAL_THREADS:-2}
kvdiff=${KVDIFF:-./kvdiff}
rec=${KVDIFF_LLAMA_BIN:-./kvdiff-llama}

tmp=$(mktemp -d "$dir/real-scale.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
# Ids 10..209: inside any preset's vocabulary; the content does not matter.
seq 0 $((n - 1)) | awk '{ printf "%d ", 10 + $1 % 200 }' > "$tmp/prompt.txt"

now() { date +%s.%N; }
# best_of CMD...: the shorter wall time of two runs, in seconds
best_of() {
    b=""
    for i in 1 2; do
        t0=$(now)
        "$@" >/dev/null 2>"$tmp/err" || { echo "real_scale: $1 failed: $(tail -n 1 "$tmp/err")" >&2; exit 1; }
        t1=$(now)
        rm -f "$tmp/d.h5"
        b=$(awk -v a="$t0" -v z="$t1" -v b="$b" 'BEGIN { t = z - a; print (b == "" || t < b) ? t : b }')
    done
    echo "$b"
}

echo "real scale: $preset bf16, a $n-token prompt and 1 new token, every stage dumped, $threads threads"
kv=$(best_of "$kvdiff" run --model "$preset" --dtype bf16 --prompt-ids-file "$tmp/prompt.txt" \
     --max-new 1 --ignore-eos --threads "$threads" --dump "$tmp/d.h5")
head=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
date=$(date -u +%Y-%m-%dT%H:%M:%S)
printf '%s\t%s\treal-scale kvdiff run --dump\t%s\tbf16\t%d\tprompt%d_full_dump_s\t%.1f\n' \
    "$date" "$head" "$preset" "$threads" "$n" "$kv" >> "$tsv"
if [ -x "$rec" ]; then
    "$kvdiff" gen --preset "$preset" --dtype bf16 --gguf "$tmp/m.gguf" >/dev/null
    ll=$(best_of "$rec" "$tmp/m.gguf" --prompt-ids-file "$tmp/prompt.txt" --max-new 1 \
         --ignore-eos --threads "$threads" --dump "$tmp/d.h5")
    printf '%s\t%s\treal-scale kvdiff-llama --dump\t%s\tbf16\t%d\tprompt%d_full_dump_s\t%.1f\n' \
        "$date" "$head" "$preset" "$threads" "$n" "$ll" >> "$tsv"
    awk -v a="$kv" -v b="$ll" -v tsv="$tsv" 'BEGIN { printf "kvdiff reference %.1f s, " \
        "llama.cpp recorded %.1f s: %.2fx (best of 2 each; appended to %s)\n", a, b, a / b, tsv }'
else
    awk -v a="$kv" -v tsv="$tsv" -v rec="$rec" 'BEGIN { printf "kvdiff reference %.1f s " \
        "(best of 2; appended to %s); llama.cpp skipped: no %s (make recorders builds it)\n", \
        a, tsv, rec }'
fi
