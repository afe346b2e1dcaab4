"""DeepSeek-V2 / V3 for tiny_torch (model_type deepseek_v2, deepseek_v3):
multi-head latent attention and DeepSeek's mixture of experts, with
transformers' module names (DeepseekV2Attention, DeepseekV2Moe,
DeepseekV3TopkRouter). tiny_torch builds a DeepSeek model's attention and
MLPs from this file; everything else (embedding, norms, the layer, the
cache, the recording) is tiny_torch's.

The attention computes the expanded form, as transformers does: q (q_proj,
or V3's LoRA q_a_proj -> q_a_layernorm -> q_b_proj), the latent
(kv_a_proj_with_mqa: kv_lora_rank values, kv_a_layernorm'd, then the
shared key tail), each head's key and value from kv_b_proj of the latent,
the tail rotated on interleaved pairs (2j, 2j+1) with YaRN. The cache
holds the expanded keys and values (transformers' DynamicCache does);
kv_latent, the row an MLA cache holds, is recorded from a tap.

Faults (--fault): mla-rope-twice (the key tail rotated a second time
before it is cached), mla-rope-uncached (the cache keeps no key tail: keys
of earlier forwards, chunks or decode steps, are read with a zero tail),
mla-no-mscale (decode steps scale q.k by head_dim^-1/2 alone: an absorbed
decode that lost YaRN's mscale_all_dim)."""

import math

import torch
from torch import nn

import tiny_torch

FAULTS = ("mla-rope-twice", "mla-rope-uncached", "mla-no-mscale")


def raw_int(c, key, default=0):
    v = c.to_dict().get(key)
    return default if v is None else int(v)


