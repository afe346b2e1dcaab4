"""record(): a Hugging Face transformers model's greedy generation, recorded
in one call, every stage kvdiff knows at absolute positions.

    from kvdiff_record.transformers import record
    record(model, prompt_ids, "hf.h5", max_new=16)              # prefill whole
    record(model, prompt_ids, "hf.h5", max_new=16, chunk=32)    # in chunks

q and k are taken after RoPE, from the modeling module's own rotary
function (apply_rotary_pos_emb) wrapped while the model runs, never from
the KV cache: a sliding layer's cache keeps only its last window - 1
positions, and a quantized one another type. Both forms transformers
uses are read: a pair (q, k, cos, sin) on [batch, heads, T, D] (Llama,
Qwen, Gemma 3) and one tensor a call (x, cos, sin) on [batch, T, heads, D]
(Gemma 4: q first, then k; a KV-shared layer rotates q alone). The layer
is the attention module being run; v is what enters attention: v_norm's
output where the attention has one (Gemma 4; on a full layer with
attention_k_eq_v, from k's projection), else v_proj's. Layers that read
another layer's cache (kv_owner) record no k and v. The other stages come
from forward hooks on the modules Hugging Face names (torch_hooks.py); a
module the model lacks leaves its stage out, and engine_settings says so."""

import contextlib
import inspect
import os
import re
import sys

import numpy as np

from .config import model_config_from_hf
from .layouts import heads_first
from .recorder import Recorder, RecorderError
from .torch_hooks import TorchHooks, hf_names, torch_settings

ROTARY = "apply_rotary_pos_emb"
# engine_settings.cache, one of the values docs/dump-format.md documents:
# transformers' dynamic cache appends each position's K/V after the last
# and reads them in position order, as a dense cache does (its sliding
# layers drop the keys their window no longer reaches; no ring wraps).
CACHE = "dense"
# The cache_type a compute_dtype gives, by the names docs/dump-format.md
# documents for cache_type: the aliases kvdiff reads for compute_dtype
# become the short names; tf32 is a matmul mode over float32 tensors.
_CACHE_TYPE = {"f32": "f32", "float32": "f32", "tf32": "f32", "bf16": "bf16",
               "bfloat16": "bf16", "f16": "f16", "float16": "f16"}
_ATTN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")


def record(model, prompt_ids, path, max_new=16, chunk=None, engine="transformers",
           settings=None, ignore_eos=False, model_config=None, names=None, inputs=None):
    """Greedy generation of `model` on `prompt_ids` (a list of ids, or a
    tensor [T] or [1, T]), recorded to `path`: the prompt in one forward
    (chunk None) or in forwards of `chunk` tokens, then one forward per
    generated token but the last, as `kvdiff run` does; stops after
    max_new tokens (0..2^24, as `kvdiff run --max-new`; 0: the prompt
    alone, /output at its last position) or at an end-of-sequence id
    (unless ignore_eos). chunk: None or at least 1 (a chunk longer than
    the prompt takes it whole). inputs: files the run read, which the dump
    may not replace (Recorder); the model's folder (model.name_or_path,
    when it is one) is always among them.
    model_config: the dump's (default: from model.config, any
    architecture); settings: more engine_settings (what you say wins;
    compute_dtype, and cache_type with it, is otherwise decided from what
    the forwards computed in: autocast, the activations' dtype, the
    parameters', bf16 values held in float32; TorchHooks).
    Returns the generated ids. Raises RecorderError on what it cannot
    record (no rotary function to wrap, a batch of more than one, a model
    on the meta device, a config field kvdiff needs, max_new or chunk out
    of range), before any file is made."""
    import torch
    ids = _prompt(prompt_ids)
    max_new = _count(max_new, "max_new", 0, 1 << 24)
    if chunk is not None:
        chunk = _count(chunk, "chunk", 1, None, "a prefill chunk holds at least one token")
    _check_device(model)
    cfg = model_config or model_config_from_hf(_config_dict(model))
    chunk = len(ids) if chunk is None or chunk >= len(ids) else chunk
    tap = _RotaryTap(model, cfg)
    names, left_out = _present_names(model, names or hf_names(cfg["model_type"]))
    st = dict(torch_settings(model))
    st.update({"chunk": chunk, "cache": CACHE, "runtime": _runtime(),
               "attn_implementation": _attn_impl(model)})
    if left_out:
        st["stages_left_out"] = left_out
    st.update(settings or {})
    eos = set() if ignore_eos else _eos_ids(model, cfg)
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    generated = []
    with Recorder(path, cfg, engine=engine, settings=st,
                  inputs=_model_inputs(model, inputs)) as rec:
        hooks = TorchHooks(rec, model, names, output_from=None)
        rec.before_close(lambda: _state_cache_type(rec))   # after the hooks state compute_dtype
        tap.attach(rec, hooks.evidence)
        try:
            seq, past, pos = list(ids), None, 0
            while True:
                feed = seq[pos:min(pos + chunk, len(ids))] if pos < len(ids) else seq[pos:]
                kw = {"logits_to_keep": 1} if keep else {}
                with hooks.step(pos), tap.step(pos), torch.no_grad():
                    out = model(input_ids=torch.tensor([feed], device=_device(model)),
                                past_key_values=past, use_cache=True, **kw)
                past = out.past_key_values
                pos += len(feed)
                if pos < len(ids):
                    continue
                row = out.logits[0, -1].detach().float().cpu().numpy()
                rec.output(pos - 1, row)
                if max_new == 0:   # the prompt alone, as kvdiff run --max-new 0
                    rec.tokens(seq, len(ids))
                    break
                nxt = int(np.argmax(row))
                generated.append(nxt)
                seq.append(nxt)
                rec.tokens(seq, len(ids))
                if len(generated) >= max_new or nxt in eos:
                    break
        finally:
            hooks.remove()
            tap.detach()
    return generated


