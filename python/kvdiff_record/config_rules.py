"""config_rules.py -- what kvdiff accepts in a Hugging Face config.json, as
model/config.c reads it: one set of limits, the same type rules, required
fields, defaults and per-family refusals, so that model_config_from_hf
refuses exactly the configs `kvdiff run --model DIR` refuses (the tests
run both over fuzz/corpus/config and hostile variants of real configs).

check(cfg, name) walks the config in config.c's order (sizes, norm and
activation, RoPE, layers, token ids, then config_validate's products) and
raises RecorderError "NAME: KEY is ...; expected ..." naming the field as
kvdiff does; it returns the few values config.py needs and cannot tell
from the raw config. load_json(path) reads a file under kvdiff's rules
for one (a regular file of at most 16 MiB; JSON as jansson takes it:
no duplicate keys, NaN, infinities, integers past int64, NUL characters
or lone surrogates).

JSON null is not absence: config.c tells them apart field by field (a
null head_dim is an error for Qwen3 and Gemma, a request for the default
for Llama), and so does this file (MISSING below)."""

import json
import math
import os
import stat

from .errors import RecorderError

# model/config.c: beyond these a value is a typo or an attack
MAX_HIDDEN = 1 << 20
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14
MAX_INTERMEDIATE = 1 << 22
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24
MAX_PATTERN = 1 << 20
MAX_MATRIX = 2**31 - 1        # elements of one weight matrix
MAX_TABLE = 1 << 34           # elements of Gemma 4's per-layer table
MIN_THETA, MAX_THETA = 1.0, 1e15
MAX_FACTOR = 1e6
MAX_SCALAR = 1e9
MAX_LAYERS = 256              # KV_MAX_LAYERS (model/config.h)
MAX_EOS = 8                   # KV_MAX_EOS
CONFIG_MAX_BYTES = 16 << 20

GEMMA_DEF_WINDOW, GEMMA_DEF_PATTERN, GEMMA_DEF_LOCAL_THETA = 4096, 6, 10000.0

# model/config.c ARCHES: activation key, whether the sizes with 7B
# defaults are required, the defaults otherwise, tie and token ids.
ARCHES = {
    "llama": dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=0, vocab=0,
                  theta=10000.0, tie=False, bos=1, eos=2),
    "qwen2": dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=0, vocab=0,
                  theta=10000.0, tie=False, bos=-1, eos=-1),
    "gemma3_text": dict(act="hidden_activation", required=False, heads=8, kv=4, head_dim=256,
                        vocab=262208, theta=1000000.0, tie=True, bos=2, eos=1),
    "qwen3": dict(act="hidden_act", required=True, heads=0, kv=0, head_dim=128, vocab=0,
                  theta=10000.0, tie=False, bos=-1, eos=-1),
    "gemma4_text": dict(act="hidden_activation", required=True, heads=0, kv=0, head_dim=256,
                        vocab=0, theta=1000000.0, tie=True, bos=2, eos=1),
}   # and each family file's ARCH (families/, added at the end of this module)
_DEF_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "gemma3_text": 131072, "qwen3": 32768,
                      "gemma4_text": 131072}
# model/families/*.c: the families whose layers may slide, their pattern
# without layer_types (0: every layer full) and their default window
_SLIDES = {"gemma3_text": (GEMMA_DEF_PATTERN, GEMMA_DEF_WINDOW),
           "gemma4_text": (0, GEMMA_DEF_WINDOW)}
_TYPES = "llama, qwen2, gemma3_text, gemma3, qwen3, gemma4_text, gemma4"
MAX_RANK = 1 << 14
MAX_EXPERTS = 1 << 12

MISSING = object()   # a key the object does not have (JSON null is None)


# ---------------------------------------------------------------- reading


def load_json(path):
    """The parsed config.json at path (a folder: its config.json), read as
    kvdiff reads one. Returns (object, path)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        # O_NONBLOCK: a FIFO with no writer must not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise RecorderError(f"{path}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecorderError(f"{path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > CONFIG_MAX_BYTES:
            raise RecorderError(f"{path}: {st.st_size} bytes; at most {CONFIG_MAX_BYTES} "
                                f"are read")
        os.set_blocking(fd, True)
        data = f.read(CONFIG_MAX_BYTES + 1)
    if len(data) > CONFIG_MAX_BYTES:
        raise RecorderError(f"{path}: larger than {CONFIG_MAX_BYTES} bytes; not a config.json")
    return parse_json(data, path), path


def parse_json(data, name):
    """JSON bytes or text, refused where jansson (JSON_REJECT_DUPLICATES)
    refuses it."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                         parse_int=_int64, parse_float=_finite)
        _strings_ok(obj)
        if not isinstance(obj, (dict, list)):   # jansson without JSON_DECODE_ANY
            raise ValueError(f"'[' or '{{' expected, not {jdesc(obj)}")
    except (ValueError, RecursionError) as exc:
        raise RecorderError(f"{name}: not valid JSON: {exc}") from None
    return obj


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate object key {k!r}")
        out[k] = v
    return out


