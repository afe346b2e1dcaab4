"""Hostile variants of a real config.json, for the test that kvdiff and
kvdiff_record.model_config_from_hf accept and refuse the same configs
(test_recorder.TestConfigAgreement).

variants(base) yields (label, bytes): the base with one field (or one
nested field) deleted or set to a wrong-typed, out-of-range or edge value,
a few structured mistakes per field, and JSON that is malformed in ways
Python's json module would let through (duplicate keys, NaN, integers
past int64, NUL characters, lone surrogates)."""

import copy
import json

DELETE = object()

# One field at a time, every field the base has and every one kvdiff reads.
VALUES = (DELETE, None, 0, -1, 1, 2, 3, 2**31, 2**63 - 1, -2**63, 2.5, 2.0, 1e300, -0.5,
          "2", "", True, False, [], {}, [1, 2])
SHORT = (DELETE, None, 0, -1, 2**31, 2.5, 2.0, "2", True, [], {})

READ_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "hidden_activation",
    "attention_bias", "mlp_bias", "use_sliding_window", "attn_logit_softcapping",
    "use_bidirectional_attention", "num_experts", "enable_moe_block",
    "query_pre_attn_scalar", "final_logit_softcapping", "rope_theta", "rope_local_base_freq",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "layer_types",
    "sliding_window_pattern", "sliding_window", "num_kv_shared_layers", "per_layer_config",
    "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "use_double_wide_mlp",
    "hidden_size_per_layer_input", "vocab_size_per_layer_input", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "text_config")

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma4_text", "gemma3", "gemma4",
            "mistral", "LLAMA", "")


