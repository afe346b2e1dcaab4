#!/usr/bin/env python3
"""A small pure-PyTorch Llama (3) / Qwen2 / Qwen3 / Gemma 3 / Gemma 4 (text:
per-layer head sizes, v from k, proportional RoPE, KV-shared layers,
double-wide MLPs, per-layer inputs, layer scalars) / gpt-oss (attention
sinks, YaRN, a mixture of experts: tiny_gpt_oss.py) / DeepSeek-V2, V3
(latent attention, shared experts: tiny_deepseek.py) that loads a
Hugging Face folder (kvdiff gen writes one) with Hugging Face's module
names, and records its greedy generation with kvdiff_record.TorchHooks. It
stands in for transformers (not packaged by Debian) so the recorder, the
hooks and the cross-runtime compare are tested on a real, different
runtime, in the precision such runtimes compute in.

    python3 tiny_torch.py --model DIR --tokens FILE --max-new N --dump OUT.h5
                          [--dtype f32|bf16|f16] [--attn sdpa|eager]
                          [--chunk N] [--fault SPEC ...]

FILE holds the prompt's token ids, separated by white space. Exit 0 when
the dump is written complete, 2 on bad input.

--dtype bf16 / f16 runs as transformers does with torch_dtype set: the
weights cast to the dtype, every module's output in the dtype (each matmul
summed in float32 and rounded once, as CPU and GPU kernels do), Gemma's
embedding normalizer computed in the dtype (sqrt(1152) becomes 34.0 in
bf16), RoPE's cos and sin cast to the dtype, norms' statistics and the
softmax in float32 where transformers keeps them there. Values are carried
as float32 tensors holding dtype values and every op's result is rounded
to the dtype once: the arithmetic of GPU kernels and of current torch's
CPU ones (widen, compute in float32, round; a bf16 matmul here differs
from Debian's torch 1.13 native one in 0.015% of elements), and it runs
f16, which that torch has no CPU matmul for. That torch's own bf16 GELU
and SiLU round inside the function (45% and 30% of values differ from
one rounding of the float32 result); this model does not copy that.
--attn eager rounds the scores and the probabilities to the dtype as
transformers' eager attention does; sdpa (the default, as in
transformers) rounds only the output.

--fault plants a bug a port makes (repeatable): window=N (sliding layers
read N keys, not the config's window), swap-layer-types=A,B (layers A and
B trade sliding / global), rope-base-local=T (sliding layers rotate with
base T), rope-base=T (every layer rotates with base T), drop-key=P (key P
is gone from the cache after the step that wrote it), decode-blind
(decode steps read no key of the prompt), global-window=N (global layers
read N keys: a split local/global cache), own-key-masked (position q reads
keys before q only: a strict mask), kv-swap=L (layer L's k_proj and v_proj
weights swapped), norm-eps=E (every RMSNorm with epsilon E), attn-scale=F
(scores scaled by F times the config's scale: query_pre_attn_scalar halved
is F = sqrt(2)), sinks-dropped (gpt-oss: no sink in any softmax),
sinks-prefill-only (gpt-oss: decode steps leave the sink out;
tiny_gpt_oss.py), mla-rope-twice, mla-rope-uncached, mla-no-mscale
(DeepSeek: tiny_deepseek.py)."""

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

DTYPES = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}

# The families whose attention or MLP is their own, each in a file beside
# this one that imports it (loaded when such a model is built): model_type
# -> module. A module gives Attention (the attention class), mlp_for(c,
# prec, layer) (a layer's MLP), FAULTS (the --fault names it plants),
# set_faults(model, faults, prompt_length) and names() (its taps beyond
# hf_names, for the recorder).
FAMILY_FILES = {"gpt_oss": "tiny_gpt_oss", "deepseek_v2": "tiny_deepseek",
                "deepseek_v3": "tiny_deepseek"}
FAMILY_FAULTS = ("sinks-dropped", "sinks-prefill-only", "mla-rope-twice", "mla-rope-uncached",
                 "mla-no-mscale")


