#!/bin/sh
# verdict_sweep.sh — the verdict judged by the pair's own evidence
# (docs/cross-runtime.md, "Structure" and "Token flips"), counted on real
# llama.cpp: legitimate runs with decode steps that must pass (exit 0; a
# near-tie flip is drift), and planted bugs, each one value of the GGUF,
# that must be found at their first (position, layer, stage) and named.
# One line per run in DIR/results.txt, then the counts per class and the
# legitimate runs' closest approach to each threshold (size walk, row-scale
# structure test, /output map).
#
#   sh bench/verdict_sweep.sh [-n "100"] [-s "3 4"] [-p "PRESETS"] [-B] [-o TSV] [DIR]
#
#   -n  prompt lengths (default 100; the tiny presets' window is 12)
#   -s  prompt seeds (default "3 4")
#   -p  presets (default tiny-gemma3 tiny-gemma4 tiny-qwen2 tiny-llama;
#       gemma3-1b-shape runs four legitimate cells and three bugs at 640
#       tokens, bf16 weights, the GGUF exported from the folder)
#   -B  no bug runs
#   -o  append the counts to TSV (bench/verdict_sweep.tsv keeps them across
#       commits: date, commit, presets, class, runs, false alarms or
#       missed, found at the first stage, named right)
#
# Legitimate cells: KV f32, f16, bf16, q8_0 x flash attention off, on x
# ubatch 1, 7, 512, 1 thread, and 2 threads on f16 + flash; 8 new tokens.
# Bugs (KV f32 off 512, f16 on 7, bf16 off 1, q8_0 on 512; 8 new tokens):
# RMSNorm epsilon x10, x100, x1000; input norm weights x1.01; the final
# softcap 15 and none where the config says 30 (tiny-gemma4); layer 0's q
# bias missing, and 1% of it missing (tiny-qwen2); the sliding window 4
# where it is 12 and the
# local RoPE base set to the global one (tiny-gemma3, tiny-gemma4).
set -u
N_LIST=100; SEEDS="3 4"; PRESETS="tiny-gemma3 tiny-gemma4 tiny-qwen2 tiny-llama"; BUGS=1
TSV=""
while getopts n:s:p:Bo: o; do
  case $o in
    n) N_LIST=$OPTARG;; s) SEEDS=$OPTARG;; p) PRESETS=$OPTARG;; B) BUGS=0;;
    o) TSV=$(cd "$(dirname "$OPTARG")" && pwd)/$(basename "$OPTARG");; *) exit 2;;
  esac
done
shift $((OPTIND - 1))
D=${1:-/tmp/kvdiff-verdict-sweep}
SRC=$PWD
K=$SRC/build/kvdiff; L=$SRC/build/kvdiff-llama
[ -x "$K" ] && [ -x "$L" ] || { echo "build kvdiff and the recorder first" >&2; exit 2; }
mkdir -p "$D" && cd "$D" || exit 2
: > results.txt

gguf_edit() { python3 "$SRC/bench/gguf_edit.py" "$@" || exit 2; }

# One run: TAG GGUF HF REF THREADS KV FA UB NEW
run_cell() {
  tag=$1 g=$2 hf=$3 ref=$4 t=$5 kv=$6 fa=$7 ub=$8 new=$9
  rm -f s.h5
  if ! $L "$g" --hf "$hf" --prompt-from "$ref" --max-new "$new" --ignore-eos --threads "$t" \
      --cache-type "$kv" --flash-attn "$fa" --ubatch "$ub" --dump s.h5 </dev/null >rec.log 2>&1
  then
    echo "$tag not-run: $(tr '\n' ' ' < rec.log | head -c 100)" | tee -a results.txt; return
  fi
  $K compare "$ref" s.h5 --json </dev/null > c.json; rc=$?
  python3 - "$tag" $rc <<'PY' | tee -a results.txt
import json, sys
tag, rc = sys.argv[1:]
try:
    j = json.load(open('c.json'))
except Exception as e:
    print(f"{tag} exit={rc} step=? kind=? (no JSON: {e})"); sys.exit()
x = j['mode']['cross_runtime'] or {}
d = j['first_divergence']; g = j.get('diagnosis') or {}; t = j['tokens']
loc = '-' if not d else '%s/%s/%s' % (d['position'], d['layer'], d['stage'])
w = x.get('drift_closest') or {}
st = x.get('structure') or {}
sc = st.get('closest') or {}
m = st.get('logit_map') or {}
flip = 'flip-drift' if t.get('flip_drift') else ('flip' if t['verdict'] == 'differ' else '-')
print(f"{tag} exit={rc} step={loc} kind={g.get('kind', '-') if d else '-'} tokens={flip} "
      f"size={w.get('ratio', 0):.3g} struct={sc.get('ratio', 0):.3g} "
      f"map={m.get('kind', '-')}:{m.get('value')}/gain={m.get('gain')}")
PY
}

prepare() { # PRESET N SEED [DTYPE]: folder, GGUF from it, the reference's run
  dt=${4:-f32}
  [ -f "$1.gguf" ] || { $K gen --preset "$1" --dtype "$dt" -o "$1" >/dev/null &&
                        $K gen --from "$1" --gguf "$1.gguf" >/dev/null; } || exit 2
  [ -f "$1-$2-$3.h5" ] || $K run --model "$1" --prompt-random "$2" --seed "$3" --max-new 8 \
      --ignore-eos --dump "$1-$2-$3.h5" >/dev/null || exit 2
}

arch_of() { case $1 in tiny-gemma4) echo gemma4;; *gemma3*) echo gemma3;;
            tiny-qwen2) echo qwen2;; *) echo llama;; esac; }

