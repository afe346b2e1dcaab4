#!/bin/sh
# xrt_sweep.sh — cross-runtime verdicts over legitimate llama.cpp settings
# and two bugs written into the GGUF metadata (docs/cross-runtime.md,
# "Measured"). One line per run: exit code, the step found, drift's closest
# approach to its threshold. Needs python3 (patching and reading JSON).
#   sh bench/xrt_sweep.sh [TOKENS] [DIR]     (from the repository root,
#   after `make kvdiff recorders`)
set -u
N=${1:-120}; D=${2:-/tmp/kvdiff-xrt-sweep}
K=$PWD/build/kvdiff; L=$PWD/kvdiff-llama
mkdir -p "$D" && cd "$D" || exit 2
patch_gguf() { # IN OUT KEY VALUE: one u32 or f32 metadata value rewritten
python3 - "$@" <<'PY'
import struct,sys
fn,out,key,val=sys.argv[1:5]
b=bytearray(open(fn,'rb').read()); o=24
nkv=struct.unpack_from('<Q',b,16)[0]
size={0:1,1:1,2:2,3:2,4:4,5:4,6:4,7:1,10:8,11:8,12:8}
def skip(t,o):
    if t==8: return o+8+struct.unpack_from('<Q',b,o)[0]
    if t==9:
        at,n=struct.unpack_from('<IQ',b,o); o+=12
        for _ in range(n): o=skip(at,o)
        return o
    return o+size[t]
for _ in range(nkv):
    n=struct.unpack_from('<Q',b,o)[0]; k=b[o+8:o+8+n].decode(); o+=8+n
    t=struct.unpack_from('<I',b,o)[0]; o+=4
    if k==key: struct.pack_into('<I' if t==4 else '<f',b,o,int(val) if t==4 else float(val))
    o=skip(t,o)
open(out,'wb').write(b)
PY
}
for p in tiny-llama tiny-qwen2 tiny-gemma3; do
  [ -f $p.gguf ] || $K gen --preset $p -o $p --gguf $p.gguf >/dev/null
  [ -f $p-ref$N.h5 ] || $K run --model $p --prompt-random $N --seed 3 --max-new 4 \
      --ignore-eos --dump $p-ref$N.h5 >/dev/null
done
patch_gguf tiny-gemma3.gguf g3-w4.gguf gemma3.attention.sliding_window 4
patch_gguf tiny-gemma3.gguf g3-rope.gguf gemma3.rope.freq_base_swa 1000000
for g in tiny-llama tiny-qwen2 tiny-gemma3 g3-w4 g3-rope; do
  case $g in g3-*) p=tiny-gemma3;; *) p=$g;; esac
  for kv in f32 f16 bf16 q8_0; do for fa in off on; do for ub in 1 7 64 $((N+4)); do
    rm -f s.h5
    if ! $L $g.gguf --hf $p --prompt-from $p-ref$N.h5 --max-new 4 --ignore-eos --threads 1 \
        --cache-type $kv --flash-attn $fa --ubatch $ub --dump s.h5 >rec.log 2>&1; then
      echo "$g kv=$kv fa=$fa ub=$ub not-run: $(head -c 100 rec.log)"; continue; fi
    $K compare $p-ref$N.h5 s.h5 --json > c.json; rc=$?
    python3 - $g $kv $fa $ub $rc <<'PY'
import json,sys
g,kv,fa,ub,rc=sys.argv[1:]
j=json.load(open('c.json')); x=j['mode']['cross_runtime']; d=j['first_divergence']
w=x['drift_closest'] or {}
loc='-' if not d else '%d/%d/%s'%(d['position'],d['layer'],d['stage'])
print(f"{g} kv={kv} fa={fa} ub={ub} exit={rc} step={loc} closest={w.get('ratio',0):.3g}"
      f"@{w.get('position')}/{w.get('layer')}/{w.get('stage')}")
PY
  done; done; done
done
