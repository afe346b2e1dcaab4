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
import sys

import numpy as np

from .layouts import heads_first
from .recorder import LAYER_STAGES, RecorderError, moe_layer

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
    """engine_settings a torch model states about itself before it runs:
    the device of its parameters, and attn_accumulator "f32" (torch's
    matmuls and attention kernels sum in float32 whatever the dtype). The
    type it computes in is not among them: the run shows it
    (ComputeEvidence), which a parameter dtype does not (float32 weights
    under autocast compute in bf16)."""
    p = next((t for t in model.parameters() if t.is_floating_point()), None)
    if p is None:
        return {}
    return {"device": str(p.device), "attn_accumulator": "f32"}


def _dtype_name(dtype):
    import torch
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.float64: "f64"}.get(dtype, str(dtype).replace("torch.", ""))


def _autocast_state(device_type):
    """The dtype name autocast casts to on device_type now, "off" when it is
    off, or None when this torch cannot say (a device type old torch has no
    query for). torch >= 2.4 takes the device type; older torch has one
    function per device, and its is_autocast_enabled() means CUDA."""
    import torch
    try:
        if hasattr(torch, "get_autocast_dtype"):
            on = torch.is_autocast_enabled(device_type)
            return _dtype_name(torch.get_autocast_dtype(device_type)) if on else "off"
        if device_type == "cpu":
            on = torch.is_autocast_cpu_enabled()
            return _dtype_name(torch.get_autocast_cpu_dtype()) if on else "off"
        if device_type == "cuda":
            on = torch.is_autocast_enabled()
            return _dtype_name(torch.get_autocast_gpu_dtype()) if on else "off"
    except (RuntimeError, TypeError, ValueError):
        pass   # a device type autocast does not know
    return None


def _tf32_allowed():
    """Whether float32 matmuls on CUDA may round their inputs to TF32 now:
    allow_tf32, or a float32 matmul precision other than "highest" (which
    sets it in current torch, and means TF32 or coarser)."""
    import torch
    precision = getattr(torch, "get_float32_matmul_precision", lambda: "highest")()
    return bool(torch.backends.cuda.matmul.allow_tf32) or precision != "highest"


# Stages whose values say nothing of the arithmetic: the embedding rows
# (embed, and layer 0's input) are the checkpoint's storage type, exactly
# bf16 in a bf16 checkpoint run in float32; the norm statistics are
# computed here in double; attn_nkeys counts keys; attn_lse is a float32
# reduction every runtime keeps in float32.
_NOT_COMPUTED = ("embed", "attn_norm_stats", "ffn_norm_stats", "attn_lse", "attn_nkeys")
_COARSE = ("bf16", "f16")
# Nonzero values that must all be exact in a coarse type before rows held
# in float32 are taken as computed in it: a float32 result is exact in
# bf16 by chance with odds 2^-16 a value.
MIN_EXACT_VALUES = 64


