#!/usr/bin/env python3
"""A small pure-PyTorch Llama / Qwen2 / Gemma 3 (text) that loads a Hugging
Face folder (kvdiff gen writes one) with Hugging Face's module names, and
records its greedy generation with kvdiff_record.TorchHooks. It stands in
for transformers (not packaged by Debian) so the recorder, the hooks and
the cross-runtime compare are tested on a real, different runtime.

    python3 tiny_torch.py --model DIR --tokens FILE --max-new N --dump OUT.h5

FILE holds the prompt's token ids, separated by white space. Exit 0 when
the dump is written complete, 2 on bad input."""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvdiff_record import Recorder, model_config_from_hf  # noqa: E402
from kvdiff_record.torch_hooks import TorchHooks, hf_names  # noqa: E402


def load_safetensors(path):
    """{name: float32 numpy array} from a .safetensors file (F32, BF16, F16):
    an 8-byte little-endian header length, a JSON header, then the data."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        raw = data[lo:hi]
        if t["dtype"] == "F32":
            a = np.frombuffer(raw, "<f4")
        elif t["dtype"] == "F16":
            a = np.frombuffer(raw, "<f2").astype(np.float32)
        elif t["dtype"] == "BF16":
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name}: dtype {t['dtype']} not read here")
        out[name] = a.reshape(t["shape"]).copy()
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, gemma):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return y * ((1.0 + self.weight) if self.gemma else self.weight)


def rope(x, positions, theta):
    """Rotate-half RoPE of x [heads, T, D]; angles in double (DESIGN.md)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class Attention(nn.Module):
    def __init__(self, c, gemma):
        super().__init__()
        h, kv, d, e = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                       c["hidden_size"])
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(e, h * d, bias=False)
        self.k_proj = nn.Linear(e, kv * d, bias=False)
        self.v_proj = nn.Linear(e, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, e, bias=False)
        if gemma:
            self.q_norm = RMSNorm(d, c["rms_norm_eps"], True)
            self.k_norm = RMSNorm(d, c["rms_norm_eps"], True)
        self.gemma = gemma

    def forward(self, x, positions, past, theta, window, scale):
        t = x.shape[1]
        q = self.q_proj(x)[0].view(t, self.h, self.d).transpose(0, 1)
        k = self.k_proj(x)[0].view(t, self.kv, self.d).transpose(0, 1)
        v = self.v_proj(x)[0].view(t, self.kv, self.d).transpose(0, 1)
        if self.gemma:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        if past is not None:
            k = torch.cat([past[0][0], k], 1)
            v = torch.cat([past[1][0], v], 1)
        n = k.shape[1]
        rep = self.h // self.kv
        kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = (q @ kk.transpose(1, 2)) * scale
        kpos = torch.arange(n)
        mask = kpos[None, :] > positions[:, None]
        if window:
            mask |= kpos[None, :] <= positions[:, None] - window
        scores = scores.masked_fill(mask[None], float("-inf"))
        out = torch.softmax(scores, -1) @ vv
        out = out.transpose(0, 1).reshape(1, t, self.h * self.d)
        return self.o_proj(out), (k[None], v[None])


class MLP(nn.Module):
    def __init__(self, c, gemma):
        super().__init__()
        e, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(e, i, bias=False)
        self.up_proj = nn.Linear(e, i, bias=False)
        self.down_proj = nn.Linear(i, e, bias=False)
        self.act = (lambda g: nn.functional.gelu(g, approximate="tanh")) if gemma else \
            nn.functional.silu

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, gemma):
        super().__init__()
        eps = c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(c["hidden_size"], eps, gemma)
        self.self_attn = Attention(c, gemma)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps, gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(c["hidden_size"], eps, True)
            self.post_feedforward_layernorm = RMSNorm(c["hidden_size"], eps, True)
        self.mlp = MLP(c, gemma)
        self.gemma = gemma

    def forward(self, x, positions, past, theta, window, scale):
        a, cache = self.self_attn(self.input_layernorm(x), positions, past, theta, window, scale)
        if self.gemma:
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), cache
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache


class Inner(nn.Module):
    def __init__(self, c, gemma):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c, gemma) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"], gemma)


class TinyCausalLM(nn.Module):
    """model(input_ids [1, T], past) -> (logits [1, T, V], past): past is a
    tuple of (k, v) per layer, [1, KV heads, positions, D], post-RoPE."""

    def __init__(self, folder):
        super().__init__()
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        self.config = model_config_from_hf(folder)
        c = self.config
        self.gemma = c["model_type"] == "gemma3_text"
        self.model = Inner(c, self.gemma)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        w = load_safetensors(os.path.join(folder, "model.safetensors"))
        if "lm_head.weight" not in w:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]   # tied
        self.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        # Gemma's sqrt(hidden) embedding scale is a float32 value (DESIGN.md).
        self.embed_scale = float(np.float32(math.sqrt(c["hidden_size"]))) if self.gemma else 1.0
        del hf

    @torch.no_grad()
    def forward(self, input_ids, past=None):
        c = self.config
        start = 0 if past is None else past[0][0].shape[2]
        t = input_ids.shape[1]
        positions = torch.arange(start, start + t)
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        new = []
        for i, layer in enumerate(self.model.layers):
            sliding = c["layer_types"][i] == "sliding_attention"
            theta = c["rope_local_base_freq"] if sliding else c["rope_theta"]
            x, cache = layer(x, positions, None if past is None else past[i], theta,
                             c["sliding_window"] if sliding else 0, c["attn_scale"])
            new.append(cache)
        return self.lm_head(self.model.norm(x)), tuple(new)


def generate_and_record(folder, prompt, max_new, dump, engine="pytorch"):
    """Greedy generation as `kvdiff run` does it (one prefill of the whole
    prompt, then a decode step per token but the last), recorded to dump.
    Returns the generated ids."""
    model = TinyCausalLM(folder)
    c = model.config
    settings = {"chunk": len(prompt), "cache": "dense", "cache_type": "f32",
                "runtime": f"torch {torch.__version__}"}
    with Recorder(dump, c, engine=engine, settings=settings) as rec:
        hooks = TorchHooks(rec, model, hf_names(c["model_type"]),
                           output_from=len(prompt) - 1)
        ids = list(prompt)
        past, pos, feed = None, 0, list(prompt)
        generated = []
        while True:
            with hooks.step(pos):
                logits, past = model(torch.tensor([feed]), past)
            hooks.record_cache(past)
            pos += len(feed)
            nxt = int(torch.argmax(logits[0, -1]))
            generated.append(nxt)
            ids.append(nxt)
            rec.tokens(ids, len(prompt))
            if len(generated) >= max_new:
                break
            feed = [nxt]
        hooks.remove()
    return generated


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, help="file of prompt token ids")
    p.add_argument("--max-new", type=int, default=4)
    p.add_argument("--dump", required=True)
    a = p.parse_args(argv)
    try:
        with open(a.tokens, encoding="utf-8") as f:
            prompt = [int(x) for x in f.read().split()]
    except (OSError, ValueError) as exc:
        print(f"tiny_torch: {a.tokens}: {exc}", file=sys.stderr)
        return 2
    if not prompt or a.max_new < 1:
        print("tiny_torch: need a prompt and --max-new >= 1", file=sys.stderr)
        return 2
    out = generate_and_record(a.model, prompt, a.max_new, a.dump)
    print("generated", " ".join(map(str, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
