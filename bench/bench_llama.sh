#!/bin/sh
# What recording costs llama.cpp: kvdiff-llama on a GGUF (meant for the
# qwen2.5-0.5b-shape preset) over a 512-token prompt and 16 decode steps,
# once with nothing watching (--no-record) and once recording every stage,
# 3 runs each; prints the best time of each and their ratio (the goal:
# under 2x). Not a test: timings depend on the machine.
#
# Usage: bench/bench_llama.sh MODEL.gguf [THREADS] [TOKENS]
set -eu
gguf=$1
threads=${2:-4}
n=${3:-512}
rec=${KVDIFF_LLAMA_BIN:-./kvdiff-llama}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-llama.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
# Ids 10..209, inside the vocabulary of any preset; the content does not matter.
seq 0 $((n - 1)) | awk '{ printf "%d ", 10 + $1 % 200 }' > "$tmp/prompt.txt"
best() { sort -n | head -n 1; }
base=$(for i in 1 2 3; do
    "$rec" "$gguf" --prompt-ids-file "$tmp/prompt.txt" --max-new 16 --ignore-eos \
        --threads "$threads" --no-record --time; done | best)
recd=$(for i in 1 2 3; do
    "$rec" "$gguf" --prompt-ids-file "$tmp/prompt.txt" --max-new 16 --ignore-eos \
        --threads "$threads" --time --dump "$tmp/d.h5"; rm -f "$tmp/d.h5"; done | best)
echo "llama.cpp alone: ${base}s  recording every stage: ${recd}s  ratio: $(echo "$recd $base" | awk '{printf "%.2f", $1 / $2}')x"
