"""DeepSeek-V2/V3 (model_type deepseek_v2, deepseek_v3): the Python
reader's half of model/families/deepseek.c. ARCH_V2 / ARCH_V3 are its rows
of the defaults tables (config_rules), rules() reads and checks its own
config.json keys (the latent attention's sizes, the experts and their
routing) as the C family's parse and check do, model_config() is the
model_config a dump of it states (config.model_config_from_hf)."""

import math

from ..config_rules import (MAX_EXPERTS, MAX_INTERMEDIATE, MAX_LAYERS, MAX_RANK, MAX_SCALAR,
                            MISSING, _present)
from ..recorder import RecorderError

# head_dim is derived (qk_nope + qk_rope): the 192 only spares the walk a
# hidden/heads it would not use
ARCH_V2 = dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=192, vocab=0,
               theta=10000.0, tie=False, bos=100000, eos=100001)
ARCH_V3 = dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=192, vocab=0,
               theta=10000.0, tie=False, bos=0, eos=1)


def rules(cx, obj, c):
    """model/families/deepseek.c's parse: the latent attention's sizes, the
    experts and their routing; sets c.mla to what config.py writes."""
    v3 = c.arch == "deepseek_v3"
    mla = {}
    mla["kv_lora_rank"] = cx.get_int(obj, "kv_lora_rank", False, 512, 1, MAX_RANK)
    q = obj.get("q_lora_rank", MISSING)
    mla["q_lora_rank"] = 1536 if q is MISSING else 0 if q is None else cx.want_int(
        "q_lora_rank", q, 1, MAX_RANK)
    nope = cx.get_int(obj, "qk_nope_head_dim", False, 128, 1, MAX_RANK)
    rope = cx.get_int(obj, "qk_rope_head_dim", False, 64, 2, MAX_RANK)
    mla["v_head_dim"] = cx.get_int(obj, "v_head_dim", False, 128, 1, MAX_RANK)
    cx.refuse_true(obj, "attention_bias", "kvdiff runs DeepSeek's attention without biases "
                                          "(no published checkpoint has them)")
    cx.refuse_true(obj, "mlp_bias", "kvdiff runs DeepSeek's MLPs without biases")
    if rope % 2:
        cx.fail("qk_rope_head_dim", f"is {rope}; RoPE needs it even")
    if v3 and not cx.get_bool(obj, "rope_interleave", True):
        cx.fail("rope_interleave", "is false; kvdiff rotates DeepSeek's key tails on "
                                   "interleaved pairs (2i, 2i+1), as the checkpoints do")
    kv = obj.get("num_key_value_heads")
    if kv is not None and kv != c.heads:
        cx.fail("num_key_value_heads", f"is {kv}; MLA expands the latent to all {c.heads} "
                                       f"heads")
    c.kv, c.head_dim = c.heads, nope + rope
    mla["qk_rope_head_dim"], mla["head_dim"] = rope, c.head_dim
    if mla["v_head_dim"] > c.head_dim:
        raise RecorderError(f"{cx.name}: v_head_dim {mla['v_head_dim']} out of 1..{c.head_dim} "
                            f"(qk_nope + qk_rope)")
    c.mla = mla
    x = obj.get("n_routed_experts", MISSING)
    if x is None:
        return
    mla["experts"] = cx.get_int(obj, "n_routed_experts", False, 256 if v3 else 64, 1,
                                MAX_EXPERTS)
    k = obj.get("num_experts_per_tok")
    if k is None:
        cx.fail("num_experts_per_tok", f"is missing (n_routed_experts is {mla['experts']})")
    mla["top_k"] = cx.want_int("num_experts_per_tok", k, 1, mla["experts"])
    cx.get_int(obj, "moe_intermediate_size", False, 2048 if v3 else 1407, 1, MAX_INTERMEDIATE)
    if _present(obj, "n_shared_experts"):
        cx.want_int("n_shared_experts", obj["n_shared_experts"], 0, 64)
    mla["first_dense"] = cx.get_int(obj, "first_k_dense_replace", False, 3 if v3 else 0, 0,
                                    c.layers)
    mla["moe_every"] = cx.get_int(obj, "moe_layer_freq", False, 1, 1, MAX_LAYERS)
    cx.get_bool(obj, "norm_topk_prob", v3)
    cx.get_num(obj, "routed_scaling_factor", 2.5 if v3 else 1.0, 0.0, True, MAX_SCALAR)
    method = cx.get_str(obj, "topk_method", "noaux_tc" if v3 else "greedy")
    scoring = cx.get_str(obj, "scoring_func", "sigmoid" if v3 else "softmax")
    known = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in known:
        cx.fail("topk_method", f"'{method[:40]}' is not {c.arch}'s (kvdiff runs "
                               f"{'noaux_tc' if v3 else 'greedy and group_limited_greedy'})")
    if scoring != ("sigmoid" if v3 else "softmax"):
        cx.fail("scoring_func", f"'{scoring[:40]}' does not go with topk_method {method}")
    mla["sigmoid"], mla["n_group"], mla["topk_group"] = v3, 0, 0
    if method != "greedy":
        g = cx.get_int(obj, "n_group", False, 1, 1, mla["experts"])
        tg = cx.get_int(obj, "topk_group", False, 1, 1, g)
        if mla["experts"] % g:
            cx.fail("n_group", f"is {g}, which does not divide n_routed_experts "
                               f"{mla['experts']}")
        if mla["top_k"] > tg * (mla["experts"] // g):
            cx.fail("topk_group", f"is {tg}: its groups hold fewer than num_experts_per_tok "
                                  f"{mla['top_k']} experts")
        mla["n_group"], mla["topk_group"] = g, tg


def model_config(cfg, name, rules):
    """deepseek_v2 / deepseek_v3 as kvdiff reads them (model/families/
    deepseek.c): every layer full, the expanded heads (head_dim qk_nope +
    qk_rope, as many KV heads as heads), q.k scaled by head_dim^-1/2 times
    DeepSeek's m(mscale_all_dim)^2, the latent's and values' widths, which
    layers have experts; config_rules has checked every field."""
    mla = rules["mla"]
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = mla["head_dim"]
    scale = 1.0 / math.sqrt(float(head_dim))
    rs = rules["rope_scaling"]
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    msa = raw.get("mscale_all_dim") if isinstance(raw, dict) else None
    if rs and rs["rope_type"] == "yarn" and msa:
        m = 0.1 * float(msa) * math.log(rs["factor"]) + 1.0 if rs["factor"] > 1.0 else 1.0
        scale = scale * (m * m)
    out = {"model_type": rules["model_type"], "hidden_size": cfg["hidden_size"],
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": heads, "head_dim": head_dim,
           "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
           "sliding_window": 0, "layer_types": ["full_attention"] * layers,
           "kv_owner": list(range(layers)),
           "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
           "rope_theta": rules["rope_theta"], "rope_local_base_freq": rules["rope_theta"],
           "attn_scale": scale}
    if rs:
        out["rope_scaling"] = rs
    if "experts" in mla:
        out["num_local_experts"] = mla["experts"]
        out["num_experts_per_tok"] = mla["top_k"]
        if mla["first_dense"] > 0 or mla["moe_every"] > 1:
            out["first_k_dense_replace"] = mla["first_dense"]
            out["moe_layer_freq"] = mla["moe_every"]
        if mla["sigmoid"]:
            out["scoring_func"] = "sigmoid"
        if mla["n_group"]:
            out["n_group"], out["topk_group"] = mla["n_group"], mla["topk_group"]
    out["kv_lora_rank"] = mla["kv_lora_rank"]
    out["qk_rope_head_dim"] = mla["qk_rope_head_dim"]
    out["v_head_dim"] = mla["v_head_dim"]
    return out


class _Row:
    """One model_type's row: what families.FAMILIES lists."""

    def __init__(self, arch, max_positions):
        self.ARCH, self.MAX_POSITIONS = arch, max_positions
        self.rules, self.model_config = rules, model_config


V2, V3 = _Row(ARCH_V2, 2048), _Row(ARCH_V3, 4096)