def _no_constant(word):
    raise ValueError(f"{word} is not JSON")


def _int64(text):
    v = int(text)
    if not -2**63 <= v < 2**63:
        raise ValueError(f"too big integer {text[:40]}")
    return v


def _finite(text):
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"real number overflow {text[:40]}")
    return v


def _strings_ok(v):
    """No NUL characters and no lone surrogates, in keys or values."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            if "\0" in x:
                raise ValueError("\\u0000 is not allowed in a string")
            x.encode("utf-8")   # UnicodeEncodeError (a ValueError) on a lone surrogate


def _kind(mode):
    from .outfile import kind
    return kind(mode)


# ---------------------------------------------------------------- values


def _is_int(v):
    return type(v) is int


def _is_num(v):
    return type(v) in (int, float)


def _fmt(v):
    """A number as config.c's messages write it."""
    if type(v) is float and v == math.floor(v) and abs(v) < 1e16:
        return f"{v:.1f}"
    return repr(v)


def jdesc(v):
    """config.c's words for a JSON value: `the string "64"`, `null`, ..."""
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return f'the string "{v[:40]}"'
    return _fmt(v)


def _g(v):
    """C's %g."""
    return f"{v:g}"


class _Ctx:
    """Where messages come from: the file, and "text_config." inside a
    nested Gemma config."""

    def __init__(self, name, scope=""):
        self.name, self.scope = name, scope

    def fail(self, key, what):
        raise RecorderError(f"{self.name}: {self.scope}{key} {what}")

    def want_int(self, key, v, lo, hi):
        if not _is_int(v):
            self.fail(key, f"is {jdesc(v)}; expected an integer")
        if not lo <= v <= hi:
            self.fail(key, f"is {v}; expected {lo}..{hi}")
        return v

    def get_int(self, obj, key, required, default, lo, hi):
        v = obj.get(key, MISSING)
        if v is MISSING:
            if required:
                self.fail(key, "is missing")
            return default
        return self.want_int(key, v, lo, hi)

    def want_num(self, key, v, lo, lo_open, hi):
        if not _is_num(v):
            self.fail(key, f"is {jdesc(v)}; expected a number")
        ok = v > lo if lo_open else v >= lo
        if not math.isfinite(v) or not ok or v > hi:
            self.fail(key, f"is {jdesc(v)}; expected a number {'>' if lo_open else '>='} "
                           f"{_g(lo)} and <= {_g(hi)}")
        return float(v)

    def get_num(self, obj, key, default, lo, lo_open, hi):
        v = obj.get(key, MISSING)
        return default if v is MISSING else self.want_num(key, v, lo, lo_open, hi)

    def get_bool(self, obj, key, default):
        v = obj.get(key, MISSING)
        if v is MISSING:
            return default
        if not isinstance(v, bool):
            self.fail(key, f"is {jdesc(v)}; expected true or false")
        return v

    def get_str(self, obj, key, default):
        v = obj.get(key, MISSING)
        if v is MISSING:
            if default is None:
                self.fail(key, "is missing")
            return default
        if not isinstance(v, str):
            self.fail(key, f"is {jdesc(v)}; expected a string")
        return v

    def refuse_true(self, obj, key, why):
        if self.get_bool(obj, key, False):
            self.fail(key, f"is true; {why}")


def _present(obj, key):
    return obj.get(key) is not None


# ---------------------------------------------------------------- the walk


class _Config:
    """The fields of kv_config the checks need."""

    def __init__(self, arch):
        self.arch = arch
        self.gemma = arch in ("gemma3_text", "gemma4_text")
        self.slides = arch in _SLIDES
        self.partial_full = 0.0
        self.scaling = None


def check(cfg, name="config"):
    """Raises RecorderError where `kvdiff run --model` would refuse the
    config.json object cfg (a model_type kvdiff reads: llama, qwen2,
    qwen3, gemma3_text, gemma3, gemma4_text, gemma4). Returns a dict of
    what config.py takes from the walk: model_type (the text model's),
    the text config object, and sliding_window, rope_theta,
    rope_local_base_freq, partial_rotary_factor_full and rope_scaling as
    kvdiff resolved them."""
    cx = _Ctx(name)
    if not isinstance(cfg, dict):
        raise RecorderError(f"{name}: top level is {jdesc(cfg)}; expected an object")
    mt = cx.get_str(cfg, "model_type", None)
    if mt in ("gemma3", "gemma4"):
        return _nested(cx, cfg, mt + "_text")
    if mt not in ARCHES:
        raise RecorderError(f"{name}: model_type '{mt[:40]}' is not supported (kvdiff reads "
                            f"{_TYPES})")
    return _text(cx, cfg, None, mt)