class ComputeEvidence:
    """The type a torch model really computes in, from what its forwards
    show, for engine_settings.compute_dtype: a parameter dtype alone says
    "f32" of a model run under torch.autocast, or of one whose kernels round
    every result to bf16 and hands it back in float32, and kvdiff's compare
    then holds bf16 rounding to a float32 floor (correct runs on
    tiny-gemma3-h288 stepped at (0, embed) and, under autocast, at
    (0, 0, q)). The evidence:

    - the autocast state, sampled in every hook (hooks run inside the
      user's autocast context), per device type;
    - the dtype of the activations the hooks see, before the float32 cast
      for the dump;
    - the parameters' floating dtypes;
    - recorded rows held in float32 whose nonzero values are all exact in
      bf16 (or f16), over at least MIN_EXACT_VALUES of them (stages that
      are not computed left out, _NOT_COMPUTED);
    - on CUDA, float32 activations with TF32 matmuls allowed: "tf32".

    Each of the first four names a coarse type or none (float32 residuals
    beside bf16 matmuls under autocast name none). decide() gives the one
    type named; "f32" (or "tf32") where none is named, something ran and
    a value was seen that is exact in neither coarse type; and no type,
    with the reason, where the evidence cannot tell: nothing ran, too few
    values, an autocast or TF32 state that changed between forwards, or
    two coarse types named (f16 autocast over bf16 parameters rounds in
    both: left out, the compare assumes bf16, the coarser, rather than
    hold bf16 rounding to an f16 floor)."""

    def __init__(self, model):
        self.params = {_dtype_name(t.dtype) for t in model.parameters() if t.is_floating_point()}
        self.autocast = {}        # device type -> autocast states seen ("off", "bf16", ...)
        self.tf32 = set()         # TF32 allowed, per CUDA float32 activation seen
        self.activations = set()  # dtype names of the activations seen
        self.values = 0           # nonzero finite values checked for exactness
        self.exact = {"bf16": True, "f16": True}

    def saw(self, tensor, rows, stage, layer):
        """One hooked activation: `tensor` as the model computed it, `rows`
        its float32 numpy copy (as recorded), of `stage` of `layer` (None
        for a model stage)."""
        if not tensor.is_floating_point():
            return
        device = tensor.device.type
        state = _autocast_state(device)
        if state is not None:
            self.autocast.setdefault(device, set()).add(state)
        dtype = _dtype_name(tensor.dtype)
        self.activations.add(dtype)
        if device == "cuda" and dtype == "f32":
            self.tf32.add(_tf32_allowed())
        if stage in _NOT_COMPUTED or (stage == "x_in" and layer == 0) or \
                not any(self.exact.values()):
            return
        a = np.asarray(rows, dtype=np.float32)
        a = a[np.isfinite(a) & (a != 0)]
        self.values += a.size
        if self.exact["bf16"]:   # bf16 is float32 with the low 16 bits zero
            self.exact["bf16"] = not np.any(a.view(np.uint32) & 0xFFFF)
        if self.exact["f16"]:
            with np.errstate(over="ignore"):
                self.exact["f16"] = bool(np.all(a.astype(np.float16).astype(np.float32) == a))

    def decide(self):
        """(compute_dtype, None), or (None, why the evidence cannot tell)."""
        for device, states in sorted(self.autocast.items()):
            if len(states) > 1:
                return None, (f"autocast state changed during the run ({device}: "
                              f"{', '.join(sorted(states))})")
        if len(self.tf32) > 1:
            return None, "TF32 matmuls were allowed in some forwards and not in others"
        named = {}   # coarse type -> the sources naming it
        for device, states in sorted(self.autocast.items()):
            for t in states & set(_COARSE):
                named.setdefault(t, []).append(f"{device} autocast to {t}")
        for t in sorted(self.activations & set(_COARSE)):
            named.setdefault(t, []).append(f"{t} activations")
        for t in sorted(self.params & set(_COARSE)):
            named.setdefault(t, []).append(f"{t} parameters")
        exact = next((t for t in _COARSE if self.exact[t]), None)
        if exact and self.values >= MIN_EXACT_VALUES:
            named.setdefault(exact, []).append(f"float32 values all exact in {exact}")
        if len(named) > 1:
            return None, "the evidence conflicts: " + ", ".join(
                w for t in sorted(named) for w in named[t])
        if named:
            return next(iter(named)), None
        if not self.activations:
            return None, "no activations were recorded (the model never ran inside the hooks)"
        if exact:
            return None, (f"only {self.values} nonzero values recorded, all exact in {exact}: "
                          f"too few to tell float32 arithmetic from {exact} held in float32")
        return ("tf32" if True in self.tf32 else "f32"), None


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
    None records no /output. Tensors must be a batch of one.

    engine_settings.compute_dtype is stated when the recorder closes, from
    what the forwards showed (ComputeEvidence); where that cannot tell, it
    is left out (kvdiff then assumes bf16 and says so) and one line on
    stderr says why. A compute_dtype given to the Recorder wins, and no
    evidence is gathered."""

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
        self.evidence = None if "compute_dtype" in recorder.settings else ComputeEvidence(model)
        names = names or hf_names(cfg["model_type"])
        modules = dict(model.named_modules())
        for stage, (template, kind) in names.items():
            if kind not in ("in", "out", "in_stats"):
                raise RecorderError(f"names[{stage!r}]: kind {kind!r} is not in, out or in_stats")
            layers = range(cfg["num_hidden_layers"]) if "{i}" in template else [None]
            if stage == "router_logits":   # a dense layer (DeepSeek's first) has no router
                layers = [i for i in layers if moe_layer(cfg, i)]
            for layer in layers:
                name = template.format(i=layer)
                if name not in modules:
                    raise RecorderError(f"names[{stage!r}]: the model has no module {name!r}")
                self._hook(modules[name], stage, layer, kind)
        recorder.before_close(self._state_compute_dtype)

    def _state_compute_dtype(self):
        if self.evidence is None or "compute_dtype" in self.rec.settings:
            return
        dtype, why = self.evidence.decide()
        if dtype:
            self.rec.setting_default("compute_dtype", dtype)
        else:
            print(f"kvdiff_record: {self.rec.path}: compute_dtype not stated: {why} "
                  f"(kvdiff compare will assume bf16; settings={{'compute_dtype': ...}} "
                  f"states it)", file=sys.stderr)

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
            if self.evidence is not None:
                self.evidence.saw(t, rows, stage, layer)
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
