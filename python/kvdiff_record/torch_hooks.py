"""Record a PyTorch model through forward hooks and its KV cache.

Hooks see module inputs and outputs; a module-name map says which module's
input ("in") or output ("out") is which stage, or whose input gives a norm's
statistics ("in_stats": mean, rms, absmax of the norm's input). "{i}" in a
name is the layer index. Post-RoPE q exists in no module of Hugging Face's
models, so the default maps leave q out; k and v come from the KV cache the
model returns (post-RoPE, as the dump wants), by record_cache().

    hooks = TorchHooks(rec, model, hf_names(config["model_type"]))
    with hooks.step(first_position=0):
        out = model(input_ids, use_cache=True)
    hooks.record_cache(out.past_key_values)
    ...
    hooks.remove()
"""

import contextlib

import numpy as np

from .layouts import heads_first
from .recorder import LAYER_STAGES, RecorderError

# Hugging Face transformers names, Llama and Qwen2 (LlamaDecoderLayer,
# Qwen2DecoderLayer): post_attention_layernorm is the FFN's input norm.
HF_LLAMA_NAMES = {
    "embed": ("model.layers.0", "in"),   # the scaled embedding is layer 0's input
    "x_in": ("model.layers.{i}", "in"),
    "attn_norm_stats": ("model.layers.{i}.input_layernorm", "in_stats"),
    "attn_norm": ("model.layers.{i}.input_layernorm", "out"),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", "in"),
    "attn_proj": ("model.layers.{i}.self_attn.o_proj", "out"),
    "h_mid": ("model.layers.{i}.post_attention_layernorm", "in"),
    "ffn_norm_stats": ("model.layers.{i}.post_attention_layernorm", "in_stats"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm", "out"),
    "ffn_out": ("model.layers.{i}.mlp", "out"),
    "x_out": ("model.layers.{i}", "out"),
    "final_norm": ("model.norm", "out"),
    "logits": ("lm_head", "out"),
}

# Gemma 3 (Gemma3DecoderLayer): four norms per layer; post_attention_layernorm
# ends the attention block, pre_feedforward_layernorm starts the FFN. A
# Gemma3ForConditionalGeneration nests the text model: prefix the names
# with "language_model." (or "model.language_model." in transformers >= 4.52).
HF_GEMMA3_NAMES = dict(HF_LLAMA_NAMES, **{
    "attn_proj": ("model.layers.{i}.post_attention_layernorm", "out"),
    "h_mid": ("model.layers.{i}.pre_feedforward_layernorm", "in"),
    "ffn_norm_stats": ("model.layers.{i}.pre_feedforward_layernorm", "in_stats"),
    "ffn_norm": ("model.layers.{i}.pre_feedforward_layernorm", "out"),
    "ffn_out": ("model.layers.{i}.post_feedforward_layernorm", "out"),
})


# Gemma 4 (Gemma4TextDecoderLayer): Gemma 3's norms, and the per-layer
# input block's output after post_per_layer_input_norm (ple_out); x_out,
# the layer's output, is after its layer_scalar.
HF_GEMMA4_NAMES = dict(HF_GEMMA3_NAMES, **{
    "ple_out": ("model.layers.{i}.post_per_layer_input_norm", "out"),
})


def hf_names(model_type, prefix=""):
    """The default module-name map for a Hugging Face model_type, each name
    prefixed with `prefix` (e.g. "language_model." for a multimodal Gemma 3)."""
    base = HF_GEMMA4_NAMES if model_type.startswith("gemma4") else \
        HF_GEMMA3_NAMES if model_type.startswith("gemma3") else HF_LLAMA_NAMES
    return {stage: (prefix + name, kind) for stage, (name, kind) in base.items()}


def torch_settings(model):
    """engine_settings a torch model states about itself: compute_dtype from
    its floating-point parameters' dtype (float32 on a GPU that allows TF32
    matmuls is "tf32"), the device, and attn_accumulator "f32" (torch's
    matmuls and attention kernels sum in float32 whatever the dtype)."""
    import torch
    p = next((t for t in model.parameters() if t.is_floating_point()), None)
    if p is None:
        return {}
    names = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
    out = {"device": str(p.device), "attn_accumulator": "f32"}
    dt = names.get(p.dtype)
    if dt == "f32" and p.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        dt = "tf32"
    if dt:
        out["compute_dtype"] = dt
    return out


def _first_tensor(x):
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x


def norm_stats(rows):
    """mean, rms, absmax of each row (a norm's input), computed in double."""
    a = np.asarray(rows, dtype=np.float64)
    return np.stack([a.mean(axis=1), np.sqrt((a * a).mean(axis=1)),
                     np.abs(a).max(axis=1)], axis=1)


class TorchHooks:
    """Forward hooks on `model` that hand each mapped module's rows to
    `recorder` at the positions set by step(). names: stage -> (module name,
    "in" | "out" | "in_stats"); default hf_names(model_type). A module name
    the model lacks raises RecorderError at once (a typo records nothing
    otherwise). output_from: /output is computed from the "logits" rows of
    positions >= output_from (kvdiff starts at the last prompt position);
    None records no /output. Tensors must be a batch of one."""

    def __init__(self, recorder, model, names=None, output_from=0, record_logits=False):
        self.rec = recorder
        self.position = None
        self.output_from = output_from
        self.record_logits = record_logits
        self._kv_next = {}
        self._seen_to = 0    # positions the hooks have seen rows of
        self._handles = []
        cfg = recorder.config
        for key, value in torch_settings(model).items():
            recorder.setting_default(key, value)
        names = names or hf_names(cfg["model_type"])
        modules = dict(model.named_modules())
        for stage, (template, kind) in names.items():
            if kind not in ("in", "out", "in_stats"):
                raise RecorderError(f"names[{stage!r}]: kind {kind!r} is not in, out or in_stats")
            layers = range(cfg["num_hidden_layers"]) if "{i}" in template else [None]
            for layer in layers:
                name = template.format(i=layer)
                if name not in modules:
                    raise RecorderError(f"names[{stage!r}]: the model has no module {name!r}")
                self._hook(modules[name], stage, layer, kind)

    def _hook(self, module, stage, layer, kind):
        def take(tensor):
            if self.position is None:
                raise RecorderError("TorchHooks: run the model inside hooks.step(first_position)")
            t = _first_tensor(tensor)
            if t.dim() == 3:
                if t.shape[0] != 1:
                    raise RecorderError(f"{stage}: batch of {t.shape[0]}; record one sequence")
                t = t[0]
            rows = t.detach().float().cpu().numpy()
            self._seen_to = max(self._seen_to, self.position + rows.shape[0])
            if kind == "in_stats":
                rows = norm_stats(rows)
            if stage in LAYER_STAGES:
                self.rec.rows(layer, stage, self.position, rows)
                return
            if stage != "logits" or self.record_logits:
                self.rec.model_rows(stage, self.position, rows)
            if stage == "logits" and self.output_from is not None:
                skip = max(0, self.output_from - self.position)
                if skip < rows.shape[0]:
                    self.rec.output(self.position + skip, rows[skip:])

        if kind == "out":
            h = module.register_forward_hook(lambda m, args, out: take(out))
        else:
            def pre(m, args, kwargs=None):
                x = args[0] if args else (kwargs or {}).get("hidden_states")
                take(x)
            try:   # torch >= 2.0 passes keyword arguments to pre-hooks on request
                h = module.register_forward_pre_hook(pre, with_kwargs=True)
            except TypeError:
                h = module.register_forward_pre_hook(lambda m, args: pre(m, args))
        self._handles.append(h)

    @contextlib.contextmanager
    def step(self, first_position):
        """Rows the model computes inside this block are at positions
        first_position, first_position + 1, ..."""
        self.position = int(first_position)
        try:
            yield self
        finally:
            self.position = None

    def record_cache(self, cache):
        """k and v of every layer that owns a cache, from the cache object
        the model returned: a tuple of (k, v) per layer (legacy format),
        a transformers Cache with key_cache/value_cache lists or with
        .layers[i].keys/.values. Tensors [1, KV heads, T, D], slot t holding
        position t (a dense cache); only positions not recorded yet are
        written. A cache whose length is not the positions the model has
        run (a sliding layer's, which keeps its last window - 1 positions;
        a quantized one's residual) is refused: its slots are not positions
        0.. (kvdiff_record.transformers.record takes k after RoPE instead;
        ring_rows() reads a ring whose slots you know)."""
        cfg = self.rec.config
        for layer in range(cfg["num_hidden_layers"]):
            if cfg["kv_owner"][layer] != layer:
                continue
            k, v = _cache_layer(cache, layer)
            k, v = heads_first(k), heads_first(v)
            if self._seen_to and k.shape[0] != self._seen_to:
                raise RecorderError(
                    f"record_cache: layer {layer}'s cache holds {k.shape[0]} positions, but the "
                    f"model has run {self._seen_to}: a sliding-window or quantized cache keeps "
                    f"other slots than positions 0..{self._seen_to - 1}; record with "
                    f"kvdiff_record.transformers.record() (q and k after RoPE), or read a "
                    f"ring's slots with ring_rows()")
            start = self._kv_next.get(layer, self.rec.start)
            if k.shape[0] > start:
                self.rec.rows(layer, "k", start, k[start:])
                self.rec.rows(layer, "v", start, v[start:])
                self._kv_next[layer] = k.shape[0]

    def remove(self):
        """Removes every hook (the model runs as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _cache_layer(cache, layer):
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    if hasattr(cache, "layers"):
        entry = cache.layers[layer]
        return entry.keys, entry.values
    try:
        k, v = cache[layer][0], cache[layer][1]
    except (TypeError, IndexError, KeyError) as exc:
        raise RecorderError(f"record_cache: cannot read layer {layer}'s k and v from a "
                            f"{type(cache).__name__}") from exc
    return k, v