def _state_cache_type(rec):
    """transformers' KV cache holds what the k and v projections output, so
    it is in the type the model computes in, whether the run showed it or
    the caller stated it (bf16 under a bf16 autocast of float32 weights;
    tf32 is a matmul mode, the cache float32), by its documented name. A
    cache_type the caller stated wins; left out where compute_dtype is, or
    where it names no type a cache holds: kvdiff then assumes bf16."""
    dtype = rec.settings.get("compute_dtype")
    if isinstance(dtype, str) and dtype in _CACHE_TYPE:
        rec.setting_default("cache_type", _CACHE_TYPE[dtype])


# ---------------------------------------------------------------- the tap


class _RotaryTap:
    """Wraps the modeling module's rotary function and hooks each
    attention module: q and k after RoPE, and v, of the layer running."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.attn = {}   # layer -> attention module
        for name, m in model.named_modules():
            hit = _ATTN.search(name)
            if hit:
                self.attn[int(getattr(m, "layer_idx", hit.group(1)))] = m
        if not self.attn:
            raise RecorderError(f"{type(model).__name__}: no attention module named "
                                f"'...layers.N.self_attn': kvdiff_record.transformers reads "
                                f"the layer from it")
        self.modules = []
        for m in self.attn.values():
            mod = sys.modules.get(type(m).__module__)
            if mod is not None and callable(getattr(mod, ROTARY, None)) and mod not in self.modules:
                self.modules.append(mod)
        if not self.modules:
            raise RecorderError(f"{type(model).__name__}: its attention's module "
                                f"({type(next(iter(self.attn.values()))).__module__}) has no "
                                f"{ROTARY}(): q and k after RoPE cannot be taken (record them "
                                f"with TorchHooks and your own tap, docs/python-recorder.md)")
        self.rec = None
        self.evidence = None
        self.position = None
        self.layer = None
        self.calls = 0
        self._saved = []
        self._handles = []

    def attach(self, rec, evidence):
        """Taps into rec; the rows also go to evidence (the hooks'
        ComputeEvidence; None where the caller stated compute_dtype)."""
        self.rec = rec
        self.evidence = evidence
        for mod in self.modules:
            original = getattr(mod, ROTARY)
            self._saved.append((mod, original))
            setattr(mod, ROTARY, self._wrap(original))
        for layer, m in self.attn.items():
            self._handles.append(m.register_forward_pre_hook(self._enter(layer)))
            self._handles.append(m.register_forward_hook(self._leave))
            if self.cfg["kv_owner"][layer] != layer:
                continue
            src = getattr(m, "v_norm", None) or getattr(m, "v_proj", None)
            if src is None:
                raise RecorderError(f"layer {layer}: its attention has neither v_norm nor v_proj: "
                                    f"v cannot be taken as it enters attention")
            self._handles.append(src.register_forward_hook(self._value(layer)))

    def detach(self):
        for mod, original in self._saved:
            setattr(mod, ROTARY, original)
        self._saved = []
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def step(self, position):
        self.position = position
        try:
            yield
        finally:
            self.position = None

    def _enter(self, layer):
        def pre(module, args):
            self.layer, self.calls = layer, 0
        return pre

    def _leave(self, module, args, out):
        self.layer = None

    def _wrap(self, original):
        def rotary(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.layer is not None and self.position is not None:
                self._rotated(out)
            return out
        rotary.__wrapped__ = original
        return rotary

    def _rotated(self, out):
        layer = self.layer
        owns = self.cfg["kv_owner"][layer] == layer
        if isinstance(out, (tuple, list)):
            # (q, k), each [batch, heads, T, D]
            q, k = out[0], out[1]
            self._rows(layer, "q", _batch_one(q, "q"), heads_dim=0)
            if owns:
                self._rows(layer, "k", _batch_one(k, "k"), heads_dim=0)
            return
        # one tensor a call, [batch, T, heads, D]: q, then k
        self.calls += 1
        stage = "q" if self.calls == 1 else "k" if self.calls == 2 else None
        if stage is None:
            raise RecorderError(f"layer {layer}: {ROTARY} called {self.calls} times in one "
                                f"attention forward; expected q then k")
        if stage == "k" and not owns:
            raise RecorderError(f"layer {layer}: rotates a k, but it reads layer "
                                f"{self.cfg['kv_owner'][layer]}'s cache (kv_owner)")
        self._rows(layer, stage, _batch_one(out, stage), heads_dim=1)

    def _rows(self, layer, stage, t, heads_dim):
        a = t.detach().float().cpu().numpy()
        rows = heads_first(a) if heads_dim == 0 else a.reshape(a.shape[0], -1)
        if self.evidence is not None:
            self.evidence.saw(t, rows, stage, layer)
        self.rec.rows(layer, stage, self.position, rows)

    def _value(self, layer):
        def take(module, args, out):
            if self.position is None:
                return
            # v_proj's [1, T, KV*D] or v_norm's [1, T, KV, D]: before any transpose
            t = _batch_one(out if not isinstance(out, (tuple, list)) else out[0], "v")
            a = t.detach().float().cpu().numpy()
            if self.evidence is not None:
                self.evidence.saw(t, a, "v", layer)
            self.rec.rows(layer, "v", self.position, a.reshape(a.shape[0], -1))
        return take


# ---------------------------------------------------------------- checks


def _batch_one(t, what):
    if t.shape[0] != 1:
        raise RecorderError(f"{what}: a batch of {t.shape[0]}; record one sequence")
    return t[0]


def _count(value, what, lo, hi, why=None):
    """value as an int in lo..hi (hi None: no bound), else RecorderError."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < lo or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise RecorderError(f"{what} is {value!r}; expected an integer {want}"
                            + (f" ({why})" if why else ""))
    return int(value)