def _nested(cx, root, inner):
    outer = inner[:-len("_text")]
    tc = root.get("text_config", MISSING)
    if tc is MISSING:
        cx.fail("text_config", f"is missing (model_type {outer} nests the text model there)")
    if not isinstance(tc, dict):
        cx.fail("text_config", f"is {jdesc(tc)}; expected an object")
    mt = tc.get("model_type", MISSING)
    if mt is not MISSING and mt != inner:
        cx.fail("text_config.model_type", f'is {jdesc(mt)}; expected "{inner}"')
    return _text(_Ctx(cx.name, "text_config."), tc, root, inner)


def _text(cx, obj, outer, arch):
    c = _Config(arch)
    _sizes(cx, obj, c)
    _norm_act(cx, obj, c)
    _rope(cx, obj, c)
    _layers(cx, obj, c)
    _tokens(cx, obj, outer, c)
    if c.arch in families.FAMILIES:   # a family file's own keys
        families.FAMILIES[c.arch].rules(cx, obj, c)
    _validate(cx, c)
    return {"model_type": arch, "text_config": obj, "sliding_window": c.window,
            "rope_theta": c.theta, "rope_local_base_freq": c.local_theta,
            "partial_rotary_factor_full": c.partial_full or 1.0, "rope_scaling": c.scaling,
            "mla": getattr(c, "mla", None)}


def _sizes(cx, obj, c):
    a = ARCHES[c.arch]
    c.hidden = cx.get_int(obj, "hidden_size", True, 0, 1, MAX_HIDDEN)
    c.layers = cx.get_int(obj, "num_hidden_layers", True, 0, 1, MAX_LAYERS)
    c.intermediate = cx.get_int(obj, "intermediate_size", True, 0, 1, MAX_INTERMEDIATE)
    _heads(cx, obj, c)
    _head_dim(cx, obj, c)
    c.vocab = cx.get_int(obj, "vocab_size", a["required"], a["vocab"], 1, MAX_VOCAB)
    c.max_positions = cx.get_int(obj, "max_position_embeddings", False,
                                 _DEF_MAX_POSITIONS[c.arch], 1, MAX_POSITIONS)


def _heads(cx, obj, c):
    a = ARCHES[c.arch]
    gemma3 = c.arch == "gemma3_text"
    c.heads = cx.get_int(obj, "num_attention_heads", a["required"], a["heads"], 1, MAX_HEADS)
    # llama and qwen default KV heads to the query heads (null too);
    # Gemma3TextConfig defaults to 4, and a null there is an error.
    kv = obj.get("num_key_value_heads", MISSING)
    if c.arch == "gemma4_text" and kv in (MISSING, None):
        cx.fail("num_key_value_heads", "is missing (gemma4_text has no default)")
    if kv is MISSING or (kv is None and not gemma3):
        c.kv = a["kv"] if gemma3 else c.heads
    else:
        c.kv = cx.want_int("num_key_value_heads", kv, 1, MAX_HEADS)
    if c.heads % c.kv:
        cx.fail("num_key_value_heads", f"is {c.kv}, which does not divide "
                                       f"num_attention_heads {c.heads}")


def _head_dim(cx, obj, c):
    hd = obj.get("head_dim", MISSING)
    # Gemma and Qwen3 have a default of their own (a null there is an
    # error); Llama and Qwen2 derive it from the sizes.
    own_default = ARCHES[c.arch]["head_dim"] > 0
    if hd is not MISSING and (hd is not None or own_default):
        c.head_dim = cx.want_int("head_dim", hd, 1, MAX_HEAD_DIM)
    elif own_default:
        c.head_dim = ARCHES[c.arch]["head_dim"]
    elif c.hidden % c.heads:
        cx.fail("head_dim", f"is missing and hidden_size {c.hidden} is not a multiple of "
                            f"num_attention_heads {c.heads}")
    else:
        c.head_dim = c.hidden // c.heads
    if c.head_dim % 2:
        cx.fail("head_dim", f"is {c.head_dim}; RoPE needs an even head_dim")


def _norm_act(cx, obj, c):
    cx.get_num(obj, "rms_norm_eps", 1e-6, 0.0, True, 1.0)
    key = ARCHES[c.arch]["act"]
    act = cx.get_str(obj, key, "gelu_pytorch_tanh" if c.gemma else "silu")
    ok = ("gelu_pytorch_tanh", "gelu_tanh") if c.gemma else ("silu", "swish")
    if act not in ok:
        cx.fail(key, f"'{act[:40]}' is not supported for {c.arch} (kvdiff runs {ok[0]})")
    _family_switches(cx, obj, c)
    if c.arch == "gemma3_text":
        cx.get_num(obj, "query_pre_attn_scalar", 256.0, 0.0, True, MAX_SCALAR)
    if c.gemma and _present(obj, "final_logit_softcapping"):
        cx.want_num("final_logit_softcapping", obj["final_logit_softcapping"], 0.0, True,
                    MAX_SCALAR)


