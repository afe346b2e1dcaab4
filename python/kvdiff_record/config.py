"""model_config_from_hf: the model_config object of a dump, from a Hugging
Face folder's config.json, with the defaults kvdiff applies (model/config.c)
so a recording of the same model states the same config kvdiff's does."""

import math

from . import config_rules, families
from .recorder import RecorderError

# model/config.c ARCHES: per model_type the default heads, KV heads, head_dim
# and RoPE base when config.json leaves them out (head_dim None: hidden/heads).
_ARCH = {
    "llama": {"heads": None, "kv": None, "head_dim": None, "theta": 10000.0},
    "qwen2": {"heads": None, "kv": None, "head_dim": None, "theta": 10000.0},
    "qwen3": {"heads": None, "kv": None, "head_dim": 128, "theta": 10000.0},
    "gemma3_text": {"heads": 8, "kv": 4, "head_dim": 256, "theta": 1000000.0},
}
_GEMMA_QPAS, _GEMMA_WINDOW, _GEMMA_PATTERN, _GEMMA_LOCAL_THETA = 256.0, 4096, 6, 10000.0
_GEMMA_VOCAB = 262208


def model_config_from_hf(folder_or_config):
    """The model_config dict (docs/dump-format.md) for a Hugging Face model
    folder, a config.json path, or an already-parsed config dict.
    Gemma 3 multimodal configs (model_type "gemma3") are read from their
    text_config. Layer types come from layer_types, else Gemma 3's
    sliding_window_pattern (layer i slides iff (i+1) % pattern != 0,
    default 6); kv_owner from num_kv_shared_layers (a shared layer reads the
    last non-shared layer of its type). For the model types kvdiff runs,
    refuses exactly what `kvdiff run --model` refuses, with kvdiff's
    limits and type rules (config_rules.py), raising RecorderError naming
    the key."""
    cfg, name = _load(folder_or_config)
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise RecorderError(f"{name}: model_type is {config_rules.jdesc(mt)}; expected a string")
    rules = None
    if isinstance(mt, str) and (mt in config_rules.ARCHES or mt in ("gemma3", "gemma4")):
        rules = config_rules.check(cfg, name)
    if mt in ("gemma3", "gemma4"):   # multimodal: the text model under text_config
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise RecorderError(f"{name}: text_config is missing (model_type {mt} nests the "
                                f"text model there)")
        cfg, mt = tc, mt + "_text"
    if mt == "gemma4_text":
        return _gemma4(cfg, name, rules)
    if mt in families.FAMILIES:   # a family file's own model_config
        return families.FAMILIES[mt].model_config(cfg, name, rules)
    if mt not in _ARCH:
        return _any_architecture(cfg, name, mt)
    gemma = mt == "gemma3_text"
    a = _ARCH[mt]

    def need(key, default=None):
        v = cfg.get(key)
        if v is None:
            if default is None:
                raise RecorderError(f"{name}: {key} is missing")
            return default
        return v

    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    heads = need("num_attention_heads", a["heads"])
    kv = cfg.get("num_key_value_heads") or (a["kv"] if gemma else heads)
    if heads % kv:
        raise RecorderError(f"{name}: num_key_value_heads is {kv}, which does not divide "
                            f"num_attention_heads {heads}")
    head_dim = cfg.get("head_dim") or a["head_dim"]
    if head_dim is None:
        if hidden % heads:
            raise RecorderError(f"{name}: head_dim is missing and hidden_size {hidden} is not "
                                f"a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    vocab = need("vocab_size", _GEMMA_VOCAB if gemma else None)

    theta, local = _rope(cfg, name, gemma, a["theta"])
    types = _layer_types(cfg, name, mt, layers)
    window = 0
    if gemma and "sliding_attention" in types:
        w = cfg.get("sliding_window", _GEMMA_WINDOW)
        if w is None:
            raise RecorderError(f"{name}: sliding_window is null but layer "
                                f"{types.index('sliding_attention')} is a sliding_attention layer")
        window = int(w)
    owners = _kv_owner(cfg, name, gemma, types)
    scale = 1.0 / math.sqrt(float(cfg.get("query_pre_attn_scalar") or _GEMMA_QPAS)
                            if gemma else float(head_dim))
    out = {"model_type": mt, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
           "intermediate_size": need("intermediate_size"), "vocab_size": vocab,
           "sliding_window": window, "layer_types": types, "kv_owner": owners,
           "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
           "rope_local_base_freq": local, "attn_scale": scale}
    scaling = rules["rope_scaling"] if rules else _rope_scaling(cfg, name, gemma)
    if scaling:
        out["rope_scaling"] = scaling
    _softcap(cfg, out, gemma)
    return out


def _softcap(cfg, out, gemma):
    """Gemma's final logit softcap, as kvdiff's dumps carry it (absent when
    none: null, 0 or not a Gemma): the comparer fits /output as a map of
    the reference's logits and undoes this cap first."""
    cap = cfg.get("final_logit_softcapping") if gemma else None
    if cap:
        out["final_logit_softcapping"] = float(cap)


def _gemma4(cfg, name, rules):
    """gemma4_text as kvdiff reads it (model/config.c): sliding layers with
    head_dim and num_key_value_heads, full ones with global_head_dim and
    num_global_key_value_heads (or per_layer_config), proportional RoPE on
    full layers, scores scaled by 1, kv_owner from num_kv_shared_layers
    and the layer types, per-layer inputs. MoE models are refused. RoPE
    and the window as config_rules resolved them (rules): the top-level
    rope_theta under a full_attention entry without one, rope_type or
    type, the 4096 default window, rope_scaling."""
    def need(key):
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise RecorderError(f"{name}: {key} is missing or not a positive integer "
                                f"(gemma4_text has no default)")
        return v

    if cfg.get("enable_moe_block") or cfg.get("num_experts"):
        raise RecorderError(f"{name}: Gemma 4's mixture-of-experts models are not supported "
                            f"(enable_moe_block / num_experts; dense E2B/E4B-style only)")
    hidden, layers = need("hidden_size"), need("num_hidden_layers")
    heads, kv = need("num_attention_heads"), need("num_key_value_heads")
    types = cfg.get("layer_types")
    if not isinstance(types, list) or len(types) != layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise RecorderError(f"{name}: layer_types must list {layers} layers, each "
                            f"sliding_attention or full_attention")
    head_dim = int(cfg.get("head_dim") or 256)
    plc = cfg.get("per_layer_config") or {}

    def full_layer_value(key):
        for i, t in enumerate(types):
            lc = plc.get(str(i)) if isinstance(plc, dict) else None
            v = lc.get(key) if isinstance(lc, dict) else None
            if t == "full_attention" and v:
                return int(v)
        return None

    head_full = int(cfg.get("global_head_dim") or full_layer_value("head_dim") or head_dim)
    kv_full = int(cfg.get("num_global_key_value_heads") or
                  full_layer_value("num_key_value_heads") or kv)
    for what, n in (("num_key_value_heads", kv), ("num_global_key_value_heads", kv_full)):
        if heads % n:
            raise RecorderError(f"{name}: {what} is {n}, which does not divide "
                                f"num_attention_heads {heads}")
    window = rules["sliding_window"]
    per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
    vocab = need("vocab_size")
    out = {"model_type": "gemma4_text", "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
           "intermediate_size": need("intermediate_size"), "vocab_size": vocab,
           "sliding_window": window, "layer_types": list(types),
           "kv_owner": _kv_owner(cfg, name, True, types),
           "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
           "rope_theta": rules["rope_theta"],
           "rope_local_base_freq": rules["rope_local_base_freq"],
           "attn_scale": 1.0, "global_head_dim": head_full,
           "num_global_key_value_heads": kv_full,
           "partial_rotary_factor_full": rules["partial_rotary_factor_full"],
           "attention_k_eq_v": bool(cfg.get("attention_k_eq_v", False)),
           "use_double_wide_mlp": bool(cfg.get("use_double_wide_mlp", False)),
           "hidden_size_per_layer_input": per_layer,
           "vocab_size_per_layer_input": int(cfg.get("vocab_size_per_layer_input") or vocab)
           if per_layer else 0}
    if rules["rope_scaling"]:
        out["rope_scaling"] = rules["rope_scaling"]
    _softcap(cfg, out, True)
    return out


def _any_architecture(cfg, name, mt):
    """A model_type kvdiff's engines do not run (Mistral, Phi, ...): its
    recording can still be a compare's reference against a port's. The
    fields every transformers decoder config has, read as transformers
    reads them; one kvdiff needs and cannot default is named."""
    if not isinstance(mt, str) or not mt:
        raise RecorderError(f"{name}: model_type is missing")
    config_rules.check_other(cfg, name)

    def need(key, *alts):
        for k in (key,) + alts:
            v = cfg.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        raise RecorderError(f"{name}: {key} is missing or not a positive integer (model_type "
                            f"{mt!r}: kvdiff needs it to size the recorded stages)")

    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or kv <= 0 or heads % kv:
        raise RecorderError(f"{name}: num_key_value_heads is {kv!r}, which does not divide "
                            f"num_attention_heads {heads}")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise RecorderError(f"{name}: head_dim is missing and hidden_size {hidden} is not a "
                            f"multiple of num_attention_heads {heads}")
    theta, _ = _rope(cfg, name, False, 10000.0)
    window = cfg.get("sliding_window")
    lt = cfg.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != layers or any(
                t not in ("sliding_attention", "full_attention") for t in lt):
            raise RecorderError(f"{name}: layer_types must list {layers} layers, each "
                                f"sliding_attention or full_attention")
        types = list(lt)
    elif isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True):
        types = ["sliding_attention"] * layers   # Mistral: every layer slides
    else:
        types = ["full_attention"] * layers
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise RecorderError(f"{name}: sliding_window is missing but layer "
                            f"{types.index('sliding_attention')} is a sliding_attention layer")
    qpas = cfg.get("query_pre_attn_scalar")
    out = {"model_type": mt, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
           "intermediate_size": need("intermediate_size"), "vocab_size": need("vocab_size"),
           "sliding_window": window if "sliding_attention" in types else 0,
           "layer_types": types, "kv_owner": _kv_owner(cfg, name, True, types),
           "rms_norm_eps": float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
           "rope_theta": theta, "rope_local_base_freq": theta,
           "attn_scale": 1.0 / math.sqrt(float(qpas or head_dim))}
    scaling = _rope_scaling(cfg, name, False)
    if scaling:
        out["rope_scaling"] = scaling
    return out


