#!/usr/bin/env python3
"""precision_profile.py — what a correct runtime's own rounding asks of the
drift model's floor, stage by stage.

    python3 bench/precision_profile.py REF.h5 TEST.h5 [--eps U] [--gain 8] [--window 16]

Walks the two dumps as the cross-runtime model does (positions ascending,
stages in dataflow order; compare/crossrt.c) and, for each row, takes its
row-relative error err = max |test - ref| / max |ref|. A row that neither
upstream (gain x the largest error of the stages before it at this
position) nor its own stage's recent rows (gain x its largest error over
the window of positions before) explain must sit under the floor: its err
is what the floor has to hold. Prints, per stage, the largest such err,
in units of the compute type's unit roundoff U (default: from the test's
engine_settings compute_dtype: f32 2^-24, tf32 and f16 2^-11, bf16 2^-8),
and where it was; the largest err overall; and, over rows above the
floor (--floor, default 4e-3 + 3 U), the largest err / max(upstream,
own): the gain that rows a floor does not cover ask for. A measurement,
not a test.
"""
import argparse
import json
import sys

import h5py
import numpy as np

STAGES = ("x_in", "attn_norm_stats", "attn_norm", "q", "k", "v", "attn_lse", "attn_nkeys",
          "attn_out", "attn_proj", "h_mid", "ffn_norm_stats", "ffn_norm", "ffn_out", "x_out")
EPS = {"f32": 2.0 ** -24, "tf32": 2.0 ** -11, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}


def rows(f, path):
    d = f[path]
    return int(d.attrs.get("first_position", 0)), d


def errors(fr, ft, path):
    """{position: err} over the positions both hold."""
    r0, dr = rows(fr, path)
    t0, dt = rows(ft, path)
    lo, hi = max(r0, t0), min(r0 + dr.shape[0], t0 + dt.shape[0])
    if hi <= lo:
        return {}
    a = dr[lo - r0:hi - r0].astype(np.float64)
    b = dt[lo - t0:hi - t0].astype(np.float64)
    diff = np.abs(a - b).max(axis=1)
    den = np.abs(a).max(axis=1)
    bad = ~np.isfinite(b).all(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(diff == 0, 0.0, diff / den)
    e[bad] = np.inf
    return {lo + i: float(x) for i, x in enumerate(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref")
    ap.add_argument("test")
    ap.add_argument("--eps", type=float, default=0)
    ap.add_argument("--gain", type=float, default=8.0)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--floor", type=float, default=0,
                    help="rows at or under this error need no gain (default 4e-3 + 3 U)")
    a = ap.parse_args()
    with h5py.File(a.ref, "r") as fr, h5py.File(a.test, "r") as ft:
        settings = json.loads(ft.attrs.get("engine_settings", "{}"))
        cd = settings.get("compute_dtype", "?")
        eps = a.eps or EPS.get(cd, 2.0 ** -8)
        a.floor = a.floor or 4e-3 + 3 * eps
        order = []   # (layer, stage, {pos: err}) in dataflow order
        if "model/embed" in fr and "model/embed" in ft:
            order.append((-1, "embed", errors(fr, ft, "model/embed")))
        n = len(fr["layers"])
        for layer in range(n):
            g = f"layers/{layer}"
            for s in STAGES:
                if s in fr[g] and s in ft[g] and s != "attn_nkeys":
                    order.append((layer, s, errors(fr, ft, f"{g}/{s}")))
    positions = sorted({p for _, _, e in order for p in e})
    need = {}       # stage -> (err, pos, layer)
    worst = {}
    gain = {}       # stage -> (err / max(upstream, own), pos, layer) over rows above the floor
    for p in positions:
        upstream = 0.0
        for layer, s, e in order:
            if p not in e:
                continue
            err = e[p]
            own = max((e.get(q, 0.0) for q in range(p - a.window, p)), default=0.0)
            if err > a.gain * max(upstream, own) and err > need.get(s, (0,))[0]:
                need[s] = (err, p, layer)
            base = max(upstream, own)
            if err > a.floor and base > 0 and err / base > gain.get(s, (0,))[0]:
                gain[s] = (err / base, p, layer)
            if err > worst.get(s, (0,))[0]:
                worst[s] = (err, p, layer)
            upstream = max(upstream, err)
    print(f"# test compute_dtype {cd}, U = {eps:.3g}; err in units of U")
    print("stage            floor-bound err (U)  at (pos, layer)      largest err (U)  at"
          "              needed gain above the floor  at")
    for s in ("embed",) + STAGES:
        if s not in worst:
            continue
        ne, npos, nl = need.get(s, (0.0, -1, -1))
        we, wp, wl = worst[s]
        print(f"{s:16s} {ne:10.4g} ({ne / eps:6.2f})  ({npos:4d}, {nl:3d})     "
              f"{we:10.4g} ({we / eps:6.2f})  ({wp:4d}, {wl:3d})     "
              f"{gain.get(s, (0,))[0]:6.2f}  {gain.get(s, (0, -1, -1))[1:]}")


if __name__ == "__main__":
    sys.exit(main())