def _family_switches(cx, obj, c):
    if c.arch == "llama":
        cx.get_bool(obj, "attention_bias", False)
        cx.refuse_true(obj, "mlp_bias", "biased MLP projections are not supported for llama")
    elif c.arch in ("qwen2", "qwen3"):
        if c.arch == "qwen3":
            cx.get_bool(obj, "attention_bias", False)
        cx.refuse_true(obj, "use_sliding_window", f"sliding-window attention is not supported "
                                                  f"for {c.arch} (kvdiff runs every layer "
                                                  f"global)")
    elif c.arch == "gemma3_text":
        if _present(obj, "attn_logit_softcapping"):
            cx.fail("attn_logit_softcapping", f"is {jdesc(obj['attn_logit_softcapping'])}; "
                                              f"attention logit softcapping is not supported "
                                              f"(Gemma 3 sets it to null)")
        cx.refuse_true(obj, "attention_bias", "biased attention projections are not supported "
                                              "for gemma3_text")
        cx.refuse_true(obj, "use_bidirectional_attention", "kvdiff runs causal decoders only")
    elif c.arch == "gemma4_text":
        _gemma4_switches(cx, obj)


def _gemma4_switches(cx, obj):
    if _present(obj, "attn_logit_softcapping"):
        cx.fail("attn_logit_softcapping", f"is {jdesc(obj['attn_logit_softcapping'])}; "
                                          f"attention logit softcapping is not supported "
                                          f"(Gemma 4 has none)")
    bi = obj.get("use_bidirectional_attention")
    if bi is not None and bi is not False and bi != "vision":
        cx.fail("use_bidirectional_attention", f"is {jdesc(bi)}; kvdiff runs causal decoders "
                                               f"only")
    ne = obj.get("num_experts")
    if ne is not None and not (_is_int(ne) and ne == 0):
        cx.fail("num_experts", f"is {jdesc(ne)}; Gemma 4's mixture-of-experts models are not "
                               f"supported (dense E2B/E4B-style models only)")
    cx.refuse_true(obj, "enable_moe_block", "Gemma 4's mixture-of-experts block is not "
                                            "supported (dense E2B/E4B-style models only)")
    cx.refuse_true(obj, "attention_bias", "biased attention projections are not supported for "
                                          "gemma4_text")


# ---------------------------------------------------------------- RoPE


def _rope(cx, obj, c):
    c.theta = cx.get_num(obj, "rope_theta", ARCHES[c.arch]["theta"], MIN_THETA, False,
                         MAX_THETA)
    c.local_theta = c.theta
    if c.arch == "gemma4_text":   # without rope_parameters: proportional 0.25, local 10000
        c.local_theta, c.partial_full = GEMMA_DEF_LOCAL_THETA, 0.25
    if c.arch == "gemma3_text":
        c.local_theta = cx.get_num(obj, "rope_local_base_freq", GEMMA_DEF_LOCAL_THETA,
                                   MIN_THETA, False, MAX_THETA)
    rs, rp = obj.get("rope_scaling", MISSING), obj.get("rope_parameters", MISSING)
    if rs not in (MISSING, None) and rp not in (MISSING, None):
        cx.fail("rope_scaling", "and rope_parameters are both set; kvdiff reads one of them")
    c.scaling = _scaling(cx, "rope_scaling", rs, True)
    if rp not in (MISSING, None):
        _rope_parameters(cx, rp, c)
    if c.scaling and c.scaling["rope_type"] == "yarn" and \
            c.scaling["original_max_position_embeddings"] is None:
        c.scaling["original_max_position_embeddings"] = c.max_positions
    if not c.gemma:
        c.local_theta = c.theta
    _refuse_partial(cx, "partial_rotary_factor", obj.get("partial_rotary_factor"))


def _rope_str(cx, path, v, key):
    s = v.get(key, MISSING)
    if s is MISSING:
        return ""
    if not isinstance(s, str):
        cx.fail(f"{path}.{key}", f"is {jdesc(s)}; expected a string")
    return s


def _scaling_type(cx, path, v, required):
    rt, ty = _rope_str(cx, path, v, "rope_type"), _rope_str(cx, path, v, "type")
    if rt and ty and rt != ty:
        cx.fail(path, f"has rope_type '{rt[:40]}' and type '{ty[:40]}'; they must agree")
    kind = rt or ty or None
    if kind is None and required:
        cx.fail(path, "has no rope_type")
    return kind