def family(model_type):
    """The family file's module of model_type, or None."""
    name = FAMILY_FILES.get(model_type)
    return __import__(name) if name else None


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


class Precision:
    """The runtime's compute type: rnd(x) rounds a float32 tensor to it
    (round to nearest even) and back; f32 leaves it alone."""

    def __init__(self, name):
        if name not in DTYPES:
            raise ValueError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
        self.name, self.type = name, DTYPES[name]

    def rnd(self, x):
        return x if self.type is None else x.to(self.type).float()



class Linear(nn.Linear):
    """nn.Linear whose output is rounded to the dtype once (a float32 sum of
    dtype products, as bf16 / f16 matmul kernels accumulate)."""

    def __init__(self, n_in, n_out, bias, prec):
        super().__init__(n_in, n_out, bias=bias)
        self.prec = prec

    def forward(self, x):
        return self.prec.rnd(super().forward(x))


class Faults:
    """The planted bugs of --fault (module docstring)."""

    def __init__(self, specs, layers):
        self.window = None
        self.swap = None
        self.rope_local = None
        self.rope_all = None
        self.drop_key = None
        self.decode_blind = False
        self.global_window = None
        self.own_masked = False
        self.kv_swap = None
        self.norm_eps = None
        self.attn_scale = None
        self.family = []   # FAMILY_FAULTS given: the family file plants them
        for s in specs or []:
            name, _, arg = s.partition("=")
            try:
                if name == "window" and arg:
                    self.window = int(arg)
                elif name == "swap-layer-types" and arg:
                    a, b = (int(x) for x in arg.split(","))
                    if not (0 <= a < layers and 0 <= b < layers) or a == b:
                        raise ValueError("two different layers")
                    self.swap = (a, b)
                elif name == "rope-base-local" and arg:
                    self.rope_local = float(arg)
                elif name == "rope-base" and arg:
                    self.rope_all = float(arg)
                elif name == "drop-key" and arg:
                    self.drop_key = int(arg)
                elif name == "decode-blind" and not arg:
                    self.decode_blind = True
                elif name == "global-window" and arg:
                    self.global_window = int(arg)
                elif name == "own-key-masked" and not arg:
                    self.own_masked = True
                elif name == "kv-swap" and arg:
                    self.kv_swap = int(arg)
                    if not 0 <= self.kv_swap < layers:
                        raise ValueError("no such layer")
                elif name == "norm-eps" and arg:
                    self.norm_eps = float(arg)
                elif name in FAMILY_FAULTS and not arg:
                    self.family.append(name)
                elif name == "attn-scale" and arg:
                    self.attn_scale = float(arg)
                    if not (self.attn_scale > 0 and math.isfinite(self.attn_scale)):
                        raise ValueError("a factor > 0")
                else:
                    raise ValueError("unknown")
            except ValueError as exc:
                raise ValueError(f"--fault {s!r}: expected window=N, swap-layer-types=A,B, "
                                 f"rope-base-local=T, rope-base=T, drop-key=P, decode-blind, "
                                 f"global-window=N, own-key-masked, kv-swap=L, norm-eps=E, "
                                 f"attn-scale=F, sinks-dropped, sinks-prefill-only, "
                                 f"mla-rope-twice, mla-rope-uncached or mla-no-mscale "
                                 f"({exc})")
        if self.window is not None and self.window < 1:
            raise ValueError(f"--fault window={self.window}: the window must be >= 1")

    def layer_type(self, types, i):
        if self.swap and i in self.swap:
            return types[self.swap[1] if i == self.swap[0] else self.swap[0]]
        return types[i]


class RMSNorm(nn.Module):
    """gemma True: Gemma 3's (1 + w), the statistics and the product in
    float32, rounded once (Gemma3RMSNorm); "gemma4": the weight as stored,
    rounded once, and with_scale False no weight at all (Gemma4RMSNorm, its
    v_norm); else Llama's: the normalized row rounded to the dtype, then
    times the weight in the dtype (LlamaRMSNorm)."""

    def __init__(self, dim, eps, gemma, prec, with_scale=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim)) if with_scale else None
        self.eps, self.gemma, self.prec = eps, gemma, prec

    def forward(self, x):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return self.prec.rnd(y)
        if self.gemma == "gemma4":
            return self.prec.rnd(y * self.weight)
        if self.gemma:
            return self.prec.rnd(y * (1.0 + self.weight))
        return self.prec.rnd(self.weight * self.prec.rnd(y))


