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
#   llama.cpp as users build it is the anchor: llama-bench built from the
#   same source with -DGGML_NATIVE=ON (scripts/build-llama-native, cached in
#   .cache/llama-native; LLAMA_BENCH names another), timed when it is there.
#   Else LLAMA_PP_TG_BIN, our timing of the prebuilt npm libllama (generic
#   x86-64: 2 to 3 times slower at prefill, which flatters kvdiff); the
#   output and the TSV rows say which build was timed ("llama.cpp-native"
#   or "llama.cpp-prebuilt"). Without either it times kvdiff alone and says
#   why llama.cpp was skipped (LLAMA_SKIP, set by `make bench`).
# Environment: BENCH_ROUNDS (3), BENCH_THREADS (2), BENCH_PP (512),
#   BENCH_TG (128), BENCH_PRESET (qwen2.5-0.5b-shape), BENCH_DTYPES ("f32 bf16";
#   "bf16" alone for a model whose f32 copies do not fit twice in memory,
#   gemma4-e2b-shape), KVDIFF (./kvdiff),
#   BENCH_PP_TG (build/bench/bench_pp_tg).
set -eu
tsv=$1
llama=${2:-}
native=${LLAMA_BENCH:-.cache/llama-native/bin/llama-bench}
build=prebuilt
if [ -x "$native" ]; then
    llama=native
    build=native
fi
llama_name="llama.cpp-$build"
preset=${BENCH_PRESET:-qwen2.5-0.5b-shape}
threads=${BENCH_THREADS:-2}
pp=${BENCH_PP:-512}
tg=${BENCH_TG:-128}
rounds=${BENCH_ROUNDS:-3}
dtypes=${BENCH_DTYPES:-f32 bf16}
kvdiff=${KVDIFF:-./kvdiff}
kv=${BENCH_PP_TG:-build/bench/bench_pp_tg}
kernels=${BENCH_KERNELS:-build/bench/bench_kernels}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/side-by-side.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM

if [ -n "$llama" ]; then
    # Exported afresh each time: a GGUF left from another commit could hold
    # other weights than the preset kvdiff draws now.
    for dt in $dtypes; do
        "$kvdiff" gen --preset "$preset" --dtype "$dt" --gguf "$tmp/$dt.gguf" >/dev/null
    done
fi

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }
echo "side by side: $preset, $threads threads, pp$pp and tg$tg (tok/s), best of $rounds" \
     "interleaved rounds; load average before: $(loadavg)"
if [ "$build" = native ]; then
    echo "llama.cpp: $native, built with GGML_NATIVE=ON ($(cat "$(dirname "$native")/../version.json" 2>/dev/null || echo "no version.json"))"
elif [ -n "$llama" ]; then
    echo "llama.cpp: the prebuilt npm libllama (generic x86-64), timed by $llama;" \
         "sh scripts/build-llama-native builds the native anchor"
fi