def _scaling(cx, path, v, type_required):
    """A rope_scaling object (or the scaling part of a rope_parameters
    entry): None, or the dict model_config states."""
    if v in (MISSING, None):
        return None
    if not isinstance(v, dict):
        cx.fail(path, f"is {jdesc(v)}; expected an object or null")
    kind = _scaling_type(cx, path, v, type_required)
    if kind is None or kind == "default":
        return None
    if kind == "llama3":
        return _llama3(cx, path, v)
    if kind == "yarn":
        return _yarn(cx, path, v)
    if kind != "linear":
        cx.fail(path, f"type '{kind[:40]}' is not supported (kvdiff supports linear, llama3 "
                      f"and yarn)")
    f = v.get("factor", MISSING)
    if f is MISSING:
        cx.fail(f"{path}.factor", "is missing")
    return {"rope_type": "linear",
            "factor": cx.want_num(f"{path}.factor", f, 0.0, True, MAX_FACTOR)}


def _llama3(cx, path, v):
    out = {"rope_type": "llama3"}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        x = v.get(key, MISSING)
        if x is MISSING:
            cx.fail(f"{path}.{key}", "is missing")
        out[key] = cx.want_num(f"{path}.{key}", x, 0.0, True, MAX_FACTOR)
    om = v.get("original_max_position_embeddings", MISSING)
    if om is MISSING:
        cx.fail(f"{path}.original_max_position_embeddings", "is missing")
    out["original_max_position_embeddings"] = cx.want_int(
        f"{path}.original_max_position_embeddings", om, 1, MAX_POSITIONS)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        cx.fail(path, f"has high_freq_factor {_g(out['high_freq_factor'])} <= low_freq_factor "
                      f"{_g(out['low_freq_factor'])}")
    return out


def _yarn_mscale(factor, mscale):
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(cx, path, v):
    """config.c's parse_yarn_scaling; original_max_position_embeddings None
    when absent (_rope fills in max_position_embeddings)."""
    f = v.get("factor", MISSING)
    if f is MISSING:
        cx.fail(f"{path}.factor", "is missing")
    out = {"rope_type": "yarn", "factor": cx.want_num(f"{path}.factor", f, 0.0, True, MAX_FACTOR)}
    om = v.get("original_max_position_embeddings")
    out["original_max_position_embeddings"] = None if om is None else cx.want_int(
        f"{path}.original_max_position_embeddings", om, 1, MAX_POSITIONS)
    out["beta_fast"] = cx.get_num(v, "beta_fast", 32.0, 0.0, True, MAX_FACTOR)
    out["beta_slow"] = cx.get_num(v, "beta_slow", 1.0, 0.0, True, MAX_FACTOR)
    out["truncate"] = cx.get_bool(v, "truncate", True)
    if out["beta_fast"] <= out["beta_slow"]:
        cx.fail(path, f"has beta_fast {_g(out['beta_fast'])} <= beta_slow "
                      f"{_g(out['beta_slow'])}")
    ms = cx.get_num(v, "mscale", 0.0, 0.0, False, MAX_FACTOR)
    msa = cx.get_num(v, "mscale_all_dim", 0.0, 0.0, False, MAX_FACTOR)
    a = v.get("attention_factor")
    if a is not None:
        out["attention_factor"] = cx.want_num(f"{path}.attention_factor", a, 0.0, True,
                                              MAX_FACTOR)
        return out
    factor = out["factor"]
    out["attention_factor"] = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, msa)
                               if ms > 0 and msa > 0 else _yarn_mscale(factor, 1.0))
    return out


def _refuse_partial(cx, key, v):
    if v is None:
        return
    f = cx.want_num(key, v, 0.0, True, 1.0)
    if f != 1.0:
        cx.fail(key, f"is {_g(f)}; partial rotary embeddings are not supported")


def _rope_entry(cx, path, v, c):
    """One entry of rope_parameters: (scaling, theta or None)."""
    if not isinstance(v, dict):
        cx.fail(path, f"is {jdesc(v)}; expected an object")
    scaling = _scaling(cx, path, v, False)
    t = v.get("rope_theta", MISSING)
    theta = None
    if t is not MISSING:
        theta = cx.want_num(f"{path}.rope_theta", t, MIN_THETA, False, MAX_THETA)
    _refuse_partial(cx, f"{path}.partial_rotary_factor", v.get("partial_rotary_factor"))
    return scaling, theta


def _sliding_rope(cx, slide, c):
    scaling, theta = _rope_entry(cx, "rope_parameters.sliding_attention", slide, c)
    if theta is not None:
        c.local_theta = theta
    if scaling is not None:
        cx.fail("rope_parameters.sliding_attention", "is scaled; kvdiff scales RoPE on "
                                                     "full-attention layers only")


