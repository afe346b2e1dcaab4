#!/usr/bin/python3
"""f64_check.py - how far recorded runs are from exact arithmetic.

Usage: f64_check.py HF_DIR NAME=DUMP.h5 [NAME=DUMP.h5 ...]

HF_DIR is a Hugging Face folder (config.json, model.safetensors; llama,
qwen2 or gemma3_text; F32 weights) as `kvdiff gen --preset P -o DIR`
writes it. When it holds golden.safetensors and prompt.txt (the
conformance folders), those goldens are the float64 side; otherwise this
script runs its own float64 forward of the Hugging Face definition over
the first T positions of the first dump's /tokens (T = the dump's
prompt_length).

Each dump (a kvdiff or llama.cpp recording of the same prompt, with full
logits: `kvdiff run --dump-logits`, `kvdiff-llama --dump-logits`) is
compared per stage with the float64 result rounded to float32, as the
conformance goldens are: max|dump - f64| / max|f64| over the whole tensor
(all positions and heads), worst layer shown. One column per dump, so
kvdiff and llama.cpp read side by side.

Needs numpy and h5py (Debian's python3-numpy, python3-h5py).
"""
import json
import math
import os
import struct
import sys

import h5py
import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {t['dtype']}; this check wants F32 weights")
        a, b = t["data_offsets"]
        out[name] = data[a:b].view("<f4").reshape(t["shape"])
    return out