def _load(src):
    """The config object and the name messages give it: a dict as it is,
    a folder's config.json or a file read as kvdiff reads one (a regular
    file of at most 16 MiB, JSON as jansson takes it: config_rules)."""
    if isinstance(src, dict):
        return src, "config"
    cfg, path = config_rules.load_json(src)
    if not isinstance(cfg, dict):
        raise RecorderError(f"{path}: top level is {config_rules.jdesc(cfg)}; expected an "
                            f"object")
    return cfg, path


def _rope(cfg, name, gemma, default_theta):
    theta = float(cfg.get("rope_theta") or default_theta)
    local = float(cfg.get("rope_local_base_freq") or _GEMMA_LOCAL_THETA) if gemma else theta
    rp = cfg.get("rope_parameters")   # transformers 5
    if isinstance(rp, dict):
        full, slide = rp.get("full_attention"), rp.get("sliding_attention")
        if gemma and (full or slide):
            theta = float((full or {}).get("rope_theta", theta))
            local = float((slide or {}).get("rope_theta", local))
        elif not gemma:
            theta = float(rp.get("rope_theta", theta))
    return theta, (local if gemma else theta)


def _rope_scaling(cfg, name, gemma):
    """The global layers' RoPE scaling as model_config states it (linear,
    llama3 or yarn, as config.json writes it; yarn with its defaults
    resolved), or None; read under config_rules' rules."""
    rs = cfg.get("rope_scaling")
    rp = cfg.get("rope_parameters")   # transformers 5
    path = "rope_scaling"
    if rs is None and isinstance(rp, dict):
        rs = rp.get("full_attention") if gemma else rp
        path = "rope_parameters.full_attention" if gemma else "rope_parameters"
    if not isinstance(rs, dict):
        return None
    out = config_rules._scaling(config_rules._Ctx(name), path, rs, False)
    if out and out["rope_type"] == "yarn" and out["original_max_position_embeddings"] is None:
        mp = cfg.get("max_position_embeddings")
        if not isinstance(mp, int) or isinstance(mp, bool) or mp <= 0:
            raise RecorderError(f"{name}: {path} is yarn without "
                                f"original_max_position_embeddings, and max_position_embeddings "
                                f"is not a positive integer")
        out["original_max_position_embeddings"] = mp
    return out