def _gemma4_full_rope(cx, v, c):
    path = "rope_parameters.full_attention"
    if not isinstance(v, dict):
        cx.fail(path, f"is {jdesc(v)}; expected an object")
    kind = _scaling_type(cx, path, v, False)
    prop = kind == "proportional"
    if kind and not prop and kind != "default":
        cx.fail(path, f"rope_type '{kind[:40]}' is not supported (Gemma 4's full layers use "
                      f"proportional)")
    t = v.get("rope_theta", MISSING)
    if t is not MISSING:
        c.theta = cx.want_num(f"{path}.rope_theta", t, MIN_THETA, False, MAX_THETA)
    f = v.get("partial_rotary_factor")
    factor = 1.0
    if f is not None:
        factor = cx.want_num(f"{path}.partial_rotary_factor", f, 0.0, True, 1.0)
    if factor != 1.0 and not prop:
        cx.fail(f"{path}.partial_rotary_factor", f"is {_g(factor)} with rope_type default; "
                                                 f"kvdiff rotates part of a head for "
                                                 f"proportional RoPE only")
    c.partial_full = 0.0 if factor == 1.0 else factor


def _rope_parameters(cx, rp, c):
    if not isinstance(rp, dict):
        cx.fail("rope_parameters", f"is {jdesc(rp)}; expected an object")
    full = rp.get("full_attention", MISSING)
    slide = rp.get("sliding_attention", MISSING)
    keyed = full is not MISSING or slide is not MISSING
    if c.arch == "gemma4_text":
        if not keyed:
            cx.fail("rope_parameters", "has neither full_attention nor sliding_attention; "
                                       "gemma4_text keys them by layer type")
        if full is not MISSING:
            _gemma4_full_rope(cx, full, c)
        if slide is not MISSING:
            _sliding_rope(cx, slide, c)
        return
    if c.arch != "gemma3_text":
        if keyed:
            cx.fail("rope_parameters", f"is keyed by layer type; {c.arch} has one kind of "
                                       f"layer")
        c.scaling, theta = _rope_entry(cx, "rope_parameters", rp, c)
        c.theta = c.theta if theta is None else theta
        return
    if not keyed:
        cx.fail("rope_parameters", "has neither full_attention nor sliding_attention; "
                                   "gemma3_text keys them by layer type")
    if full is not MISSING:
        c.scaling, theta = _rope_entry(cx, "rope_parameters.full_attention", full, c)
        c.theta = c.theta if theta is None else theta
    if slide is not MISSING:
        _sliding_rope(cx, slide, c)


# ---------------------------------------------------------------- layers


def _layers(cx, obj, c):
    lt = obj.get("layer_types")
    c.types = ["full_attention"] * c.layers
    pattern = _SLIDES.get(c.arch, (0, 0))[0]
    if pattern and lt is None:
        p = cx.get_int(obj, "sliding_window_pattern", False, pattern, 1, MAX_PATTERN)
        c.types = ["sliding_attention" if (i + 1) % p else "full_attention"
                   for i in range(c.layers)]
    elif c.arch == "gemma4_text" and lt is None:
        cx.fail("layer_types", "is missing (gemma4_text lists each layer's type)")
    elif lt is not None and c.arch != "llama":   # LlamaConfig has no layer_types
        _layer_types(cx, lt, c)
    c.window = 0
    if c.slides:
        _window(cx, obj, c)
    _kv_sharing(cx, obj, c)
    if c.arch == "gemma4_text":
        _gemma4_layers(cx, obj, c)


def _layer_types(cx, lt, c):
    if not isinstance(lt, list):
        cx.fail("layer_types", f"is {jdesc(lt)}; expected an array of strings")
    if len(lt) != c.layers:
        cx.fail("layer_types", f"has {len(lt)} entries but num_hidden_layers is {c.layers}")
    for i, t in enumerate(lt):
        key = f"layer_types[{i}]"
        if t == "sliding_attention" and not c.slides:
            cx.fail(key, f"is 'sliding_attention'; sliding attention is not supported for "
                         f"{c.arch}")
        if t not in ("sliding_attention", "full_attention"):
            cx.fail(key, f"is {jdesc(t)}; expected 'sliding_attention' or 'full_attention'")
        c.types[i] = t


def _window(cx, obj, c):
    w = obj.get("sliding_window", MISSING)
    window = _SLIDES[c.arch][1]
    if w is None:
        window = 0
    elif w is not MISSING:
        window = cx.want_int("sliding_window", w, 1, MAX_POSITIONS)
    sliding = [i for i, t in enumerate(c.types) if t == "sliding_attention"]
    if sliding and window == 0:
        cx.fail("sliding_window", f"is null but layer {sliding[0]} is a sliding_attention "
                                  f"layer")
    c.window = window if sliding else 0