def _structured(base):
    """Per field, values of the right shape that are wrong for this base."""
    n = base.get("num_hidden_layers", 4) if isinstance(base.get("num_hidden_layers"), int) else 4
    n = max(1, min(n, 64))
    lt = base.get("layer_types") if isinstance(base.get("layer_types"), list) else None
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                 "rope_theta": 1e6}
    return {
        "layer_types": [["full_attention"] * n, ["sliding_attention"] * n,
                        ["full_attention"] * (n + 1), ["full_attention"] * (n - 1),
                        ["sliding"] + ["full_attention"] * (n - 1),
                        [None] * n, (lt or ["full_attention"] * n)[::-1]],
        "num_kv_shared_layers": [n - 1, n, n + 1, n // 2, 256, 257],
        "eos_token_id": [list(range(9)), [0, 300], [-1], [1, "2"], [1, None], [], [0]],
        "bos_token_id": [255, 256, 262207, 262208],
        "vocab_size": [255, 1, 2, 1 << 24, (1 << 24) + 1, 262208],
        "hidden_size": [1 << 20, (1 << 20) + 1, 63, 4096],
        "intermediate_size": [1 << 22, (1 << 22) + 1],
        "num_attention_heads": [3, 4096, 4097, 8],
        "num_key_value_heads": [3, 4, 8, 4096],
        "head_dim": [1 << 14, (1 << 14) + 1, 33, 4096, 8192],
        "global_head_dim": [33, 1 << 14, (1 << 14) + 2, 2],
        "num_global_key_value_heads": [3, 4, 8],
        "sliding_window": [1 << 24, (1 << 24) + 1],
        "sliding_window_pattern": [1 << 20, (1 << 20) + 1, 1, 7],
        "max_position_embeddings": [1 << 24, (1 << 24) + 1],
        "rms_norm_eps": [1.0, 1.0000001, 1e-300, 0.0],
        "rope_theta": [1.0, 0.999, 1e15, 1.1e15],
        "rope_local_base_freq": [1.0, 0.5, 1e16],
        "query_pre_attn_scalar": [1e9, 1.1e9, 0.0],
        "final_logit_softcapping": [1e9, 2e9, 0.0, 30],
        "partial_rotary_factor": [1.0, 1, 0.5, 1.5],
        "hidden_size_per_layer_input": [1 << 16, (1 << 20) // n + 1, 0, 16],
        "vocab_size_per_layer_input": [1 << 24, 257, 255, 256],
        "hidden_act": ["gelu", "swish", "SiLU", "gelu_pytorch_tanh"],
        "hidden_activation": ["gelu_tanh", "gelu", "silu"],
        "use_bidirectional_attention": ["vision", "all", "VISION"],
        "num_experts": [0, 0.0, 8],
        "model_type": list(FAMILIES),
        "rope_scaling": [
            {"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 0},
            {"rope_type": "yarn", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0},
            {"rope_type": "linear", "type": "llama3", "factor": 2.0},
            {"rope_type": "default"}, {"rope_type": ""}, {}, {"factor": 2.0},
            {"rope_type": "linear", "factor": 1e6}, {"rope_type": "linear", "factor": 1.1e6},
            {"rope_type": None, "type": "linear", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
             "high_freq_factor": 1.0, "original_max_position_embeddings": 64},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 1 << 25}],
        "rope_parameters": [
            {"rope_theta": 10000.0}, {"rope_type": "default", "rope_theta": 0.5},
            {"full_attention": full_rope},
            {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
            {"full_attention": dict(full_rope, partial_rotary_factor=0.01)},
            {"full_attention": {"type": "proportional", "partial_rotary_factor": 0.5}},
            {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            {"full_attention": {"rope_type": "linear", "factor": 2.0}},
            {"full_attention": None}, {"sliding_attention": None},
            {"full_attention": {"rope_theta": 0.5}},
            {"full_attention": {"rope_theta": 1e6, "partial_rotary_factor": None}},
            {"full_attention": {}, "sliding_attention": {}}, {"other": {}},
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}],
        "per_layer_config": [
            {"3": {"head_dim": 33}}, {"3": {"head_dim": 64, "num_key_value_heads": 3}},
            {"3": [1]}, {"3": 5}, {"3": {"head_dim": None}}, {"0": {"head_dim": 0}},
            {"3": {"num_key_value_heads": 1 << 13}}, {"3": {"head_dim": 2.0}},
            {"03": {"head_dim": 33}}],
    }


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value is DELETE:
        if path[-1] not in obj:
            return False
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return True


def _nested_paths(obj, prefix=(), depth=3):
    """Paths to every member of the objects under obj (not obj's own)."""
    for k, v in obj.items():
        if isinstance(v, dict) and depth > 0:
            for kk in v:
                yield prefix + (k, kk)
            yield from _nested_paths(v, prefix + (k,), depth - 1)


def _dump(obj):
    return json.dumps(obj, indent=1).encode()


def variants(base, values=VALUES, nested_values=SHORT):
    """(label, config.json bytes) for every hostile variant of base."""
    keys = list(base) + [k for k in READ_KEYS if k not in base]
    structured = _structured(base)
    for key in keys:
        for v in tuple(values) + tuple(structured.get(key, ())):
            c = copy.deepcopy(base)
            if _set(c, (key,), v):
                yield f"{key}={'<deleted>' if v is DELETE else repr(v)[:60]}", _dump(c)
    for path in _nested_paths(base):
        for v in nested_values:
            c = copy.deepcopy(base)
            if _set(c, path, v):
                label = ".".join(path)
                yield f"{label}={'<deleted>' if v is DELETE else repr(v)[:60]}", _dump(c)
    yield from _raw(base)


def _raw(base):
    """JSON Python's json module reads but jansson refuses (or the other
    way round), spelled as text."""
    text = json.dumps(base)
    first = next(iter(base))
    inner = f'"{first}": {json.dumps(base[first])}, '
    out = {
        "duplicate key": "{" + inner + text[1:],
        "NaN": text[:-1] + ', "x_nan": NaN}',
        "Infinity": text[:-1] + ', "x_inf": -Infinity}',
        "real overflow": text[:-1] + ', "x_big": 1e400}',
        "real underflow": text[:-1] + ', "x_small": 1e-400}',
        "int past int64": text[:-1] + ', "x_int": 9223372036854775808}',
        "int at int64": text[:-1] + ', "x_int": -9223372036854775808}',
        "NUL in a string": text[:-1] + ', "x_nul": "a\\u0000b"}',
        "NUL in a key": text[:-1] + ', "x\\u0000": 1}',
        "lone surrogate": text[:-1] + ', "x_sur": "\\ud800"}',
        "surrogate pair": text[:-1] + ', "x_pair": "\\ud83d\\ude00"}',
        "trailing comma": text[:-1] + ", }",
        "trailing garbage": text + " x",
        "trailing whitespace": text + " \n\t ",
        "top-level array": "[" + text + "]",
        "top-level string": '"config"',
        "empty": "",
        "deep nesting": text[:-1] + ', "x_deep": ' + "[" * 200 + "]" * 200 + "}",
    }
    for label, t in out.items():
        yield label, t.encode()
    yield "BOM", b"\xef\xbb\xbf" + text.encode()
    yield "invalid UTF-8", text[:-1].encode() + b', "x_bad": "\xff"}'
    if isinstance(base.get("hidden_size"), int):
        yield "hidden_size past int64", text.replace(
            f'"hidden_size": {base["hidden_size"]}', '"hidden_size": 18446744073709551616',
            1).encode()
        yield "hidden_size as 64.0e0", text.replace(
            f'"hidden_size": {base["hidden_size"]}', '"hidden_size": 64.0e0', 1).encode()
