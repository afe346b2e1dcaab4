#!/usr/bin/env python3
"""precision_sweep.py — cross-runtime verdicts in the precisions runtimes
compute in, at real scale, counted.

    python3 bench/precision_sweep.py [--presets "gemma3-1b-shape qwen3-0.6b-shape"]
                                     [--tokens 640] [--dtypes "f32 bf16 f16"]
                                     [--bugs all|none] [--tsv FILE] [--profile] [DIR]

For each preset: `kvdiff gen --dtype bf16` writes the model folder (bf16
weights, as the released checkpoints), kvdiff's reference records a
prompt of --tokens random ids plus 4 generated ones, then the torch model
(python/examples/tiny_torch.py, the stand-in for transformers) runs in
each --dtype: correct (sdpa, the prompt whole; eager, in chunks of 128)
and with each bug it can plant that the preset has the layers for:

  window     sliding layers read half the config's window    (W/2, first sliding layer, attn_out)
  layers     layers 4 and 5 trade sliding / global           (1, 4, q)
  rope       Gemma: sliding layers rotate with the global base; others: base 1e4
                                                              (1, 0, q)
  drop-key   key N-5 gone after the prefill                  (N, 0, attn_out)
  blind      decode steps read no key of the prompt          (N, 0, attn_out)
  global-window  the global layers read the sliding window   (W, first global layer, attn_out)
  own-masked the query's own key masked (j < q)              (0, 0, attn_out)
  kv-swap    layer 0's k_proj and v_proj weights swapped     (0, 0, k)
  norm-eps   every RMSNorm with epsilon 0.1                  (0, 0, attn_norm)
  attn-scale the scores scaled by sqrt(2) times the config's  (1, 0, attn_out)

and `kvdiff compare REF TEST --json` judges it. One line per run; then per
dtype: legitimate runs and false alarms, bug runs located at their exact
(position, layer, stage), named (the diagnosis kind expected), and
undecided (several causes named, the expected one among them: the data
cannot tell them apart, e.g. attn_out alone over decode steps of one
repeated token, and the text says what would). Exit 0
always: a measurement, not a test. Each 1B run takes about 1.5 minutes on
two cores (torch with OpenBLAS) and writes about 0.8 GB, removed after
its compare. From the repository root, after `make kvdiff`.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVDIFF = os.path.join(ROOT, "build", "kvdiff")
TINY = os.path.join(ROOT, "python", "examples", "tiny_torch.py")
PROFILE = os.path.join(ROOT, "bench", "precision_profile.py")
TORCH_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
MAX_NEW = 4

sys.path.insert(0, os.path.join(ROOT, "python"))
from kvdiff_record.config import model_config_from_hf  # noqa: E402


def run(args, **kw):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    return p.returncode, p.stdout


def bugs_for(cfg, n):
    """(name, faults, expected (position, layer, stage), expected kind)."""
    types = cfg["layer_types"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    out = []
    if sliding and cfg["sliding_window"] and cfg["sliding_window"] < n:
        w = cfg["sliding_window"] // 2
        out.append(("window", [f"window={w}"], (w, sliding[0], "attn_out"), "window"))
    if len(types) > 5 and types[4] != types[5]:
        swapped = 4 if types[4] == "sliding_attention" else 5
        out.append(("layers", ["swap-layer-types=4,5"], (1, min(4, swapped), "q"),
                    "layer_type"))
    if sliding:
        out.append(("rope", [f"rope-base-local={cfg['rope_theta']:g}"],
                    (1, sliding[0], "q"), "rope_convention"))
    else:
        out.append(("rope", ["rope-base=10000"], (1, 0, "q"), "rope_convention"))
    out.append(("drop-key", [f"drop-key={n - 5}"], (n, 0, "attn_out"), "missing_key"))
    out.append(("blind", ["decode-blind"], (n, 0, "attn_out"), "split_decode_blind"))
    glob = [i for i, t in enumerate(types) if t != "sliding_attention"]
    if sliding and glob and cfg["sliding_window"] and cfg["sliding_window"] < n:
        w = cfg["sliding_window"]
        out.append(("global-window", [f"global-window={w}"], (w, glob[0], "attn_out"),
                    "layer_type"))
    out.append(("own-masked", ["own-key-masked"], (0, 0, "attn_out"), "own_key_masked"))
    out.append(("kv-swap", ["kv-swap=0"], (0, 0, "k"), "kv_swapped"))
    out.append(("norm-eps", ["norm-eps=0.1"], (0, 0, "attn_norm"), "norm_eps"))
    out.append(("attn-scale", ["attn-scale=1.41421356"], (1, 0, "attn_out"), "attn_scale"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="/tmp/kvdiff-precision-sweep")
    ap.add_argument("--presets", default="gemma3-1b-shape qwen3-0.6b-shape")
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--dtypes", default="f32 bf16 f16")
    ap.add_argument("--bugs", default="all", choices=["all", "none"])
    ap.add_argument("--tsv", help="append one line per run to this file")
    ap.add_argument("--profile", action="store_true",
                    help="print bench/precision_profile.py's table for each correct run")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rows = []
    for preset in a.presets.split():
        folder = os.path.join(a.dir, preset)
        if not os.path.exists(os.path.join(folder, "model.safetensors")):
            rc, out = run([KVDIFF, "gen", "--preset", preset, "--dtype", "bf16", "-o", folder])
            if rc:
                sys.exit(f"gen {preset}: {out}")
        cfg = model_config_from_hf(folder)
        ref = os.path.join(a.dir, f"{preset}-ref.h5")
        rc, out = run([KVDIFF, "run", "--model", folder, "--prompt-random", str(a.tokens),
                       "--seed", "5", "--max-new", str(MAX_NEW), "--dump", ref])
        if rc:
            sys.exit(f"reference {preset}: {out}")
        ids = os.path.join(a.dir, f"{preset}-prompt.txt")
        rc, out = run([TORCH_PY, "-c", "import h5py,sys; f=h5py.File(sys.argv[1],'r'); "
                       "n=int(f['tokens'].attrs['prompt_length']); "
                       "print(' '.join(map(str, f['tokens'][:n])))", ref])
        with open(ids, "w", encoding="utf-8") as f:
            f.write(out)
        cases = [("ok", [], "sdpa", 0, None, None), ("ok-eager-c128", [], "eager", 128, None, None)]
        if a.bugs == "all":
            cases += [(n, fl, "sdpa", 0, where, kind)
                      for n, fl, where, kind in bugs_for(cfg, a.tokens)]
        for dtype in a.dtypes.split():
            for name, faults, attn, chunk, where, kind in cases:
                dump = os.path.join(a.dir, f"{preset}-{dtype}-{name}.h5")
                args = [TORCH_PY, TINY, "--model", folder, "--tokens", ids, "--max-new",
                        str(MAX_NEW), "--dump", dump, "--dtype", dtype, "--attn", attn,
                        "--chunk", str(chunk)]
                for fl in faults:
                    args += ["--fault", fl]
                t0 = time.time()
                rc, out = run(args)
                if rc:
                    print(f"{preset} {dtype} {name}: torch run failed: {out[-500:]}")
                    continue
                rc, out = run([KVDIFF, "compare", ref, dump, "--json"])
                secs = time.time() - t0
                if a.profile and where is None:
                    _, prof = run([TORCH_PY, PROFILE, ref, dump])
                    print(f"# profile {preset} {dtype} {name}\n{prof}", end="", flush=True)
                os.unlink(dump)
                try:
                    j = json.loads(out)
                except ValueError:
                    print(f"{preset} {dtype} {name}: compare exit {rc}: {out[-500:]}")
                    continue
                d = j.get("first_divergence") or {}
                got = (d.get("position"), d.get("layer"), d.get("stage")) if d else None
                g = j.get("diagnosis") or {}
                x = (j.get("mode") or {}).get("cross_runtime") or {}
                closest = x.get("drift_closest") or {}
                if where is None:
                    verdict = "ok" if rc == 0 else "FALSE-ALARM"
                else:
                    located = got == where
                    named = located and g.get("kind") == kind and not g.get("undecided")
                    # several causes named, the planted one among them: honest
                    among = any(h.get("kind") == kind and h.get("status") == "remains"
                                for h in g.get("hypotheses") or [])
                    undecided = located and bool(g.get("undecided")) and among
                    verdict = ("named" if named else "undecided" if undecided
                               else "located" if located else "MISPLACED")
                line = (f"{preset}\t{dtype}\t{name}\t{verdict}\texit={rc}\tat={got}\t"
                        f"kind={g.get('kind')}\tstep={x.get('step_error')}/"
                        f"{x.get('step_threshold')}\tclosest={closest.get('ratio')}"
                        f"@{closest.get('position')},{closest.get('layer')},"
                        f"{closest.get('stage')}\t{secs:.0f}s")
                print(line, flush=True)
                rows.append((preset, dtype, name, verdict))
                if a.tsv:
                    with open(a.tsv, "a", encoding="utf-8") as f:
                        f.write(f"{time.strftime('%Y-%m-%d')}\t{a.tokens}\t{line}\n")
        os.unlink(ref)
    print("\ndtype  legitimate  false-alarms  bugs  located  named  undecided")
    for dtype in a.dtypes.split():
        r = [x for x in rows if x[1] == dtype]
        legit = [x for x in r if x[3] in ("ok", "FALSE-ALARM")]
        bug = [x for x in r if x not in legit]
        print(f"{dtype:5s}  {len(legit):10d}  {sum(x[3] == 'FALSE-ALARM' for x in legit):12d}  "
              f"{len(bug):4d}  {sum(x[3] in ('located', 'named', 'undecided') for x in bug):7d}  "
              f"{sum(x[3] == 'named' for x in bug):5d}  "
              f"{sum(x[3] == 'undecided' for x in bug):9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