# llama-bench as our timing programs print: "pp X tg Y" (tok/s, one
# repetition: the rounds repeat). Flash attention off, as bench_pp_tg.
llama_bench() {
    "$native" -m "$1" -t "$2" -p "$3" -n "$4" -fa 0 -r 1 -o csv 2>/dev/null |
        awk -F, -v pp="$3" -v tg="$4" '
            NR == 1 { for (i = 1; i <= NF; i++) { gsub(/"/, "", $i); col[$i] = i }; next }
            { gsub(/"/, "") }
            $col["n_prompt"] == pp && $col["n_gen"] == 0 { p = $col["avg_ts"] }
            $col["n_prompt"] == 0 && $col["n_gen"] == tg { g = $col["avg_ts"] }
            END { if (p == "" || g == "") exit 1; print "pp", p, "tg", g }'
}

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
    for dt in $dtypes; do
        run kvdiff "$dt" "$kv" "$preset" "$dt" "$threads" "$pp" "$tg"
        if [ "$build" = native ]; then
            run llama.cpp "$dt" llama_bench "$tmp/$dt.gguf" "$threads" "$pp" "$tg"
        elif [ -n "$llama" ]; then
            run llama.cpp "$dt" "$llama" "$tmp/$dt.gguf" "$threads" "$pp" "$tg"
        fi
    done
    r=$((r + 1))
done

# Decode reads every weight once a token: tok/s x the GGUF's bytes is the
# rate it streams them at, printed beside the 2-thread memory-read roof
# measured now (bench_kernels roof), after the rounds, on the same machine.
roof=$("$kernels" roof 2>/dev/null | awk '/2 threads/ { print $(NF - 1) }')
: > "$tmp/bytes"
for dt in $dtypes; do
    [ -f "$tmp/$dt.gguf" ] && echo "$dt $(wc -c < "$tmp/$dt.gguf")" >> "$tmp/bytes"
done

head=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
date=$(date -u +%Y-%m-%dT%H:%M:%S)
awk -v pp="$pp" -v tg="$tg" -v tsv="$tsv" -v head="$head" -v date="$date" \
    -v preset="$preset" -v threads="$threads" -v have_llama="${llama:+1}" \
    -v lname="$llama_name" -v dtypes="$dtypes" '
    { k = $1 " " $2 " " $3
      if (!(k in best) || $4 > best[k]) best[k] = $4
      if (!(k in low) || $4 < low[k]) low[k] = $4 }
    END {
      if (have_llama)
          printf "%-12s %18s %18s %7s\n", "figure", "kvdiff", lname, "ratio"
      else
          printf "%-12s %18s\n", "figure", "kvdiff"
      nd = split(dtypes, dts, " ")
      for (i = 1; i <= nd; i++) for (j = 1; j <= 2; j++) {
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
              printf "%s\t%s\tside-by-side %s\t%s\t%s\t%d\t%s\t%.1f\n", date, head, lname, preset,
                     dt, threads, metric, best[lk] >> tsv
              printf "%s\t%s\tside-by-side ratio %s\t%s\t%s\t%d\t%s\t%.3f\n", date, head, lname,
                     preset, dt, threads, f n "_kvdiff_over_llama", ratio >> tsv
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
if [ -s "$tmp/bytes" ] && [ -n "$roof" ]; then
    awk -v tg="$tg" -v roof="$roof" -v tsv="$tsv" -v head="$head" -v date="$date" \
        -v preset="$preset" -v threads="$threads" -v lname="$llama_name" '
        FNR == NR { bytes[$1] = $2; next }
        $3 == "tg" { k = $1 " " $2; if (!(k in best) || $4 > best[k]) best[k] = $4 }
        END {
          printf "decode tg%d, weights streamed (GGUF bytes x tok/s) against the 2-thread read " \
                 "roof measured now, %.1f GB/s:\n", tg, roof
          if (preset ~ /gemma4/)
              printf "  (Gemma 4: the per-layer table of the GGUF, gathered one row a token, is " \
                     "counted as streamed: subtract it, vocab x layers x P x 2 bytes in bf16)\n"
          printf "%s\t%s\tread roof\t-\t-\t%d\tread_roof_GB_s\t%.1f\n", date, head, threads,
                 roof >> tsv
          split("f32 bf16", dts, " ")
          for (i = 1; i <= 2; i++) {
              dt = dts[i]; line = ""
              split("kvdiff " lname, es, " ")
              for (j = 1; j <= 2; j++) {
                  k = (es[j] ~ /^llama/ ? "llama.cpp" : "kvdiff") " " dt
                  if (!(k in best) || !(dt in bytes)) continue
                  gbs = best[k] * bytes[dt] * 1e-9
                  line = line sprintf("  %s %.1f GB/s (%.0f%%)", es[j], gbs, 100 * gbs / roof)
                  printf "%s\t%s\tside-by-side %s\t%s\t%s\t%d\ttg%d_GB_s\t%.1f\n", date, head,
                         es[j], preset, dt, threads, tg, gbs >> tsv
              }
              if (line != "")
                  printf "  %-5s%s\n", dt, line
          }
        }' "$tmp/bytes" "$tmp/all"
fi
if [ -n "$llama" ]; then
    echo "(best, and the range over rounds in parentheses; ratio = kvdiff / llama.cpp, best to best)"
else
    echo "(best, and the range over rounds in parentheses)"
    echo "llama.cpp skipped: ${LLAMA_SKIP:-no llama.cpp benchmark program given}"
fi
echo "load average after: $(loadavg); appended to $tsv"
