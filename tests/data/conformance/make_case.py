#!/usr/bin/python3
"""make_case.py: writes a conformance case (config.json, model.safetensors,
prompt.txt, golden.safetensors) from a float64 forward written here with
numpy alone, from the Hugging Face transformers definitions:

  qwen3        Qwen3ForCausalLM: per-head q/k RMSNorm (multiplier w) before
               RoPE, head_dim 32 unlike hidden/heads = 16, no biases, tied
               embeddings (modeling_qwen3.Qwen3Attention).
  qwen3-hd64   the same at head_dim 64 (llama.cpp rotates a quantized KV
               cache in blocks of 64 there).
  gemma4       Gemma4ForCausalLM (modeling_gemma4, text model): sliding
               layers with head_dim 16 and 2 KV heads, full layers with
               global_head_dim 32, 1 KV head, v taken from k_proj
               (attention_k_eq_v) and proportional RoPE rotating a quarter
               of the pairs; q/k norms with weight w, v norm without one,
               attention scale 1; the last two layers read layers 3
               (sliding) and 2 (full) with double-wide MLPs; per-layer
               inputs (8 wide) and layer scalars; final logit softcap 30.
  gpt-oss      GptOssForCausalLM (modeling_gpt_oss): layers alternating
               sliding (window 8) and full attention, a learned sink logit
               per head in every softmax, q/k/v/o biases, YaRN RoPE
               (factor 32, beta_fast 32, beta_slow 1, truncate false,
               cos/sin times 0.1 ln 32 + 1; original_max_position_embeddings
               64 so that at head_dim 16 one pair is kept, one blended and
               six slowed), a mixture of 4 experts with 2 chosen (biased
               router, softmax over the chosen, interleaved gate/up, the
               clamped gpt-oss SwiGLU), untied embeddings.
  deepseek-v2  DeepseekV2ForCausalLM (modeling_deepseek_v2): multi-head
               latent attention (q_proj; kv_a_proj_with_mqa to a latent of
               32, normed, and one shared 8-wide key tail; kv_b_proj to each
               head's 16 key dims and 12 value dims), RoPE on interleaved
               pairs of the tails, YaRN with mscale / mscale_all_dim 0.707
               (q.k times m^2); layer 0 dense, then 6 experts (2 chosen by
               softmax, greedy) and a shared expert.
  deepseek-v3  DeepseekV3ForCausalLM: the same with a q LoRA (24), sigmoid
               routing in 4 groups of 2 with e_score_correction_bias,
               normalised weights times 2.5.
  llama3-bias  LlamaForCausalLM with attention_bias (q, k, v and o_proj
               biased, modeling_llama.LlamaAttention) and rope_scaling llama3
               (modeling_rope_utils._compute_llama3_parameters), tied.

It shares no code with kvdiff: run it with Debian's python3 (numpy) from
the repository root,

    /usr/bin/python3 tests/data/conformance/make_case.py qwen3 llama3-bias

and it rewrites tests/data/conformance/<case>/. The output is a function of
the fixed seeds below, so a second run writes the same bytes. README.md
beside this file describes the layout of golden.safetensors.
"""

import json
import math
import os
import struct
import sys

import numpy as np

T = 40  # prompt length

