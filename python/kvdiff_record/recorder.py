"""The Recorder: rows handed in by (layer, stage, absolute position), in any
order, written as a kvdiff dump (docs/dump-format.md, schema v1).

Why it holds rows back: a stage dataset covers contiguous positions from
its first_position, so a row that arrives ahead of a gap (a ring cache read
back out of order, decode rows before the prefill's) waits in memory until
the gap is filled, then goes out. Rows in order go straight to the file.

Status is "partial: running" from creation, "complete" only after every
row and the hash index are written, "partial: <exception>" when the with
block ends by an exception: a recording never looks whole when it is not.
"""

import errno
import fcntl
import json
import math
import os
import re
import resource
import struct

import h5py
import numpy as np

from . import outfile
from .errors import RecorderError

try:  # Debian's python3-xxhash; without it the dump has no row hashes
    import xxhash
except ImportError:  # pragma: no cover - depends on the machine
    xxhash = None

# In dataflow order; ple_in and ple_out are Gemma 4's per-layer input block,
# attn_sink and router_logits gpt-oss's sinks and experts, kv_latent an MLA
# model's cache row (DeepSeek).
LAYER_STAGES = ("x_in", "attn_norm_stats", "attn_norm", "q", "kv_latent", "k", "v", "attn_lse",
                "attn_nkeys", "attn_sink", "attn_out", "attn_proj", "h_mid",
                "ffn_norm_stats", "ffn_norm", "router_logits", "ffn_out", "ple_in", "ple_out",
                "x_out")
MODEL_STAGES = ("embed", "final_norm", "logits")
# /row_hash_index stage ids (kvdiff's stage_wire_id): format 1's ids stay
# (x_in 0 .. x_out 14, embed 15, final_norm 16, logits 17), stages added
# since come after.
_STAGE_ID = {s: i for i, s in enumerate(
    ("x_in", "attn_norm_stats", "attn_norm", "q", "k", "v", "attn_lse", "attn_nkeys",
     "attn_out", "attn_proj", "h_mid", "ffn_norm_stats", "ffn_norm", "ffn_out", "x_out",
     "embed", "final_norm", "logits", "ple_in", "ple_out", "attn_sink", "router_logits",
     "kv_latent"))}
_REQUIRED = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
             "sliding_window", "layer_types", "kv_owner", "rms_norm_eps", "rope_theta",
             "rope_local_base_freq")
_CHUNK_ROWS = 64   # kvdiff's own chunk height
_HASH_COLUMNS = "XXH3-64 of the row's float32 bytes"


# What a write that found no room is said as.
_NO_ROOM = {errno.ENOSPC: "no space left on the device",
            errno.EFBIG: "file size limit reached (ulimit -f)",
            errno.EDQUOT: "disk quota exceeded"}

# Room kept beside the rows for what libhdf5 writes with them (object
# headers, chunk indexes, the heap, the superblock's last flush).
_METADATA_ROOM = 1 << 20


def _write_errno(exc):
    """The errno of a write that failed inside libhdf5 (h5py quotes it as
    "errno = N"), else the exception's own, else None."""
    m = re.search(r"errno = (\d+)", str(exc))
    return int(m.group(1)) if m else getattr(exc, "errno", None)


def _lock_target(path, inputs):
    """Opens path in place by the output discipline (outfile.py: a new
    file, or the regular file there; never a link, a device, a FIFO, a
    socket, a folder or one of inputs) and takes kvdiff's write lock on
    it: an open-file-description lock on the whole file, the one kvdiff's
    dump writer takes (docs/dump-format.md), so that neither overwrites a
    dump the other is still writing. Nothing is truncated here. Returns
    (descriptor, created), the descriptor held until the dump is closed."""
    fd, created = outfile.open_in_place(path, inputs)
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    lock = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_OFD_SETLK", 37), lock)
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            return fd, created   # a file system without locks: written unguarded, as kvdiff does
        # Not removed even when created here: between the create and the
        # lock another run may have opened it and taken the lock.
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise RecorderError(f"{path}: another kvdiff is writing this file; two runs cannot "
                                f"record to one dump (choose another path, or wait for that "
                                f"run to end)") from exc
        raise RecorderError(f"{path}: cannot lock the dump: {exc.strerror}") from exc
    return fd, created


class _DumpIO:
    """The dump's bytes as libhdf5 reaches them (h5py's "fileobj" driver),
    through the descriptor the recorder opened and locked: libhdf5 never
    opens the path itself, so what it writes is the file that was judged.

    A write or truncate the file system refuses (no space, the file-size
    limit, an I/O error) is not passed on to libhdf5: it is noted in
    .failed (the errno) and it and every later one are dropped. libhdf5
    handed a failed write cannot close the file again (its metadata cache
    stays "slist already enabled"), and the file id h5py still holds
    crashed the interpreter at exit (SIGSEGV in H5F__close_cb); told
    nothing, it closes cleanly, and the recorder, seeing .failed, abandons
    the dump."""

    def __init__(self, fd):
        self.fd = fd
        self.pos = 0
        self.failed = None     # errno of the first refused write
        self.size = 0          # the size libhdf5 believes in, once writes are dropped

    def seekable(self):
        return True

    def readable(self):
        return True

    def writable(self):
        return True

    def seek(self, offset, whence=os.SEEK_SET):
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos}.get(whence)
        self.pos = (self._eof() if base is None else base) + offset
        return self.pos

    def tell(self):
        return self.pos

    def _eof(self):
        real = os.fstat(self.fd).st_size
        return max(real, self.size) if self.failed else real

    def readinto(self, buf):
        view = memoryview(buf).cast("B")
        n = os.preadv(self.fd, [view], self.pos)
        self.pos += n
        return n

    def read(self, n=-1):
        if n is None or n < 0:
            n = max(0, self._eof() - self.pos)
        data = os.pread(self.fd, n, self.pos)
        self.pos += len(data)
        return data

    def write(self, data):
        view = memoryview(data).cast("B")
        n = len(view)
        done = 0
        while not self.failed and done < n:
            try:
                done += os.pwrite(self.fd, view[done:], self.pos + done)
            except InterruptedError:
                continue
            except OSError as exc:
                self.failed = exc.errno or errno.EIO
        if self.failed:
            self.size = max(self.size, self.pos + n)
        self.pos += n
        return n

    def truncate(self, size=None):
        size = self.pos if size is None else size
        if not self.failed:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.failed = exc.errno or errno.EIO
        if self.failed:
            self.size = size
        return size

    def flush(self):
        pass


