"""gpt-oss (model_type gpt_oss): the Python reader's half of
model/families/gpt_oss.c. ARCH and the traits are its row of the defaults
tables (config_rules), rules() reads and checks its own config.json keys as
the C family's parse and check do, model_config() is the model_config a
dump of it states (config.model_config_from_hf)."""

import math

from ..config_rules import MAX_EXPERTS, MAX_SCALAR, MISSING, jdesc

ARCH = dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=64, vocab=0,
            theta=150000.0, tie=False, bos=-1, eos=-1)
MAX_POSITIONS = 131072
SLIDES = (2, 128)   # without layer_types every 2nd layer full; window 128
SINKS = True        # a learned sink logit per head in every softmax (the attn_sink stage)


def rules(cx, obj, c):
    """model/families/gpt_oss.c's parse: experts, their clamp, the
    attention biases; MXFP4 checkpoints refused."""
    q = obj.get("quantization_config")
    if q is not None:
        cx.fail("quantization_config", f"is {jdesc(q)}; kvdiff reads gpt-oss with "
                                       f"BF16/F16/F32 expert weights (dequantize the MXFP4 "
                                       f"experts first, e.g. save_pretrained after loading "
                                       f"with dequantize=True)")
    c.experts = cx.get_int(obj, "num_local_experts", True, 0, 1, MAX_EXPERTS)
    a, b = obj.get("num_experts_per_tok", MISSING), obj.get("experts_per_token", MISSING)
    if a is not MISSING:
        a = cx.want_int("num_experts_per_tok", a, 1, c.experts)
    if b is not MISSING:
        b = cx.want_int("experts_per_token", b, 1, c.experts)
    if a is not MISSING and b is not MISSING and a != b:
        cx.fail("experts_per_token", f"is {b} but num_experts_per_tok is {a}")
    cx.get_num(obj, "swiglu_limit", 7.0, 0.0, True, MAX_SCALAR)
    cx.get_bool(obj, "attention_bias", True)


def model_config(cfg, name, rules):
    """gpt_oss as kvdiff reads it (model/families/gpt_oss.c): layers
    alternating sliding (even) and full unless layer_types says otherwise,
    head_dim 64 by default, scores scaled by head_dim^-1/2, YaRN on every
    layer, experts; config_rules has checked every field."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else kv
    head_dim = cfg.get("head_dim")
    head_dim = 64 if head_dim is None else head_dim
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        p = cfg.get("sliding_window_pattern") or 2
        types = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(layers)]
    experts = cfg["num_local_experts"]
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    out = {"model_type": "gpt_oss", "hidden_size": cfg["hidden_size"],
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": head_dim,
           "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
           "sliding_window": rules["sliding_window"], "layer_types": list(types),
           "kv_owner": list(range(layers)),
           "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
           "rope_theta": rules["rope_theta"], "rope_local_base_freq": rules["rope_theta"],
           "attn_scale": 1.0 / math.sqrt(float(head_dim)),
           "num_local_experts": experts,
           "num_experts_per_tok": min(experts, 4) if top_k is None else top_k}
    if rules["rope_scaling"]:
        out["rope_scaling"] = rules["rope_scaling"]
    return out
