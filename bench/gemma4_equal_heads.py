#!/usr/bin/env python3
"""gemma4_equal_heads.py — a Gemma 4 folder whose full layers have the
sliding layers' head size, KV head count and their own v_proj, so that a
runtime can run any layer as either type with the same tensors (for
bench/xrt_sweep.sh: a GGUF whose layer pattern says a sliding layer is
full, run by llama.cpp, against the folder's own config).

    gemma4_equal_heads.py IN OUT

IN: a Gemma 4 folder of f32 tensors (`kvdiff gen --preset tiny-gemma4`).
Each full layer keeps the first heads of its q_proj and o_proj (as many
rows as the sliding layers' head size allows), the first entries of its
q/k norms, its k_proj read as the sliding layers' KV heads, and gains a
v_proj (k_proj's rows reversed). config.json: global_head_dim,
num_global_key_value_heads and attention_k_eq_v follow. numpy only.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np


def read_st(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    meta = head.pop("__metadata__", None)
    out = {}
    for k, v in head.items():
        if v["dtype"] != "F32":
            sys.exit(f"{path}: {k} is {v['dtype']}, not F32")
        s, e = v["data_offsets"]
        out[k] = np.frombuffer(b[8 + n + s:8 + n + e], dtype="<f4").reshape(v["shape"])
    return out, meta


def write_st(path, tensors, meta):
    head, off, blobs = {}, 0, []
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k], dtype="<f4")
        head[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        blobs.append(a.tobytes())
    if meta:
        head["__metadata__"] = meta
    h = json.dumps(head, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".part"
    with open(tmp, "xb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.rename(tmp, path)


def main():
    src, dst = sys.argv[1:3]
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    D = text["head_dim"]
    KV = text["num_key_value_heads"]
    types = text["layer_types"]
    t, meta = read_st(os.path.join(src, "model.safetensors"))
    prefix = next(k[:k.index("layers.")] for k in t if "layers." in k)
    for i, ty in enumerate(types):
        if ty == "sliding_attention":
            continue
        p = f"{prefix}layers.{i}.self_attn."
        H = t[p + "q_proj.weight"].shape[0] // text["global_head_dim"]
        t[p + "q_proj.weight"] = t[p + "q_proj.weight"][:H * D]
        t[p + "o_proj.weight"] = t[p + "o_proj.weight"][:, :H * D]
        t[p + "q_norm.weight"] = t[p + "q_norm.weight"][:D]
        if p + "k_proj.weight" in t:      # not a KV-shared layer
            k = t[p + "k_proj.weight"]
            if k.shape[0] != KV * D:
                sys.exit(f"layer {i}: k_proj has {k.shape[0]} rows, not {KV} x {D}")
            t[p + "k_norm.weight"] = t[p + "k_norm.weight"][:D]
            if p + "v_proj.weight" not in t:
                t[p + "v_proj.weight"] = k[::-1].copy()
    text["global_head_dim"] = D
    text["num_global_key_value_heads"] = KV
    text["attention_k_eq_v"] = False
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    write_st(os.path.join(dst, "model.safetensors"), t, meta)


if __name__ == "__main__":
    main()
