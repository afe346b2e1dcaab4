"""gpt-oss for tiny_torch (model_type gpt_oss): attention with a learned
sink logit per head in every softmax, biases on q, k, v and o, YaRN on the
sliding layers too, and the mixture of experts (GptOssTopKRouter,
GptOssExperts: gate and up interleaved, the clamped SwiGLU), with
transformers' module names. tiny_torch builds a gpt-oss model's attention
and MLPs from this file; the rest is tiny_torch's.

Faults (--fault): sinks-dropped (no sink in any softmax), sinks-prefill-only
(decode steps leave the sink out)."""

import torch
from torch import nn

import tiny_torch

FAULTS = ("sinks-dropped", "sinks-prefill-only")


class Attention(tiny_torch.Attention):
    """GptOssAttention: tiny_torch's, biased, with its sinks."""
    qkv_bias = o_bias = True
    scale_sliding = True

    def __init__(self, c, arch, prec, attn, layer_idx):
        super().__init__(c, arch, prec, attn, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(c["num_attention_heads"]))
        self.sink_mode = "on"         # --fault sinks-dropped / sinks-prefill-only
        self.prompt_length = 0

    def use_sink(self, positions):
        return self.sink_mode == "on" or (
            self.sink_mode == "prefill-only" and positions[0] < self.prompt_length)

    def softmax(self, scores, sink):
        """The softmax over the keys; with the sink one more logit per head
        joins it, and its column is dropped, as transformers'
        eager_attention_forward for GptOss does."""
        if not sink:
            return torch.softmax(scores, -1)
        col = self.sinks.view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
        both = torch.cat([scores, col], -1)
        both = both - both.max(-1, keepdim=True).values
        return torch.softmax(both, -1)[..., :-1]


class Router(nn.Module):
    """GptOssTopKRouter: logits, the top k, softmax over the chosen."""

    def __init__(self, c, prec):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c["num_local_experts"], c["hidden_size"]))
        self.bias = nn.Parameter(torch.zeros(c["num_local_experts"]))
        self.top_k, self.prec = c["num_experts_per_tok"], prec
        self.logits_tap = nn.Identity()   # the router's logits: the hooks' tap

    def forward(self, x):
        logits = self.logits_tap(self.prec.rnd(nn.functional.linear(x, self.weight, self.bias)))
        val, idx = torch.topk(logits, self.top_k, dim=-1)
        return self.prec.rnd(torch.softmax(val, -1)), idx


class Experts(nn.Module):
    """GptOssExperts: stacked, input-major; gate and up interleaved."""

    def __init__(self, c, prec):
        super().__init__()
        x, e, i = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
        self.gate_up_proj = nn.Parameter(torch.zeros(x, e, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(x, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(x, i, e))
        self.down_proj_bias = nn.Parameter(torch.zeros(x, e))
        self.limit, self.prec = c.get("swiglu_limit", 7.0), prec

    def forward(self, x, weights, idx):
        r = self.prec.rnd
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], idx[t]):
                gu = r(x[t] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
                g, u = gu[0::2].clamp(max=self.limit), gu[1::2].clamp(-self.limit, self.limit)
                y = r(r(g * torch.sigmoid(g * 1.702)) * (u + 1))
                out[t] = r(out[t] + r(w * r(y @ self.down_proj[e] + self.down_proj_bias[e])))
        return out


class MoE(nn.Module):
    """GptOssMLP: returns (output, router scores) as transformers' does."""

    def __init__(self, c, prec):
        super().__init__()
        self.router, self.experts = Router(c, prec), Experts(c, prec)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.router(flat)
        return self.experts(flat, w, idx).view(shape), w


def mlp_for(c, prec, layer):
    """Every gpt-oss layer's MLP is its mixture of experts."""
    del layer
    return MoE(c, prec)


def set_faults(model, faults, prompt_length):
    mode = "dropped" if "sinks-dropped" in faults else \
        "prefill-only" if "sinks-prefill-only" in faults else "on"
    for m in model.modules():
        if isinstance(m, Attention):
            m.sink_mode, m.prompt_length = mode, prompt_length


def names():
    """The router's logits, from its tap."""
    return {"router_logits": ("model.layers.{i}.mlp.router.logits_tap", "out")}