def _layer_dims(config, layer):
    """KV heads and head size of `layer`: Gemma 4's full-attention layers
    have global_head_dim and num_global_key_value_heads when set."""
    kv, d = config["num_key_value_heads"], config["head_dim"]
    types = config.get("layer_types") or []
    if layer is not None and 0 <= layer < len(types) and types[layer] == "full_attention":
        kv = config.get("num_global_key_value_heads") or kv
        d = config.get("global_head_dim") or d
    return kv, d


def moe_layer(config, layer):
    """Has `layer` experts (DeepSeek: dense before first_k_dense_replace)?"""
    first = config.get("first_k_dense_replace") or 0
    every = config.get("moe_layer_freq") or 1
    return layer >= first and layer % every == 0


def _has_sinks(config):
    """Does the model_type's family put a sink in every softmax (its row in
    families.FAMILIES says SINKS)?"""
    from . import families   # the family files import this module
    return bool(getattr(families.FAMILIES.get(config.get("model_type")), "SINKS", False))


def stage_width(config, stage, layer=None):
    """Floats per row of `stage` (of `layer`, whose widths may differ on
    Gemma 4) for the model_config dict `config`."""
    e, h = config["hidden_size"], config["num_attention_heads"]
    kv, d = _layer_dims(config, layer)
    dv = config.get("v_head_dim") or d   # MLA: values narrower than keys
    widths = {"attn_norm_stats": 3, "ffn_norm_stats": 3, "q": h * d, "k": kv * d,
              "v": kv * dv, "attn_lse": h, "attn_nkeys": h, "attn_out": h * dv,
              "logits": config["vocab_size"], "attn_sink": h,
              "router_logits": config.get("num_local_experts") or 0,
              "ple_in": config.get("hidden_size_per_layer_input") or 0,
              "kv_latent": (config.get("kv_lora_rank") or 0)
              + (config.get("qk_rope_head_dim") or 0)}
    if stage not in _STAGE_ID:
        raise RecorderError(f"unknown stage {stage!r}; layer stages are "
                            f"{', '.join(LAYER_STAGES)}; model stages {', '.join(MODEL_STAGES)}")
    if stage == "router_logits" and not config.get("num_local_experts"):
        raise RecorderError("router_logits: the model has no experts (num_local_experts is "
                            "not set in the model config)")
    if stage == "attn_sink" and not _has_sinks(config):
        raise RecorderError("attn_sink: the model has no attention sinks")
    if stage == "kv_latent" and not config.get("kv_lora_rank"):
        raise RecorderError("kv_latent: the model has no latent (MLA) cache (kv_lora_rank is "
                            "not set in the model config)")
    if stage == "router_logits" and layer is not None and not moe_layer(config, layer):
        raise RecorderError(f"router_logits: layer {layer} has a dense MLP "
                            f"(first_k_dense_replace, moe_layer_freq)")
    if stage in ("ple_in", "ple_out") and not config.get("hidden_size_per_layer_input"):
        raise RecorderError(f"{stage}: the model has no per-layer inputs "
                            f"(hidden_size_per_layer_input is not set in the model config)")
    return widths.get(stage, e)


def _width_words(config, stage, layer=None):
    h = config["num_attention_heads"]
    kv, d = _layer_dims(config, layer)
    dv = config.get("v_head_dim") or d
    return {"q": f"{h} heads x {d}", "attn_out": f"{h} heads x {dv}",
            "k": f"{kv} KV heads x {d}", "v": f"{kv} KV heads x {dv}",
            "kv_latent": "kv_lora_rank + qk_rope_head_dim",
            "attn_lse": f"{h} heads", "attn_nkeys": f"{h} heads", "attn_sink": f"{h} heads",
            "router_logits": "num_local_experts",
            "attn_norm_stats": "mean, rms, absmax", "ffn_norm_stats": "mean, rms, absmax",
            "logits": "vocab_size",
            "ple_in": "hidden_size_per_layer_input"}.get(stage, "hidden_size")


def _columns_attr(config, stage, layer=None):
    """The descriptive "columns" attribute kvdiff writes (words for people)."""
    h = config["num_attention_heads"]
    kv, d = _layer_dims(config, layer)
    if stage.endswith("_stats"):
        return "mean,rms,absmax of the norm's input"
    if stage in ("q", "k"):
        n = h if stage == "q" else kv
        return f"{n} {'heads' if stage == 'q' else 'KV heads'} x {d}, head-major; after RoPE"
    dv = config.get("v_head_dim") or d
    if stage == "v":
        return f"{kv} KV heads x {dv}, head-major"
    if stage == "attn_out":
        return f"{h} heads x {dv}, head-major"
    if stage == "kv_latent":
        return (f"normed latent x {config['kv_lora_rank']}, then the rotated key tail x "
                f"{config['qk_rope_head_dim']}")
    if stage in ("attn_lse", "attn_nkeys", "attn_sink"):
        return "one per head"
    if stage == "router_logits":
        return "one per expert"
    if stage == "logits":
        return "one per token id"
    return f"{config['hidden_size']} hidden dims"


