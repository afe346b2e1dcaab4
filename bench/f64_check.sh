#!/bin/sh
# f64_check.sh — kvdiff and llama.cpp against a float64 forward, side by side.
#
# Usage: bench/f64_check.sh [PRESET ...]   (run from the repository root)
#
# For each preset (default: qwen2.5-0.5b-shape gemma3-1b-shape) writes its
# weights as a Hugging Face folder and a GGUF (F32), runs the same 40-token
# prompt through kvdiff's reference and through llama.cpp (f32 KV cache,
# one ubatch, no flash attention, 1 thread), and prints both runs' max
# relative error per stage against bench/f64_check.py's float64 forward.
# Then the three conformance folders, both runtimes, against their float64
# goldens. llama.cpp's default CPU build takes GELU from a float16 table:
# on Gemma 3 its error from the first MLP on is that table's (~5e-4), so
# the q@0, k@0, v@0 rows (layer 0, before any activation) are the fair ones.
# Needs ./kvdiff, ./kvdiff-llama (make recorders) and /usr/bin/python3 with
# numpy and h5py; about 2 minutes and 9 GB of /tmp for both presets.
# Slow and outside `make test` on purpose; docs/numerics.md has the figures.
set -eu
PY=/usr/bin/python3
work=$(mktemp -d /tmp/kvdiff-f64.XXXXXX)
trap 'rm -rf "$work"' EXIT
[ -x ./kvdiff ] || { echo "f64_check.sh: build ./kvdiff first (make kvdiff)" >&2; exit 2; }
llama=1
[ -x ./kvdiff-llama ] || { echo "f64_check.sh: no ./kvdiff-llama (make recorders): kvdiff only" >&2; llama=0; }

presets=${*:-qwen2.5-0.5b-shape gemma3-1b-shape}
for p in $presets; do
    dir=$work/$p
    ./kvdiff gen --preset "$p" -o "$dir" $( [ $llama = 1 ] && echo --gguf "$work/$p.gguf" ) >/dev/null
    vocab=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$dir/config.json")
    # The prompt of tests/check_double_forward.c: (37 i + 11) mod vocab.
    $PY -c "import sys; v=int(sys.argv[1]); print(' '.join(str((37*i+11)%v) for i in range(40)))" \
        "$vocab" >"$work/$p.ids"
    ./kvdiff run --model "$p" --prompt-ids-file "$work/$p.ids" --max-new 0 --dump-logits \
        --threads 2 --dump "$work/$p.kvdiff.h5" >/dev/null
    set -- "kvdiff=$work/$p.kvdiff.h5"
    if [ $llama = 1 ]; then
        ./kvdiff-llama "$work/$p.gguf" --prompt-ids-file "$work/$p.ids" --ubatch 512 \
            --threads 1 --cache-type f32 --flash-attn off --max-new 0 --dump-logits \
            --hf "$dir" --dump "$work/$p.llama.h5" >/dev/null
        rm -f "$work/$p.gguf"
        set -- "$@" "llama.cpp=$work/$p.llama.h5"
    fi
    $PY bench/f64_check.py "$dir" "$@"
    rm -rf "$dir" "$work/$p".*.h5
    echo
done

for c in llama qwen2 gemma3; do
    d=tests/data/conformance/$c
    [ -d "$d" ] || continue
    ./kvdiff run --model "$d" --prompt-ids-file "$d/prompt.txt" --max-new 0 --dump-logits \
        --threads 1 --dump "$work/$c.h5" >/dev/null
    set -- "kvdiff=$work/$c.h5"
    if [ $llama = 1 ]; then
        ./kvdiff gen --from "$d" --gguf "$work/$c.gguf" >/dev/null
        ./kvdiff-llama "$work/$c.gguf" --prompt-ids-file "$d/prompt.txt" --ubatch 512 \
            --threads 1 --cache-type f32 --flash-attn off --max-new 0 --dump-logits \
            --hf "$d" --dump "$work/$c.llama.h5" >/dev/null
        set -- "$@" "llama.cpp=$work/$c.llama.h5"
    fi
    $PY bench/f64_check.py "$d" "$@"
    echo
done