def norm_kind(arch):
    """RMSNorm's gemma argument for a model_type."""
    return "gemma4" if arch == "gemma4_text" else arch == "gemma3_text"


def layer_dims(c, i):
    """Head size and KV heads of layer i (Gemma 4's full layers have their
    own) and whether its v is k's projection (attention_k_eq_v)."""
    if c["layer_types"][i] == "full_attention" and c.get("global_head_dim"):
        return (c["global_head_dim"], c["num_global_key_value_heads"],
                bool(c.get("attention_k_eq_v")))
    return c["head_dim"], c["num_key_value_heads"], False


def rope_tables(positions, theta, d, prec, scaling=None, partial=1.0):
    """cos, sin [T, D] of rotate-half RoPE; angles in double (DESIGN.md),
    cast to the dtype as transformers casts them to the query's. scaling:
    model_config's rope_scaling (linear, or llama3's band-wise frequency
    scaling); partial < 1: Gemma 4's proportional RoPE, the first partial x
    D/2 pairs at theta^(-2j/D), the others at frequency 0 (unrotated)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if partial < 1.0:
        inv[int(partial * d // 2):] = 0.0
    mscale = 1.0
    if scaling and scaling["rope_type"] == "linear":
        inv = inv / scaling["factor"]
    elif scaling and scaling["rope_type"] == "yarn":
        inv, mscale = yarn_inv_freq(inv, theta, d, scaling)
    elif scaling and scaling["rope_type"] == "llama3":
        f, orig = scaling["factor"], scaling["original_max_position_embeddings"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / f + smooth * inv
        inv = torch.where(wavelen < orig / hi, inv, torch.where(wavelen > orig / lo, inv / f, mid))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos = (torch.cat([ang.cos(), ang.cos()], -1) * mscale).float()
    sin = (torch.cat([ang.sin(), ang.sin()], -1) * mscale).float()
    return prec.rnd(cos), prec.rnd(sin)


def yarn_inv_freq(inv, theta, d, s):
    """transformers' _compute_yarn_parameters: the frequencies below the
    ramp kept, above it divided by factor, blended between; and the
    attention factor cos and sin are multiplied by."""
    factor, old = s["factor"], s["original_max_position_embeddings"]

    def dim_of(rot):
        return d * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.get("beta_fast", 32.0)), dim_of(s.get("beta_slow", 1.0))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mscale = s.get("attention_factor", 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv / factor * ramp + inv * (1 - ramp), mscale


def rotate_half(x):
    d = x.shape[-1]
    return torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rnd=None):
    """RoPE as transformers' Llama, Qwen and Gemma 3 modeling files define
    it (a module-level function the attention looks up when it runs, which
    kvdiff_record.transformers wraps): q [batch, heads, T, D] and k
    [batch, KV heads, T, D] rotated by cos, sin [batch, T, D]. rnd rounds
    each product to the runtime's dtype (transformers' tensors are in it)."""
    del position_ids
    r = rnd or (lambda t: t)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (r(r(q * cos) + r(rotate_half(q) * sin)),
            r(r(k * cos) + r(rotate_half(k) * sin)))


class DynamicLayer:
    """One layer's cache in transformers' DynamicCache: keys, values
    [1, KV heads, T, D], post-RoPE, slot t holding position first + t. A
    sliding layer keeps the last window - 1 positions only (transformers'
    DynamicSlidingWindowLayer): what a later query can still read."""

    def __init__(self, keep=None):
        self.keys = self.values = None
        self.first = 0
        self.keep = keep

    def update(self, k, v):
        """Adds the new rows; returns every key and value the new queries
        may read (the kept ones and the new), and the first's position."""
        if self.keys is None:
            keys, values, first = k, v, self.first
        else:
            keys, values = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
            first = self.first
        self.keys, self.values = keys, values
        if self.keep is not None and keys.shape[2] > self.keep:
            drop = keys.shape[2] - self.keep
            self.keys, self.values = keys[:, :, drop:], values[:, :, drop:]
            self.first = first + drop
        return keys, values, first

    def seen(self):
        return 0 if self.keys is None else self.first + self.keys.shape[2]