CASES = {
    "qwen3": {
        "seed": 1603,
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 4,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
    # Qwen3 at head_dim 64, as real models have (64 to 256): llama.cpp
    # rotates a quantized KV cache in blocks of 64 there, and attention
    # kernels specialise on it; the tiny presets stop at 32.
    "qwen3-hd64": {
        "seed": 1605,
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 3,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
    "gemma4": {
        "seed": 1606,
        "config": {
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_global_key_value_heads": 1,
            "head_dim": 16,
            "global_head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-06,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "sliding_attention", "sliding_attention", "full_attention"],
            "sliding_window": 8,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0},
            },
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 128,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "enable_moe_block": False,
            "vocab_size": 128,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "torch_dtype": "float32",
        },
    },
    "gpt-oss": {
        "seed": 1607,
        "config": {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64},
            "layer_types": ["sliding_attention", "full_attention",
                            "sliding_attention", "full_attention"],
            "sliding_window": 8,
            "attention_bias": True,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": False,
            "vocab_size": 128,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
    # DeepSeek-V2 (modeling_deepseek_v2): MLA with one q_proj, values of
    # 12 (narrower than the keys' 16 + 8), YaRN factor 8 from 16 positions
    # with mscale = mscale_all_dim 0.707 (cos/sin unscaled, q.k times m^2);
    # the first layer dense, then 6 experts of 24 with 2 chosen by a
    # softmax over all (greedy, weights not normalised) and a shared one.
    "deepseek-v2": {
        "seed": 1608,
        "config": {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 16},
            "attention_bias": False,
            "n_routed_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "scoring_func": "softmax",
            "vocab_size": 128,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
    # DeepSeek-V3 (modeling_deepseek_v3): a q LoRA (q_a_proj, its norm,
    # q_b_proj), sigmoid routing over 8 experts in 4 groups (2 kept, each
    # scored by its best two), chosen with e_score_correction_bias,
    # weights normalised and times 2.5; mscale = mscale_all_dim 1.
    "deepseek-v3": {
        "seed": 1609,
        "config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 24,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 16},
            "rope_interleave": True,
            "attention_bias": False,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "vocab_size": 128,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32",
        },
    },
    "llama3-bias": {
        "seed": 1604,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            # Llama 3.1's rule with original_max_position_embeddings scaled
            # down so that at head_dim 16 one frequency is kept, one
            # blended and six slowed.
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "attention_bias": True,
            "mlp_bias": False,
            "vocab_size": 128,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
}


# ---- weights -------------------------------------------------------------

def make_weights(cfg, rng):
    """Hugging Face names -> float32 arrays. Linear layers N(0, 1/fan_in),
    RMSNorm multipliers 1 + 0.1 N(0, 1), biases 0.3 N(0, 1), embeddings
    N(0, 1)."""
    E, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qwen3 = cfg["model_type"] == "qwen3"
    bias = cfg.get("attention_bias", False)
    w = {}

    def linear(name, n_out, n_in):
        w[name] = rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(name, n):
        w[name] = 1.0 + 0.1 * rng.standard_normal(n)

    def vec(name, n):
        w[name] = 0.3 * rng.standard_normal(n)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, E))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", E)
        linear(p + "self_attn.q_proj.weight", H * D, E)
        if bias:
            vec(p + "self_attn.q_proj.bias", H * D)
        linear(p + "self_attn.k_proj.weight", KV * D, E)
        if bias:
            vec(p + "self_attn.k_proj.bias", KV * D)
        linear(p + "self_attn.v_proj.weight", KV * D, E)
        if bias:
            vec(p + "self_attn.v_proj.bias", KV * D)
        linear(p + "self_attn.o_proj.weight", E, H * D)
        if bias:
            vec(p + "self_attn.o_proj.bias", E)
        if qwen3:
            norm(p + "self_attn.q_norm.weight", D)
            norm(p + "self_attn.k_norm.weight", D)
        norm(p + "post_attention_layernorm.weight", E)
        linear(p + "mlp.gate_proj.weight", I, E)
        linear(p + "mlp.up_proj.weight", I, E)
        linear(p + "mlp.down_proj.weight", E, I)
    norm("model.norm.weight", E)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rng.standard_normal((V, E)) / math.sqrt(E)
    # The file holds float32; the forward computes on exactly those values.
    return {k: v.astype(np.float32) for k, v in w.items()}


# ---- the forward, float64 ------------------------------------------------

