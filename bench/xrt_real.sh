#!/bin/sh
# xrt_real.sh — the user's path at real scale: a real-shaped preset (1B
# Gemma 3 shape by default, window 512) exported as a bf16 GGUF, a prompt
# of several hundred ids, kvdiff's reference against llama.cpp under
# legitimate settings (every verdict must be "no bug", exit 0) and under
# bugs written into the GGUF's metadata (each must be found at its exact
# position, layer and stage, and diagnosed). Times the three commands a
# user runs (reference, llama.cpp record, compare) and what each costs
# without recording. Not a test: minutes per case on one thread.
#
#   sh bench/xrt_real.sh [PRESET] [TOKENS] [DIR] [GRID] [DTYPE]
#     PRESET  gemma3-1b-shape (default), qwen2.5-0.5b-shape, qwen3-0.6b-shape
#     TOKENS  prompt length (default 640)
#     DIR     work folder, reused between runs (default /tmp/kvdiff-xrt-real)
#     GRID    full (default): KV f32, f16, bf16, q8_0, q4_0 x flash off, on x
#             ubatch 64, 512; quick: three legitimate settings
#     DTYPE   the weights, in the GGUF and the reference's folder alike:
#             bf16 (default, as released checkpoints are) or f32
# Run from the repository root after `make kvdiff recorders`. One line per
# case, then one summary line (cases, false alarms, missed bugs, mislocated
# or misdiagnosed ones); rows are appended to DIR/PRESET-DTYPE-TOKENS.tsv
# (bench/xrt_real.tsv holds the runs docs/cross-runtime.md reports). Every
# run is single-threaded (--threads 1). Needs python3.
set -u
P=${1:-gemma3-1b-shape}; N=${2:-640}; D=${3:-/tmp/kvdiff-xrt-real}; GRID=${4:-full}
DT=${5:-bf16}
NEW=4
K=${KVDIFF_BIN:-$PWD/build/kvdiff}; L=${KVDIFF_LLAMA_BIN:-$PWD/kvdiff-llama}
mkdir -p "$D" && cd "$D" || exit 2
M=$P-$DT   # the model folder and GGUF
TSV=$M-$N.tsv
now() { date +%s.%N; }
secs() { echo "$1 $2" | awk '{ printf "%.1f", $2 - $1 }'; }

# ---- the model, the prompt, the reference --------------------------------
# The GGUF is exported from the folder, as a user converts her checkpoint:
# `gen --preset P --dtype bf16 -o DIR --gguf F` keeps the GGUF's norms
# f32 from the unrounded draws while the folder holds them in bf16, two
# models 2^-9 apart in every norm weight (3.3e-3 at qwen3's layer 0
# attn_norm, 0.83 of the drift floor).
[ -f "$M/config.json" ] || $K gen --preset "$P" --dtype "$DT" -o "$M" >/dev/null || exit 2
[ -f "$M.gguf" ] || $K gen --from "$M" --dtype "$DT" --gguf "$M.gguf" >/dev/null || exit 2
arch=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['model_type'])" \
       "$M/config.json") || exit 2
ids=ids-$P-$N.txt
[ -f "$ids" ] || python3 - "$M/config.json" "$N" > "$ids" <<'PY' || exit 2
import json, random, sys
vocab = json.load(open(sys.argv[1]))['vocab_size']
r = random.Random(13)   # the content does not matter; the same ids every time
print(' '.join(str(r.randrange(10, vocab - 1)) for _ in range(int(sys.argv[2]))))
PY
ref=ref-$M-$N.h5
t0=$(now)
if [ ! -f "$ref" ]; then
    $K run --model "$M" --prompt-ids-file "$ids" --max-new $NEW --ignore-eos --threads 1 \
        --dump "$ref.tmp" >/dev/null || exit 2
    mv "$ref.tmp" "$ref"
    echo "reference run with dump: $(secs "$t0" "$(now)") s"
fi

# ---- the bugs: one metadata value of the GGUF rewritten -------------------
# patch IN OUT KEY VALUE (a u32 or f32 key; the tensor data is copied as is)
patch() {
python3 - "$@" <<'PY'
import shutil, struct, sys
src, out, key, val = sys.argv[1:5]
with open(src, 'rb') as f:
    b = f.read(64 << 20)   # the metadata, vocabulary included
size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def skip(t, o):
    if t == 8:
        return o + 8 + struct.unpack_from('<Q', b, o)[0]
    if t == 9:
        at, n = struct.unpack_from('<IQ', b, o); o += 12
        if at in size:
            return o + n * size[at]
        for _ in range(n):
            o = skip(at, o)
        return o
    return o + size[t]
o, where = 24, None
for _ in range(struct.unpack_from('<Q', b, 16)[0]):
    n = struct.unpack_from('<Q', b, o)[0]; k = b[o + 8:o + 8 + n].decode(); o += 8 + n
    t = struct.unpack_from('<I', b, o)[0]; o += 4
    if k == key:
        where = (o, t)
    o = skip(t, o)
if where is None:
    sys.exit('%s: no key %s' % (src, key))
shutil.copyfile(src, out)
with open(out, 'r+b') as f:
    f.seek(where[0])
    f.write(struct.pack('<I', int(val)) if where[1] == 4 else struct.pack('<f', float(val)))
PY
}
# The config's figures the expectations follow from.
eval "$(python3 - "$M/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
w = c.get('sliding_window') or 0
types = c.get('layer_types') or []
first = types.index('sliding_attention') if 'sliding_attention' in types else \
        (0 if w and c['model_type'].startswith('gemma3') else -1)