class DynamicCache:
    """transformers' DynamicCache, as its .layers: one DynamicLayer per
    layer that owns a cache (a KV-shared layer reads its owner's)."""

    def __init__(self, config):
        keep = config["sliding_window"] - 1 if config["sliding_window"] > 0 else None
        self.layers = [DynamicLayer(keep if t == "sliding_attention" else None)
                       for t in config["layer_types"]]

    def get_seq_length(self):
        return self.layers[0].seen()


class Attention(nn.Module):
    """The attention of Llama, Qwen and Gemma; a family file's subclass
    sets the switches below (tiny_gpt_oss: biases, sinks, YaRN on the
    sliding layers too) and may take the softmax (softmax, use_sink)."""
    qkv_bias = False      # q, k, v biases (Qwen2 has them whatever this says)
    o_bias = False        # an o_proj bias
    scale_sliding = False # rope_scaling on the sliding layers too

    def __init__(self, c, arch, prec, attn, layer_idx):
        super().__init__()
        h, e = c["num_attention_heads"], c["hidden_size"]
        d, kv, self.k_eq_v = layer_dims(c, layer_idx)
        self.h, self.kv, self.d = h, kv, d
        self.layer_idx = layer_idx
        self.owner = c["kv_owner"][layer_idx]
        bias = arch == "qwen2" or self.qkv_bias
        self.q_proj = Linear(e, h * d, bias, prec)
        if self.owner == layer_idx:   # a KV-shared layer has no k and v of its own
            self.k_proj = Linear(e, kv * d, bias, prec)
            if not self.k_eq_v:       # Gemma 4's K=V layers take v from k_proj
                self.v_proj = Linear(e, kv * d, bias, prec)
        self.o_proj = Linear(h * d, e, self.o_bias, prec)
        self.qk_norm = arch in ("gemma3_text", "qwen3", "gemma4_text")
        kind = norm_kind(arch)
        if self.qk_norm:
            self.q_norm = RMSNorm(d, c["rms_norm_eps"], kind, prec)
            if self.owner == layer_idx:
                self.k_norm = RMSNorm(d, c["rms_norm_eps"], kind, prec)
        if arch == "gemma4_text" and self.owner == layer_idx:
            self.v_norm = RMSNorm(d, c["rms_norm_eps"], kind, prec, with_scale=False)
        full = c["layer_types"][layer_idx] == "full_attention"
        self.partial = float(c.get("partial_rotary_factor_full", 1.0)) if full else 1.0
        self.q_rope = nn.Identity()   # q after RoPE [1, T, heads*D]: the hooks' tap
        self.prec, self.attn = prec, attn
        self.scaling = c.get("rope_scaling")   # global layers' RoPE scaling
        self.strict = False           # --fault own-key-masked

    def project(self, x, t):
        """q, and k and v where this layer owns a cache: [1, heads, T, D]."""
        q = self.q_proj(x).view(1, t, self.h, self.d).transpose(1, 2)
        if self.qk_norm:
            q = self.q_norm(q)
        if self.owner != self.layer_idx:
            return q, None, None
        # [1, T, heads, D] until the norms, as Gemma 4's attention has them
        # (its v_norm sees that layout; the recorder takes v there).
        k = self.k_proj(x).view(1, t, self.kv, self.d)
        v = k if self.k_eq_v else self.v_proj(x).view(1, t, self.kv, self.d)
        if hasattr(self, "v_norm"):
            v = self.v_norm(v)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.qk_norm:
            k = self.k_norm(k)
        return q, k, v

    def rotate(self, q, k, cos, sin):
        """Post-RoPE q and k through the module-level function, looked up
        at call time as transformers' attention does."""
        if k is None:   # a KV-shared layer: q alone (the owner rotated its k)
            return apply_rotary_pos_emb(q, q[:, :0], cos[None], sin[None],
                                        rnd=self.prec.rnd)[0], None
        return apply_rotary_pos_emb(q, k, cos[None], sin[None], rnd=self.prec.rnd)

    def forward(self, x, positions, cache, theta, window, scale, visible):
        t, p = x.shape[1], self.prec
        q, k, v = self.project(x, t)
        scaled = self.scaling if (not window or self.scale_sliding) else None
        cos, sin = rope_tables(positions, theta, self.d, p, scaled, self.partial)
        q, k = self.rotate(q, k, cos, sin)
        self.q_rope(q[0].transpose(0, 1).reshape(1, t, self.h * self.d))
        layer = cache.layers[self.owner]
        if k is not None:
            k, v, first = layer.update(k, v)
        else:   # the owner ran first in this forward: its cache holds these positions
            k, v, first = layer.last_keys, layer.last_values, layer.last_first
        if k is not None and self.owner == self.layer_idx:
            layer.last_keys, layer.last_values, layer.last_first = k, v, first
        k, v = k[0], v[0]
        q = q[0]
        n = k.shape[1]
        rep = self.h // self.kv
        kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        kpos = torch.arange(first, first + n)
        mask = kpos[None, :] > positions[:, None]
        if self.strict:
            mask |= kpos[None, :] == positions[:, None]
        if window:
            mask |= kpos[None, :] <= positions[:, None] - window
        mask |= ~visible[kpos][None, :]
        sink = self.use_sink(positions)
        if self.attn == "eager":
            scores = p.rnd(p.rnd(q @ kk.transpose(1, 2)) * scale)
            scores = scores.masked_fill(mask[None], float("-inf"))
            out = p.rnd(p.rnd(self.softmax(scores, sink)) @ vv)
        else:
            scores = (q @ kk.transpose(1, 2)) * scale
            scores = scores.masked_fill(mask[None], float("-inf"))
            out = p.rnd(self.softmax(scores, sink) @ vv)
        out = out.transpose(0, 1).reshape(1, t, self.h * self.d)
        return self.o_proj(out)


    def use_sink(self, positions):
        """Whether this forward's softmax takes a sink (none here)."""
        del positions
        return False

    def softmax(self, scores, sink):
        """The softmax over the keys (sink: a family's, tiny_gpt_oss)."""
        del sink
        return torch.softmax(scores, -1)