def rms_norm(x, w, eps):
    """LlamaRMSNorm / Qwen3RMSNorm: x / sqrt(mean(x^2) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_freq(cfg):
    D = cfg["head_dim"]
    f = 1.0 / (cfg["rope_theta"] ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = cfg.get("rope_scaling")
    if not rs:
        return f
    assert rs["rope_type"] == "llama3"
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / f
    scaled = np.where(wavelen > low_wavelen, f / factor, f)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled)


def rope(x, pos, freqs):
    """rotate_half RoPE on x (T, heads, D) at positions pos (T,)."""
    ang = pos[:, None] * freqs[None, :]            # (T, D/2), float64
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def attend(q, k, v, mask, div):
    """softmax(q k^T / div + mask) v per head, grouped KV heads, heads
    concatenated: [T, H*D]."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    att = np.empty((t, heads, d))
    for h in range(heads):
        s = (q[:, h, :] @ k[:, h // group, :].T) / div
        s = np.where(mask, s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        att[:, h, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, h // group, :]
    return att.reshape(t, heads * d)


def forward(cfg, w, ids):
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    qwen3 = cfg["model_type"] == "qwen3"
    W = {k: v.astype(np.float64) for k, v in w.items()}

    def lin(x, name, bias_name=None):
        y = x @ W[name].T
        return y + W[bias_name] if bias_name in W else y

    pos = np.arange(T, dtype=np.float64)
    freqs = inv_freq(cfg)
    mask = np.tril(np.ones((T, T), dtype=bool))
    out = {}
    x = W["model.embed_tokens.weight"][ids]
    out["embed"] = x
    for i in range(L):
        p = f"model.layers.{i}."
        xn = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = lin(xn, p + "self_attn.q_proj.weight", p + "self_attn.q_proj.bias").reshape(T, H, D)
        k = lin(xn, p + "self_attn.k_proj.weight", p + "self_attn.k_proj.bias").reshape(T, KV, D)
        v = lin(xn, p + "self_attn.v_proj.weight", p + "self_attn.v_proj.bias").reshape(T, KV, D)
        if qwen3:
            q = rms_norm(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, freqs), rope(k, pos, freqs)
        att = attend(q, k, v, mask, math.sqrt(D))
        h_mid = x + lin(att, p + "self_attn.o_proj.weight", p + "self_attn.o_proj.bias")
        hn = rms_norm(h_mid, W[p + "post_attention_layernorm.weight"], eps)
        g = lin(hn, p + "mlp.gate_proj.weight")
        u = lin(hn, p + "mlp.up_proj.weight")
        x = h_mid + lin(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj.weight")
        out[f"layers.{i}.q"] = q
        out[f"layers.{i}.k"] = k
        out[f"layers.{i}.v"] = v
        out[f"layers.{i}.attn_out"] = att
        out[f"layers.{i}.x_out"] = x
    fn = rms_norm(x, W["model.norm.weight"], eps)
    out["final_norm"] = fn
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    out["logits"] = fn @ head.T
    assert out["logits"].shape == (T, V)
    return out


# ---- Gemma 4 ---------------------------------------------------------------

def g4_layer_dims(cfg, i):
    """head size and KV heads of layer i."""
    if cfg["layer_types"][i] == "full_attention":
        return cfg["global_head_dim"], cfg["num_global_key_value_heads"]
    return cfg["head_dim"], cfg["num_key_value_heads"]


def g4_owner(cfg, i):
    """The layer whose K/V layer i reads: the last non-shared layer of its
    type when i is among the last num_kv_shared_layers."""
    L, S = cfg["num_hidden_layers"], cfg["num_kv_shared_layers"]
    first = L - S
    if i < first:
        return i
    t = cfg["layer_types"][i]
    return max(j for j in range(first) if cfg["layer_types"][j] == t)


def make_weights_gemma4(cfg, rng):
    """Gemma 4 names. RMSNorm weights are used as stored: 1 + 0.1 N(0, 1)
    (q/k norms times D^-1/4); layer scalars the same; embeddings hidden^-1/2 N(0, 1), the per-layer
    table P^-1/2 N(0, 1)."""
    E, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, P = cfg["num_attention_heads"], cfg["hidden_size_per_layer_input"]
    w = {}

    def linear(name, n_out, n_in):
        w[name] = rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(name, n):
        w[name] = 1.0 + 0.1 * rng.standard_normal(n)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, E)) / math.sqrt(E)
    w["model.embed_tokens_per_layer.weight"] = (
        rng.standard_normal((cfg["vocab_size_per_layer_input"], L * P)) / math.sqrt(P))
    linear("model.per_layer_model_projection.weight", L * P, E)
    norm("model.per_layer_projection_norm.weight", P)
    for i in range(L):
        p = f"model.layers.{i}."
        D, KV = g4_layer_dims(cfg, i)
        owns = g4_owner(cfg, i) == i
        full = cfg["layer_types"][i] == "full_attention"
        wide = I * 2 if (cfg["use_double_wide_mlp"] and not owns) else I
        norm(p + "input_layernorm.weight", E)
        linear(p + "self_attn.q_proj.weight", H * D, E)
        if owns:
            linear(p + "self_attn.k_proj.weight", KV * D, E)
            if not (full and cfg["attention_k_eq_v"]):
                linear(p + "self_attn.v_proj.weight", KV * D, E)
        linear(p + "self_attn.o_proj.weight", E, H * D)
        # Scores are q.k unscaled (attention scale 1): q/k norm weights of
        # D^-1/4 keep them of order sqrt(D)^0, as trained models' are small.
        norm(p + "self_attn.q_norm.weight", D)
        w[p + "self_attn.q_norm.weight"] *= D ** -0.25
        if owns:
            norm(p + "self_attn.k_norm.weight", D)
            w[p + "self_attn.k_norm.weight"] *= D ** -0.25
        norm(p + "post_attention_layernorm.weight", E)
        norm(p + "pre_feedforward_layernorm.weight", E)
        norm(p + "post_feedforward_layernorm.weight", E)
        linear(p + "mlp.gate_proj.weight", wide, E)
        linear(p + "mlp.up_proj.weight", wide, E)
        linear(p + "mlp.down_proj.weight", E, wide)
        linear(p + "per_layer_input_gate.weight", P, E)
        linear(p + "per_layer_projection.weight", E, P)
        norm(p + "post_per_layer_input_norm.weight", E)
        norm(p + "layer_scalar", 1)
    norm("model.norm.weight", E)
    return {k: v.astype(np.float32) for k, v in w.items()}


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward_gemma4(cfg, w, ids):
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, P, eps = cfg["num_attention_heads"], cfg["hidden_size_per_layer_input"], cfg["rms_norm_eps"]
    W = {k: v.astype(np.float64) for k, v in w.items()}
    rp = cfg["rope_parameters"]

    def lin(x, name):
        return x @ W[name].T

    def freqs(i):
        D, _ = g4_layer_dims(cfg, i)
        if cfg["layer_types"][i] == "sliding_attention":
            return 1.0 / (rp["sliding_attention"]["rope_theta"] ** (np.arange(0, D, 2) / D))
        # proportional: the first factor * D/2 pairs at theta^(-2j/D), the rest 0
        full = rp["full_attention"]
        n_rot = int(full["partial_rotary_factor"] * D // 2)
        f = 1.0 / (full["rope_theta"] ** (np.arange(0, 2 * n_rot, 2) / D))
        return np.concatenate([f, np.zeros(D // 2 - n_rot)])

    pos = np.arange(T, dtype=np.float64)
    out = {}
    x = W["model.embed_tokens.weight"][ids] * math.sqrt(E)
    out["embed"] = x
    # per-layer inputs
    pl_tab = W["model.embed_tokens_per_layer.weight"][ids].reshape(T, L, P) * math.sqrt(P)
    pl_proj = (lin(x, "model.per_layer_model_projection.weight") / math.sqrt(E)).reshape(T, L, P)
    pl_proj = rms_norm(pl_proj, W["model.per_layer_projection_norm.weight"], eps)
    pl = (pl_proj + pl_tab) / math.sqrt(2.0)
    kv = {}
    for i in range(L):
        p = f"model.layers.{i}."
        D, KV = g4_layer_dims(cfg, i)
        owner = g4_owner(cfg, i)
        full = cfg["layer_types"][i] == "full_attention"
        xn = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = lin(xn, p + "self_attn.q_proj.weight").reshape(T, H, D)
        q = rope(rms_norm(q, W[p + "self_attn.q_norm.weight"], eps), pos, freqs(i))
        if owner == i:
            kraw = lin(xn, p + "self_attn.k_proj.weight").reshape(T, KV, D)
            vraw = kraw if (full and cfg["attention_k_eq_v"]) else \
                lin(xn, p + "self_attn.v_proj.weight").reshape(T, KV, D)
            k = rope(rms_norm(kraw, W[p + "self_attn.k_norm.weight"], eps), pos, freqs(i))
            v = rms_norm(vraw, 1.0, eps)
            kv[i] = (k, v)
            out[f"layers.{i}.k"] = k
            out[f"layers.{i}.v"] = v
        k, v = kv[owner]
        mask = np.tril(np.ones((T, T), dtype=bool))
        if not full:
            mask &= ~np.tril(np.ones((T, T), dtype=bool), -cfg["sliding_window"])
        att = attend(q, k, v, mask, 1.0)   # Gemma 4 scales scores by 1
        a = rms_norm(lin(att, p + "self_attn.o_proj.weight"), W[p + "post_attention_layernorm.weight"], eps)
        h_mid = x + a
        hn = rms_norm(h_mid, W[p + "pre_feedforward_layernorm.weight"], eps)
        g = gelu_tanh(lin(hn, p + "mlp.gate_proj.weight")) * lin(hn, p + "mlp.up_proj.weight")
        f = rms_norm(lin(g, p + "mlp.down_proj.weight"), W[p + "post_feedforward_layernorm.weight"], eps)
        x = h_mid + f
        ple_in = pl[:, i, :]
        gp = gelu_tanh(lin(x, p + "per_layer_input_gate.weight")) * ple_in
        ple_out = rms_norm(lin(gp, p + "per_layer_projection.weight"),
                           W[p + "post_per_layer_input_norm.weight"], eps)
        x = (x + ple_out) * W[p + "layer_scalar"][0]
        out[f"layers.{i}.q"] = q
        out[f"layers.{i}.attn_out"] = att
        out[f"layers.{i}.ple_in"] = ple_in
        out[f"layers.{i}.ple_out"] = ple_out
        out[f"layers.{i}.x_out"] = x
    fn = rms_norm(x, W["model.norm.weight"], eps)
    out["final_norm"] = fn
    cap = cfg["final_logit_softcapping"]
    out["logits"] = cap * np.tanh((fn @ W["model.embed_tokens.weight"].T) / cap)
    assert out["logits"].shape == (T, V)
    # dataflow order: embed, then per layer q, k, v, attn_out, ple_in, ple_out, x_out
    order = ["embed"]
    for i in range(L):
        order += [f"layers.{i}.{s}" for s in ("q", "k", "v", "attn_out", "ple_in", "ple_out", "x_out")
                  if f"layers.{i}.{s}" in out]
    order += ["final_norm", "logits"]
    return {n: out[n] for n in order}


# ---- gpt-oss ---------------------------------------------------------------

def make_weights_gpt_oss(cfg, rng):
    """gpt-oss names. Linear layers N(0, 1/fan_in), biases 0.3 N(0, 1),
    RMSNorm multipliers 1 + 0.1 N(0, 1), sinks 1 + N(0, 1) (a visible share
    of a short softmax), experts stacked input-major as transformers keeps
    them: gate_up_proj (X, E, 2I) with gate and up interleaved, down_proj
    (X, I, E)."""
    E, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    X = cfg["num_local_experts"]
    w = {}

    def linear(name, n_out, n_in):
        w[name] = rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(name, n):
        w[name] = 1.0 + 0.1 * rng.standard_normal(n)

    def vec(name, *shape):
        w[name] = 0.3 * rng.standard_normal(shape)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, E))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", E)
        for proj, n_out in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)):
            linear(p + f"self_attn.{proj}.weight", n_out, E)
            vec(p + f"self_attn.{proj}.bias", n_out)
        linear(p + "self_attn.o_proj.weight", E, H * D)
        vec(p + "self_attn.o_proj.bias", E)
        w[p + "self_attn.sinks"] = 1.0 + rng.standard_normal(H)
        norm(p + "post_attention_layernorm.weight", E)
        linear(p + "mlp.router.weight", X, E)
        vec(p + "mlp.router.bias", X)
        w[p + "mlp.experts.gate_up_proj"] = rng.standard_normal((X, E, 2 * I)) / math.sqrt(E)
        vec(p + "mlp.experts.gate_up_proj_bias", X, 2 * I)
        w[p + "mlp.experts.down_proj"] = rng.standard_normal((X, I, E)) / math.sqrt(I)
        vec(p + "mlp.experts.down_proj_bias", X, E)
    norm("model.norm.weight", E)
    w["lm_head.weight"] = rng.standard_normal((V, E)) / math.sqrt(E)
    return {k: v.astype(np.float32) for k, v in w.items()}


def yarn_freqs(cfg):
    """modeling_rope_utils._compute_yarn_parameters: (inv_freq, attention
    factor)."""
    D, base, rs = cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"]
    factor, fast, slow = rs["factor"], rs.get("beta_fast", 32), rs.get("beta_slow", 1)
    old = rs.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    pos_freqs = base ** (np.arange(0, D, 2, dtype=np.float64) / D)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def dim_of(rot):
        return D * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inter * (1 - keep) + extra * keep, mscale


def attend_sinks(q, k, v, mask, div, sinks):
    """softmax over [q k^T / div + mask, sink] per head, the sink column
    dropped before v: (attention [T, H*D], the sink's share [T, H])."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    att, share = np.empty((t, heads, d)), np.empty((t, heads))
    for h in range(heads):
        s = (q[:, h, :] @ k[:, h // group, :].T) / div
        s = np.where(mask, s, -np.inf)
        s = np.concatenate([s, np.full((t, 1), sinks[h])], axis=1)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
        att[:, h, :] = s[:, :-1] @ v[:, h // group, :]
        share[:, h] = s[:, -1]
    return att.reshape(t, heads * d), share


def forward_gpt_oss(cfg, w, ids):
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    X, K, lim = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["swiglu_limit"]
    eps = cfg["rms_norm_eps"]
    W = {k: v.astype(np.float64) for k, v in w.items()}

    def lin(x, name):
        return x @ W[name + ".weight"].T + W[name + ".bias"]

    freqs, mscale = yarn_freqs(cfg)
    pos = np.arange(T, dtype=np.float64)
    out = {}
    x = W["model.embed_tokens.weight"][ids]
    out["embed"] = x
    for i in range(L):
        p = f"model.layers.{i}."
        xn = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        # YaRN multiplies cos and sin, so q and k, by the attention factor
        q = rope(lin(xn, p + "self_attn.q_proj").reshape(T, H, D), pos, freqs) * mscale
        k = rope(lin(xn, p + "self_attn.k_proj").reshape(T, KV, D), pos, freqs) * mscale
        v = lin(xn, p + "self_attn.v_proj").reshape(T, KV, D)
        mask = np.tril(np.ones((T, T), dtype=bool))
        if cfg["layer_types"][i] == "sliding_attention":
            mask &= ~np.tril(np.ones((T, T), dtype=bool), -cfg["sliding_window"])
        att, share = attend_sinks(q, k, v, mask, math.sqrt(D), W[p + "self_attn.sinks"])
        h_mid = x + lin(att, p + "self_attn.o_proj")
        hn = rms_norm(h_mid, W[p + "post_attention_layernorm.weight"], eps)
        logits = lin(hn, p + "mlp.router")
        moe = np.zeros_like(hn)
        for t in range(T):
            top = np.argsort(-logits[t], kind="stable")[:K]
            wts = np.exp(logits[t, top] - logits[t, top].max())
            wts /= wts.sum()
            for e, wt in zip(top, wts):
                gu = hn[t] @ W[p + "mlp.experts.gate_up_proj"][e] \
                    + W[p + "mlp.experts.gate_up_proj_bias"][e]
                g, u = np.minimum(gu[0::2], lim), np.clip(gu[1::2], -lim, lim)
                y = (u + 1) * (g / (1 + np.exp(-1.702 * g)))
                moe[t] += wt * (y @ W[p + "mlp.experts.down_proj"][e]
                                + W[p + "mlp.experts.down_proj_bias"][e])
        x = h_mid + moe
        out[f"layers.{i}.q"] = q
        out[f"layers.{i}.k"] = k
        out[f"layers.{i}.v"] = v
        out[f"layers.{i}.attn_sink"] = share
        out[f"layers.{i}.attn_out"] = att
        out[f"layers.{i}.x_out"] = x
    fn = rms_norm(x, W["model.norm.weight"], eps)
    out["final_norm"] = fn
    out["logits"] = fn @ W["lm_head.weight"].T
    assert out["logits"].shape == (T, V)
    return out


# ---- DeepSeek-V2 / V3 (MLA) -------------------------------------------------

def make_weights_deepseek(cfg, rng):
    """DeepseekV2/V3 names: the latent attention's projections and norms,
    dense MLPs on the first layers, then the router (V3: and its
    e_score_correction_bias), each expert's gate/up/down and the shared
    experts'. Linear N(0, 1/fan_in), norms 1 + 0.1 N(0, 1)."""
    E, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, R, QR = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["q_lora_rank"]
    nope, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    X, MI, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    w = {}

    def linear(name, n_out, n_in):
        w[name] = rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(name, n):
        w[name] = 1.0 + 0.1 * rng.standard_normal(n)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, E))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", E)
        if QR:
            linear(p + "self_attn.q_a_proj.weight", QR, E)
            norm(p + "self_attn.q_a_layernorm.weight", QR)
            linear(p + "self_attn.q_b_proj.weight", H * (nope + dr), QR)
        else:
            linear(p + "self_attn.q_proj.weight", H * (nope + dr), E)
        linear(p + "self_attn.kv_a_proj_with_mqa.weight", R + dr, E)
        norm(p + "self_attn.kv_a_layernorm.weight", R)
        linear(p + "self_attn.kv_b_proj.weight", H * (nope + dv), R)
        linear(p + "self_attn.o_proj.weight", E, H * dv)
        norm(p + "post_attention_layernorm.weight", E)
        if i < cfg["first_k_dense_replace"]:
            linear(p + "mlp.gate_proj.weight", I, E)
            linear(p + "mlp.up_proj.weight", I, E)
            linear(p + "mlp.down_proj.weight", E, I)
            continue
        linear(p + "mlp.gate.weight", X, E)
        if cfg["scoring_func"] == "sigmoid":
            w[p + "mlp.gate.e_score_correction_bias"] = 0.3 * rng.standard_normal(X)
        for e in range(X):
            linear(p + f"mlp.experts.{e}.gate_proj.weight", MI, E)
            linear(p + f"mlp.experts.{e}.up_proj.weight", MI, E)
            linear(p + f"mlp.experts.{e}.down_proj.weight", E, MI)
        linear(p + "mlp.shared_experts.gate_proj.weight", S * MI, E)
        linear(p + "mlp.shared_experts.up_proj.weight", S * MI, E)
        linear(p + "mlp.shared_experts.down_proj.weight", E, S * MI)
    norm("model.norm.weight", E)
    w["lm_head.weight"] = rng.standard_normal((V, E)) / math.sqrt(E)
    return {k: v.astype(np.float32) for k, v in w.items()}


def deepseek_yarn(cfg):
    """_compute_yarn_parameters over the rotated tail (DeepseekV2Config's
    head_dim is qk_rope_head_dim), with DeepSeek's mscale keys: (inv_freq,
    cos/sin factor, q.k factor)."""
    dr, base, rs = cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg["rope_scaling"]
    factor, fast, slow = rs["factor"], rs.get("beta_fast", 32), rs.get("beta_slow", 1)
    old = rs["original_max_position_embeddings"]
    pos_freqs = base ** (np.arange(0, dr, 2, dtype=np.float64) / dr)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def dim_of(rot):
        return dr * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(dim_of(fast)), math.ceil(dim_of(slow))
    low, high = max(low, 0), min(high, dr - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dr // 2, dtype=np.float64) - low) / (high - low), 0, 1)

    def m(x):
        return 0.1 * x * math.log(factor) + 1.0 if factor > 1 else 1.0

    keep = 1 - ramp
    return (inter * (1 - keep) + extra * keep, m(rs["mscale"]) / m(rs["mscale_all_dim"]),
            m(rs["mscale_all_dim"]) ** 2)


def rope_interleaved(x, pos, freqs):
    """Pairs (2j, 2j+1) rotated by pos * freqs[j] (x [T, heads, dr])."""
    ang = pos[:, None] * freqs[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def deepseek_route(cfg, logits, bias):
    """DeepseekV2Moe / DeepseekV3TopkRouter on one row: (experts, weights)."""
    X, K = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    if cfg["scoring_func"] == "softmax":
        scores = np.exp(logits - logits.max())
        scores /= scores.sum()
        sel = scores.copy()
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        sel = scores + bias
    if cfg["topk_method"] in ("group_limited_greedy", "noaux_tc"):
        G, TG = cfg["n_group"], cfg["topk_group"]
        groups = sel.reshape(G, X // G)
        if cfg["scoring_func"] == "sigmoid":
            gs = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
        else:
            gs = groups.max(axis=1)
        keep = np.argsort(-gs, kind="stable")[:TG]
        mask = np.zeros(G, dtype=bool)
        mask[keep] = True
        # -inf as DeepSeek's inference code (and llama.cpp) mask dropped
        # groups; transformers fills 0.0, which differs only when a kept
        # group's corrected scores are negative (no row of this case)
        sel = np.where(np.repeat(mask, X // G), sel, -np.inf)
    top = np.argsort(-sel, kind="stable")[:K]
    wts = scores[top]
    if cfg["scoring_func"] == "sigmoid":
        if cfg["norm_topk_prob"]:
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * cfg["routed_scaling_factor"]
    elif K > 1 and cfg["norm_topk_prob"]:
        wts = wts / (wts.sum() + 1e-20)
    else:
        wts = wts * cfg["routed_scaling_factor"]
    return top, wts


def forward_deepseek(cfg, w, ids):
    E, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    H, R, QR = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["q_lora_rank"]
    nope, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    X, eps = cfg["n_routed_experts"], cfg["rms_norm_eps"]
    D = nope + dr
    W = {k: v.astype(np.float64) for k, v in w.items()}

    def lin(x, name):
        return x @ W[name + ".weight"].T

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def mlp(x, p):
        return lin(silu(lin(x, p + "gate_proj")) * lin(x, p + "up_proj"), p + "down_proj")

    freqs, cs_factor, qk_factor = deepseek_yarn(cfg)
    scale = qk_factor / math.sqrt(D)
    pos = np.arange(T, dtype=np.float64)
    out = {}
    x = W["model.embed_tokens.weight"][ids]
    out["embed"] = x
    mask = np.tril(np.ones((T, T), dtype=bool))
    for i in range(L):
        p = f"model.layers.{i}."
        xn = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        if QR:
            qa = rms_norm(lin(xn, p + "self_attn.q_a_proj"),
                          W[p + "self_attn.q_a_layernorm.weight"], eps)
            q = lin(qa, p + "self_attn.q_b_proj").reshape(T, H, D)
        else:
            q = lin(xn, p + "self_attn.q_proj").reshape(T, H, D)
        ckv = lin(xn, p + "self_attn.kv_a_proj_with_mqa")
        lat = rms_norm(ckv[:, :R], W[p + "self_attn.kv_a_layernorm.weight"], eps)
        k_pe = rope_interleaved(ckv[:, None, R:], pos, freqs)[:, 0, :] * cs_factor
        q = q.copy()
        q[..., nope:] = rope_interleaved(q[..., nope:], pos, freqs) * cs_factor
        kv = (lat @ W[p + "self_attn.kv_b_proj.weight"].T).reshape(T, H, nope + dv)
        k = np.concatenate([kv[..., :nope], np.repeat(k_pe[:, None, :], H, axis=1)], axis=2)
        v = kv[..., nope:]
        att = np.empty((T, H, dv))
        for h in range(H):
            sc = np.where(mask, (q[:, h, :] @ k[:, h, :].T) * scale, -np.inf)
            sc = np.exp(sc - sc.max(axis=1, keepdims=True))
            sc /= sc.sum(axis=1, keepdims=True)
            att[:, h, :] = sc @ v[:, h, :]
        att = att.reshape(T, H * dv)
        h_mid = x + lin(att, p + "self_attn.o_proj")
        hn = rms_norm(h_mid, W[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            y = mlp(hn, p + "mlp.")
        else:
            logits = lin(hn, p + "mlp.gate")
            bias = W.get(p + "mlp.gate.e_score_correction_bias", np.zeros(X))
            y = mlp(hn, p + "mlp.shared_experts.")
            for t in range(T):
                top, wts = deepseek_route(cfg, logits[t], bias)
                for e, wt in zip(top, wts):
                    y[t] += wt * mlp(hn[t:t + 1], p + f"mlp.experts.{e}.")[0]
        x = h_mid + y
        out[f"layers.{i}.q"] = q
        out[f"layers.{i}.kv_latent"] = np.concatenate([lat, k_pe], axis=1)
        out[f"layers.{i}.k"] = k
        out[f"layers.{i}.v"] = v
        out[f"layers.{i}.attn_out"] = att
        out[f"layers.{i}.x_out"] = x
    fn = rms_norm(x, W["model.norm.weight"], eps)
    out["final_norm"] = fn
    out["logits"] = fn @ W["lm_head.weight"].T
    return out


# ---- files ---------------------------------------------------------------

def write_safetensors(path, tensors, metadata):
    """Plain safetensors: u64 header length, JSON header padded with spaces
    to a multiple of 8, F32 little-endian data in the order given."""
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def make_case(name, root):
    spec = CASES[name]
    cfg = spec["config"]
    rng = np.random.default_rng(spec["seed"])
    kind = {"gemma4_text": (make_weights_gemma4, forward_gemma4),
            "gpt_oss": (make_weights_gpt_oss, forward_gpt_oss),
            "deepseek_v2": (make_weights_deepseek, forward_deepseek),
            "deepseek_v3": (make_weights_deepseek, forward_deepseek)}
    make, fwd = kind.get(cfg["model_type"], (make_weights, forward))
    weights = make(cfg, rng)
    ids = rng.integers(0, cfg["vocab_size"], size=T)
    golden = fwd(cfg, weights, ids)
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(folder, "prompt.txt"), "w") as f:
        f.write(" ".join(str(int(t)) for t in ids) + "\n")
    write_safetensors(os.path.join(folder, "model.safetensors"), weights, {"format": "pt"})
    tokens = " ".join(str(int(t)) for t in ids)
    write_safetensors(os.path.join(folder, "golden.safetensors"),
                      {k: v.astype(np.float32) for k, v in golden.items()},
                      {"case": name, "tokens": tokens})
    print(f"{folder}: {len(weights)} weights, {len(golden)} golden tensors")


def main(argv):
    names = argv[1:] or sorted(CASES)
    root = os.path.dirname(os.path.abspath(__file__))
    for n in names:
        if n not in CASES:
            sys.exit(f"make_case.py: unknown case {n!r} (cases: {', '.join(sorted(CASES))})")
        make_case(n, root)


if __name__ == "__main__":
    main(sys.argv)
