#!/bin/sh
# kvdiff's reference engine and llama.cpp side by side on the same weights:
# qwen2.5-0.5b-shape (weights seed 0; llama.cpp runs the GGUF `kvdiff gen
# --gguf` writes of it), f32 and bf16 weights, pp512 and tg128 as
# llama-bench defines them (bench/bench_pp_tg.c, bench/bench_llama_pp_tg.c),
# 2 threads. The runs alternate (kvdiff f32, llama.cpp f32, kvdiff bf16,
# llama.cpp bf16) for ROUNDS rounds and each figure keeps its best: what
# compares is the ratio, taken from runs made side by side, not an
# absolute figure, which depends on the machine and on what else runs on
# it (the load average is printed before and after).
#
# kvdiff keeps f32 activations with bf16 weights; llama.cpp's BF16 path
# rounds activations to bf16 too, so the bf16 rows compare two different
# computations of the same model.
#
# Usage: bench/side_by_side.sh OUT.tsv [LLAMA_PP_TG_BIN]
#   Without LLAMA_PP_TG_BIN (llama.cpp not there) it times kvdiff alone and
#   says why llama.cpp was skipped (LLAMA_SKIP, set by `make bench`).
# Environment: BENCH_ROUNDS (3), BENCH_THREADS (2), BENCH_PP (512),
#   BENCH_TG (128), BENCH_PRESET (qwen2.5-0.5b-shape), KVDIFF (./kvdiff),
#   BENCH_PP_TG (build/bench/bench_pp_tg).
set -eu
tsv=$1
llama=${2:-}
preset=${BENCH_PRESET:-qwen2.5-0.5b-shape}
threads=${BENCH_THREADS:-2}
pp=${BENCH_PP:-512}
tg=${BENCH_TG:-128}
rounds=${BENCH_ROUNDS:-3}
kvdiff=${KVDIFF:-./kvdiff}
kv=${BENCH_PP_TG:-build/bench/bench_pp_tg}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/side-by-side.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM

if [ -n "$llama" ]; then
    # Exported afresh each time: a GGUF left from another commit could hold
    # other weights than the preset kvdiff draws now.
    for dt in f32 bf16; do
        "$kvdiff" gen --preset "$preset" --dtype "$dt" --gguf "$tmp/$dt.gguf" >/dev/null
    done
fi

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }
echo "side by side: $preset, $threads threads, pp$pp and tg$tg (tok/s), best of $rounds" \
     "interleaved rounds; load average before: $(loadavg)"

# run ENGINE DTYPE COMMAND...: appends "ENGINE DTYPE pp X" and "... tg Y" to $tmp/all
: > "$tmp/all"
run() {
    e=$1 d=$2
    shift 2
    out=$("$@") || { echo "side_by_side: $e $d failed" >&2; exit 1; }
    echo "$out" | awk -v e="$e" -v d="$d" '{ print e, d, "pp", $2; print e, d, "tg", $4 }' \
        >> "$tmp/all"
}
r=1
while [ "$r" -le "$rounds" ]; do
    for dt in f32 bf16; do
        run kvdiff "$dt" "$kv" "$preset" "$dt" "$threads" "$pp" "$tg"
        if [ -n "$llama" ]; then
            run llama.cpp "$dt" "$llama" "$tmp/$dt.gguf" "$threads" "$pp" "$tg"
        fi
    done
    r=$((r + 1))
done

head=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
date=$(date -u +%Y-%m-%dT%H:%M:%S)
awk -v pp="$pp" -v tg="$tg" -v tsv="$tsv" -v head="$head" -v date="$date" \
    -v preset="$preset" -v threads="$threads" -v have_llama="${llama:+1}" '
    { k = $1 " " $2 " " $3
      if (!(k in best) || $4 > best[k]) best[k] = $4
      if (!(k in low) || $4 < low[k]) low[k] = $4 }
    END {
      if (have_llama)
          printf "%-12s %18s %18s %7s\n", "figure", "kvdiff", "llama.cpp", "ratio"
      else
          printf "%-12s %18s\n", "figure", "kvdiff"
      split("f32 bf16", dts, " ")
      for (i = 1; i <= 2; i++) for (j = 1; j <= 2; j++) {
          dt = dts[i]; f = j == 1 ? "pp" : "tg"; n = j == 1 ? pp : tg
          kk = "kvdiff " dt " " f; lk = "llama.cpp " dt " " f
          kvs = sprintf("%.1f (%.1f-%.1f)", best[kk], low[kk], best[kk])
          name = dt " " f n
          metric = f n "_tok_s"
          printf "%s\t%s\tside-by-side kvdiff\t%s\t%s\t%d\t%s\t%.1f\n", date, head, preset, dt,
                 threads, metric, best[kk] >> tsv
          if (have_llama) {
              lls = sprintf("%.1f (%.1f-%.1f)", best[lk], low[lk], best[lk])
              ratio = best[kk] / best[lk]
              printf "%-12s %18s %18s %6.2fx\n", name, kvs, lls, ratio
              printf "%s\t%s\tside-by-side llama.cpp\t%s\t%s\t%d\t%s\t%.1f\n", date, head, preset,
                     dt, threads, metric, best[lk] >> tsv
              printf "%s\t%s\tside-by-side ratio\t%s\t%s\t%d\t%s\t%.3f\n", date, head, preset, dt,
                     threads, f n "_kvdiff_over_llama", ratio >> tsv
          } else {
              printf "%-12s %18s\n", name, kvs
          }
      }
    }' "$tmp/all"
# The runs themselves keep about $threads runnable; more than half a core
# beyond that over the last minute was someone else's.
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
busy=$(awk -v t="$threads" '{ print ($1 - t > 0.5) ? 1 : 0 }' /proc/loadavg 2>/dev/null || echo 0)
if [ -n "$llama" ] && [ "$busy" = 1 ]; then
    echo "warning: the load average ($(loadavg)) says other programs ran on these $cores cores:"
    echo "  llama.cpp's threads spin while they wait and lose far more than kvdiff's when a"
    echo "  core is taken, so these ratios favour kvdiff; rerun on an idle machine"
fi
if [ -n "$llama" ]; then
    echo "(best, and the range over rounds in parentheses; ratio = kvdiff / llama.cpp, best to best)"
else
    echo "(best, and the range over rounds in parentheses)"
    echo "llama.cpp skipped: ${LLAMA_SKIP:-no llama.cpp benchmark program given}"
fi
echo "load average after: $(loadavg); appended to $tsv"