class MLP(nn.Module):
    def __init__(self, c, gemma, prec, wide=False):
        super().__init__()
        e, i = c["hidden_size"], c["intermediate_size"] * (2 if wide else 1)
        self.gate_proj = Linear(e, i, False, prec)
        self.up_proj = Linear(e, i, False, prec)
        self.down_proj = Linear(i, e, False, prec)
        self.act = (lambda g: nn.functional.gelu(g, approximate="tanh")) if gemma else \
            nn.functional.silu
        self.prec = prec

    def forward(self, x):
        r = self.prec.rnd
        return self.down_proj(r(r(self.act(self.gate_proj(x))) * self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self, c, arch, prec, attn, layer_idx, attention=Attention):
        super().__init__()
        eps, kind = c["rms_norm_eps"], norm_kind(arch)
        gemma = arch in ("gemma3_text", "gemma4_text")
        e = c["hidden_size"]
        self.input_layernorm = RMSNorm(e, eps, kind, prec)
        self.self_attn = attention(c, arch, prec, attn, layer_idx)
        self.post_attention_layernorm = RMSNorm(e, eps, kind, prec)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(e, eps, kind, prec)
            self.post_feedforward_layernorm = RMSNorm(e, eps, kind, prec)
        shared = c["kv_owner"][layer_idx] != layer_idx
        fam = family(arch)
        self.mlp = fam.mlp_for(c, prec, layer_idx) if fam else \
            MLP(c, gemma, prec, wide=shared and bool(c.get("use_double_wide_mlp")))
        self.ple = arch == "gemma4_text" and c.get("hidden_size_per_layer_input", 0) > 0
        if self.ple:   # Gemma 4's per-layer input block and layer scalar
            pl = c["hidden_size_per_layer_input"]
            self.per_layer_input_gate = Linear(e, pl, False, prec)
            self.per_layer_projection = Linear(pl, e, False, prec)
            self.post_per_layer_input_norm = RMSNorm(e, eps, kind, prec)
        if arch == "gemma4_text":
            self.layer_scalar = nn.Parameter(torch.ones(1))
        self.gemma, self.prec = gemma, prec

    def forward(self, x, positions, cache, theta, window, scale, visible, ple=None):
        r = self.prec.rnd
        a = self.self_attn(self.input_layernorm(x), positions, cache, theta, window, scale,
                           visible)
        if self.gemma:
            h = r(x + self.post_attention_layernorm(a))
            out = r(h + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(h))))
            if self.ple:
                g = r(nn.functional.gelu(self.per_layer_input_gate(out), approximate="tanh"))
                out = r(out + self.post_per_layer_input_norm(
                    self.per_layer_projection(r(g * ple))))
            if hasattr(self, "layer_scalar"):
                out = r(out * self.layer_scalar)
            return out
        h = r(x + a)
        m = self.mlp(self.post_attention_layernorm(h))
        return r(h + (m[0] if isinstance(m, tuple) else m))