legit_cells() {
  case $1 in
    gemma3-1b-shape) printf '%s\n' "1 f32 off 512" "1 f16 on 512" "1 q8_0 on 512" "1 bf16 off 7";;
    *) for kv in f32 f16 bf16 q8_0; do for fa in off on; do for ub in 1 7 512; do
         echo "1 $kv $fa $ub"; done; done; done
       echo "2 f16 on 7"; echo "2 f16 on 512";;
  esac
}

for p in $PRESETS; do for n in $N_LIST; do for s in $SEEDS; do
  [ "$p" = gemma3-1b-shape ] && { n=640; prepare "$p" $n "$s" bf16; } || prepare "$p" "$n" "$s"
  legit_cells "$p" | while read -r t kv fa ub; do
    run_cell "legit $p n=$n seed=$s t=$t kv=$kv fa=$fa ub=$ub" "$p.gguf" "$p" "$p-$n-$s.h5" \
        "$t" "$kv" "$fa" "$ub" 8
  done
done; done; done

if [ "$BUGS" = 1 ]; then
  for p in $PRESETS; do
    a=$(arch_of "$p"); s=${SEEDS%% *}; n=${N_LIST%% *}
    [ "$p" = gemma3-1b-shape ] && n=640
    eps=$(python3 -c "import json;print(json.load(open('$p/config.json')).get('rms_norm_eps',1e-6))")
    bugs="eps10 eps100 eps1000 normw"
    case $p in
      tiny-gemma4) bugs="$bugs cap15 cap0 window rope";;
      tiny-gemma3) bugs="$bugs window rope";;
      tiny-qwen2) bugs="$bugs qbias qbias99";;
    esac
    for bug in $bugs; do
      f=$p-$bug.gguf
      case $bug in
        eps10) v=10;; eps100) v=100;; eps1000) v=1000;;
      esac
      case $bug in
        eps*) gguf_edit meta "$p.gguf" "$f" "$a.attention.layer_norm_rms_epsilon" \
                "$(python3 -c "print($eps*$v)")"; want="0/0/attn_norm norm_eps";;
        normw) gguf_edit mul "$p.gguf" "$f" blk.0.attn_norm.weight 1.01
               want="0/0/attn_norm row_scale";;
        cap15) gguf_edit meta "$p.gguf" "$f" "$a.final_logit_softcapping" 15
               want="$((n - 1))/-1/logits logit_map";;
        cap0) gguf_edit meta "$p.gguf" "$f" "$a.final_logit_softcapping" 0
              want="$((n - 1))/-1/logits logit_map";;
        qbias) gguf_edit mul "$p.gguf" "$f" blk.0.attn_q.bias 0; want="0/0/q bias";;
        qbias99) gguf_edit mul "$p.gguf" "$f" blk.0.attn_q.bias 0.99; want="0/0/q bias";;
        window) gguf_edit meta "$p.gguf" "$f" "$a.attention.sliding_window" 4
                want="4/0/attn_out window";;
        rope) gguf_edit meta "$p.gguf" "$f" "$a.rope.freq_base_swa" 1000000
              want="1/0/q rope_convention";;
      esac
      cells="1 f32 off 512|1 f16 on 7|1 bf16 off 1|1 q8_0 on 512"
      [ "$p" = gemma3-1b-shape ] && cells="1 f16 on 512"
      echo "$cells" | tr '|' '\n' | while read -r t kv fa ub; do
        run_cell "bug $bug $p n=$n t=$t kv=$kv fa=$fa ub=$ub want=${want% *}:${want#* }" "$f" \
            "$p" "$p-$n-$s.h5" "$t" "$kv" "$fa" "$ub" 8
      done
    done
  done
fi

# The counts, per class.
COMMIT=$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 - "$TSV" "$COMMIT" "$PRESETS" <<'PY'
import re, collections, sys, time
tsv, commit, presets = sys.argv[1:4]
legit = alarms = notrun = flips = 0
closest = {'size': 0, 'struct': 0}
per = collections.OrderedDict()
bad = []
for line in open('results.txt'):
    if ' not-run:' in line:
        notrun += 1; continue
    m = re.search(r'exit=(\d+) step=(\S+) kind=(\S+) tokens=(\S+) size=(\S+) struct=(\S+)', line)
    if not m: continue
    rc, step, kind, tok, size, struct = m.groups()
    if line.startswith('legit'):
        legit += 1
        flips += tok == 'flip-drift'
        for k, v in (('size', size), ('struct', struct)):
            closest[k] = max(closest[k], float(v))
        if rc != '0': alarms += 1; bad.append('FALSE ALARM: ' + line.strip())
        continue
    cls = line.split()[1]
    c = per.setdefault(cls, [0, 0, 0])
    c[0] += 1
    w = re.search(r'want=(\S+):(\S+)', line)
    if rc == '1' and step == w.group(1):
        c[1] += 1
        if kind == w.group(2): c[2] += 1
        else: bad.append('MISNAMED: ' + line.strip())
    else: bad.append('MISSED: ' + line.strip())
print(f"legitimate runs {legit}: false alarms {alarms}, near-tie flips judged drift {flips}; "
      f"closest to a threshold: size walk {closest['size']:.3g}, structure {closest['struct']:.3g}; "
      f"not run (refused by llama.cpp) {notrun}")
for cls, (n, f, k) in per.items():
    print(f"bug {cls}: {n} runs, found at the first stage {f}, named right {k}")
for b in bad: print(b)
if tsv:
    day = time.strftime('%Y-%m-%d')
    with open(tsv, 'a') as out:
        out.write(f"{day}\t{commit}\t{presets}\tlegitimate\t{legit}\t{alarms}\t-\t-\n")
        for cls, (n, f, k) in per.items():
            out.write(f"{day}\t{commit}\t{presets}\t{cls}\t{n}\t{n - f}\t{f}\t{k}\n")
PY