def to_float32_rows(array, what="rows"):
    """float32 [n, cols] from a numpy array, a torch tensor (any device,
    bfloat16 included), a JAX array or anything numpy.asarray takes.
    float16/bfloat16/float32/float64 and integers convert exactly or by
    rounding to nearest; bool, complex and objects are refused."""
    if hasattr(array, "detach") and hasattr(array, "cpu"):   # torch.Tensor
        t = array.detach().cpu()
        if not (t.is_floating_point() or str(t.dtype).startswith("torch.int")):
            raise RecorderError(f"{what}: tensor dtype {t.dtype} is not a number type")
        array = t.float().numpy()
    try:
        a = np.asarray(array)
    except Exception as exc:  # noqa: BLE001 - name what could not be read
        raise RecorderError(f"{what}: numpy.asarray cannot read a {type(array).__name__}: "
                            f"{exc}") from exc
    if a.dtype.name == "bfloat16" or a.dtype.kind in "fiu":   # ml_dtypes' bfloat16 (JAX)
        return np.ascontiguousarray(a.astype(np.float32, copy=False)).astype("<f4", copy=False)
    raise RecorderError(f"{what}: dtype {a.dtype} cannot be recorded (float16, bfloat16, "
                        f"float32, float64 or integers)")


def row_stats(rows):
    """(L2 norm, max |x|) per row as kvdiff computes them (dump/writer.c
    row_stats): eight double lanes, lane k summing elements k, k+8, ...,
    added pairwise in a fixed order, so the statistics are the same bits
    kvdiff's would be. NaN makes the norm NaN and never wins the max."""
    n, cols = rows.shape
    pad = (-cols) % 8
    x = np.pad(rows, ((0, 0), (0, pad))).astype(np.float64).reshape(n, -1, 8)
    sq = x * x
    ss = np.zeros((n, 8))
    for i in range(sq.shape[1]):   # sequential, as the C loop: not numpy's pairwise sum
        ss += sq[:, i, :]
    total = ((ss[:, 0] + ss[:, 4]) + (ss[:, 2] + ss[:, 6])) + \
            ((ss[:, 1] + ss[:, 5]) + (ss[:, 3] + ss[:, 7]))
    absmax = np.fmax.reduce(np.abs(rows), axis=1, initial=np.float32(0)) if cols else \
        np.zeros(n, np.float32)
    return np.stack([np.sqrt(total).astype(np.float32), absmax.astype(np.float32)], axis=1)


class _Sink:
    """One stage dataset (with its .hash and .stats) being filled in order."""

    def __init__(self, group, name, cols, start):
        self.group, self.name, self.cols = group, name, cols
        self.layer = None                  # set by the recorder for layer stages
        self.start = self.next = start     # rows [start, next) are in the file
        self.pending = {}                  # first position -> rows, waiting for a gap
        self.dsets = None
        self.digest = xxhash.xxh3_128() if xxhash else None
        self.sum_sq = 0.0
        self.finite = True

    def overlap(self, first, n):
        """The positions of [first, first+n) already given, or None."""
        ranges = [(self.start, self.next)] + [(p, p + len(r)) for p, r in self.pending.items()]
        for lo, hi in ranges:
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                return a, b - 1
        return None

    def missing(self):
        """The first gap that holds pending rows back, as (lo, hi), or None."""
        if not self.pending:
            return None
        return self.next, min(self.pending) - 1