def _kv_sharing(cx, obj, c):
    n = cx.get_int(obj, "num_kv_shared_layers", False, 0, 0, MAX_LAYERS)
    if n > 0 and not c.gemma:
        cx.fail("num_kv_shared_layers", f"is {n}; KV sharing is read for gemma3_text and "
                                        f"gemma4_text only")
    if n >= c.layers:
        cx.fail("num_kv_shared_layers", f"is {n} but the model has {c.layers} layers; at "
                                        f"least the first layer must compute K/V")
    first = c.layers - n
    c.owner = list(range(c.layers))
    for i in range(first, c.layers):
        t = c.types[i]
        owner = next((j for j in range(first - 1, -1, -1) if c.types[j] == t), -1)
        if owner < 0:
            cx.fail("num_kv_shared_layers", f"is {n}: layer {i} ({t}) has no earlier "
                                            f"non-shared {t} layer to read K/V from")
        c.owner[i] = owner


def _per_layer_full(cx, obj, c, key):
    """per_layer_config's key for the first full-attention layer that
    states it, or 0."""
    plc = obj.get("per_layer_config")
    if plc is None:
        return 0
    if not isinstance(plc, dict):
        cx.fail("per_layer_config", f"is {jdesc(plc)}; expected an object")
    for i, t in enumerate(c.types):
        lc = plc.get(str(i))
        if t != "full_attention" or not isinstance(lc, dict) or key not in lc:
            continue
        return cx.want_int(f"per_layer_config.{i}.{key}", lc[key], 1, MAX_HEAD_DIM)
    return 0


def _full_layer_size(cx, obj, c, key, pkey, hi, fallback):
    v = obj.get(key)
    out = cx.want_int(key, v, 1, hi) if v is not None else _per_layer_full(cx, obj, c, pkey)
    return out or fallback


def _gemma4_layers(cx, obj, c):
    c.head_dim_full = _full_layer_size(cx, obj, c, "global_head_dim", "head_dim", MAX_HEAD_DIM,
                                       c.head_dim)
    c.kv_full = _full_layer_size(cx, obj, c, "num_global_key_value_heads",
                                 "num_key_value_heads", MAX_HEADS, c.kv)
    if c.head_dim_full % 2:
        cx.fail("global_head_dim", f"is {c.head_dim_full}; RoPE needs an even head size")
    if c.heads % c.kv_full:
        cx.fail("num_global_key_value_heads", f"is {c.kv_full}, which does not divide "
                                              f"num_attention_heads {c.heads}")
    if c.partial_full > 0 and int(c.partial_full * c.head_dim_full / 2) < 1:
        cx.fail("rope_parameters.full_attention.partial_rotary_factor",
                f"is {_g(c.partial_full)}: no pair of a {c.head_dim_full}-wide head rotates")
    cx.get_bool(obj, "attention_k_eq_v", False)
    c.double_wide = cx.get_bool(obj, "use_double_wide_mlp", False)
    p = obj.get("hidden_size_per_layer_input")
    c.per_layer_dim = 0 if p is None else cx.want_int("hidden_size_per_layer_input", p, 0,
                                                      MAX_HIDDEN)
    c.per_layer_vocab = 0
    if c.per_layer_dim > 0:
        c.per_layer_vocab = cx.get_int(obj, "vocab_size_per_layer_input", False, c.vocab, 1,
                                       MAX_VOCAB)
        if c.per_layer_dim * c.layers > MAX_HIDDEN:
            cx.fail("hidden_size_per_layer_input", f"is {c.per_layer_dim}: times {c.layers} "
                                                   f"layers, the per-layer table is wider "
                                                   f"than {MAX_HIDDEN}")


# ---------------------------------------------------------------- gpt-oss


# ---------------------------------------------------------------- token ids


def _tokens(cx, obj, outer, c):
    """Gemma's multimodal configs keep the token ids (and the tie flag) at
    the top level too; set there (not null) they win over text_config's."""
    a = ARCHES[c.arch]
    top = _Ctx(cx.name)

    def pick(key):
        if outer is not None and _present(outer, key):
            return top, outer
        return cx, obj

    u, src = pick("tie_word_embeddings")
    u.get_bool(src, "tie_word_embeddings", a["tie"])
    for key in ("bos_token_id", "eos_token_id"):
        # absent (not null): the family's default id, which
        # config_validate then checks against the vocabulary
        default = a[key[:3]]
        u, src = pick(key)
        if src.get(key, MISSING) is MISSING and not -1 <= default < c.vocab:
            u.fail(key, f"is missing, and its default {default} is past the vocabulary "
                        f"(0..{c.vocab - 1})")
    u, src = pick("bos_token_id")
    if _present(src, "bos_token_id"):
        u.want_int("bos_token_id", src["bos_token_id"], 0, c.vocab - 1)
    u, src = pick("eos_token_id")
    eos = src.get("eos_token_id")
    if eos is None:
        return
    if _is_int(eos):
        u.want_int("eos_token_id", eos, 0, c.vocab - 1)
        return
    if not isinstance(eos, list):
        u.fail("eos_token_id", f"is {jdesc(eos)}; expected an integer, a list of integers or "
                               f"null")
    if len(eos) > MAX_EOS:
        u.fail("eos_token_id", f"lists {len(eos)} ids; kvdiff keeps at most {MAX_EOS}")
    for i, x in enumerate(eos):
        u.want_int(f"eos_token_id[{i}]", x, 0, c.vocab - 1)