def rope_pairs(x, cos, sin, rnd):
    """x [..., T, heads, dr] rotated on pairs (2j, 2j+1) by cos, sin [T, dr/2],
    computed in float32 and rounded once (transformers' DeepSeek-V2 rotates
    through complex float32 products, cast back to the dtype)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return rnd(out)


class Attention(nn.Module):
    """DeepseekV2Attention / DeepseekV3Attention in the expanded form."""

    def __init__(self, c, arch, prec, attn, layer_idx):
        super().__init__()
        del arch
        e, h = c["hidden_size"], c["num_attention_heads"]
        self.h, self.d = h, c["head_dim"]
        self.dr, self.r = c["qk_rope_head_dim"], c["kv_lora_rank"]
        self.nope, self.dv = self.d - self.dr, c["v_head_dim"]
        self.layer_idx = layer_idx
        qr = raw_int(c, "q_lora_rank")
        if qr:
            self.q_a_proj = tiny_torch.Linear(e, qr, False, prec)
            self.q_a_layernorm = tiny_torch.RMSNorm(qr, c["rms_norm_eps"], False, prec)
            self.q_b_proj = tiny_torch.Linear(qr, h * self.d, False, prec)
        else:
            self.q_proj = tiny_torch.Linear(e, h * self.d, False, prec)
        self.kv_a_proj_with_mqa = tiny_torch.Linear(e, self.r + self.dr, False, prec)
        self.kv_a_layernorm = tiny_torch.RMSNorm(self.r, c["rms_norm_eps"], False, prec)
        self.kv_b_proj = tiny_torch.Linear(self.r, h * (self.nope + self.dv), False, prec)
        self.o_proj = tiny_torch.Linear(h * self.dv, e, False, prec)
        self.q_rope = nn.Identity()       # q after RoPE [1, T, heads*D]: the hooks' tap
        self.kv_latent_tap = nn.Identity()   # the cache row [1, T, R + dr]
        self.prec, self.attn = prec, attn
        self.scaling = c.get("rope_scaling")
        self.theta = c["rope_theta"]
        self.unscaled = 1.0 / math.sqrt(self.d)
        self.faults = set()
        self.prompt_length = 0

    def forward(self, x, positions, cache, theta, window, scale, visible):
        del theta, window   # every DeepSeek layer is global, at rope_theta
        t, p, h = x.shape[1], self.prec, self.h
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, self.d)
        ckv = self.kv_a_proj_with_mqa(x)[0]
        lat = self.kv_a_layernorm(ckv[:, :self.r])
        cos, sin = tiny_torch.rope_tables(positions, self.theta, self.dr,
                                          tiny_torch.Precision("f32"), self.scaling)
        cos, sin = cos[:, :self.dr // 2], sin[:, :self.dr // 2]
        k_pe = rope_pairs(ckv[:, None, self.r:], cos, sin, p.rnd)
        if "mla-rope-twice" in self.faults:
            k_pe = rope_pairs(k_pe, cos, sin, p.rnd)
        q = torch.cat([q[..., :self.nope], rope_pairs(q[..., self.nope:], cos, sin, p.rnd)], -1)
        self.q_rope(q.reshape(1, t, h * self.d))
        self.kv_latent_tap(torch.cat([lat, k_pe[:, 0]], -1)[None])
        kv = self.kv_b_proj(lat).view(t, h, self.nope + self.dv)
        k = torch.cat([kv[..., :self.nope], k_pe.expand(t, h, self.dr)], -1)
        v = kv[..., self.nope:]
        layer = cache.layers[self.layer_idx]
        if "mla-rope-uncached" in self.faults and layer.keys is not None:
            layer.keys[..., self.nope:] = 0.0   # what earlier forwards cached: no tail
        k, v, first = layer.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        k, v, q = k[0], v[0], q.transpose(0, 1)
        kpos = torch.arange(first, first + k.shape[1])
        mask = (kpos[None, :] > positions[:, None]) | ~visible[kpos][None, :]
        if "mla-no-mscale" in self.faults and positions[0] >= self.prompt_length > 0:
            scale = self.unscaled
        if self.attn == "eager":
            scores = p.rnd(p.rnd(q @ k.transpose(1, 2)) * scale)
            probs = p.rnd(torch.softmax(scores.masked_fill(mask[None], float("-inf")), -1))
        else:
            scores = (q @ k.transpose(1, 2)) * scale
            probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), -1)
        out = p.rnd(probs @ v)
        return self.o_proj(out.transpose(0, 1).reshape(1, t, h * self.dv))


class Expert(nn.Module):
    """DeepseekV2MLP: SiLU(gate) * up, then down."""

    def __init__(self, e, i, prec):
        super().__init__()
        self.gate_proj = tiny_torch.Linear(e, i, False, prec)
        self.up_proj = tiny_torch.Linear(e, i, False, prec)
        self.down_proj = tiny_torch.Linear(i, e, False, prec)
        self.prec = prec

    def forward(self, x):
        r = self.prec.rnd
        return self.down_proj(r(r(nn.functional.silu(self.gate_proj(x))) * self.up_proj(x)))


class Gate(nn.Module):
    """The router: logits (V2 in the dtype, V3's in float32), and the row
    the experts are chosen by, which the tap records (V2: the logits; V3:
    sigmoid + e_score_correction_bias)."""

    def __init__(self, c, prec, v3):
        super().__init__()
        x = c["num_local_experts"]
        self.weight = nn.Parameter(torch.zeros(x, c["hidden_size"]))
        if v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(x))
        self.logits_tap = nn.Identity()
        self.prec, self.v3 = prec, v3

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        if not self.v3:
            logits = self.prec.rnd(logits)
            self.logits_tap(logits)
            return torch.softmax(logits, -1), logits
        scores = torch.sigmoid(logits)
        sel = scores + self.e_score_correction_bias
        self.logits_tap(sel)
        return scores, sel


class DeepseekMoE(nn.Module):
    """DeepseekV2Moe / DeepseekV3MoE: routed experts chosen per row (top-k,
    in groups where the config limits them; dropped groups masked to -inf
    as DeepSeek's own code and llama.cpp mask them), their weights
    (softmax or sigmoid scores, normalized and scaled as the config says),
    plus the shared experts."""

    def __init__(self, c, prec):
        super().__init__()
        raw = c.to_dict()
        e, i = c["hidden_size"], int(raw["moe_intermediate_size"])
        self.v3 = c["model_type"] == "deepseek_v3"
        self.gate = Gate(c, prec, self.v3)
        self.experts = nn.ModuleList([Expert(e, i, prec) for _ in range(c["num_local_experts"])])
        shared = int(raw.get("n_shared_experts") or 0)
        if shared:
            self.shared_experts = Expert(e, i * shared, prec)
        self.top_k = c["num_experts_per_tok"]
        self.n_group, self.topk_group = c.get("n_group") or 0, c.get("topk_group") or 0
        self.norm = bool(raw.get("norm_topk_prob"))
        self.scale = float(raw.get("routed_scaling_factor") or 1.0)
        self.prec = prec

    def choose(self, sel):
        """The top-k experts of one selection row, group-limited."""
        if self.n_group:
            groups = sel.view(self.n_group, -1)
            gs = groups.topk(2, -1).values.sum(-1) if self.v3 else groups.max(-1).values
            keep = torch.zeros(self.n_group, dtype=torch.bool)
            keep[torch.topk(gs, self.topk_group).indices] = True
            sel = sel.masked_fill(~keep.repeat_interleave(groups.shape[1]), float("-inf"))
        return torch.topk(sel, self.top_k).indices

    def forward(self, x):
        r = self.prec.rnd
        flat = x.reshape(-1, x.shape[-1])
        scores, sel = self.gate(flat)
        out = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            idx = self.choose(sel[t])
            w = scores[t, idx]
            normed = self.norm and (self.v3 or self.top_k > 1)
            if normed:
                w = w / (w.sum() + 1e-20)
            if self.v3 or not normed:   # V2 scales the weights it does not normalize
                w = w * self.scale
            w = r(w)
            for wt, e in zip(w, idx):
                out[t] = r(out[t] + r(wt * self.experts[int(e)](flat[t:t + 1])[0]))
        if hasattr(self, "shared_experts"):
            out = r(out + self.shared_experts(flat))
        return out.view(x.shape)


def moe_layer(c, i):
    """Has layer i routed experts (first_k_dense_replace, moe_layer_freq)?"""
    first, every = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
    return bool(c.get("num_local_experts")) and i >= first and i % every == 0


def mlp_for(c, prec, i):
    """Layer i's MLP: DeepseekMoE, or a dense DeepseekV2MLP."""
    if moe_layer(c, i):
        return DeepseekMoE(c, prec)
    return Expert(c["hidden_size"], c["intermediate_size"], prec)


def set_faults(model, faults, prompt_length):
    for m in model.modules():
        if isinstance(m, Attention):
            m.faults = {f for f in faults if f in FAULTS}
            m.prompt_length = prompt_length


def names():
    """The taps tiny_torch records beyond hf_names: the cache row and the
    router's selection row (layers with experts only)."""
    return {"kv_latent": ("model.layers.{i}.self_attn.kv_latent_tap", "out"),
            "router_logits": ("model.layers.{i}.mlp.gate.logits_tap", "out")}