class Recorder:
    """Writes one kvdiff dump. Use as a context manager (or call close()).

    path: the HDF5 file to create, in place: a new path, or a regular file
        there (truncated, once kvdiff's write lock on it is taken). A
        symlink, a device, a FIFO, a socket, a folder or one of inputs
        there is refused (outfile.py), before anything is written.
    model_config: the model_config dict of docs/dump-format.md
        (model_config_from_hf(folder) builds it from a Hugging Face folder).
    engine: who computed the rows ("pytorch", "jax", "coreml", ...); kvdiff
        compares an engine other than its own with its cross-runtime model.
    settings: engine_settings, a dict (stored as JSON): give "chunk",
        "cache" ("dense", "split", "ring") and "max_ctx" when you know them,
        "cache_type" ("f32", "f16", "bf16") for the KV storage type, and
        "compute_dtype" ("f32", "tf32", "bf16", "f16") for the type the
        activations are computed in (kvdiff's drift model sizes its floor
        by it; without it bf16 is assumed, and said so).
    start_position: first absolute position every stage records (rows
        before it are refused); 0 unless you record only a later part.
    topk: K of /output's top-k (kvdiff's default 8).
    row_hashes: write <stage>.hash/.stats and /row_hash_index (default:
        when the xxhash module is there).
    inputs: the files the run read (paths; a folder stands for the files
        in it, e.g. the model folder): the dump may be none of them.
    Raises RecorderError when an argument would make a dump `kvdiff
    validate` refuses (a malformed config, settings holding NaN or
    something JSON cannot say, topk outside 1..vocab_size) or the file
    cannot be created; the error names the problem, and no file is left."""

    def __init__(self, path, model_config, engine="python", settings=None, *, seed=0,
                 weight_fingerprint="", start_position=0, topk=8, row_hashes=None,
                 tool_version=None, inputs=None):
        from . import __version__
        self.path = str(path)
        # Every argument is judged before the file is touched: a refused
        # one leaves nothing behind.
        self.config = _check_config(model_config)
        if row_hashes and xxhash is None:
            raise RecorderError("row_hashes=True needs the xxhash module "
                                "(Debian: apt-get install python3-xxhash)")
        self.hashes = xxhash is not None if row_hashes is None else bool(row_hashes)
        self.start = _whole(start_position, "start_position", 0)
        vocab = self.config["vocab_size"]
        self.topk = _whole(topk, "topk", 1, vocab, f"1..{vocab} (vocab_size)")
        seed = _whole(seed, "seed", 0, 2**64 - 1)
        fp = str(weight_fingerprint or "")
        if fp and (len(fp) != 16 or any(c not in "0123456789abcdef" for c in fp)):
            raise RecorderError(f"weight_fingerprint {fp!r}: expected 16 lowercase hex digits "
                                f"or \"\"")
        try:
            self.settings = dict(settings or {})
        except (TypeError, ValueError) as exc:
            raise RecorderError(f"engine_settings: expected a dict, got "
                                f"{type(settings).__name__}") from exc
        settings_text = _json_text(self.settings, "engine_settings")
        inputs = outfile.input_ids(inputs)
        self._sinks = {}          # (layer or -1, stage) -> _Sink
        self._tokens = None
        self._prompt_length = None
        self._output = {}         # position -> (lse, ids, values)
        self._closed = False
        self._before_close = []   # callables close() runs first (before_close)
        self._room = 0            # bytes _make_room may hand out unasked
        self._lock_fd, self._created = _lock_target(self.path, inputs)
        self._io = _DumpIO(self._lock_fd)
        try:
            if not self._created:
                os.ftruncate(self._lock_fd, 0)   # locked: no other writer's dump
            self._f = h5py.File(self._io, "w", track_order=False)
        except (OSError, ValueError, RuntimeError) as exc:
            self._closed = True
            self._discard()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise RecorderError(f"{self.path}: cannot create the dump: {why}") from exc
        try:
            a = self._f.attrs
            a.create("format", "kvdiff-dump", dtype=h5py.string_dtype())
            a.create("format_version", 1, dtype="<i8")
            a.create("mode", "full", dtype=h5py.string_dtype())
            a.create("row_hashes", 1 if self.hashes else 0, dtype="<i8")
            a.create("engine", str(engine), dtype=h5py.string_dtype())
            a.create("engine_settings", settings_text, dtype=h5py.string_dtype())
            a.create("model_config", _json_text(self.config, "model_config"),
                     dtype=h5py.string_dtype())
            a.create("weight_fingerprint", fp, dtype=h5py.string_dtype())
            a.create("seed", seed, dtype="<u8")
            a.create("status", "partial: running", dtype=h5py.string_dtype())
            a.create("tool_version", str(tool_version or f"kvdiff_record {__version__} (python)"),
                     dtype=h5py.string_dtype())
            self._make_room(0)
            self._f.flush()
        except (OSError, RuntimeError) as exc:
            self._abandon(self._io.failed or _write_errno(exc), exc)
        self._check_io()

    # -------------------------------------------------------------- inputs

    def tokens(self, ids, prompt_length):
        """The prompt then the generated tokens (element p: the token at
        position p). May be called again as generation goes on; the last
        call wins."""
        t = np.asarray(ids)
        if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
            raise RecorderError(f"tokens: expected a 1-D list of integer ids, got shape "
                                f"{t.shape} dtype {t.dtype}")
        vocab = self.config["vocab_size"]
        if t.size and (t.min() < 0 or t.max() >= vocab):
            raise RecorderError(f"tokens: ids must be in 0..{vocab - 1} (vocab_size)")
        pl = int(prompt_length)
        if not 0 < pl <= t.size:
            raise RecorderError(f"tokens: prompt_length {pl} must be 1..{t.size} "
                                f"(the number of tokens)")
        self._tokens, self._prompt_length = t.astype(np.int32), pl

    def rows(self, layer, stage, first_position, array):
        """Rows of `stage` of `layer` for positions first_position,
        first_position+1, ...: array [n, width] (a single row [width] is one
        row). Calls may come in any order (prefill chunks, decode steps,
        a ring cache by absolute position); a position may be given once.
        NaN and infinities are recorded as they are."""
        n_layers = self.config["num_hidden_layers"]
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < n_layers:
            raise RecorderError(f"layer {layer!r}: the model has layers 0..{n_layers - 1}")
        if stage not in LAYER_STAGES:
            raise RecorderError(f"layer {layer}: {stage!r} is not a layer stage ("
                                f"{', '.join(LAYER_STAGES)}); model stages go to model_rows()")
        owner = self.config["kv_owner"][layer]
        if stage in ("k", "v") and owner != layer:
            raise RecorderError(f"layer {layer} {stage}: layer {layer} reads layer {owner}'s "
                                f"KV cache (kv_owner) and writes none; record {stage} on "
                                f"layer {owner}")
        self._add(int(layer), stage, first_position, array)

    def model_rows(self, stage, first_position, array):
        """Model-level rows: "embed" (Gemma 3: scaled by sqrt(hidden_size)),
        "final_norm" or "logits" [n, vocab_size]."""
        if stage not in MODEL_STAGES:
            raise RecorderError(f"{stage!r} is not a model stage ({', '.join(MODEL_STAGES)})")
        self._add(-1, stage, first_position, array)

    def output(self, first_position, logits=None, *, lse=None, topk_ids=None,
               topk_values=None):
        """/output for positions first_position, ...: either the logits
        [n, vocab_size] (lse and top-k computed here: log-sum-exp in double,
        top-k descending, ties by lower id) or lse [n] with topk_ids and
        topk_values [n, K]."""
        pos = self._position(first_position, "output")
        if logits is not None:
            lg = to_float32_rows(logits, "output logits")
            lg = lg.reshape(1, -1) if lg.ndim == 1 else lg
            if lg.ndim != 2 or lg.shape[1] != self.config["vocab_size"]:
                raise RecorderError(f"output: logits of shape {lg.shape}; expected "
                                    f"[positions, {self.config['vocab_size']}] (vocab_size)")
            k = min(self.topk, lg.shape[1])
            d = lg.astype(np.float64)
            m = np.max(d, axis=1, keepdims=True)
            with np.errstate(invalid="ignore", over="ignore"):
                lse = (m[:, 0] + np.log(np.sum(np.exp(d - m), axis=1))).astype(np.float32)
            order = np.argsort(-d, axis=1, kind="stable")[:, :k]
            topk_ids = order.astype(np.int32)
            topk_values = np.take_along_axis(lg, order, axis=1)
        elif lse is None or topk_ids is None or topk_values is None:
            raise RecorderError("output: give the logits, or lse, topk_ids and topk_values")
        lse = np.asarray(to_float32_rows(lse, "output lse")).reshape(-1)
        if hasattr(topk_ids, "detach") and hasattr(topk_ids, "cpu"):   # torch.Tensor
            topk_ids = topk_ids.detach().cpu().numpy()
        ids = np.asarray(topk_ids)
        vocab = self.config["vocab_size"]
        if ids.size and ids.dtype.kind not in "iu":
            raise RecorderError(f"output: topk_ids of dtype {ids.dtype}; expected integer "
                                f"token ids")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise RecorderError(f"output: topk_ids must be in 0..{vocab - 1} (vocab_size); "
                                f"got {ids.min()}..{ids.max()}")
        ids = ids.reshape(len(lse), -1).astype(np.int32)
        vals = to_float32_rows(topk_values, "output topk_values").reshape(len(lse), -1)
        if ids.shape[1] != self.topk or vals.shape != ids.shape:
            raise RecorderError(f"output: topk_ids {ids.shape} and topk_values {vals.shape} "
                                f"must both be [{len(lse)}, {self.topk}] (topk)")
        for i in range(len(lse)):
            if pos + i in self._output:
                raise RecorderError(f"output: position {pos + i} was already given")
        for i in range(len(lse)):
            self._output[pos + i] = (lse[i], ids[i], vals[i])

    def setting_default(self, key, value):
        """Sets engine_settings[key] to value unless the settings given to
        the Recorder already hold key (what the caller said wins). Used by
        TorchHooks to state the device, and compute_dtype once the run has
        shown it (before_close)."""
        if key in self.settings or self._closed:
            return
        text = _json_text(dict(self.settings, **{key: value}), "engine_settings")
        self.settings[key] = value
        try:
            self._f.attrs.create("engine_settings", text, dtype=h5py.string_dtype())
        except (OSError, RuntimeError) as exc:
            self._abandon(self._io.failed or _write_errno(exc), exc)
        self._check_io()

    def before_close(self, callback):
        """callback() runs when close() begins, before the status is
        written: for settings only the finished run can tell (TorchHooks
        states compute_dtype there, from what the forwards computed in;
        engine_settings is written when the file is created, before any
        forward). Its setting_default() calls overwrite engine_settings
        while the dump still says "partial: running", so a crash in between
        leaves it partial. Callbacks run in the order given."""
        self._before_close.append(callback)

    # ------------------------------------------------------------- closing

    def close(self, status=None):
        """Writes what waits, the tokens, /output, the hash index and the
        status; "complete" unless `status` (a reason) says otherwise or rows
        are missing (a gap before rows that were given). Raises
        RecorderError after writing when the dump could not be complete, or
        when the disk or the file-size limit has no room for it (then no
        dump is left)."""
        if self._closed:
            return
        problems = [] if status is None else [status]
        try:
            for callback in self._before_close:
                callback()
            # /output, the tokens and the index: a few rows each
            self._make_room(len(self._output) * (8 + 8 * self.topk) +
                            (0 if self._tokens is None else self._tokens.nbytes) +
                            len(self._sinks) * 48)
            self._write_closing(problems)
            self._f.flush()
        except (OSError, RuntimeError) as exc:
            self._abandon(self._io.failed or _write_errno(exc), exc)
        except BaseException:
            if not self._closed:
                self._closed = True
                self._release()
            raise
        self._closed = True
        self._release()
        if self._io.failed:   # refused while libhdf5 wrote out its caches
            self._abandon(self._io.failed)
        if problems and status is None:
            raise RecorderError(f"{self.path}: written as partial: {'; '.join(problems)}")

    def _write_closing(self, problems):
        """What close() writes; problems grows with what keeps it partial."""
        for (layer, stage), s in self._sinks.items():
            gap = s.missing()
            if gap:
                where = f"layer {layer}" if layer >= 0 else "model"
                held = sum(len(r) for r in s.pending.values())
                problems.append(f"{where} {stage}: positions {gap[0]}..{gap[1]} never "
                                f"given ({held} later rows not written)")
        if self._tokens is None:
            problems.append("no tokens given (call tokens())")
        else:
            t = self._f.create_dataset("tokens", data=self._tokens, track_times=False)
            t.attrs.create("first_position", 0, dtype="<i8")
            t.attrs.create("prompt_length", self._prompt_length, dtype="<i8")
        problems += self._write_output()
        if not problems and self.hashes and all(
                math.isfinite(s.sum_sq) for s in self._sinks.values()):
            # The index is optional, and kvdiff's reader refuses a row
            # whose sum of squares is not finite (a NaN row): none then.
            self._write_index()
        text = "complete" if not problems else "partial: " + "; ".join(problems)
        self._f.attrs.create("status", text[:1000], dtype=h5py.string_dtype())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        why = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
        try:
            self.close(status=why)
        except Exception:  # noqa: BLE001 - the user's exception is the one to see
            pass
        return False

    # ------------------------------------------------------------- helpers

    def _position(self, first_position, what):
        if not isinstance(first_position, (int, np.integer)) or first_position < self.start:
            raise RecorderError(f"{what}: first_position {first_position!r} must be an integer "
                                f">= {self.start} (start_position)")
        return int(first_position)

    def _add(self, layer, stage, first_position, array):
        if self._closed:
            raise RecorderError(f"{self.path}: the recorder is closed")
        where = f"layer {layer} {stage}" if layer >= 0 else f"model {stage}"
        pos = self._position(first_position, where)
        rows = to_float32_rows(array, where)
        width = stage_width(self.config, stage, layer if layer >= 0 else None)
        if rows.ndim == 1 and rows.size == width:
            rows = rows.reshape(1, width)
        if rows.ndim != 2 or rows.shape[1] != width:
            raise RecorderError(
                f"{where}: rows of shape {tuple(rows.shape)}; expected [positions, {width}] "
                f"({stage} is {_width_words(self.config, stage, layer)} wide). A [heads, T, D] array "
                f"needs heads_first(), a padded head_dim unpad_head_dim()")
        if rows.shape[0] == 0:
            return
        s = self._sink(layer, stage, width)
        clash = s.overlap(pos, rows.shape[0])
        if clash:
            raise RecorderError(f"{where}: positions {clash[0]}..{clash[1]} were already given "
                                f"(rows {pos}..{pos + rows.shape[0] - 1} overlap them)")
        s.pending[pos] = rows
        while s.next in s.pending:
            r = s.pending.pop(s.next)
            # the row, its hash and its two statistics
            self._make_room(r.nbytes + r.shape[0] * 16)
            try:
                self._append(s, r)
            except (OSError, RuntimeError) as exc:
                self._abandon(self._io.failed or _write_errno(exc), exc)
            self._check_io()

    def _make_room(self, nbytes):
        """Writes no further than there is room for: the disk's free space
        and the file-size limit (ulimit -f) are asked before a write of
        nbytes (and room for libhdf5's own), and a write that would not fit
        is not made: the dump is abandoned with one error instead, before
        libhdf5 has spent time on rows that cannot be kept (a write the
        file system refuses anyway, another program having filled the disk
        meanwhile, is caught by _DumpIO). The room found
        is spent down by the writes that follow, and asked again only when
        they would pass it (a decode step's rows are small; three system
        calls each would cost more than writing them)."""
        if nbytes <= self._room:
            self._room -= nbytes
            return
        need = nbytes + _METADATA_ROOM
        try:
            size = max(os.fstat(self._lock_fd).st_size, self._f.id.get_filesize())
        except (OSError, RuntimeError, ValueError):
            size = 0
        room = float("inf")
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            if size + need > soft:
                self._abandon(errno.EFBIG)
            room = soft - size - need
        try:
            st = os.fstatvfs(self._lock_fd)
        except OSError:
            st = None
        if st is not None:
            free = st.f_bavail * st.f_frsize
            if free < need:
                self._abandon(errno.ENOSPC)
            room = min(room, free - need)
        # spent down from here; half of it, as another program may fill the
        # disk meanwhile
        self._room = room / 2 if room != float("inf") else 0

    def _abandon(self, code, exc=None):
        """No room for the dump (or a write the file system refused): every
        later write is dropped (_DumpIO), so libhdf5 closes the file
        cleanly, the half file is discarded (_discard) and one error says
        why. Raises RecorderError."""
        words = _NO_ROOM.get(code) or (f"write failed ({str(exc).splitlines()[0]})" if exc
                                       else f"write failed ({os.strerror(code or errno.EIO)})")
        self._io.failed = self._io.failed or code or errno.EIO
        self._closed = True
        self._release()
        self._discard()
        raise RecorderError(f"{self.path}: {words}: no dump written") from None

    def _check_io(self):
        """Abandons the dump when the file system refused a write."""
        if self._io.failed:
            self._abandon(self._io.failed)

    def _release(self):
        """Closes the HDF5 file (libhdf5 writes out its caches) and, with
        nothing left to discard, the descriptor and its lock."""
        f = getattr(self, "_f", None)
        if f is not None:
            try:
                f.close()
            except (OSError, RuntimeError, ValueError):
                pass   # writes past a refusal are dropped: not expected
        if not self._io.failed and self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _discard(self):
        """The half-made dump is not left looking like one: removed when
        this recorder created the path (and the path is still that file),
        emptied when it was a file there before (kvdiff's writer removes
        only what it made). Closes the descriptor, which holds the lock
        until then, so no other run's new file is touched."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd < 0:
            return
        try:
            mine, there = os.fstat(fd), os.lstat(self.path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                if self._created:
                    os.unlink(self.path)
                else:
                    os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _sink(self, layer, stage, width):
        key = (layer, stage)
        if key not in self._sinks:
            if layer >= 0:
                gname = f"layers/{layer}"
                if gname not in self._f:
                    g = self._f.create_group(gname, track_order=False)
                    c = self.config
                    sliding = c["layer_types"][layer] == "sliding_attention"
                    g.attrs.create("attention", "sliding" if sliding else "global",
                                   dtype=h5py.string_dtype())
                    g.attrs.create("window", c["sliding_window"] if sliding else 0, dtype="<i8")
                    g.attrs.create("rope_theta", float(c["rope_local_base_freq"] if sliding
                                                       else c["rope_theta"]), dtype="<f8")
                    g.attrs.create("kv_owner", c["kv_owner"][layer], dtype="<i8")
            else:
                gname = "model"
                if gname not in self._f:
                    self._f.create_group(gname)
            self._sinks[key] = _Sink(self._f[gname], stage, width, self.start)
            self._sinks[key].layer = layer if layer >= 0 else None
        return self._sinks[key]

    def _create(self, s):
        def make(name, cols, dtype, columns):
            shape = (0, cols) if cols else (0,)
            d = s.group.create_dataset(name, shape=shape, maxshape=(None,) + shape[1:],
                                       chunks=(_CHUNK_ROWS,) + shape[1:], dtype=dtype,
                                       track_times=False, fillvalue=0)
            d.attrs.create("first_position", s.start, dtype="<i8")
            d.attrs.create("columns", columns, dtype=h5py.string_dtype())
            return d
        rows = make(s.name, s.cols, "<f4", _columns_attr(self.config, s.name, s.layer))
        units = {"attn_lse": "nats (natural log)", "attn_nkeys": "keys attended",
                 "attn_sink": "share of the softmax (0..1)",
                 "router_logits": "logits (before top-k)"}.get(s.name)
        if units:
            rows.attrs.create("units", units, dtype=h5py.string_dtype())
        s.dsets = [rows]
        if self.hashes:
            s.dsets += [make(s.name + ".hash", 0, "<u8", _HASH_COLUMNS),
                        make(s.name + ".stats", 2, "<f4", "l2,absmax")]

    def _append(self, s, rows):
        if s.dsets is None:
            self._create(s)
        n = rows.shape[0]
        old = s.next - s.start
        parts = [rows]
        if self.hashes:
            hashes = np.array([xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows],
                              dtype="<u8")
            stats = row_stats(rows)
            s.digest.update(hashes.tobytes())
            for l2 in stats[:, 0].astype(np.float64):
                s.sum_sq += l2 * l2
            s.finite &= bool(np.all(np.isfinite(stats)))
            parts += [hashes, stats]
        for d, data in zip(s.dsets, parts):
            d.resize(old + n, axis=0)
            d[old:old + n] = data
        s.next += n

    def _write_output(self):
        if not self._output:
            return []
        first = min(self._output)
        last = max(self._output)
        missing = [p for p in range(first, last + 1) if p not in self._output]
        problems = []
        if missing:
            problems.append(f"output: positions {missing[0]}.. never given (from {first} to "
                            f"{last}); only {first}..{missing[0] - 1} written")
            last = missing[0] - 1
        rows = [self._output[p] for p in range(first, last + 1)]
        g = self._f.create_group("output")
        g.attrs.create("k", self.topk, dtype="<i8")
        for name, data in (("lse", np.array([r[0] for r in rows], "<f4")),
                           ("topk_ids", np.stack([r[1] for r in rows]).astype("<i4")),
                           ("topk_values", np.stack([r[2] for r in rows]).astype("<f4"))):
            d = g.create_dataset(name, data=data, track_times=False)
            d.attrs.create("first_position", first, dtype="<i8")
        return problems

    def _write_index(self):
        table = []
        for layer_plus in range(self.config["num_hidden_layers"] + 1):
            for stage in LAYER_STAGES + MODEL_STAGES:
                s = self._sinks.get((layer_plus - 1, stage))
                if s is None or s.dsets is None:
                    continue
                d = s.digest.intdigest()
                table.append([layer_plus, _STAGE_ID[stage], s.start, s.next - s.start, s.cols,
                              d & (2**64 - 1), d >> 64,
                              int(np.float64(s.sum_sq).view(np.uint64)),
                              int(s.finite) | 2])
        if table:
            self._f.create_dataset("row_hash_index", data=np.array(table, dtype="<u8"),
                                   track_times=False)


# What kvdiff's dump reader accepts in model_config (dump/dump.c,
# dump_config_parse): config.json's own limits (model/config.h, KV_MAX_*),
# so that every model kvdiff runs writes a dump kvdiff reads.
_CONFIG_INTS = (("hidden_size", 1, 1 << 20), ("num_hidden_layers", 1, 256),
                ("num_attention_heads", 1, 1 << 12), ("num_key_value_heads", 1, 1 << 12),
                ("head_dim", 1, 1 << 14), ("intermediate_size", 1, 1 << 22),
                ("vocab_size", 1, 1 << 24))
# Gemma 4's fields, optional there (null or absent) and read nowhere else.
_GEMMA4_INTS = (("global_head_dim", 2, 1 << 14), ("num_global_key_value_heads", 1, 1 << 12),
                ("hidden_size_per_layer_input", 0, 1 << 20),
                ("vocab_size_per_layer_input", 0, 1 << 24))
_INT32_MAX = 2**31 - 1


def _as_int(v):
    """v as a Python int when it is an integer (numpy's too), else None."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _as_number(v):
    """v as a finite Python int or float, else None."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                              np.floating)):
        return None
    v = int(v) if isinstance(v, (int, np.integer)) else float(v)
    return v if math.isfinite(v) else None


def _whole(value, what, lo, hi=None, words=None):
    """value as an int in lo..hi (hi None: no bound), else RecorderError."""
    v = _as_int(value)
    if v is None or v < lo or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else f"in {words or f'{lo}..{hi}'}"
        raise RecorderError(f"{what} is {value!r}; expected an integer {want}")
    return v


def _json_problem(v, where):
    """What JSON (as kvdiff's jansson reads it) cannot hold in v, or None:
    NaN and infinities, NUL characters and lone surrogates in strings,
    objects that are not dicts, lists, strings, numbers, booleans or None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where} holds a lone surrogate; JSON text must be UTF-8"
        return f"{where} holds a NUL character; kvdiff's JSON reader refuses it" \
            if "\0" in v else None
    if isinstance(v, float):
        return None if math.isfinite(v) else f"{where} is {v!r}; JSON has no NaN or infinity"
    if v is None or isinstance(v, int):
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"{where} has the key {k!r}; JSON keys are strings"
            p = _json_problem(k, f"{where} key {k!r}") or _json_problem(x, f"{where}[{k!r}]")
            if p:
                return p
        return None
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            p = _json_problem(x, f"{where}[{i}]")
            if p:
                return p
        return None
    return f"{where} is a {type(v).__name__}; JSON cannot hold it"


def _json_text(obj, what):
    """obj as the JSON text of a root attribute, or RecorderError naming
    what kvdiff validate would refuse in it."""
    problem = _json_problem(obj, what)
    if problem:
        raise RecorderError(f"{problem} (kvdiff validate refuses such a dump)")
    return json.dumps(obj, allow_nan=False)


def _check_config(config):
    """A copy of model_config as kvdiff's dump reader accepts it (dump/dump.c
    dump_config_parse), numpy scalars made Python ones; else RecorderError
    naming the field."""
    if not isinstance(config, dict):
        raise RecorderError(f"model_config: expected a dict, got {type(config).__name__}")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise RecorderError(f"model_config: missing {', '.join(missing)} "
                            f"(model_config_from_hf(folder) fills them)")
    c = dict(config)
    mt = c["model_type"]
    if not isinstance(mt, str) or not mt or len(mt.encode("utf-8", "replace")) > 31:
        raise RecorderError(f"model_config: model_type is {mt!r}; expected a string of 1 to 31 "
                            f"characters")
    for key, lo, hi in _CONFIG_INTS:
        c[key] = _whole(c[key], f"model_config: {key}", lo, hi)
    n = c["num_hidden_layers"]
    if c["sliding_window"] is not None:
        c["sliding_window"] = _whole(c["sliding_window"], "model_config: sliding_window", 0,
                                     _INT32_MAX)
    for key in ("layer_types", "kv_owner"):
        if not isinstance(c[key], (list, tuple)) or len(c[key]) != n:
            raise RecorderError(f"model_config: {key} must list {n} layers "
                                f"(num_hidden_layers)")
    c["layer_types"] = list(c["layer_types"])
    c["kv_owner"] = [_whole(o, f"model_config: kv_owner[{i}]", 0, i)
                     for i, o in enumerate(c["kv_owner"])]
    for i, (t, o) in enumerate(zip(c["layer_types"], c["kv_owner"])):
        if t not in ("sliding_attention", "full_attention"):
            raise RecorderError(f"model_config: layer_types[{i}] is {t!r}")
        if c["kv_owner"][o] != o:
            raise RecorderError(f"model_config: kv_owner[{i}] is {o}, which does not own a "
                                f"cache itself")
    for key in ("rms_norm_eps", "rope_theta", "rope_local_base_freq"):
        c[key] = _as_number(c[key])
        if c[key] is None:
            raise RecorderError(f"model_config: {key} is {config[key]!r}; expected a number")
    for key, positive in (("attn_scale", True), ("final_logit_softcapping", False)):
        if c.get(key) is not None:
            v = _as_number(c[key])
            if v is None or v < 0 or (positive and v == 0):
                raise RecorderError(f"model_config: {key} is {c[key]!r}; expected a number "
                                    f"{'>' if positive else '>='} 0")
            c[key] = v
    _check_rope_scaling(c)
    _check_gemma4_fields(c)
    _json_text(c, "model_config")
    return c


def _check_rope_scaling(c):
    """rope_scaling as kvdiff's dump reader takes it (dump/dump.c)."""
    rs = c.get("rope_scaling")
    if rs is None:
        return
    kind = rs.get("rope_type") if isinstance(rs, dict) else None
    if kind not in ("linear", "llama3", "yarn"):
        raise RecorderError("model_config: rope_scaling must be null or an object whose "
                            "rope_type is \"linear\", \"llama3\" or \"yarn\"")
    keys = ("factor",) + (("low_freq_factor", "high_freq_factor") if kind == "llama3" else ())
    v = {k: _as_number(rs.get(k)) for k in keys}
    if kind in ("llama3", "yarn"):
        _whole(rs.get("original_max_position_embeddings"),
               "model_config: rope_scaling.original_max_position_embeddings", 1, _INT32_MAX)
    if any(x is None for x in v.values()) or v["factor"] <= 0 or (
            kind == "llama3" and not v["high_freq_factor"] > v["low_freq_factor"] > 0):
        raise RecorderError("model_config: rope_scaling: factor must be a number > 0 (and "
                            "high_freq_factor > low_freq_factor > 0 for llama3)")
    if kind == "yarn":
        fast, slow = _as_number(rs.get("beta_fast", 32.0)), _as_number(rs.get("beta_slow", 1.0))
        af = rs.get("attention_factor")
        af = 1.0 if af is None else _as_number(af)
        if fast is None or slow is None or not fast > slow > 0 or af is None or af <= 0 or \
                not isinstance(rs.get("truncate", True), bool):
            raise RecorderError("model_config: rope_scaling: yarn needs beta_fast > beta_slow "
                                "> 0, attention_factor > 0 and truncate true or false")


def _check_gemma4_fields(c):
    """Gemma 4's full-layer widths and per-layer inputs size rows here
    (stage_width); kvdiff reads them for gemma4 only, so elsewhere they
    would make rows of widths its reader does not expect."""
    gemma4 = c["model_type"] in ("gemma4_text", "gemma4")
    for key, lo, hi in _GEMMA4_INTS:
        if c.get(key) is None:
            continue
        if not gemma4:
            if c[key]:
                raise RecorderError(f"model_config: {key} is {c[key]!r}, but kvdiff reads it "
                                    f"for gemma4_text only (model_type {c['model_type']!r})")
            continue
        c[key] = _whole(c[key], f"model_config: {key}", lo, hi)
    f = c.get("partial_rotary_factor_full")
    if gemma4 and f is not None:
        v = _as_number(f)
        if v is None or not 0 < v <= 1:
            raise RecorderError(f"model_config: partial_rotary_factor_full is {f!r}; expected "
                                f"a number in (0, 1]")
        c["partial_rotary_factor_full"] = v