hdim = c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']
print('WIN=%d SLIDE0=%d THETA=%g HDIM=%d' % (w, first, c.get('rope_theta', 1e4), hdim))
PY
)"
# BUGS: name|gguf|expected position|layer|stage|kind|phrase in the diagnosis
case $arch in
gemma3*)
    half=$((WIN / 2))
    [ -f "$M-w$half.gguf" ] || patch "$M.gguf" "$M-w$half.gguf" \
        gemma3.attention.sliding_window $half || exit 2
    [ -f "$M-ropeswa.gguf" ] || patch "$M.gguf" "$M-ropeswa.gguf" \
        gemma3.rope.freq_base_swa "$THETA" || exit 2
    BUGS="window$half|$M-w$half.gguf|$half|$SLIDE0|attn_out|window|appears to be $half, config says $WIN
rope-local-is-global|$M-ropeswa.gguf|1|$SLIDE0|q|rope_convention|theta $(python3 -c "print('%g' % $THETA)")"
    ;;
*)
    [ -f "$M-rope1e4.gguf" ] || patch "$M.gguf" "$M-rope1e4.gguf" "$arch.rope.freq_base" 10000 \
        || exit 2
    BUGS="rope-base-1e4|$M-rope1e4.gguf|1|0|q|rope_convention|theta 10000"
    ;;
esac

# ---- one case: record with llama.cpp, compare, judge ----------------------
cases=0; alarms=0; missed=0; wrong=0; notrun=0
worst=0; worst_at=-
one() { # LABEL GGUF KV FLASH UBATCH [EXPECT: pos|layer|stage|kind|phrase]
    label=$1 g=$2 kv=$3 fa=$4 ub=$5 expect=${6:-}
    rm -f s.h5
    t1=$(now)
    if ! $L "$g" --hf "$M" --prompt-ids-file "$ids" --max-new $NEW --ignore-eos --threads 1 \
            --cache-type "$kv" --flash-attn "$fa" --ubatch "$ub" --dump s.h5 >rec.log 2>&1 </dev/null; then
        echo "$label kv=$kv fa=$fa ub=$ub not run: $(head -c 160 rec.log | tr '\n' ' ')"
        notrun=$((notrun + 1)); return
    fi
    t2=$(now)
    $K compare "$ref" s.h5 --json > c.json </dev/null; rc=$?
    t3=$(now)
    line=$(python3 - "$label" "$kv" "$fa" "$ub" "$rc" "$expect" "$(secs "$t1" "$t2")" \
           "$(secs "$t2" "$t3")" <<'PY'
import json, sys
label, kv, fa, ub, rc, expect, trec, tcmp = sys.argv[1:]
j = json.load(open('c.json'))
x = j['mode']['cross_runtime'] or {}
d = j.get('first_divergence')
g = j.get('diagnosis') or {}
w = x.get('drift_closest') or {}
loc = '-' if not d else '%d/%d/%s' % (d['position'], d['layer'], d['stage'])
text = ' '.join(str(g.get(k, '')) for k in ('summary', 'detail', 'evidence'))
if not expect:
    verdict = 'ok' if rc == '0' else 'FALSE-ALARM'
else:
    pos, layer, stage, kind, phrase = expect.split('|')
    if rc != '1':
        verdict = 'MISSED'
    elif not d:
        verdict = 'UNLOCATED'   # exit 1 from the tokens alone: no step found
    elif loc != '%s/%s/%s' % (pos, layer, stage):
        verdict = 'MISLOCATED'
    elif g.get('kind') != kind or phrase not in text:
        verdict = 'MISDIAGNOSED'
    else:
        verdict = 'ok'
# the attention output's closest approach (attn_proj where the runtime
# gives no attn_out): where the KV cache's rounding shows first
att = '-'
for name in ('attn_out', 'attn_proj'):
    rows = [r for r in x.get('stages', []) if r['stage'] == name]
    if rows:
        r = max(rows, key=lambda r: r['ratio'])
        att = '%s %.3g@%d' % (name, r['ratio'], r['layer'])
        break
step = ('%.3g/%.3g' % (x['step_error'], x['step_threshold'])) if x.get('step') else '-'
print('\t'.join([verdict, label, kv, fa, ub, rc, loc, step, g.get('kind', '-') or '-',
                 '%.3g' % w.get('ratio', 0),
                 '%s/%s/%s' % (w.get('position'), w.get('layer'), w.get('stage')),
                 x.get('kv_precision', '-'), trec, tcmp, (g.get('detail') or '')[:90],
                 att]))
PY
)
    [ -f "$TSV" ] || printf 'model\ttokens\tverdict\tcase\tkv\tflash\tubatch\texit\tstep_at\tstep_err/thr\tdiagnosis\tclosest_ratio\tclosest_at\tkv_assumed\trecord_s\tcompare_s\tdetail\tattn_closest\n' > "$TSV"
    printf '%s\t%s\t%s\n' "$M" "$N" "$line" >> "$TSV"
    echo "$line" | awk -F'\t' '{ printf "%-12s %-22s kv=%-4s fa=%-3s ub=%-3s exit=%s step=%s (%s) %s closest=%s@%s (%s) rec=%ss cmp=%ss %s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $16, $13, $14, $15 }'
    cases=$((cases + 1))
    case $line in
    FALSE-ALARM*) alarms=$((alarms + 1)) ;;
    MISSED* | UNLOCATED*) missed=$((missed + 1)) ;;
    MISLOCATED* | MISDIAGNOSED*) wrong=$((wrong + 1)) ;;
    esac
    if [ -z "$expect" ]; then
        r=$(echo "$line" | cut -f10)
        if awk -v a="$r" -v b="$worst" 'BEGIN { exit !(a > b) }'; then
            worst=$r; worst_at="$label kv=$kv fa=$fa ub=$ub @$(echo "$line" | cut -f11)"
        fi
    fi
    rm -f s.h5
}