class Model:
    def __init__(self, d):
        self.cfg = json.load(open(os.path.join(d, "config.json")))
        c = self.cfg
        self.w = read_safetensors(os.path.join(d, "model.safetensors"))
        self.gemma = c["model_type"].startswith("gemma3")
        self.E = c["hidden_size"]
        self.H = c["num_attention_heads"]
        self.KV = c.get("num_key_value_heads", self.H)
        self.D = c.get("head_dim") or self.E // self.H
        self.L = c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        self.prefix = "model." if "model.embed_tokens.weight" in self.w else ""
        if self.gemma:
            self.scale = c["query_pre_attn_scalar"] ** -0.5
            self.types = c.get("layer_types") or [
                "full_attention" if (i + 1) % c["sliding_window_pattern"] == 0
                else "sliding_attention" for i in range(self.L)]
        else:
            self.scale = self.D ** -0.5
            self.types = ["full_attention"] * self.L
        rs = c.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
            raise SystemExit("rope_scaling is not modelled here")

    def t(self, name):
        return np.asarray(self.w[self.prefix + name], dtype=np.float64)

    def norm(self, x, w):
        inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * inv * ((1.0 + w) if self.gemma else w)

    def rope(self, x, theta):
        T, D = x.shape[0], self.D
        inv = theta ** (-np.arange(0, D // 2, dtype=np.float64) * 2.0 / D)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        lo, hi = x[..., : D // 2], x[..., D // 2:]
        return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)

    def forward(self, ids):
        c, T, E, H, KV, D = self.cfg, len(ids), self.E, self.H, self.KV, self.D
        out = {}
        emb = self.w[self.prefix + "embed_tokens.weight"]
        x = np.asarray(emb[ids], dtype=np.float64)
        if self.gemma:
            x = x * float(np.float32(math.sqrt(E)))
        for l in range(self.L):
            p = f"layers.{l}."
            lin = lambda n, v: v @ self.t(p + n + ".weight").T + (
                self.t(p + n + ".bias") if (self.prefix + p + n + ".bias") in self.w else 0.0)
            xn = self.norm(x, self.t(p + "input_layernorm.weight"))
            q = lin("self_attn.q_proj", xn).reshape(T, H, D)
            k = lin("self_attn.k_proj", xn).reshape(T, KV, D)
            v = lin("self_attn.v_proj", xn).reshape(T, KV, D)
            sliding = self.types[l] == "sliding_attention"
            theta = c["rope_theta"]
            if self.gemma:
                q = self.norm(q, self.t(p + "self_attn.q_norm.weight"))
                k = self.norm(k, self.t(p + "self_attn.k_norm.weight"))
                if sliding:
                    theta = c.get("rope_local_base_freq", 10000.0)
            q, k = self.rope(q, theta), self.rope(k, theta)
            out[("q", l)], out[("k", l)], out[("v", l)] = q, k, v
            kk = np.repeat(k, H // KV, axis=1)
            vv = np.repeat(v, H // KV, axis=1)
            s = np.einsum("ihd,jhd->hij", q, kk) * self.scale
            i, j = np.arange(T)[:, None], np.arange(T)[None, :]
            mask = j <= i
            if sliding:
                mask &= j > i - c["sliding_window"]
            s = np.where(mask[None], s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            att = np.einsum("hij,jhd->ihd", s, vv).reshape(T, H * D)
            out[("attn_out", l)] = att
            o = lin("self_attn.o_proj", att)
            if self.gemma:
                o = self.norm(o, self.t(p + "post_attention_layernorm.weight"))
                h = x + o
                hn = self.norm(h, self.t(p + "pre_feedforward_layernorm.weight"))
            else:
                h = x + o
                hn = self.norm(h, self.t(p + "post_attention_layernorm.weight"))
            g, u = lin("mlp.gate_proj", hn), lin("mlp.up_proj", hn)
            if self.gemma:
                a = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
            else:
                a = g / (1.0 + np.exp(-g))
            f = lin("mlp.down_proj", a * u)
            if self.gemma:
                f = self.norm(f, self.t(p + "post_feedforward_layernorm.weight"))
            x = h + f
            out[("x_out", l)] = x
        fn = self.norm(x, self.t("norm.weight"))
        out[("final_norm", -1)] = fn
        head = self.w.get("lm_head.weight")
        if head is None:
            head = emb
        logits = np.empty((T, head.shape[0]))
        for r0 in range(0, head.shape[0], 16384):
            logits[:, r0:r0 + 16384] = fn @ np.asarray(head[r0:r0 + 16384], dtype=np.float64).T
        cap = c.get("final_logit_softcapping")
        if cap:
            logits = cap * np.tanh(logits / cap)
        out[("logits", -1)] = logits
        return out


def goldens(d, L):
    g = read_safetensors_any(os.path.join(d, "golden.safetensors"))
    out = {}
    for name, a in g.items():
        a = np.asarray(a, dtype=np.float64)
        if name.startswith("layers."):
            _, l, st = name.split(".", 2)
            out[(st, int(l))] = a.reshape(a.shape[0], -1)
        elif name != "embed":
            out[(name, -1)] = a
    return out


def read_safetensors_any(path):
    return read_safetensors(path)


def dump_rows(f, st, layer, T):
    path = f"layers/{layer}/{st}" if layer >= 0 else f"model/{st}"
    if path not in f:
        return None
    ds = f[path]
    first = int(ds.attrs.get("first_position", 0))
    if first != 0 or ds.shape[0] < T:
        return None
    return np.asarray(ds[:T], dtype=np.float64)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    d = sys.argv[1]
    dumps = [a.split("=", 1) for a in sys.argv[2:]]
    files = [(n, h5py.File(p, "r")) for n, p in dumps]
    m = Model(d)
    if os.path.exists(os.path.join(d, "golden.safetensors")):
        ref = goldens(d, m.L)
        T = next(iter(ref.values())).shape[0]
    else:
        f0 = files[0][1]
        T = int(f0["tokens"].attrs.get("prompt_length", len(f0["tokens"])))
        ids = np.asarray(f0["tokens"][:T], dtype=np.int64)
        for n, f in files[1:]:
            if not np.array_equal(np.asarray(f["tokens"][:T]), ids):
                sys.exit(f"{n}: its prompt differs from {files[0][0]}'s")
        ref = m.forward(ids)
    # Layer 0's q, k, v come before any activation function: a runtime
    # whose GELU is a lookup table (llama.cpp's default build) is compared
    # fairly there, whatever its later layers show.
    stages = ["q", "k", "v", "attn_out", "x_out", "logits", "q@0", "k@0", "v@0"]
    print(f"{os.path.basename(os.path.normpath(d))}: {T} positions, max|run - f64| / max|f64| "
          "(worst layer)")
    print(f"{'stage':<11}" + "".join(f"{n:>22}" for n, _ in files))
    for st in stages:
        row = f"{st:<11}"
        for _, f in files:
            worst, where = None, None
            name, only = (st.split("@")[0], int(st.split("@")[1])) if "@" in st else (st, None)
            for (s, l), want in ref.items():
                if s != name or (only is not None and l != only):
                    continue
                got = dump_rows(f, name, l, T)
                if got is None:
                    continue
                w32 = want.reshape(T, -1).astype(np.float32).astype(np.float64)
                rel = np.max(np.abs(got - w32)) / np.max(np.abs(w32))
                if worst is None or rel > worst:
                    worst, where = rel, l
            if worst is None:
                row += f"{'-':>22}"
            else:
                row += f"{worst:>15.2e}" + (f" (L{where:<2})" if where >= 0 else " " * 6)
        print(row)


if __name__ == "__main__":
    main()