# ---------------------------------------------------------------- products


def _validate(cx, c):
    """config_validate's checks the walk above does not already make: the
    sizes of the largest weight matrices and of Gemma 4's per-layer
    table. Named by the config.json fields behind them."""
    if c.arch == "gemma4_text" and c.per_layer_dim and c.per_layer_vocab > c.vocab:
        cx.fail("vocab_size_per_layer_input", f"is {c.per_layer_vocab}; expected "
                                              f"1..{c.vocab} (vocab_size)")
    head_full = getattr(c, "head_dim_full", 0)
    q_width = c.heads * max(c.head_dim, head_full)
    ffn = c.intermediate * (2 if getattr(c, "double_wide", False) else 1)
    for what, n in (("num_attention_heads x head_dim", q_width), ("intermediate_size", ffn),
                    ("vocab_size", c.vocab)):
        if c.hidden * n > MAX_MATRIX:
            raise RecorderError(f"{cx.name}: {cx.scope}hidden_size {c.hidden} x {what} {n}: a "
                                f"weight matrix has more than {MAX_MATRIX} elements")
    table = getattr(c, "per_layer_vocab", 0) * getattr(c, "per_layer_dim", 0) * c.layers
    if table > MAX_TABLE:
        raise RecorderError(f"{cx.name}: {cx.scope}vocab_size_per_layer_input x "
                            f"hidden_size_per_layer_input x num_hidden_layers: the per-layer "
                            f"embedding table has {table} elements, more than {MAX_TABLE}")


# ---------------------------------------------------------------- other types


def check_other(cfg, name="config"):
    """A model_type kvdiff's engines do not run (model_config_from_hf
    still reads it, for a recording that is a compare's reference): the
    fields read from it, where present and not null, under the same
    limits and type rules as kvdiff's own families."""
    cx = _Ctx(name)
    for key, hi in (("hidden_size", MAX_HIDDEN), ("num_hidden_layers", MAX_LAYERS),
                    ("num_attention_heads", MAX_HEADS), ("num_key_value_heads", MAX_HEADS),
                    ("head_dim", MAX_HEAD_DIM), ("intermediate_size", MAX_INTERMEDIATE),
                    ("vocab_size", MAX_VOCAB), ("sliding_window", MAX_POSITIONS)):
        if _present(cfg, key):
            cx.want_int(key, cfg[key], 1, hi)
    if _present(cfg, "head_dim") and cfg["head_dim"] % 2:
        cx.fail("head_dim", f"is {cfg['head_dim']}; RoPE needs an even head_dim")
    if _present(cfg, "num_kv_shared_layers"):
        cx.want_int("num_kv_shared_layers", cfg["num_kv_shared_layers"], 0, MAX_LAYERS)
    for key in ("rms_norm_eps", "layer_norm_eps"):
        if _present(cfg, key):
            cx.want_num(key, cfg[key], 0.0, True, 1.0)
    if _present(cfg, "query_pre_attn_scalar"):
        cx.want_num("query_pre_attn_scalar", cfg["query_pre_attn_scalar"], 0.0, True,
                    MAX_SCALAR)
    if _present(cfg, "rope_theta"):
        cx.want_num("rope_theta", cfg["rope_theta"], MIN_THETA, False, MAX_THETA)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and _present(rp, "rope_theta"):
        cx.want_num("rope_parameters.rope_theta", rp["rope_theta"], MIN_THETA, False,
                    MAX_THETA)
    if _present(cfg, "use_sliding_window"):
        cx.get_bool(cfg, "use_sliding_window", True)
    _scaling(cx, "rope_scaling", cfg.get("rope_scaling"), False)


# The families in files of their own (families/): their defaults and
# traits join the tables above.
from . import families  # noqa: E402  (the family files use this module)

for _mt, _f in families.FAMILIES.items():
    ARCHES[_mt] = _f.ARCH
    _DEF_MAX_POSITIONS[_mt] = _f.MAX_POSITIONS
    if getattr(_f, "SLIDES", None):
        _SLIDES[_mt] = _f.SLIDES
    _TYPES += ", " + _mt
