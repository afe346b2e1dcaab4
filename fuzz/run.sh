#!/bin/sh
# run.sh — builds every fuzz/fuzz_*.c as a libFuzzer binary (clang,
# -fsanitize=fuzzer,address,undefined) and runs each for $1 seconds
# (default 30) on its seeds in fuzz/corpus/<name>/; with a second
# argument, only the target of that name (run.sh 60 safetensors).
#
# A target names what it links in its first lines:
#   // fuzz-sources: model/err.c model/safetensors.c
#   // fuzz-pkgs: libxxhash          (optional: more pkg-config packages)
# Every target links jansson (pkg-config) whether it names it or not.
# New inputs go to build-fuzz/corpus/<name>/, so the seeds stay as checked
# in; a crash is saved as build-fuzz/<name>-crash-*. Exits non-zero when a
# target does not build or finds anything. FUZZ_CC overrides clang.
set -u
seconds=${1:-30}
only=${2:-}
cd "$(dirname "$0")/.." || exit 1
cc=${FUZZ_CC:-clang}
out=build-fuzz
flags="-std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -ffp-contract=off -g -O1
       -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -Wall -Wextra -Werror -I."
status=0
mkdir -p "$out"

for src in fuzz/fuzz_*.c; do
    [ -e "$src" ] || continue
    name=$(basename "$src" .c)
    name=${name#fuzz_}
    [ -z "$only" ] || [ "$only" = "$name" ] || continue
    sources=$(sed -n 's|^// fuzz-sources:||p' "$src" | head -n 1)
    pkgs="jansson $(sed -n 's|^// fuzz-pkgs:||p' "$src" | head -n 1)"
    # shellcheck disable=SC2086  # one word per package
    if ! pkg_flags=$(pkg-config --cflags --libs $pkgs); then
        echo "fuzz: $src: pkg-config cannot find: $pkgs" >&2
        status=1
        continue
    fi
    bin=$out/fuzz_$name
    # shellcheck disable=SC2086  # word splitting of the flag lists is wanted
    if ! $cc $flags -o "$bin" "$src" $sources $pkg_flags -lm; then
        echo "fuzz: $src does not build" >&2
        status=1
        continue
    fi
    mkdir -p "$out/corpus/$name"
    seeds=
    [ -d "fuzz/corpus/$name" ] && seeds=fuzz/corpus/$name
    echo "fuzz: $name for ${seconds}s"
    # shellcheck disable=SC2086
    if ! "$bin" -max_total_time="$seconds" -timeout=10 -artifact_prefix="$out/$name-" \
            -print_final_stats=1 "$out/corpus/$name" $seeds; then
        echo "fuzz: $name FAILED (see $out/$name-*)" >&2
        status=1
    fi
done
exit $status