def _model_inputs(model, inputs):
    """The files the run read: inputs, and the model's own folder
    (transformers' name_or_path, when it names a folder here)."""
    if inputs is None:
        paths = []
    elif isinstance(inputs, (str, bytes, os.PathLike)):
        paths = [inputs]
    else:
        paths = list(inputs)
    folder = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None)
    if isinstance(folder, str) and os.path.isdir(folder):
        paths.append(folder)
    return paths


def _prompt(prompt_ids):
    if hasattr(prompt_ids, "detach"):
        prompt_ids = prompt_ids.detach().cpu().numpy()
    a = np.asarray(prompt_ids)
    if a.ndim == 2:
        if a.shape[0] != 1:
            raise RecorderError(f"prompt_ids: a batch of {a.shape[0]}; record one sequence")
        a = a[0]
    if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
        raise RecorderError(f"prompt_ids: expected a non-empty list of integer ids, got shape "
                            f"{a.shape} dtype {a.dtype}")
    return [int(x) for x in a]


def _device(model):
    p = next(model.parameters(), None)
    return p.device if p is not None else "cpu"


def _check_device(model):
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "meta":
        raise RecorderError(f"{type(model).__name__} is on the meta device (its weights were "
                            f"never loaded): load it on a cpu or gpu first")


def _config_dict(model):
    c = getattr(model, "config", None)
    if c is None:
        raise RecorderError(f"{type(model).__name__} has no .config: pass model_config=")
    return c.to_dict() if hasattr(c, "to_dict") else dict(c)


def _present_names(model, names):
    """The stage map with q, k and v (the tap's), and the stages whose
    module the model lacks, left out (and listed)."""
    modules = dict(model.named_modules())
    keep, left = {}, []
    for stage, (template, kind) in names.items():
        if stage in ("q", "k", "v"):
            continue
        if template.format(i=0) in modules:
            keep[stage] = (template, kind)
        else:
            left.append(stage)
    return keep, left


def _attn_impl(model):
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return str(impl) if impl else "unknown"


def _eos_ids(model, cfg):
    c = getattr(model, "config", None)
    e = getattr(c, "eos_token_id", None)
    if e is None and isinstance(c, dict):
        e = c.get("eos_token_id")
    if e is None:
        return set()
    return set(e) if isinstance(e, (list, tuple)) else {int(e)}


def _runtime():
    import torch
    try:
        import transformers
        return f"transformers {transformers.__version__}, torch {torch.__version__}"
    except ImportError:
        return f"torch {torch.__version__}"