# ---- where the time goes (the default settings: f16 KV, ubatch 512) -------
# wall and CPU seconds (user + system): on a shared machine the wall time
# says more about the neighbours than about kvdiff
timed() { # LABEL COMMAND...: one line, wall / cpu
    label=$1; shift
    /usr/bin/time -f '%e %U %S' -o time.txt "$@" >/dev/null 2>&1 </dev/null
    awk -v l="$label" '{ printf "  %-34s wall %6.1f s  cpu %6.1f s\n", l, $1, $2 + $3 }' time.txt
}
echo "where the time goes ($N-token prompt, $NEW new tokens, 1 thread):"
timed "reference, no dump" $K run --model "$M" --prompt-ids-file "$ids" --max-new $NEW \
    --ignore-eos --threads 1
timed "reference, full dump" $K run --model "$M" --prompt-ids-file "$ids" --max-new $NEW \
    --ignore-eos --threads 1 --dump t.h5
rm -f t.h5
timed "llama.cpp f16 KV, no recording" $L "$M.gguf" --hf "$M" --prompt-ids-file "$ids" \
    --max-new $NEW --ignore-eos --threads 1 --no-record
timed "llama.cpp f16 KV, recording" $L "$M.gguf" --hf "$M" --prompt-ids-file "$ids" \
    --max-new $NEW --ignore-eos --threads 1 --dump t.h5
timed "compare" $K compare "$ref" t.h5
rm -f t.h5

echo "legitimate settings ($GRID grid), $N-token prompt, $NEW new tokens:"
if [ "$GRID" = quick ]; then
    grid="f32:off:512 f16:on:64 q8_0:on:512 q4_0:on:512"
else
    grid=""
    for kv in f32 f16 bf16 q8_0 q4_0; do for fa in off on; do for ub in 64 512; do
        grid="$grid $kv:$fa:$ub"; done; done; done
fi
for s in $grid; do
    IFS=: read -r kv fa ub <<EOF
$s
EOF
    one correct "$M.gguf" "$kv" "$fa" "$ub"
done
echo "bugs written into the GGUF:"
printf '%s\n' "$BUGS" > bugs.txt
while IFS='|' read -r name g pos layer stage kind phrase; do
    for s in f32:off:512 f16:off:512 f16:on:64 bf16:off:512 q8_0:on:512 q4_0:on:512; do
        IFS=: read -r kv fa ub <<EOF
$s
EOF
        # (a quantized cache's rotated attn_out is rotated back by the
        # recorder: the step is at attn_out with every cache)
        one "$name" "$g" "$kv" "$fa" "$ub" "$pos|$layer|$stage|$kind|$phrase"
    done
done < bugs.txt

echo "SUMMARY $M $N tokens: $cases cases ($notrun settings llama.cpp refused), $alarms false" \
     "alarms, $missed missed bugs (no step found), $wrong mislocated or misdiagnosed; worst" \
     "drift ratio of a legitimate run $worst ($worst_at)"