class Inner(nn.Module):
    def __init__(self, c, arch, prec, attn, attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c, arch, prec, attn, i, attention)
                                     for i in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"], norm_kind(arch), prec)
        pl = c.get("hidden_size_per_layer_input", 0) if arch == "gemma4_text" else 0
        if pl:   # Gemma 4's per-layer inputs
            n = pl * c["num_hidden_layers"]
            self.embed_tokens_per_layer = nn.Embedding(c["vocab_size_per_layer_input"], n)
            self.per_layer_model_projection = Linear(c["hidden_size"], n, False, prec)
            self.per_layer_projection_norm = RMSNorm(pl, c["rms_norm_eps"], "gemma4", prec)
        self.prec = prec

    def per_layer_inputs(self, ids, x, c):
        """Gemma 4: (table(ids) * sqrt(P) + norm(proj(x) * E^-1/2)) * 2^-1/2,
        [1, T, L, P], each product and sum rounded to the dtype."""
        r = self.prec.rnd
        pl, n_layers = c["hidden_size_per_layer_input"], c["num_hidden_layers"]
        tab = r(self.embed_tokens_per_layer(ids) *
                r(torch.tensor(float(np.float32(math.sqrt(pl))))))
        proj = r(self.per_layer_model_projection(x) *
                 r(torch.tensor(float(np.float32(c["hidden_size"] ** -0.5)))))
        proj = self.per_layer_projection_norm(proj.view(1, -1, n_layers, pl))
        return r(r(proj + tab.view(1, -1, n_layers, pl)) *
                 r(torch.tensor(float(np.float32(2 ** -0.5)))))


class HFConfig(dict):
    """The model's config as both readers want it: a dict of kvdiff's
    model_config (what this model computes from), and, as a transformers
    PretrainedConfig, to_dict() the folder's config.json, its eos_token_id
    and _attn_implementation."""

    def __init__(self, folder, attn):
        super().__init__(model_config_from_hf(folder))
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            self._raw = json.load(f)
        self.eos_token_id = self._raw.get("eos_token_id")
        self._attn_implementation = attn   # as transformers' config says it

    def to_dict(self):
        return dict(self._raw)


class Output:
    """transformers' CausalLMOutputWithPast, the two fields read here."""

    def __init__(self, logits, past_key_values):
        self.logits, self.past_key_values = logits, past_key_values