def _layer_types(cfg, name, mt, layers):
    lt = cfg.get("layer_types")
    if mt == "gemma3_text" and lt is None:
        pattern = int(cfg.get("sliding_window_pattern") or _GEMMA_PATTERN)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)]
    if lt is None or mt == "llama":   # LlamaConfig has no layer_types
        return ["full_attention"] * layers
    if not isinstance(lt, list) or len(lt) != layers:
        raise RecorderError(f"{name}: layer_types must list {layers} layers "
                            f"(num_hidden_layers)")
    for i, t in enumerate(lt):
        if t not in ("sliding_attention", "full_attention") or \
                (t == "sliding_attention" and mt != "gemma3_text"):
            raise RecorderError(f"{name}: layer_types[{i}] is {t!r}; kvdiff reads "
                                f"full_attention (and sliding_attention for gemma3_text)")
    return list(lt)


def _kv_owner(cfg, name, gemma, types):
    n = len(types)
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared and not gemma:
        raise RecorderError(f"{name}: num_kv_shared_layers is {shared}; KV sharing is read for "
                            f"gemma3_text and gemma4_text only")
    if shared >= n and shared:
        raise RecorderError(f"{name}: num_kv_shared_layers is {shared} but the model has {n} "
                            f"layers")
    first_shared = n - shared
    owners = []
    for i in range(n):
        if i < first_shared:
            owners.append(i)
            continue
        owner = next((j for j in range(first_shared - 1, -1, -1) if types[j] == types[i]), -1)
        if owner < 0:
            raise RecorderError(f"{name}: num_kv_shared_layers is {shared}: layer {i} has no "
                                f"earlier non-shared {types[i]} layer to read K/V from")
        owners.append(owner)
    return owners
