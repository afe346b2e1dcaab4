"""The families whose Python reading lives in a file of its own, as each
C family lives in model/families/<name>.c: model_type -> a row with ARCH
(transformers' defaults, config_rules.ARCHES' form), MAX_POSITIONS, SLIDES
(pattern, window) where layers may slide, SINKS where every softmax has a
sink (recorder: the attn_sink stage), rules(cx, obj, c) (its own
config.json keys, read and checked) and model_config(cfg, name, rules).
A new family is a new file plus its line here. (The families read before
this table, Llama, Qwen and Gemma, are still in config_rules.py and
config.py.)"""

from . import deepseek, gpt_oss

FAMILIES = {
    "gpt_oss": gpt_oss,
    "deepseek_v2": deepseek.V2,
    "deepseek_v3": deepseek.V3,
}