class TinyCausalLM(nn.Module):
    """Called as a transformers model is: model(input_ids=[1, T],
    past_key_values=cache or None, use_cache=True, logits_to_keep=0) ->
    .logits [1, T, V] (the last logits_to_keep rows; 0: every row) and
    .past_key_values, a DynamicCache (post-RoPE keys and values in the
    dtype). dtype: "f32", "bf16" or "f16"; attn: "sdpa" or "eager";
    faults: --fault specs; prompt_length: where decode starts (for
    decode-blind); cache: "dynamic" (sliding layers keep the last window - 1
    positions, as transformers' DynamicCache does) or "full" (every
    position, which TorchHooks.record_cache reads); rotary: "pair" (one
    call rotates q and k, [batch, heads, T, D]: Llama, Qwen, Gemma 3) or
    "single" (one tensor a call, [batch, T, heads, D]: Gemma 4)."""

    def __init__(self, folder, dtype="f32", attn="sdpa", faults=None, prompt_length=0,
                 cache="dynamic", rotary="pair"):
        super().__init__()
        self.config = HFConfig(folder, attn)
        c = self.config
        arch = c["model_type"]
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"--attn {attn!r}: expected sdpa or eager")
        if cache not in ("dynamic", "full"):
            raise ValueError(f"cache {cache!r}: expected dynamic or full")
        fam = family(arch)
        if fam:
            attention = fam.Attention
        elif rotary == "single":
            from tiny_rope_single import SingleRopeAttention as attention
        elif rotary == "pair":
            attention = Attention
        else:
            raise ValueError(f"rotary {rotary!r}: expected pair or single")
        self.prec = Precision(dtype)
        self.attn = attn
        self.cache_kind = cache
        self.faults = Faults(faults, c["num_hidden_layers"])
        self.prompt_length = prompt_length
        self.gemma = arch in ("gemma3_text", "gemma4_text")
        self.model = Inner(c, arch, self.prec, attn, attention)
        self.lm_head = Linear(c["hidden_size"], c["vocab_size"], False, self.prec)
        w = load_safetensors(os.path.join(folder, "model.safetensors"))
        if "lm_head.weight" not in w:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]   # tied
        # The weights cast to the dtype (torch_dtype=...), carried as float32.
        f = self.faults
        if f.kv_swap is not None:
            kn, vn = (f"model.layers.{f.kv_swap}.self_attn.{n}_proj.weight" for n in "kv")
            w[kn], w[vn] = w[vn], w[kn]
        self.load_state_dict({k: self.prec.rnd(torch.from_numpy(v)) for k, v in w.items()},
                             strict=True)
        for m in self.modules():
            if isinstance(m, RMSNorm) and f.norm_eps is not None:
                m.eps = f.norm_eps
            if isinstance(m, Attention):
                m.strict = f.own_masked
        if fam:
            fam.set_faults(self, f.family, prompt_length)
        # Gemma's sqrt(hidden) embedding scale: a float32 value (DESIGN.md),
        # which transformers casts to the dtype before the product.
        scale = float(np.float32(math.sqrt(c["hidden_size"]))) if self.gemma else 1.0
        self.embed_scale = self.prec.rnd(torch.tensor(scale))

    def new_cache(self):
        if self.cache_kind == "dynamic":
            return DynamicCache(self.config)
        full = dict(self.config, sliding_window=0)
        return DynamicCache(full)

    @torch.no_grad()
    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        """logits_to_keep: logits of the last rows only (0: every row); a
        prefill needs one, and the vocabulary projection of every prompt
        row is most of the work at a 262k vocabulary."""
        del use_cache
        c, f, p = self.config, self.faults, self.prec
        cache = past_key_values if past_key_values is not None else self.new_cache()
        start = cache.get_seq_length()
        t = input_ids.shape[1]
        positions = torch.arange(start, start + t)
        visible = torch.ones(start + t, dtype=torch.bool)
        if f.drop_key is not None and f.drop_key < start:
            visible[f.drop_key] = False
        if f.decode_blind and start >= self.prompt_length > 0:
            visible[:self.prompt_length] = False
        x = self.model.embed_tokens(input_ids)
        if self.gemma:
            x = p.rnd(x * self.embed_scale)
        ple = (self.model.per_layer_inputs(input_ids, x, c)
               if hasattr(self.model, "per_layer_inputs") and
               hasattr(self.model, "embed_tokens_per_layer") else None)
        for i, layer in enumerate(self.model.layers):
            sliding = f.layer_type(c["layer_types"], i) == "sliding_attention"
            theta = c["rope_local_base_freq"] if sliding else c["rope_theta"]
            if f.rope_all is not None:
                theta = f.rope_all
            if sliding and f.rope_local is not None:
                theta = f.rope_local
            window = (f.window or c["sliding_window"]) if sliding else (f.global_window or 0)
            scale = c["attn_scale"] * (f.attn_scale or 1.0)
            x = layer(x, positions, cache, theta, window, scale, visible,
                      None if ple is None else ple[:, :, i])
        x = self.model.norm(x)
        if logits_to_keep:   # after the final norm, of every row, as transformers
            x = x[:, x.shape[1] - logits_to_keep:]
        logits = self.lm_head(x)
        cap = c.get("final_logit_softcapping")
        if cap:   # Gemma's final softcap, as transformers applies it (in float32)
            logits = (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)
        return Output(logits, cache)


