#!/usr/bin/env python3
"""noise_sweep.py — how well a cascade noise floor separates drift from bugs.

For N random configurations (preset, weights seed, prompt, prompt length
past the sliding window, chunk sizes, cache layouts, max-new) it records:

  ref    the reference engine;
  test   the chunked engine with cascade attention, chunk A, cache X;
  noise  another cascade run, chunk B != A, cache Y;

and runs `kvdiff compare ref test --noise-floor noise`: a clean
configuration that exits 1 is a false alarm (one that exits 2 is counted
apart: a noise recording that shows no drift is refused). Then, for every injection that
applies to the configuration, it records the injected run twice — exact
attention (compared in exact mode: where the bug really is) and cascade
(compared with the noise floor) — and counts a miss when the cascade
comparison exits 0 or locates the first divergence at another
(position, layer, stage) than the exact one. Injected runs that are
bit-identical to the reference in exact mode (the bug never triggers in
that configuration) are skipped.

usage: bench/noise_sweep.py [--n 40] [--seed 1] [--kvdiff build/kvdiff] [-v]
Prints one line per configuration (with -v every injection, else only the
misses) and the totals; exit 0 always (a measurement, not a test).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

PRESETS = ["tiny-gemma3", "tiny-gemma3-kvshared", "tiny-qwen2", "tiny-llama"]
SLIDING = {"tiny-gemma3", "tiny-gemma3-kvshared"}
WINDOW = 12


def run(kv, args, check=True):
    p = subprocess.run([kv] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        sys.exit("failed: %s\n%s" % (" ".join(args), p.stderr))
    return p


def record(kv, cfg, path, engine=None, inject=None):
    a = ["run", "--model", cfg["model"], "--weights-seed", str(cfg["ws"]), "--prompt-random",
         str(cfg["P"]), "--seed", str(cfg["seed"]), "--max-new", str(cfg["new"]),
         "--ignore-eos", "--threads", "1", "--dump", path]
    if engine:
        attn, chunk, cache = engine
        a += ["--engine", "chunked", "--attn", attn, "--chunk", str(chunk), "--cache", cache]
    if inject:
        a += ["--inject", inject]
    run(kv, a)


def compare(kv, ref, test, noise=None):
    a = ["compare", ref, test, "--json"]
    if noise:
        a += ["--noise-floor", noise]
    p = run(kv, a, check=False)
    if p.returncode == 2:
        return 2, p.stderr.strip(), None
    d = json.loads(p.stdout)
    f = d["first_divergence"]
    loc = (f["position"], f["layer"], f["stage"]) if f else None
    compare.row_rel = f["row_rel"] if f else None
    return p.returncode, loc, (d["diagnosis"] or {}).get("kind")


def injections(cfg):
    inj = ["isolated-chunks", "isolated-chunks-pos", "rope-offset=3"]
    if cfg["model"] in SLIDING:
        inj += ["window=%d" % random.randint(2, WINDOW - 2), "stale-local"]
        if cfg["cache"] == "ring":
            inj.append("ring-no-wrap")
    if cfg["model"] == "tiny-gemma3-kvshared":
        inj.append("zero-shared-kv")
    if cfg["cache"] == "split":
        inj.append("split-mask-off-by-one")
    if cfg["new"] >= 2:
        inj.append("decode-index-stuck")
    return inj


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kvdiff", default="build/kvdiff")
    ap.add_argument("-v", action="store_true")
    o = ap.parse_args()
    random.seed(o.seed)
    kv = os.path.abspath(o.kvdiff)
    alarms = misses = injected = refused = 0
    smallest = float("inf")   # row-relative error of an injected bug where found
    with tempfile.TemporaryDirectory() as tmp:
        ref, test, noise = (os.path.join(tmp, n + ".h5") for n in ("ref", "test", "noise"))
        tex, tcs = os.path.join(tmp, "tex.h5"), os.path.join(tmp, "tcs.h5")
        for i in range(o.n):
            cfg = {"model": random.choice(PRESETS), "ws": random.randint(0, 999),
                   "seed": random.randint(0, 999), "P": random.randint(WINDOW + 2, 72),
                   "new": random.randint(0, 8), "cache": random.choice(["dense", "split", "ring"])}
            top = min(24, cfg["P"] + cfg["new"])   # a chunk fits the context
            cfg["A"] = random.randint(2, top)
            cfg["B"] = random.choice([b for b in range(2, top + 1) if b != cfg["A"]])
            cfg["ncache"] = random.choice(["dense", "split", "ring"])
            record(kv, cfg, ref)
            record(kv, cfg, test, ("cascade", cfg["A"], cfg["cache"]))
            record(kv, cfg, noise, ("cascade", cfg["B"], cfg["ncache"]))
            rc, loc, kind = compare(kv, ref, test, noise)
            alarms += rc == 1
            refused += rc == 2
            line = "%2d %-21s ws=%-3d seed=%-3d P=%-2d new=%d A=%-2d %-5s B=%-2d %-5s clean rc=%d" % (
                i, cfg["model"], cfg["ws"], cfg["seed"], cfg["P"], cfg["new"], cfg["A"],
                cfg["cache"], cfg["B"], cfg["ncache"], rc)
            if rc == 1:
                line += " at %s (%s)" % (loc, kind)
            if rc == 2:   # the noise recording cannot set a floor: nothing to judge
                print(line + " refused: " + loc, flush=True)
                continue
            for inj in injections(cfg):
                record(kv, cfg, tex, ("exact", cfg["A"], cfg["cache"]), inj)
                rce, loce, kinde = compare(kv, ref, tex)
                if rce == 0:
                    if o.v:
                        line += "\n     %s: no effect" % inj
                    continue
                injected += 1
                record(kv, cfg, tcs, ("cascade", cfg["A"], cfg["cache"]), inj)
                rcc, locc, kindc = compare(kv, ref, tcs, noise)
                if rcc == 1:
                    smallest = min(smallest, compare.row_rel)
                miss = rcc != 1 or locc != loce
                misses += miss
                if miss or o.v:
                    line += "\n     %s: exact %s %s, floor rc=%d %s %s%s" % (
                        inj, loce, kinde, rcc, locc, kindc, "  MISS" if miss else "")
            print(line, flush=True)
    print("false alarms: %d of %d clean configurations (%d refused)" % (alarms, o.n, refused))
    print("misses: %d of %d injected configurations (smallest row-relative error where "
          "found: %.3g)" % (misses, injected, smallest))


if __name__ == "__main__":
    main()