def tiny_names(model_type):
    """hf_names plus q after RoPE, from the attention's q_rope tap; the
    logits are recorded by generate_and_record (one row per step)."""
    names = dict(hf_names(model_type))
    names["q"] = ("model.layers.{i}.self_attn.q_rope", "out")
    fam = family(model_type)
    if fam:
        names.update(fam.names())
    del names["final_norm"], names["logits"]
    return names


def generate_and_record(folder, prompt, max_new, dump, engine="pytorch", dtype="f32",
                        attn="sdpa", chunk=None, faults=None):
    """Greedy generation as `kvdiff run` does it (a prefill of the prompt,
    whole or in chunks of `chunk`, then a decode step per token but the
    last), recorded to dump. Returns the generated ids."""
    model = TinyCausalLM(folder, dtype, attn, faults, len(prompt), cache="full")
    c = model.config
    chunk = len(prompt) if not chunk or chunk >= len(prompt) else int(chunk)
    settings = {"chunk": chunk, "cache": "dense", "cache_type": dtype,
                "compute_dtype": dtype, "attn_implementation": attn, "attn_accumulator": "f32",
                "runtime": f"torch {torch.__version__}", "device": "cpu"}
    if faults:
        settings["faults"] = list(faults)
    with Recorder(dump, c, engine=engine, settings=settings) as rec:
        hooks = TorchHooks(rec, model, tiny_names(c["model_type"]), output_from=None)
        ids = list(prompt)
        past, pos = None, 0
        generated = []
        while True:
            feed = ids[pos:min(pos + chunk, len(prompt))] if pos < len(prompt) else ids[pos:]
            with hooks.step(pos):
                out = model(torch.tensor([feed]), past_key_values=past, logits_to_keep=1)
            logits, past = out.logits, out.past_key_values
            hooks.record_cache(past)
            pos += len(feed)
            if pos < len(prompt):
                continue
            rec.output(pos - 1, logits[0].numpy())
            nxt = int(torch.argmax(logits[0, -1]))
            generated.append(nxt)
            ids.append(nxt)
            rec.tokens(ids, len(prompt))
            if len(generated) >= max_new:
                break
        hooks.remove()
    return generated


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, help="file of prompt token ids")
    p.add_argument("--max-new", type=int, default=4)
    p.add_argument("--dump", required=True)
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the whole prompt)")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    try:
        with open(a.tokens, encoding="utf-8") as f:
            prompt = [int(x) for x in f.read().split()]
    except (OSError, ValueError) as exc:
        print(f"tiny_torch: {a.tokens}: {exc}", file=sys.stderr)
        return 2
    if not prompt or a.max_new < 1 or a.chunk < 0:
        print("tiny_torch: need a prompt, --max-new >= 1 and --chunk >= 0", file=sys.stderr)
        return 2
    try:
        Faults(a.fault, 1 << 30)
        out = generate_and_record(a.model, prompt, a.max_new, a.dump, dtype=a.dtype,
                                  attn=a.attn, chunk=a.chunk, faults=a.fault)
    except ValueError as exc:
        print(f"tiny_torch: {exc}", file=sys.stderr)
        return 2
    print("generated", " ".join(map(str, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
