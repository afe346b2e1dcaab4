"""Tests of kvdiff_record: every dump it writes is checked by `kvdiff
validate` and compared by `kvdiff compare` against kvdiff's reference.
KVDIFF_BIN names the kvdiff binary (default: build/kvdiff)."""

import contextlib
import glob
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "python", "examples"))
sys.path.insert(0, HERE)

import hostile_configs  # noqa: E402

from kvdiff_record import (LAYER_STAGES, Recorder, RecorderError,  # noqa: E402
                           from_interleaved_rope, heads_first, model_config_from_hf,
                           ring_rows, stage_width, unpad_head_dim)

# The stages of a model without Gemma 4's per-layer inputs, sinks or experts.
PLAIN_STAGES = tuple(st for st in LAYER_STAGES
                     if st not in ("ple_in", "ple_out", "attn_sink", "router_logits", "kv_latent"))

KVDIFF = os.environ.get("KVDIFF_BIN", os.path.join(ROOT, "build", "kvdiff"))


def kvdiff(*args):
    p = subprocess.run([KVDIFF, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvdiff-py-")
        for preset in ("tiny-llama", "tiny-gemma3", "tiny-gemma3-kvshared", "tiny-qwen3",
                       "tiny-llama3", "tiny-gemma3-h288", "tiny-qwen2", "tiny-gemma4",
                       "tiny-gpt-oss", "tiny-deepseek-v2", "tiny-deepseek-v3"):
            rc, out = kvdiff("gen", "--preset", preset, "-o", os.path.join(cls.dir, preset))
            assert rc == 0, out
        cls.ref = os.path.join(cls.dir, "ref.h5")
        rc, out = kvdiff("run", "--model", os.path.join(cls.dir, "tiny-llama"),
                         "--prompt-random", "12", "--max-new", "4", "--dump", cls.ref)
        assert rc == 0, out

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def assert_valid(self, path):
        rc, out = kvdiff("validate", path)
        self.assertEqual(rc, 0, out)
        return out

    def copy_header(self, rec, ref):
        rec.tokens(ref["tokens"][:], int(ref["tokens"].attrs["prompt_length"]))
        o = ref["output"]
        rec.output(int(o["lse"].attrs["first_position"]), lse=o["lse"][:],
                   topk_ids=o["topk_ids"][:], topk_values=o["topk_values"][:])


class TestRecorder(Base):
    def test_config_matches_kvdiff(self):
        for preset in ("tiny-llama", "tiny-gemma3", "tiny-gemma3-kvshared", "tiny-qwen3",
                       "tiny-llama3", "tiny-gemma3-h288", "tiny-qwen2", "tiny-gemma4",
                       "tiny-gpt-oss", "tiny-deepseek-v2", "tiny-deepseek-v3"):
            dump = self.path(f"cfg-{preset}.h5")
            rc, out = kvdiff("run", "--model", self.path(preset), "--prompt-random", "4",
                             "--max-new", "1", "--dump", dump)
            self.assertEqual(rc, 0, out)
            with h5py.File(dump, "r") as f:
                theirs = json.loads(f.attrs["model_config"])
            self.assertEqual(model_config_from_hf(self.path(preset)), theirs, preset)

    def test_config_gemma4(self):
        """Gemma 4 nested or flat, per_layer_config for the full layers'
        sizes, kv_owner from the layer types; MoE refused."""
        with open(self.path("tiny-gemma4/config.json")) as f:
            text = json.load(f)
        flat = model_config_from_hf(text)
        self.assertEqual(flat["kv_owner"], list(range(8)) + [6, 6, 6, 7])
        self.assertEqual((flat["global_head_dim"], flat["num_global_key_value_heads"]), (64, 1))
        self.assertEqual(flat["attn_scale"], 1.0)
        nested = model_config_from_hf({"model_type": "gemma4", "text_config": text})
        self.assertEqual(nested, flat)
        alt = dict(text)
        del alt["global_head_dim"], alt["num_global_key_value_heads"]
        alt["per_layer_config"] = {"3": {"head_dim": 64, "num_key_value_heads": 1}}
        self.assertEqual(model_config_from_hf(alt), flat)
        self.assertEqual(stage_width(flat, "q", 3), 4 * 64)
        self.assertEqual(stage_width(flat, "k", 0), 2 * 32)
        self.assertEqual(stage_width(flat, "ple_in", 0), 16)
        with self.assertRaisesRegex(RecorderError, "mixture-of-experts"):
            model_config_from_hf(dict(text, enable_moe_block=True))
        with self.assertRaisesRegex(RecorderError, "num_kv_shared_layers is 12 but the model "
                                                   "has 12 layers"):
            model_config_from_hf(dict(text, num_kv_shared_layers=12))
        with self.assertRaisesRegex(RecorderError, "no per-layer inputs"):
            stage_width(self.cfg_llama(), "ple_in", 0)

    def test_gemma4_rows_compare_identical(self):
        """A Gemma 4 recording made with the recorder from kvdiff's own rows
        (per-layer widths, shared layers without k/v, the per-layer input
        stages) is what kvdiff wrote: compare says identical."""
        ref, out = self.path("g4-ref.h5"), self.path("g4-copy.h5")
        rc, text = kvdiff("run", "--model", self.path("tiny-gemma4"), "--prompt-random", "14",
                          "--max-new", "3", "--dump", ref)
        self.assertEqual(rc, 0, text)
        cfg = model_config_from_hf(self.path("tiny-gemma4"))
        with h5py.File(ref, "r") as f:
            with Recorder(out, cfg, engine="pytorch", settings={"cache": "dense"}) as rec:
                self.copy_header(rec, f)
                for layer in range(12):
                    for st in LAYER_STAGES:
                        if st in f[f"layers/{layer}"]:
                            rec.rows(layer, st, 0, f[f"layers/{layer}/{st}"][:])
                    if layer >= 8:
                        with self.assertRaisesRegex(RecorderError, "k"):
                            rec.rows(layer, "k", 0, f["layers/0/k"][:])
                rec.model_rows("embed", 0, f["model/embed"][:])
        rc, text = kvdiff("compare", ref, out)
        self.assertEqual(rc, 0, text)
        self.assertIn("identical", text)

    def cfg_llama(self):
        return model_config_from_hf(self.path("tiny-llama"))

    def test_config_qwen3_head_dim_default(self):
        # Qwen3Config: head_dim 128 when absent, not hidden / heads (16 here).
        with open(self.path("tiny-qwen3/config.json")) as f:
            text = json.load(f)
        del text["head_dim"]
        cfg = model_config_from_hf(text)
        self.assertEqual(cfg["head_dim"], 128)
        self.assertAlmostEqual(cfg["attn_scale"], 128 ** -0.5)

    def test_config_gemma3_nested_and_pattern(self):
        with open(self.path("tiny-gemma3/config.json")) as f:
            text = json.load(f)
        flat = model_config_from_hf(text)
        del text["layer_types"]
        text["sliding_window_pattern"] = 3
        nested = model_config_from_hf({"model_type": "gemma3", "text_config": text})
        self.assertEqual(nested["model_type"], "gemma3_text")
        self.assertEqual(nested["layer_types"], ["sliding_attention", "sliding_attention",
                                                 "full_attention"] * 2)
        self.assertEqual({k: v for k, v in nested.items() if k != "layer_types"},
                         {k: v for k, v in flat.items() if k != "layer_types"})

    def test_rows_any_order_identical_to_kvdiff(self):
        """Rows given out of order (later positions first) make the very
        dump kvdiff wrote: same rows, hashes, statistics and hash index."""
        out = self.path("copy.h5")
        with h5py.File(self.ref, "r") as ref:
            cfg = json.loads(ref.attrs["model_config"])
            with Recorder(out, cfg, engine="pytorch",
                          settings={"chunk": 12, "cache": "dense"}) as rec:
                self.copy_header(rec, ref)
                for layer in reversed(range(4)):
                    for st in PLAIN_STAGES:
                        rows = ref[f"layers/{layer}/{st}"][:]
                        rec.rows(layer, st, 12, rows[12:])
                        rec.rows(layer, st, 5, rows[5:12].astype(np.float64))
                        rec.rows(layer, st, 0, rows[:5])
                rec.model_rows("embed", 0, ref["model/embed"][:])
            with h5py.File(out, "r") as got:
                self.assertEqual(got.attrs["status"], "complete")
                for layer in range(4):
                    for st in PLAIN_STAGES:
                        for suffix in ("", ".hash", ".stats"):
                            name = f"layers/{layer}/{st}{suffix}"
                            np.testing.assert_array_equal(got[name][:], ref[name][:], name)
                np.testing.assert_array_equal(got["row_hash_index"][:],
                                              ref["row_hash_index"][:])
        self.assert_valid(out)
        rc, text = kvdiff("compare", self.ref, out)
        self.assertEqual(rc, 0, text)
        self.assertIn("identical", text)

    def test_dtypes(self):
        """float16, bfloat16 (torch), float64 and integers become float32 rows."""
        import torch
        cfg = model_config_from_hf(self.path("tiny-llama"))
        out = self.path("dtypes.h5")
        x = np.linspace(-2, 2, 64, dtype=np.float32).reshape(1, 64)
        with Recorder(out, cfg) as rec:
            rec.tokens([1, 2, 3, 4], 4)
            rec.rows(0, "x_in", 0, x.astype(np.float16))
            rec.rows(0, "x_in", 1, torch.from_numpy(x).to(torch.bfloat16))
            rec.rows(0, "x_in", 2, x.astype(np.float64))
            rec.rows(0, "x_in", 3, np.arange(64).reshape(1, 64))
        with h5py.File(out, "r") as f:
            got = f["layers/0/x_in"][:]
        self.assertEqual(got.dtype, np.float32)
        np.testing.assert_array_equal(got[0], x[0].astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(got[1], torch.from_numpy(x).to(torch.bfloat16).float()
                                      .numpy()[0])
        np.testing.assert_array_equal(got[2], x[0])
        np.testing.assert_array_equal(got[3], np.arange(64, dtype=np.float32))
        self.assert_valid(out)
        with self.assertRaisesRegex(RecorderError, "dtype complex"):
            with Recorder(self.path("complex.h5"), cfg) as rec:
                rec.rows(0, "x_in", 0, x.astype(np.complex64))

    def test_partial_on_exception(self):
        """An exception mid-way leaves a readable dump, status
        "partial: <exception>", that validate accepts and compare compares."""
        out = self.path("partial.h5")
        with h5py.File(self.ref, "r") as ref:
            cfg = json.loads(ref.attrs["model_config"])
            with self.assertRaisesRegex(RuntimeError, "device lost"):
                with Recorder(out, cfg, engine="pytorch",
                              settings={"chunk": 12, "cache": "dense"}) as rec:
                    self.copy_header(rec, ref)
                    with h5py.File(out, "r") as during:
                        self.assertEqual(during.attrs["status"], "partial: running")
                    for layer in range(4):
                        for st in PLAIN_STAGES:
                            rec.rows(layer, st, 0, ref[f"layers/{layer}/{st}"][:8])
                    raise RuntimeError("device lost")
        with h5py.File(out, "r") as f:
            self.assertEqual(f.attrs["status"], "partial: RuntimeError: device lost")
            self.assertEqual(f["layers/3/x_out"].shape, (8, 64))
        self.assert_valid(out)
        rc, text = kvdiff("compare", self.ref, out)
        self.assertEqual(rc, 2, text)   # kvdiff: no verdict on a partial run
        self.assertIn("INCOMPLETE: no divergence over what both hold", text)
        self.assertIn("is partial: RuntimeError: device lost", text)

    def test_gap_is_partial_and_raises(self):
        cfg = model_config_from_hf(self.path("tiny-llama"))
        out = self.path("gap.h5")
        with self.assertRaisesRegex(RecorderError, r"layer 1 k: positions 0\.\.2 never given"):
            with Recorder(out, cfg) as rec:
                rec.tokens(list(range(6)), 6)
                rec.rows(1, "k", 3, np.zeros((3, 32)))
        with h5py.File(out, "r") as f:
            self.assertTrue(f.attrs["status"].startswith("partial: layer 1 k"))
        self.assert_valid(out)


class TestBadInput(Base):
    def setUp(self):
        self.cfg = model_config_from_hf(self.path("tiny-llama"))

    def test_wrong_width(self):
        with Recorder(self.path("width.h5"), self.cfg) as rec:
            rec.tokens([1, 2], 2)
            with self.assertRaisesRegex(RecorderError, r"layer 2 k: rows of shape \(2, 48\); "
                                        r"expected \[positions, 32\] \(k is 2 KV heads x 16"):
                rec.rows(2, "k", 0, np.zeros((2, 48)))
            with self.assertRaisesRegex(RecorderError, "needs heads_first"):
                rec.rows(2, "k", 0, np.zeros((2, 2, 16)))
            with self.assertRaisesRegex(RecorderError, "the model has layers 0..3"):
                rec.rows(4, "x_in", 0, np.zeros((1, 64)))
            with self.assertRaisesRegex(RecorderError, "'kq' is not a layer stage"):
                rec.rows(0, "kq", 0, np.zeros((1, 64)))
            rec.rows(2, "k", 0, np.zeros((2, 32)))
        self.assert_valid(self.path("width.h5"))

    def test_overlapping_positions(self):
        with Recorder(self.path("overlap.h5"), self.cfg) as rec:
            rec.tokens(list(range(10)), 10)
            rec.rows(0, "v", 0, np.ones((4, 32)))
            rec.rows(0, "v", 6, np.ones((2, 32)))
            with self.assertRaisesRegex(RecorderError, r"layer 0 v: positions 2\.\.3 were "
                                        r"already given \(rows 2\.\.4 overlap them\)"):
                rec.rows(0, "v", 2, np.ones((3, 32)))
            with self.assertRaisesRegex(RecorderError, r"positions 6\.\.6 were already given"):
                rec.rows(0, "v", 5, np.ones((2, 32)))
            rec.rows(0, "v", 4, np.ones((2, 32)))
        with h5py.File(self.path("overlap.h5"), "r") as f:
            self.assertEqual(f["layers/0/v"].shape, (8, 32))
            self.assertEqual(f.attrs["status"], "complete")

    def test_nan_recorded_as_is(self):
        out = self.path("nan.h5")
        row = np.ones((1, 64), np.float32)
        row[0, 5], row[0, 9] = np.nan, np.inf
        with Recorder(out, self.cfg) as rec:
            rec.tokens([1], 1)
            rec.rows(0, "x_out", 0, row)
        with h5py.File(out, "r") as f:
            got = f["layers/0/x_out"][0]
            self.assertTrue(np.isnan(got[5]) and np.isinf(got[9]))
            self.assertTrue(np.isnan(f["layers/0/x_out.stats"][0, 0]))
            self.assertNotIn("row_hash_index", f)   # optional; a NaN sum is refused
        text = self.assert_valid(out)
        self.assertIn("NaN", text)

    def test_unwritable_path(self):
        bad = os.path.join(self.dir, "no-such-dir", "x.h5")
        with self.assertRaisesRegex(RecorderError, "no-such-dir/x.h5: cannot create the dump"):
            Recorder(bad, self.cfg)

    def test_lock_shared_with_kvdiff(self):
        """The Recorder takes kvdiff's write lock: while it writes, kvdiff
        (and a second Recorder) refuse the path instead of truncating a
        dump being written; once it is closed, the path is free."""
        path = self.path("locked.h5")
        rec = Recorder(path, self.cfg)
        try:
            with self.assertRaisesRegex(RecorderError, "another kvdiff is writing this file"):
                Recorder(path, self.cfg)
            rc, out = kvdiff("run", "--model", self.path("tiny-llama"), "--prompt-random", "4",
                             "--max-new", "1", "--dump", path)
            self.assertEqual(rc, 2, out)
            self.assertIn("another kvdiff is writing this file", out)
        finally:
            rec.close(status="test")
        rc, out = kvdiff("run", "--model", self.path("tiny-llama"), "--prompt-random", "4",
                         "--max-new", "1", "--dump", path)
        self.assertEqual(rc, 0, out)

    def test_file_size_limit(self):
        """Rows past the file-size limit (ulimit -f): one RecorderError,
        no dump left, a clean exit. libhdf5 whose write failed could not
        close the file and crashed at exit (SIGSEGV), the error unsaid."""
        path = self.path("limited.h5")
        script = (
            "import resource, sys, numpy as np\n"
            "from kvdiff_record import Recorder, RecorderError\n"
            f"cfg = {self.cfg!r}\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))\n"
            "try:\n"
            f"    with Recorder({path!r}, cfg) as rec:\n"
            "        rows = np.ones((64, cfg['vocab_size']), np.float32)\n"
            "        for p in range(0, 64 * 200, 64):\n"
            "            rec.model_rows('logits', p, rows)\n"
            "except RecorderError as e:\n"
            "    print(e)\n"
            "    sys.exit(3)\n")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120, env=env)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertEqual(p.stdout.strip(), f"{path}: file size limit reached (ulimit -f): no "
                                           f"dump written")
        self.assertEqual(p.stderr, "")
        self.assertFalse(os.path.exists(path))

    def test_not_a_regular_file(self):
        fifo, link = self.path("fifo.h5"), self.path("null.h5")
        os.mkfifo(fifo)
        os.symlink("/dev/null", link)
        for path, kind in ((fifo, "is a FIFO, not a regular file"),
                           (link, "is a symbolic link; kvdiff never writes through one"),
                           (self.dir, "is a directory, not a regular file")):
            with self.assertRaisesRegex(RecorderError, kind):
                Recorder(path, self.cfg)
        self.assertTrue(os.path.islink(link) and os.path.exists("/dev/null"))

    def test_bad_config(self):
        with self.assertRaisesRegex(RecorderError, "model_config: missing kv_owner"):
            Recorder(self.path("c.h5"), {k: v for k, v in self.cfg.items() if k != "kv_owner"})
        # any architecture's config is read; a field kvdiff needs is named
        with self.assertRaisesRegex(RecorderError, "config: hidden_size is missing or not a "
                                                   "positive integer \\(model_type 'gpt2'"):
            model_config_from_hf({"model_type": "gpt2", "n_embd": 64})

    def test_kv_shared_layer_has_no_kv(self):
        cfg = model_config_from_hf(self.path("tiny-gemma3-kvshared"))
        shared = next(i for i, o in enumerate(cfg["kv_owner"]) if o != i)
        with Recorder(self.path("shared.h5"), cfg) as rec:
            rec.tokens([1], 1)
            with self.assertRaisesRegex(RecorderError, f"layer {shared} k: layer {shared} reads"):
                rec.rows(shared, "k", 0, np.zeros((1, cfg["num_key_value_heads"] *
                                                   cfg["head_dim"])))


class TestLayouts(Base):
    """Each helper undoes its layout: the reference's k rows put into it,
    taken out by the helper, recorded, compare bit-identical."""

    def record_k(self, name, transform):
        out = self.path(name)
        with h5py.File(self.ref, "r") as ref:
            cfg = json.loads(ref.attrs["model_config"])
            with Recorder(out, cfg, engine="jax", settings={"chunk": 12, "cache": "dense"}) as rec:
                self.copy_header(rec, ref)
                for layer in range(4):
                    transform(rec, layer, ref[f"layers/{layer}/k"][:])
        self.assert_valid(out)
        rc, text = kvdiff("compare", self.ref, out)
        self.assertEqual(rc, 0, text)
        self.assertIn("identical", text)

    def test_heads_first(self):
        def t(rec, layer, k):       # [T, KV*D] -> [1, KV, T, D]
            rec.rows(layer, "k", 0, heads_first(k.reshape(-1, 2, 16).transpose(1, 0, 2)[None]))
        self.record_k("heads_first.h5", t)

    def test_interleaved_rope(self):
        def t(rec, layer, k):       # rotate-half -> interleaved pairs
            inter = k.reshape(-1, 2, 2, 8).transpose(0, 1, 3, 2).reshape(-1, 32)
            self.assertFalse(np.array_equal(inter, k))
            rec.rows(layer, "k", 0, from_interleaved_rope(inter, 16))
        self.record_k("interleaved.h5", t)

    def test_padded_head_dim(self):
        def t(rec, layer, k):       # heads padded 16 -> 24 with garbage
            padded = np.concatenate([k.reshape(-1, 2, 16), np.full((k.shape[0], 2, 8), 7.0)], 2)
            rec.rows(layer, "k", 0, unpad_head_dim(padded.reshape(-1, 48), 2, 16))
        self.record_k("padded.h5", t)

    def test_ring(self):
        """A ring of 8 slots read back after the prefill (positions 4..11 of
        12) and after each decode step: slot = position % 8, -1 empty."""
        def t(rec, layer, k):
            rec.rows(layer, "k", 0, k[:4])   # what the ring overwrote, recorded before
            recorded = 4
            for upto in range(12, k.shape[0] + 1):
                slots, where = np.zeros((8, 32)), np.full(8, -1)
                for p in range(max(0, upto - 8), upto):
                    slots[p % 8], where[p % 8] = k[p], p
                for first, rows in ring_rows(slots, where, since=recorded):
                    rec.rows(layer, "k", first, rows)
                    recorded = first + len(rows)
        self.record_k("ring.h5", t)
        with self.assertRaisesRegex(RecorderError, "two slots hold position 3"):
            ring_rows(np.zeros((2, 4)), [3, 3])


class TestTorch(Base):
    """The recorder's PyTorch hooks on a small torch model that loads a
    kvdiff-generated folder: identical within drift to kvdiff's reference."""

    def check_model(self, preset):
        from tiny_torch import generate_and_record
        ref = self.path(f"ref-{preset}.h5")
        rc, out = kvdiff("run", "--model", self.path(preset), "--prompt-random", "14",
                         "--max-new", "5", "--dump", ref)
        self.assertEqual(rc, 0, out)
        with h5py.File(ref, "r") as f:
            prompt = [int(t) for t in f["tokens"][:f["tokens"].attrs["prompt_length"]]]
            want = [int(t) for t in f["tokens"][len(prompt):]]
        dump = self.path(f"torch-{preset}.h5")
        self.assertEqual(generate_and_record(self.path(preset), prompt, 5, dump), want)
        self.assert_valid(dump)
        rc, text = kvdiff("compare", ref, dump)
        self.assertEqual(rc, 0, text)
        self.assertIn("no bug: drift (cross-runtime", text)
        with h5py.File(dump, "r") as f:
            self.assertEqual(f.attrs["status"], "complete")
            self.assertIn("k", f["layers/0"])
            self.assertIn("attn_norm_stats", f["layers/0"])

    def test_torch_llama(self):
        self.check_model("tiny-llama")

    def test_torch_gemma3(self):
        self.check_model("tiny-gemma3")

    def test_torch_gpt_oss(self):
        self.check_model("tiny-gpt-oss")

    def test_torch_gpt_oss_bf16_routing_flip_and_sinks(self):
        """gpt-oss in bf16: on this prompt the test's router takes another
        expert at a near tie at position 19 (its logits within the pair's
        error there): no bug, the positions from it on not compared; the
        reference run following the test's routing compares them all. A
        port that drops the sinks is named from attn_out alone."""
        from tiny_torch import generate_and_record
        ref = self.path("ref-oss-40.h5")
        rc, out = kvdiff("run", "--model", self.path("tiny-gpt-oss"), "--prompt-random", "40",
                         "--seed", "3", "--max-new", "8", "--dump", ref)
        self.assertEqual(rc, 0, out)
        with h5py.File(ref, "r") as f:
            prompt = [int(t) for t in f["tokens"][:f["tokens"].attrs["prompt_length"]]]
        dump = self.path("torch-oss-bf16.h5")
        generate_and_record(self.path("tiny-gpt-oss"), prompt, 8, dump, dtype="bf16")
        rc, text = kvdiff("compare", ref, dump)
        self.assertEqual(rc, 0, text)
        self.assertIn("no bug: drift (cross-runtime", text)
        self.assertRegex(text, r"positions 19\.\. not compared: at position 19, layer 3 the "
                               r"test routed to expert \d+ where the reference chose expert \d+")
        self.assertIn("a rounding flip at a near tie", text)
        # the reference following the test's tokens and routing: every
        # position compared, no flip left
        fol = self.path("ref-oss-followed.h5")
        rc, out = kvdiff("run", "--model", self.path("tiny-gpt-oss"), "--follow", dump,
                         "--dump", fol)
        self.assertEqual(rc, 0, out)
        rc, text = kvdiff("compare", fol, dump)
        self.assertEqual(rc, 0, text)
        self.assertIn("no bug: drift (cross-runtime", text)
        self.assertIn("x 47 positions x", text)
        self.assertNotIn("not compared", text)
        dump = self.path("torch-oss-nosink.h5")
        generate_and_record(self.path("tiny-gpt-oss"), prompt, 8, dump,
                            faults=["sinks-dropped"])
        rc, text = kvdiff("compare", ref, dump)
        self.assertEqual(rc, 1, text)
        self.assertIn("FIRST STEP ABOVE DRIFT  position 0, layer 0", text)
        self.assertIn("the attention sinks are left out of the softmax: every attention reads "
                      "its keys alone", text)

    def test_torch_deepseek_v2(self):
        self.check_model("tiny-deepseek-v2")

    def test_torch_deepseek_v3(self):
        self.check_model("tiny-deepseek-v3")

    def test_torch_deepseek_bf16_routing_followed(self):
        """DeepSeek-V2 in bf16 on this prompt: the test's router takes
        another expert at a near tie at position 8, and a token flips at 15,
        past it. Compared as run, the pair cannot decide (nothing from the
        flip on is compared); the reference re-run on the test's tokens and
        routing is compared at every position: no bug."""
        from tiny_torch import generate_and_record
        prompt = list(range(1, 48, 4))
        model = self.path("tiny-deepseek-v2")
        ref = self.path("ref-ds2-route.h5")
        rc, out = kvdiff("run", "--model", model, "--prompt-tokens",
                         ",".join(map(str, prompt)), "--max-new", "6", "--dump", ref)
        self.assertEqual(rc, 0, out)
        dump = self.path("torch-ds2-bf16.h5")
        generate_and_record(model, prompt, 6, dump, dtype="bf16")
        rc, text = kvdiff("compare", ref, dump)
        self.assertEqual(rc, 1, text)
        self.assertIn("not decided: the comparison stops at a routing flip before the tokens "
                      "differ", text)
        self.assertIn("kvdiff run --model MODEL --follow TEST.h5", text)
        fol = self.path("ref-ds2-followed.h5")
        rc, out = kvdiff("run", "--model", model, "--follow", dump, "--dump", fol)
        self.assertEqual(rc, 0, out)
        rc, text = kvdiff("compare", fol, dump)
        self.assertEqual(rc, 0, text)
        self.assertIn("no bug: drift (cross-runtime", text)
        self.assertNotIn("not compared", text)

    def test_torch_deepseek_latent_faults(self):
        """A port's latent-cache bugs in the torch DeepSeek, each found
        where it is born and named: the key tail rotated twice (the cache
        row itself, position 1), not cached (the second chunk's first
        query), decode without YaRN's mscale (the first decode step)."""
        from tiny_torch import generate_and_record
        for preset in ("tiny-deepseek-v2", "tiny-deepseek-v3"):
            ref = self.path(f"ref-faults-{preset}.h5")
            rc, out = kvdiff("run", "--model", self.path(preset), "--prompt-random", "12",
                             "--max-new", "4", "--dump", ref)
            self.assertEqual(rc, 0, out)
            with h5py.File(ref, "r") as f:
                prompt = [int(t) for t in f["tokens"][:f["tokens"].attrs["prompt_length"]]]
            for fault, chunk, where, name in (
                    ("mla-rope-twice", None, "position 1, layer 0 (global), stage kv_latent",
                     "the latent cache's RoPE key tail is rotated twice"),
                    ("mla-rope-uncached", 5, "position 5, layer 0 (global), stage attn_out",
                     "the latent cache holds no RoPE key tail: keys before position 5"),
                    ("mla-no-mscale", None, "position 12, layer 0 (global), stage attn_out",
                     "the softmax scale lacks YaRN's mscale_all_dim correction in decode")):
                dump = self.path(f"torch-{preset}-{fault}.h5")
                generate_and_record(self.path(preset), prompt, 4, dump, chunk=chunk,
                                    faults=[fault])
                rc, text = kvdiff("compare", ref, dump)
                self.assertEqual(rc, 1, f"{preset} {fault}: {text}")
                self.assertIn(f"FIRST STEP ABOVE DRIFT  {where}", text, f"{preset} {fault}")
                self.assertIn(name, text, f"{preset} {fault}")

    def test_torch_hooks_bad_name(self):
        from tiny_torch import TinyCausalLM
        from kvdiff_record.torch_hooks import TorchHooks
        model = TinyCausalLM(self.path("tiny-llama"))
        with Recorder(self.path("hooks.h5"), model.config) as rec:
            rec.tokens([1], 1)
            with self.assertRaisesRegex(RecorderError, "no module 'model.layers.0.attn'"):
                TorchHooks(rec, model, {"x_in": ("model.layers.{i}.attn", "in")})


class _NoRotaryAttention:
    """Stands for an architecture whose modeling module has no module-level
    rotary function (this test module has none)."""


class TestTransformers(Base):
    """kvdiff_record.transformers.record on tiny_torch, which is built as
    transformers models are (a module-level rotary function in either form,
    attention modules run per layer, a DynamicCache whose sliding layers
    keep their last window - 1 positions, KV-shared layers): a correct run
    recorded in one call is "no bug" against kvdiff's reference."""

    def reference(self, preset, n=30, max_new=5, seed=5):
        ref = self.path(f"hfref-{preset}-{n}-{seed}.h5")
        if not os.path.exists(ref):
            rc, out = kvdiff("run", "--model", self.path(preset), "--prompt-random", str(n),
                             "--seed", str(seed), "--max-new", str(max_new), "--ignore-eos",
                             "--dump", ref)
            self.assertEqual(rc, 0, out)
        with h5py.File(ref, "r") as f:
            prompt = [int(t) for t in f["tokens"][:f["tokens"].attrs["prompt_length"]]]
            want = [int(t) for t in f["tokens"][len(prompt):]]
        return ref, prompt, want

    def test_correct_runs_are_no_bug(self):
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        # tiny-gemma3-h288 with prompt seed 3: tokens bf16 rounding does not
        # flip (TestPrecision)
        cases = [("tiny-llama", "pair", None, "f32"), ("tiny-llama", "pair", 7, "f32"),
                 ("tiny-qwen2", "pair", None, "f32"), ("tiny-qwen2", "pair", 6, "f32"),
                 ("tiny-qwen3", "pair", None, "f32"), ("tiny-qwen3", "pair", 4, "f32"),
                 ("tiny-llama3", "pair", None, "f32"), ("tiny-llama3", "pair", 9, "f32"),
                 ("tiny-gemma3", "pair", None, "f32"), ("tiny-gemma3", "pair", 5, "f32"),
                 ("tiny-gemma3", "single", 7, "f32"),
                 ("tiny-gemma3-h288", "pair", None, "bf16"),
                 ("tiny-gemma3-h288", "single", 16, "bf16"),
                 ("tiny-gemma3-kvshared", "pair", 7, "f32"),
                 ("tiny-gemma3-kvshared", "single", None, "f32"),
                 ("tiny-gemma4", "pair", None, "f32"), ("tiny-gemma4", "single", 7, "f32"),
                 ("tiny-gemma4", "pair", 16, "bf16")]
        for preset, rotary, chunk, dtype in cases:
            with self.subTest(preset=preset, rotary=rotary, chunk=chunk, dtype=dtype):
                bf16 = dtype == "bf16"
                ref, prompt, want = self.reference(preset, 40 if bf16 else 30, 4 if bf16 else 5,
                                                   3 if bf16 else 5)
                dump = self.path(f"hf-{preset}-{rotary}-{chunk}-{dtype}.h5")
                model = TinyCausalLM(self.path(preset), dtype=dtype, rotary=rotary)
                # tiny_torch carries bf16 values in float32 tensors: record()
                # finds the dtype from the values (TestComputeDtype)
                got = record(model, prompt, dump, max_new=len(want), chunk=chunk,
                             ignore_eos=True)
                self.assertEqual(got, want)
                self.assert_valid(dump)
                rc, text = kvdiff("compare", ref, dump)
                self.assertEqual(rc, 0, text)
                self.assertIn("no bug: drift (cross-runtime", text)
                with h5py.File(dump, "r") as f:
                    self.assertEqual(f.attrs["engine"], "transformers")
                    st = json.loads(f.attrs["engine_settings"])
                    for key in ("compute_dtype", "cache_type", "attn_implementation", "device",
                                "chunk", "cache", "runtime"):
                        self.assertIn(key, st)
                    self.assertEqual(st["chunk"], chunk or len(prompt))
                    self.assertEqual((st["compute_dtype"], st["cache_type"]), (dtype, dtype))
                    cfg = json.loads(f.attrs["model_config"])
                    for layer, owner in enumerate(cfg["kv_owner"]):
                        held = set(f[f"layers/{layer}"])
                        self.assertIn("q", held)
                        self.assertEqual("k" in held and "v" in held, owner == layer, layer)

    def test_cache_is_a_documented_value(self):
        """engine_settings.cache is one of the values docs/dump-format.md
        lists (the diagnosis reads it): "dense", what transformers' dynamic
        cache is (positions appended in order, no ring), not "dynamic"."""
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        with open(os.path.join(ROOT, "docs", "dump-format.md")) as f:
            row = next(line for line in f if line.startswith("| `cache` ("))
        documented = re.findall(r"`(\w+)`", row.split(")")[0])[1:]
        self.assertIn("dense", documented)
        for preset in ("tiny-llama", "tiny-gemma3"):
            with self.subTest(preset=preset):
                dump = self.path(f"hf-cache-{preset}.h5")
                record(TinyCausalLM(self.path(preset)), list(range(3, 23)), dump, max_new=2,
                       ignore_eos=True)
                with h5py.File(dump, "r") as f:
                    cache = json.loads(f.attrs["engine_settings"])["cache"]
                self.assertIn(cache, documented)
                self.assertEqual(cache, "dense")
                self.assertNotIn("warning", self.assert_valid(dump))

    def test_sliding_cache_refused_by_record_cache(self):
        """The recipe of hooks and record_cache on a cache whose sliding
        layers keep the last window - 1 positions wrote positions 89..99 as
        0..10, a false alarm; it is refused, naming what to use."""
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.torch_hooks import TorchHooks
        model = TinyCausalLM(self.path("tiny-gemma3"))   # a DynamicCache, as transformers
        with Recorder(self.path("sliding.h5"), model.config) as rec:
            hooks = TorchHooks(rec, model, output_from=None)
            with hooks.step(0):
                out = model(torch.tensor([list(range(20))]), logits_to_keep=1)
            with self.assertRaisesRegex(RecorderError, "layer 0's cache holds 11 positions, but "
                                        "the model has run 20: a sliding-window or quantized "
                                        "cache .* kvdiff_record.transformers.record"):
                hooks.record_cache(out.past_key_values)
            hooks.remove()
            rec.close(status="test")

    def test_two_outside_dumps(self):
        """transformers as the reference, a port as the test, neither
        kvdiff's, on an architecture kvdiff does not run (Mistral: every
        layer slides): a correct port is no bug, a window hard-coded to 4
        is found at its place and named from the reference's own rows."""
        from tiny_torch import TinyCausalLM, generate_and_record
        from kvdiff_record.transformers import record
        folder = self.path("tiny-mistral")
        if not os.path.exists(folder):
            shutil.copytree(self.path("tiny-llama"), folder)
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                c = json.load(f)
            c.update(model_type="mistral", sliding_window=8)
            with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
                json.dump(c, f)
        prompt = [int(x) for x in np.random.RandomState(3).randint(0, 256, 30)]
        ref = self.path("mistral-hf.h5")
        record(TinyCausalLM(folder), prompt, ref, max_new=4, chunk=7, ignore_eos=True)
        for name, faults, rc_want, says in (
                ("ok", None, 0, "no bug: drift (cross-runtime, engines differ: transformers vs "
                                "pytorch)"),
                ("bug", ["window=4"], 1, "window in test appears to be 4, config says 8")):
            test = self.path(f"mistral-{name}.h5")
            generate_and_record(folder, prompt, 4, test, faults=faults)
            rc, text = kvdiff("compare", ref, test)
            self.assertEqual(rc, rc_want, text)
            self.assertIn(says, text)
            if rc_want:
                self.assertIn("FIRST STEP ABOVE DRIFT  position 4, layer 0 (sliding, window 8)",
                              text)

    def test_bad_input(self):
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        model = TinyCausalLM(self.path("tiny-llama"))
        with self.assertRaisesRegex(RecorderError, "prompt_ids: a batch of 2; record one "
                                                   "sequence"):
            record(model, torch.zeros((2, 5), dtype=torch.long), self.path("b.h5"))
        meta = TinyCausalLM(self.path("tiny-llama")).to("meta")
        with self.assertRaisesRegex(RecorderError, "is on the meta device"):
            record(meta, [1, 2, 3], self.path("m.h5"))
        # the attention's module has no apply_rotary_pos_emb(): nothing to wrap
        model.model.layers[0].self_attn.__class__ = type(
            "Attention", (type(model.model.layers[0].self_attn),),
            {"__module__": _NoRotaryAttention.__module__})
        for layer in model.model.layers[1:]:
            layer.self_attn.__class__ = model.model.layers[0].self_attn.__class__
        with self.assertRaisesRegex(RecorderError, "has no apply_rotary_pos_emb\\(\\): q and k "
                                                   "after RoPE cannot be taken"):
            record(model, [1, 2, 3], self.path("r.h5"))
        for p in ("b.h5", "m.h5", "r.h5"):
            self.assertFalse(os.path.exists(self.path(p)), p)


def _scale_stack(config, dtype):
    """A model of config's layers, each x * weight (elementwise: CPU torch
    runs it in bf16 and f16, where it has no f16 matmul), with parameters
    in dtype; its modules are "layers.<i>"."""
    import torch

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, config["hidden_size"]))

        def forward(self, x):
            return x * self.weight

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Scale() for _ in range(config["num_hidden_layers"]))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack().to(dtype)


class TestComputeDtype(Base):
    """engine_settings.compute_dtype is what the forwards computed in
    (kvdiff_record.torch_hooks.ComputeEvidence), not the parameters' dtype
    alone: float32 weights under autocast, or rounding every result to
    bf16, compute in bf16, and a compare told "f32" cries wolf
    (TestPrecision.test_autocast_stated_bf16). Where the run cannot tell,
    compute_dtype is left out and one line on stderr says why."""

    PROMPT = list(range(3, 23))

    def settings(self, dump):
        with h5py.File(dump, "r") as f:
            self.assertEqual(f.attrs["status"], "complete")
            return json.loads(f.attrs["engine_settings"])

    def run_record(self, name, model, autocast=False, **kw):
        """record() of model on a 20-token prompt, under a cpu bf16
        autocast or none: (engine_settings, what went to stderr)."""
        import torch
        from kvdiff_record.transformers import record
        dump = self.path(name + ".h5")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            record(model, self.PROMPT, dump, max_new=3, ignore_eos=True, **kw)
        return self.settings(dump), err.getvalue()

    def run_hooks(self, name, forwards, settings=None):
        """TorchHooks on tiny_torch's tiny-llama (float32), made outside any
        autocast; forwards: (token ids, autocast dtype or None), run one
        after another as prefill and decode steps. (engine_settings, what
        went to stderr)."""
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.torch_hooks import TorchHooks
        model = TinyCausalLM(self.path("tiny-llama"))
        dump = self.path(name + ".h5")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with Recorder(dump, model.config, settings=settings) as rec:
                hooks = TorchHooks(rec, model, output_from=None)
                pos, past, ids = 0, None, []
                for feed, dtype in forwards:
                    with hooks.step(pos), torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                                         enabled=dtype is not None):
                        past = model(torch.tensor([feed]), past_key_values=past,
                                     logits_to_keep=1).past_key_values
                    pos, ids = pos + len(feed), ids + feed
                hooks.remove()
                rec.tokens(ids, len(ids))
        return self.settings(dump), err.getvalue()

    def test_autocast(self):
        """(a) float32 parameters under torch.autocast("cpu", bf16): bf16,
        and transformers' KV cache with it; autocast is read inside the
        forward, not when the hooks are made."""
        import torch
        from tiny_torch import TinyCausalLM
        st, err = self.run_record("cd-autocast", TinyCausalLM(self.path("tiny-llama")),
                                  autocast=True)
        self.assertEqual((st["compute_dtype"], st["cache_type"]), ("bf16", "bf16"))
        self.assertEqual(err, "")
        st, err = self.run_hooks("cd-autocast-hooks", [(self.PROMPT, torch.bfloat16),
                                                        ([7], torch.bfloat16)])
        self.assertEqual(st["compute_dtype"], "bf16")
        self.assertEqual(err, "")

    def test_coarse_values_held_in_float32(self):
        """(b) float32 parameters whose forward rounds every result to bf16
        (or f16) and keeps it in float32, as GPU kernels hand back and
        tiny_torch --dtype computes: the recorded values are all exact in
        that type."""
        import torch
        from tiny_torch import TinyCausalLM
        for dtype in ("bf16", "f16"):
            with self.subTest(dtype=dtype):
                model = TinyCausalLM(self.path("tiny-gemma3"), dtype=dtype)
                self.assertEqual({p.dtype for p in model.parameters()}, {torch.float32})
                st, err = self.run_record(f"cd-held-{dtype}", model)
                self.assertEqual((st["compute_dtype"], st["cache_type"]), (dtype, dtype))
                self.assertEqual(err, "")

    def test_plain_f32(self):
        """(c) float32 throughout is "f32", and stays so for a bf16
        checkpoint run in float32, whose embedding rows are exactly bf16
        (they are the checkpoint's storage, not arithmetic)."""
        import torch
        from tiny_torch import TinyCausalLM
        model = TinyCausalLM(self.path("tiny-gemma3"))
        st, err = self.run_record("cd-f32", model)
        self.assertEqual((st["compute_dtype"], st["cache_type"]), ("f32", "f32"))
        self.assertEqual(err, "")
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        st, err = self.run_record("cd-f32-bf16-weights", model)
        self.assertEqual(st["compute_dtype"], "f32")
        self.assertEqual(err, "")

    def test_coarse_parameters(self):
        """(d) parameters (and so activations) in bf16 or f16."""
        import torch
        from kvdiff_record.torch_hooks import TorchHooks
        cfg = model_config_from_hf(self.path("tiny-llama"))
        names = {"x_in": ("layers.{i}", "in"), "x_out": ("layers.{i}", "out")}
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
            with self.subTest(dtype=name):
                model = _scale_stack(cfg, dtype)
                dump = self.path(f"cd-params-{name}.h5")
                with Recorder(dump, cfg) as rec:
                    hooks = TorchHooks(rec, model, names, output_from=None)
                    with hooks.step(0):
                        model(torch.randn(1, 5, cfg["hidden_size"]).to(dtype))
                    rec.tokens([1] * 5, 5)
                self.assertEqual(self.settings(dump)["compute_dtype"], name)

    def test_stated_wins(self):
        """(e) the caller's compute_dtype wins, silently, where the run
        shows another type or cannot tell; transformers' cache_type
        follows the type stated."""
        import torch
        from tiny_torch import TinyCausalLM
        st, err = self.run_record("cd-stated", TinyCausalLM(self.path("tiny-llama"), dtype="f16"),
                                  settings={"compute_dtype": "bf16"})
        self.assertEqual((st["compute_dtype"], st["cache_type"]), ("bf16", "bf16"))
        self.assertEqual(err, "")
        st, err = self.run_hooks("cd-stated-hooks", [(self.PROMPT, torch.bfloat16), ([7], None)],
                                 settings={"compute_dtype": "f32"})
        self.assertEqual(st["compute_dtype"], "f32")
        self.assertEqual(err, "")

    def test_cannot_tell(self):
        """(f) a prefill under autocast and a decode step without it, or no
        forward at all: no compute_dtype (kvdiff assumes bf16 and says so),
        and one line on stderr saying why."""
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.torch_hooks import TorchHooks
        st, err = self.run_hooks("cd-changed", [(self.PROMPT, torch.bfloat16), ([7], None)])
        self.assertNotIn("compute_dtype", st)
        self.assertEqual(err.count("\n"), 1, err)
        self.assertIn("kvdiff_record: " + self.path("cd-changed.h5") + ": compute_dtype not "
                      "stated: autocast state changed during the run (cpu: bf16, off)", err)
        dump = self.path("cd-nothing.h5")
        model = TinyCausalLM(self.path("tiny-llama"))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with Recorder(dump, model.config) as rec:
                TorchHooks(rec, model).remove()
                rec.tokens([1], 1)
        self.assertNotIn("compute_dtype", self.settings(dump))
        self.assertEqual(err.getvalue().count("\n"), 1, err.getvalue())
        self.assertIn("compute_dtype not stated: no activations were recorded", err.getvalue())

    def test_stated_alone_gives_cache_type(self):
        """A compute_dtype stated alone, in any spelling kvdiff reads
        (docs/dump-format.md), gives record() the cache_type transformers'
        cache holds, by the name docs/dump-format.md gives cache_type (not
        "bfloat16"; tf32 is float32 tensors), and kvdiff's drift model
        reads it; a stated cache_type wins; a type no cache holds states
        none (kvdiff assumes bf16 and says the KV cache is unknown)."""
        from tiny_torch import TinyCausalLM
        cases = [("bf16", "bf16"), ("bfloat16", "bf16"), ("f16", "f16"), ("float16", "f16"),
                 ("f32", "f32"), ("float32", "f32"), ("tf32", "f32")]
        for stated, cache in cases:
            with self.subTest(compute_dtype=stated):
                st, err = self.run_record(f"cd-alone-{stated}",
                                          TinyCausalLM(self.path("tiny-llama")),
                                          settings={"compute_dtype": stated})
                self.assertEqual((st["compute_dtype"], st["cache_type"]), (stated, cache))
                self.assertEqual(err, "")
        ref = self.path("cd-alone-ref.h5")
        rc, out = kvdiff("run", "--model", self.path("tiny-llama"), "--prompt-tokens",
                         ",".join(map(str, self.PROMPT)), "--max-new", "3", "--ignore-eos",
                         "--dump", ref)
        self.assertEqual(rc, 0, out)
        rc, text = kvdiff("compare", ref, self.path("cd-alone-bfloat16.h5"))
        self.assertEqual(rc, 0, text)
        self.assertIn("compute bf16, KV cache bf16;", text)
        st, _ = self.run_record("cd-alone-both", TinyCausalLM(self.path("tiny-llama")),
                                settings={"compute_dtype": "bf16", "cache_type": "f16"})
        self.assertEqual((st["compute_dtype"], st["cache_type"]), ("bf16", "f16"))
        st, _ = self.run_record("cd-alone-f64", TinyCausalLM(self.path("tiny-llama")),
                                settings={"compute_dtype": "f64"})
        self.assertNotIn("cache_type", st)

    def test_evidence(self):
        """Both of torch's autocast APIs (a device type argument since 2.4,
        one function per device before); TF32 on CUDA; too few values to
        tell float32 from bf16 held in float32."""
        import types
        from unittest import mock
        import torch
        from kvdiff_record.torch_hooks import ComputeEvidence, _autocast_state
        self.assertEqual(_autocast_state("cpu"), "off")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.assertEqual((_autocast_state("cpu"), _autocast_state("cuda")), ("bf16", "off"))
        on = {"cpu": False, "cuda": True}
        with mock.patch.object(torch, "get_autocast_dtype", create=True,
                               new=lambda device: torch.float16), \
                mock.patch.object(torch, "is_autocast_enabled", new=lambda device: on[device]):
            self.assertEqual((_autocast_state("cpu"), _autocast_state("cuda")), ("off", "f16"))

        def decide(tensor, rows):
            ev = ComputeEvidence(torch.nn.Linear(2, 2))
            ev.saw(tensor, rows, "attn_norm", 1)
            return ev.decide()
        rows = np.random.RandomState(0).randn(2, 64).astype(np.float32)
        cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"),
                                     dtype=torch.float32, is_floating_point=lambda: True)
        with mock.patch.object(torch, "get_float32_matmul_precision", new=lambda: "highest"):
            self.assertEqual(decide(cuda, rows), ("f32", None))
        with mock.patch.object(torch, "get_float32_matmul_precision", new=lambda: "high"):
            self.assertEqual(decide(cuda, rows), ("tf32", None))
        few = np.full((2, 8), 1.5, np.float32)
        dtype, why = decide(torch.from_numpy(few), few)
        self.assertIsNone(dtype)
        self.assertIn("only 16 nonzero values recorded, all exact in bf16", why)


class TestPrecision(Base):
    """The drift model in the precision runtimes compute in: the torch
    model run as transformers runs bf16 and f16 (tiny_torch.py --dtype) on
    tiny-gemma3-h288, whose sqrt(288) embedding scale is inexact in bf16
    (17.0) as gemma-3-1b's is (34.0), and 288 columns wide. Correct runs
    are drift; bugs are found at their exact place and named."""

    PROMPT = 40

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model = os.path.join(cls.dir, "tiny-gemma3-h288")
        cls.href = os.path.join(cls.dir, "ref-h288.h5")
        rc, out = kvdiff("run", "--model", cls.model, "--prompt-random", str(cls.PROMPT),
                         "--seed", "3", "--max-new", "4", "--dump", cls.href)
        assert rc == 0, out
        with h5py.File(cls.href, "r") as f:
            cls.prompt = [int(t) for t in f["tokens"][:cls.PROMPT]]

    def record(self, name, **kw):
        from tiny_torch import generate_and_record
        dump = self.path(name + ".h5")
        generate_and_record(self.model, self.prompt, 4, dump, **kw)
        self.assert_valid(dump)
        return dump

    def compare(self, dump):
        rc, out = kvdiff("compare", self.href, dump, "--json")
        return rc, json.loads(out)

    def test_correct_runs_are_drift(self):
        for dtype in ("bf16", "f16"):
            for attn, chunk in (("sdpa", None), ("eager", 16)):
                with self.subTest(dtype=dtype, attn=attn, chunk=chunk):
                    dump = self.record(f"ok-{dtype}-{attn}", dtype=dtype, attn=attn, chunk=chunk)
                    rc, j = self.compare(dump)
                    self.assertEqual(rc, 0, json.dumps(j)[:3000])
                    self.assertEqual(j["verdict"], "within_tolerance")
                    x = j["mode"]["cross_runtime"]
                    self.assertEqual(x["compute"],
                                     {"precision": dtype, "eps": 2.0 ** (-8 if dtype == "bf16" else -11),
                                      "factor": 3.0, "stated": True, "assumed_why": None})
                    # The attention check runs on the torch model's f16 cache
                    # too: its attention sums in float32 (attn_accumulator).
                    self.assertTrue(x["attention_check"]["ran"], x["attention_check"])
                    self.assertLess(x["attention_check"]["closest"]["ratio"], 0.5)

    def test_old_floor_cried_wolf(self):
        """The same bf16 run said to compute in f32 is judged by the floor
        of before: the false alarm at embed that the precision term removes."""
        dump = self.record("ok-bf16-as-f32", dtype="bf16")
        with h5py.File(dump, "r+") as f:
            s = json.loads(f.attrs["engine_settings"])
            s["compute_dtype"] = "f32"
            f.attrs["engine_settings"] = json.dumps(s)
        rc, j = self.compare(dump)
        self.assertEqual(rc, 1)
        self.assertEqual(j["first_divergence"]["stage"], "embed")

    def test_unstated_precision_is_said(self):
        dump = self.record("ok-bf16-unstated", dtype="bf16")
        with h5py.File(dump, "r+") as f:
            s = json.loads(f.attrs["engine_settings"])
            del s["compute_dtype"]
            f.attrs["engine_settings"] = json.dumps(s)
        rc, out = kvdiff("compare", self.href, dump)
        self.assertEqual(rc, 0, out)
        self.assertIn("compute precision: the test's engine_settings give no compute_dtype; "
                      "bf16 assumed (the coarsest common type, so as not to cry wolf)", out)
        # Units in the last place mean nothing across runtimes: none shown.
        self.assertNotIn("ulp", out)

    def expect_bug(self, name, fault, pos, layer, stage, kind, words, dtype="bf16", chunk=None):
        dump = self.record(name, dtype=dtype, faults=[fault], chunk=chunk)
        rc, j = self.compare(dump)
        d = j["first_divergence"]
        self.assertEqual(rc, 1, json.dumps(j)[:2000])
        self.assertEqual((d["position"], d["layer"], d["stage"]), (pos, layer, stage),
                         json.dumps(d))
        self.assertEqual(j["diagnosis"]["kind"], kind, json.dumps(j["diagnosis"]))
        g = j["diagnosis"]
        self.assertIn(words, " ".join((g["summary"], g["detail"], g["evidence"])))
        rc, text = kvdiff("compare", self.href, dump)
        self.assertEqual(rc, 1)
        self.assertNotIn("ulp", text)

    def test_window_bug_bf16(self):
        self.expect_bug("window-bf16", "window=8", 8, 0, "attn_out", "window",
                        "window in test appears to be 8, config says 12")

    def test_window_bug_f16_chunked(self):
        self.expect_bug("window-f16", "window=8", 8, 0, "attn_out", "window",
                        "window in test appears to be 8, config says 12", dtype="f16", chunk=7)

    def test_rope_base_bug_bf16(self):
        self.expect_bug("rope-bf16", "rope-base-local=1e6", 1, 0, "q", "rope_convention",
                        "theta 1e+06, the global layers' base, on a sliding layer")

    def test_layer_types_swapped_bf16(self):
        # Layers 4 and 5 trade sliding and global: layer 4 rotates with the
        # global base (the first step, at position 1) and reads every key.
        self.expect_bug("layers-bf16", "swap-layer-types=4,5", 1, 4, "q", "layer_type",
                        "layer 4 runs as a global layer")

    def test_global_layer_windowed_bf16(self):
        self.expect_bug("global-window-bf16", "global-window=12", 12, 5, "attn_out", "layer_type",
                        "layer 5, global in the config, read through a window of 12 keys")

    def test_own_key_masked_bf16(self):
        # Position 0 reads no key at all: NaN, which a key set explains.
        self.expect_bug("own-masked-bf16", "own-key-masked", 0, 0, "attn_out", "own_key_masked",
                        "the query's own key is masked out")

    def test_kv_swapped_bf16(self):
        self.expect_bug("kv-swap-bf16", "kv-swap=0", 0, 0, "k", "kv_swapped",
                        "k and v projections swapped")

    def test_attn_scale_bf16(self):
        # Scores scaled by sqrt(2) times the config's (query_pre_attn_scalar
        # halved): q, k, v right, the attention sharper. Was "cause not
        # identified (attention differs)"; the fitted factor names it.
        self.expect_bug("scale-bf16", "attn-scale=1.41421356", 1, 0, "attn_out", "attn_scale",
                        "where the config says 0.125 = 1/sqrt(64): the scalar halved")

    def test_attn_scale_f32(self):
        self.expect_bug("scale-f32", "attn-scale=1.41421356", 1, 0, "attn_out", "attn_scale",
                        "the test scales scores by 0.176777 = 1/sqrt(32)", dtype="f32")

    def test_norm_eps_bf16(self):
        self.expect_bug("norm-eps-bf16", "norm-eps=0.1", 0, 0, "attn_norm", "norm_eps",
                        "with eps 0.1 where the config says 1e-06")

    def test_decode_blind_bf16(self):
        # Decode steps that never see the prompt, whatever cache is named:
        # named, or (when the decode tokens' values repeat and only
        # attn_out is recorded) left undecided with it among the causes.
        dump = self.record("blind-bf16", dtype="bf16", faults=["decode-blind"])
        rc, j = self.compare(dump)
        self.assertEqual(rc, 1)
        g = j["diagnosis"]
        kinds = [h["kind"] for h in g["hypotheses"] if h["status"] != "refuted"]
        self.assertIn("split_decode_blind", kinds, json.dumps(g))
        if g["undecided"]:
            self.assertNotEqual(g["basis"], "heuristic")
        else:
            self.assertEqual(g["kind"], "split_decode_blind", json.dumps(g))

    def scaled(self, name, layer, pos, factor):
        """A correct bf16 recording whose layer's attn_out at pos is scaled
        (its row hash rewritten, as a runtime that computed it would)."""
        import xxhash
        dump = self.record(name, dtype="bf16")
        with h5py.File(dump, "r+") as f:
            d = f[f"layers/{layer}/attn_out"]
            row = d[pos] * np.float32(factor)
            d[pos] = row
            f[f"layers/{layer}/attn_out.hash"][pos] = xxhash.xxh3_64_intdigest(
                row.astype("<f4").tobytes())
        return dump

    def test_attention_check_rms(self):
        """A coherent 1.2% shift of one attention row (a key set that
        differs moves the whole row): under the check's threshold on the
        max-relative residual (0.0196) and the drift floor at attn_out, but
        not on twice the RMS-relative one, which a bf16 kernel's rounding
        keeps near one unit roundoff. A 0.4% shift is rounding's size:
        drift."""
        rc, j = self.compare(self.scaled("rms-step", 2, 30, 1.012))
        d = j["first_divergence"]
        self.assertEqual(rc, 1, json.dumps(j)[:2000])
        self.assertEqual((d["position"], d["layer"], d["stage"]), (30, 2, "attn_out"))
        ac = j["mode"]["cross_runtime"]["attention_check"]
        self.assertTrue(ac["step"])
        self.assertEqual(ac["rms_weight"], 2.0)
        rc, j = self.compare(self.scaled("rms-drift", 2, 30, 1.004))
        self.assertEqual(rc, 0, json.dumps(j)[:2000])

    def test_autocast_stated_bf16(self):
        """float32 weights run under torch.autocast compute in bf16: record()
        states it, and the compare is drift. Stated f32 (the parameters'
        dtype, as before), the same run stepped at (0, 0, q), 0.006 against
        0.004."""
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        dump = self.path("autocast-h288.h5")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            record(TinyCausalLM(self.model), self.prompt, dump, max_new=4, ignore_eos=True)
        self.assert_valid(dump)
        rc, j = self.compare(dump)
        self.assertEqual(rc, 0, json.dumps(j)[:3000])
        self.assertEqual(j["verdict"], "within_tolerance")
        c = j["mode"]["cross_runtime"]["compute"]
        self.assertEqual((c["precision"], c["stated"]), ("bf16", True))

    def test_stated_f32_under_autocast(self):
        """The same autocast run stated f32 by hand: a step at its first
        stage that errs, and the diagnosis says the stated precision looks
        wrong and how to state it (not a RoPE base, as before)."""
        import torch
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        dump = self.path("autocast-f32-h288.h5")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            record(TinyCausalLM(self.model), self.prompt, dump, max_new=4, ignore_eos=True,
                   settings={"compute_dtype": "f32", "cache_type": "f32"})
        rc, j = self.compare(dump)
        self.assertEqual(rc, 1, json.dumps(j)[:3000])
        d = j["diagnosis"]
        self.assertEqual(d["kind"], "stated_precision", json.dumps(d))
        self.assertIn("stated precision looks wrong", d["summary"])
        self.assertIn('"compute_dtype": "bf16"', d["detail"])


# ---------------------------------------------------------------- the audit
#
# The reader accepts what kvdiff accepts; no argument makes a dump kvdiff
# validate refuses; the output discipline of model/outfile.c; a disk that
# fills between two rows() calls is an error, not a crash.

SHARED_CONFORMANCE = os.path.join(os.path.dirname(ROOT), "shared", "conformance")
TINY = (hostile_configs.DELETE, None, 0, 2.5, "2")


def kvdiff_reads_config(folder):
    """(accepted, message) of `kvdiff run --model folder` on folder's
    config.json: with an empty model.safetensors beside it, the run parses
    the config (model/config.c) and stops at the weights, cheaply."""
    rc, out = kvdiff("run", "--model", folder, "--prompt-tokens", "0", "--max-new", "0")
    if "model.safetensors: empty file" in out:
        return True, out
    if os.path.join(folder, "config.json") in out:
        return False, out
    raise AssertionError(f"{folder}: kvdiff neither read nor refused the config: {out}")


def python_reads_config(folder):
    """(accepted, message, model_config) of model_config_from_hf; any
    exception but RecorderError is a failure of the test."""
    try:
        return True, "", model_config_from_hf(folder)
    except RecorderError as exc:
        return False, str(exc), None


def field_named(message, folder):
    """The field a refusal names: the word after "config.json: "."""
    rest = message.split(os.path.join(folder, "config.json") + ": ", 1)[-1]
    return rest.split(" ", 1)[0]


# C's internal names in config_validate's messages, and the config.json
# fields the Python reader names for them.
C_ALIASES = {"bos_id": "bos_token_id", "eos": "eos_token_id",
             "per_layer_vocab": "vocab_size_per_layer_input", "a": "hidden_size"}


class TestConfigAgreement(Base):
    """model_config_from_hf accepts exactly the configs `kvdiff run --model
    DIR` accepts, for every family kvdiff runs: the fuzz corpus, the
    conformance configs, the presets, and hostile variants of them."""

    def cases(self):
        out = []
        for p in sorted(glob.glob(os.path.join(ROOT, "fuzz", "corpus", "config", "*"))):
            with open(p, "rb") as f:
                out.append((os.path.relpath(p, ROOT), f.read()))
        for folder in (os.path.join(ROOT, "tests", "data", "conformance"), SHARED_CONFORMANCE):
            for p in sorted(glob.glob(os.path.join(folder, "*", "config.json"))):
                with open(p, "rb") as f:
                    out.append((p, f.read()))
        base = {}
        for preset in ("tiny-gemma4", "tiny-gemma3", "tiny-gemma3-kvshared", "tiny-llama3",
                       "tiny-qwen2", "tiny-qwen3", "tiny-deepseek-v3"):
            with open(self.path(f"{preset}/config.json"), "rb") as f:
                data = f.read()
            out.append((preset, data))
            base[preset] = json.loads(data)
        # Gemma 4 in full (where the audit found 47), the others in brief
        for label, data in hostile_configs.variants(base["tiny-gemma4"]):
            out.append((f"tiny-gemma4 {label}", data))
        nested = {"model_type": "gemma4", "text_config": base["tiny-gemma4"],
                  "eos_token_id": [1, 2]}
        for label, data in hostile_configs.variants(nested, TINY, TINY):
            out.append((f"gemma4 nested {label}", data))
        for preset in ("tiny-gemma3", "tiny-gemma3-kvshared", "tiny-llama3", "tiny-qwen2",
                       "tiny-qwen3", "tiny-deepseek-v3"):
            for label, data in hostile_configs.variants(base[preset], TINY, TINY):
                out.append((f"{preset} {label}", data))
        return out

    def test_accepts_what_kvdiff_accepts(self):
        from concurrent.futures import ThreadPoolExecutor
        cases = self.cases()
        root = tempfile.mkdtemp(prefix="agree-", dir=self.dir)
        folders = []
        for i, (_, data) in enumerate(cases):
            folder = os.path.join(root, str(i))
            os.mkdir(folder)
            with open(os.path.join(folder, "config.json"), "wb") as f:
                f.write(data)
            open(os.path.join(folder, "model.safetensors"), "wb").close()
            folders.append(folder)
        with ThreadPoolExecutor(4) as pool:
            theirs = list(pool.map(kvdiff_reads_config, folders))
        wrong, names, counts = [], [], {"both": 0, "neither": 0, "other model_type": 0}
        for (label, _), folder, (kv_ok, kv_msg) in zip(cases, folders, theirs):
            py_ok, py_msg, cfg = python_reads_config(folder)
            if py_ok and not kv_ok and "is not supported (kvdiff reads llama" in kv_msg:
                # a model_type kvdiff does not run: read as transformers
                # reads any decoder (docs/python-recorder.md), on purpose
                self.assertNotIn(cfg["model_type"], ("llama", "qwen2", "qwen3", "gemma3_text",
                                                     "gemma4_text"), label)
                counts["other model_type"] += 1
            elif py_ok != kv_ok:
                wrong.append(f"{label}: kvdiff {'accepts' if kv_ok else 'refuses'} "
                             f"({kv_msg.strip()[-160:]}), python "
                             f"{'accepts' if py_ok else 'refuses'} ({py_msg[:160]})")
            elif kv_ok:
                counts["both"] += 1
            elif "is not supported (kvdiff reads llama" in kv_msg:
                counts["neither"] += 1   # Python names what the other type lacks
            else:
                counts["neither"] += 1
                theirs_field = field_named(kv_msg, folder)
                if field_named(py_msg, folder) != C_ALIASES.get(theirs_field, theirs_field):
                    names.append(f"{label}: kvdiff: {kv_msg.strip()[-120:]} / python: "
                                 f"{py_msg[-120:]}")
        shutil.rmtree(root, ignore_errors=True)
        self.assertEqual(wrong, [], f"{len(wrong)} of {len(cases)} configs read differently:\n"
                         + "\n".join(wrong[:30]))
        self.assertEqual(names, [], f"{len(names)} refusals name another field:\n"
                         + "\n".join(names[:30]))
        self.assertGreater(counts["both"], 500, counts)
        self.assertGreater(counts["neither"], 1000, counts)

    def test_gemma4_audit_cases(self):
        """What the audit found model_config_from_hf accepting: head_dim 0
        read as 256, head_dim -1 and 2^31, num_kv_shared_layers -1, 2.5,
        "2" and null; each refused naming the field, as kvdiff does."""
        with open(self.path("tiny-gemma4/config.json")) as f:
            g4 = json.load(f)
        for key, value, says in (
                ("head_dim", 0, "is 0; expected 1..16384"),
                ("head_dim", -1, "is -1; expected 1..16384"),
                ("head_dim", 2**31, "is 2147483648; expected 1..16384"),
                ("num_kv_shared_layers", -1, "is -1; expected 0..256"),
                ("num_kv_shared_layers", 2.5, "is 2.5; expected an integer"),
                ("num_kv_shared_layers", "2", 'is the string "2"; expected an integer'),
                ("num_kv_shared_layers", None, "is null; expected an integer")):
            with self.subTest(key=key, value=value):
                with self.assertRaisesRegex(RecorderError, f"^config: {key} {re.escape(says)}"):
                    model_config_from_hf(dict(g4, **{key: value}))
                nested = {"model_type": "gemma4", "text_config": dict(g4, **{key: value})}
                with self.assertRaisesRegex(RecorderError, f"config: text_config.{key} "):
                    model_config_from_hf(nested)

    def test_values_match_kvdiff(self):
        """Configs both accept give the model_config kvdiff's own dump
        states (variants that keep the preset's weights): Gemma 4's RoPE
        base from rope_theta under a full_attention entry without one,
        rope_type spelled "type", the default window of 4096, rope_scaling;
        Gemma 3's keyed rope_parameters, Llama 3's scaling in
        rope_parameters."""
        gone = object()
        cases = {
            "tiny-gemma4": [
                {"rope_parameters": gone}, {"rope_parameters": gone, "rope_theta": 5e5},
                {"sliding_window": gone},
                {"rope_parameters": {"full_attention": {"type": "proportional",
                                                        "partial_rotary_factor": 0.5}}},
                {"rope_parameters": {"sliding_attention": {"rope_theta": 2e4}},
                 "rope_theta": 2e5},
                {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
                {"rope_parameters": {"full_attention": {"rope_type": "proportional",
                                                        "partial_rotary_factor": None}}},
                {"rope_parameters": gone, "rope_scaling": {"rope_type": "linear",
                                                           "factor": 2.0}},
                {"global_head_dim": gone, "per_layer_config": {"3": {"head_dim": 64},
                                                               "7": [1]}}],
            "tiny-gemma3": [
                {"layer_types": gone, "sliding_window_pattern": 3},
                {"rope_local_base_freq": gone, "query_pre_attn_scalar": gone},
                {"final_logit_softcapping": 30.0},
                {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                {"rope_scaling": gone, "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                    "sliding_attention": {"rope_theta": 3e4}}},
                {"layer_types": ["full_attention"] * 6, "sliding_window": None}],
            "tiny-llama3": [
                {"rope_scaling": gone, "rope_parameters": {
                    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                    "rope_theta": 1e4}},
                {"rope_scaling": {"type": "linear", "factor": 2.0}},
                {"layer_types": ["sliding_attention"] * 4}],
            "tiny-qwen2": [{"rope_scaling": gone, "rope_parameters": {"rope_theta": 1e4}},
                           {"layer_types": ["full_attention"] * 4, "sliding_window": 5}],
        }
        for preset, variants in cases.items():
            with open(self.path(f"{preset}/config.json")) as f:
                base = json.load(f)
            for i, change in enumerate(variants):
                with self.subTest(preset=preset, change=change):
                    cfg = {k: v for k, v in dict(base, **change).items() if v is not gone}
                    folder = self.path(f"values-{preset}-{i}")
                    os.makedirs(folder, exist_ok=True)
                    with open(os.path.join(folder, "config.json"), "w") as f:
                        json.dump(cfg, f)
                    if not os.path.lexists(os.path.join(folder, "model.safetensors")):
                        os.symlink(self.path(f"{preset}/model.safetensors"),
                                   os.path.join(folder, "model.safetensors"))
                    dump = folder + ".h5"
                    rc, out = kvdiff("run", "--model", folder, "--prompt-tokens", "0",
                                     "--max-new", "0", "--dump", dump)
                    self.assertEqual(rc, 0, out)
                    with h5py.File(dump, "r") as f:
                        theirs = json.loads(f.attrs["model_config"])
                    self.assertEqual(model_config_from_hf(folder), theirs)

    def test_file_read_as_kvdiff_reads_one(self):
        """config.json is read as kvdiff reads it: a FIFO is refused (not
        waited on), so is a file past 16 MiB; JSON Python would take but
        jansson refuses is refused."""
        folder = tempfile.mkdtemp(dir=self.dir)
        cfg = os.path.join(folder, "config.json")
        os.mkfifo(cfg)
        with self.assertRaisesRegex(RecorderError, "config.json: not a regular file \\(a FIFO\\)"):
            model_config_from_hf(folder)
        os.unlink(cfg)
        with open(cfg, "wb") as f:
            f.truncate((16 << 20) + 1)
        with self.assertRaisesRegex(RecorderError, "at most 16777216 are read"):
            model_config_from_hf(folder)
        with open(self.path("tiny-llama/config.json")) as f:
            text = f.read().rstrip()
        for extra, says in ((', "x": NaN}', "NaN is not JSON"),
                            (', "x": 18446744073709551616}', "too big integer"),
                            (', "x": "a\\u0000"}', "not allowed in a string"),
                            (', "hidden_size": 64}', "duplicate object key")):
            with open(cfg, "w") as f:
                f.write(text[:-1] + extra)
            with self.assertRaisesRegex(RecorderError, f"config.json: not valid JSON: .*{says}"):
                model_config_from_hf(folder)


class TestUpFrontRefusals(Base):
    """Arguments that made dumps `kvdiff validate` refuses (or that meant
    something else than asked) are refused before any file is made."""

    def setUp(self):
        self.cfg = model_config_from_hf(self.path("tiny-llama"))

    def test_recorder_arguments(self):
        for kw, says in (
                ({"settings": {"chunk": 4, "x": float("nan")}},
                 r"engine_settings\['x'\] is nan; JSON has no NaN or infinity"),
                ({"settings": {"a": {"b": [float("inf")]}}},
                 r"engine_settings\['a'\]\['b'\]\[0\] is inf"),
                ({"settings": {"x": object()}}, "is a object; JSON cannot hold it"),
                ({"settings": {"x": "a\0b"}}, "holds a NUL character"),
                ({"settings": {1: 2}}, "JSON keys are strings"),
                ({"topk": 0}, r"topk is 0; expected an integer in 1..256 \(vocab_size\)"),
                ({"topk": 257}, r"topk is 257; expected an integer in 1..256"),
                ({"topk": 2.5}, "topk is 2.5"),
                ({"seed": -1}, "seed is -1"),
                ({"start_position": -1}, "start_position is -1"),
                ({"weight_fingerprint": "xyz"}, "weight_fingerprint 'xyz'")):
            with self.subTest(kw=kw):
                path = self.path("upfront.h5")
                with self.assertRaisesRegex(RecorderError, says):
                    Recorder(path, self.cfg, **kw)
                self.assertFalse(os.path.lexists(path))

    def test_model_config_as_the_dump_reader_takes_it(self):
        for change, says in ((dict(head_dim=32768), "head_dim is 32768; expected an integer "
                                                    "in 1..16384"),
                             (dict(rope_theta=float("nan")), "rope_theta is nan"),
                             (dict(rope_theta=True), "rope_theta is True"),
                             (dict(kv_owner=[0, 0, 1, 3]), "kv_owner\\[2\\] is 1, which does "
                                                           "not own a cache itself"),
                             (dict(model_type="x" * 32), "model_type is 'x+'"),
                             (dict(global_head_dim=32), "global_head_dim is 32, but kvdiff "
                                                        "reads it for gemma4_text only"),
                             (dict(extra=float("inf")), "model_config\\['extra'\\] is inf")):
            with self.subTest(change=change):
                path = self.path("upfront-config.h5")
                with self.assertRaisesRegex(RecorderError, says):
                    Recorder(path, dict(self.cfg, **change))
                self.assertFalse(os.path.lexists(path))

    def test_record_arguments(self):
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        model = TinyCausalLM(self.path("tiny-llama"))
        for kw, says in (({"max_new": -3}, "max_new is -3; expected an integer in 0..16777216"),
                         ({"max_new": 2.5}, "max_new is 2.5"),
                         ({"chunk": 0}, "chunk is 0; expected an integer >= 1 \\(a prefill "
                                        "chunk holds at least one token\\)"),
                         ({"chunk": -2}, "chunk is -2"),
                         ({"settings": {"x": float("nan")}}, "engine_settings\\['x'\\] is nan")):
            with self.subTest(kw=kw):
                path = self.path("upfront-record.h5")
                with self.assertRaisesRegex(RecorderError, says):
                    record(model, [1, 2, 3, 4], path, **kw)
                self.assertFalse(os.path.lexists(path))

    def test_topk_ids_past_the_vocabulary(self):
        path = self.path("topk-ids.h5")
        with Recorder(path, self.cfg, settings={"chunk": 2, "cache": "dense"}) as rec:
            rec.tokens([1, 2, 3], 2)
            for ids, says in ((np.full((2, 8), 256), "topk_ids must be in 0..255"),
                              (np.full((2, 8), -1), "topk_ids must be in 0..255"),
                              (np.full((2, 8), 2.0), "topk_ids of dtype float64")):
                with self.assertRaisesRegex(RecorderError, says):
                    rec.output(1, lse=np.zeros(2), topk_ids=ids, topk_values=np.zeros((2, 8)))
        with h5py.File(path, "r") as f:
            self.assertNotIn("output", f)
        self.assert_valid(path)

    def test_recorded_dumps_validate(self):
        """A normal recording passes kvdiff validate, and so does a
        prompt-only one (max_new=0, as kvdiff run --max-new 0)."""
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        model = TinyCausalLM(self.path("tiny-llama"))
        for max_new in (3, 0):
            with self.subTest(max_new=max_new):
                path = self.path(f"normal-{max_new}.h5")
                got = record(model, [1, 2, 3, 4], path, max_new=max_new, chunk=3,
                             ignore_eos=True)
                self.assertEqual(len(got), max_new)
                self.assert_valid(path)
                with h5py.File(path, "r") as f:
                    self.assertEqual(f.attrs["status"], "complete")
                    self.assertEqual(len(f["tokens"]), 4 + max_new)
                    self.assertEqual(f["output/lse"].attrs["first_position"], 3)


class TestOutputDiscipline(Base):
    """The Recorder's dump path under model/outfile.c's discipline
    (kvdiff_record/outfile.py): a FIFO, a symlink, a device, a socket, a
    folder or one of the run's inputs there is refused, and left as it
    was."""

    def setUp(self):
        self.cfg = model_config_from_hf(self.path("tiny-llama"))
        self.tmp = tempfile.mkdtemp(dir=self.dir)
        self.victim = os.path.join(self.tmp, "victim.txt")
        with open(self.victim, "w") as f:
            f.write("precious\n")

    def assert_victim(self):
        with open(self.victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def refused(self, path, says, **kw):
        with self.assertRaisesRegex(RecorderError, says):
            Recorder(path, self.cfg, **kw)

    def test_fifo(self):
        path = os.path.join(self.tmp, "fifo.h5")
        os.mkfifo(path)
        self.refused(path, "is a FIFO, not a regular file")
        self.assertTrue(stat.S_ISFIFO(os.lstat(path).st_mode))

    def test_symlink_to_a_victim(self):
        path = os.path.join(self.tmp, "link.h5")
        os.symlink(self.victim, path)
        self.refused(path, "is a symbolic link; kvdiff never writes through one")
        self.assertEqual(os.readlink(path), self.victim)
        self.assert_victim()
        dangling = os.path.join(self.tmp, "dangling.h5")
        os.symlink(os.path.join(self.tmp, "made-through-link.h5"), dangling)
        self.refused(dangling, "is a symbolic link")
        self.assertFalse(os.path.lexists(os.path.join(self.tmp, "made-through-link.h5")))

    @unittest.skipUnless(os.geteuid() == 0, "mknod needs root")
    def test_char_device(self):
        path = os.path.join(self.tmp, "null.h5")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        self.refused(path, "is a device, not a regular file")
        st = os.lstat(path)
        self.assertTrue(stat.S_ISCHR(st.st_mode))
        self.assertEqual(st.st_rdev, os.makedev(1, 3))

    def test_socket_and_folder(self):
        import socket
        path = os.path.join(self.tmp, "sock.h5")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(path)
            self.refused(path, "is a socket, not a regular file")
            self.assertTrue(stat.S_ISSOCK(os.lstat(path).st_mode))
        finally:
            s.close()
        self.refused(self.tmp, "is a directory, not a regular file")

    def test_an_input(self):
        """The model folder's files (and a hard link to one) are the run's
        inputs: never written over; an unrelated regular file is."""
        folder = os.path.join(self.tmp, "model")
        shutil.copytree(self.path("tiny-llama"), folder)
        config = os.path.join(folder, "config.json")
        with open(config, "rb") as f:
            before = f.read()
        self.refused(config, "is one of this run's inputs; writing there would destroy it",
                     inputs=folder)
        hard = os.path.join(self.tmp, "hard.h5")
        os.link(os.path.join(folder, "model.safetensors"), hard)
        self.refused(hard, "is one of this run's inputs", inputs=[self.victim, folder])
        self.refused(self.victim, "is one of this run's inputs", inputs=self.victim)
        with open(config, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertEqual(os.path.getsize(hard), os.path.getsize(
            self.path("tiny-llama/model.safetensors")))
        self.assert_victim()
        # a regular file the run did not read is reused, in place
        with Recorder(self.victim, self.cfg, inputs=folder) as rec:
            rec.tokens([1], 1)
        self.assert_valid(self.victim)

    def test_record_never_writes_over_the_model(self):
        from tiny_torch import TinyCausalLM
        from kvdiff_record.transformers import record
        folder = os.path.join(self.tmp, "model")
        shutil.copytree(self.path("tiny-llama"), folder)
        model = TinyCausalLM(folder)
        model.name_or_path = folder   # as transformers' from_pretrained(folder) sets it
        target = os.path.join(folder, "model.safetensors")
        size = os.path.getsize(target)
        with self.assertRaisesRegex(RecorderError, "is one of this run's inputs"):
            record(model, [1, 2, 3], target, max_new=1)
        self.assertEqual(os.path.getsize(target), size)

    def test_write_whole(self):
        from kvdiff_record import outfile
        path = os.path.join(self.tmp, "report.json")
        outfile.write_whole(path, b"{}\n")
        outfile.write_whole(path, b"[]\n")   # a regular file is replaced
        with open(path, "rb") as f:
            self.assertEqual(f.read(), b"[]\n")
        fifo, link = os.path.join(self.tmp, "w.fifo"), os.path.join(self.tmp, "w.link")
        os.mkfifo(fifo)
        os.symlink(self.victim, link)
        for target, says, kw in ((fifo, "is a FIFO", {}), (link, "is a symbolic link", {}),
                                 (self.tmp, "names a folder|is a directory", {}),
                                 (self.victim, "is one of this run's inputs",
                                  {"inputs": outfile.input_ids(self.victim)})):
            with self.subTest(target=target):
                with self.assertRaisesRegex(RecorderError, says):
                    outfile.write_whole(target, b"x", **kw)
        self.assert_victim()
        self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link))
        self.assertEqual(sorted(n for n in os.listdir(self.tmp) if n.startswith(".")), [])


class TestNoRoomMidRun(Base):
    """The room the Recorder asked for is taken by someone else between two
    rows() calls: libhdf5's write fails. That left libhdf5 unable to close
    the file and the interpreter died at exit (SIGSEGV, rc 139); now the
    Recorder raises its RecorderError, removes the half dump it created
    (empties a file that was there before) and the process exits normally."""

    SCRIPT = (
        "import os, resource, subprocess, sys, numpy as np\n"
        "from kvdiff_record import Recorder, RecorderError\n"
        "cfg, path, mode, take = {cfg!r}, {path!r}, {mode!r}, {take!r}\n"
        "try:\n"
        "    with Recorder(path, cfg) as rec:\n"
        "        rec.tokens(list(range(10)), 5)\n"
        "        rec.model_rows('logits', 0, np.ones((64, cfg['vocab_size']), np.float32))\n"
        "        if take == 'limit':   # the file-size limit drops to what the file holds\n"
        "            size = os.path.getsize(path)\n"
        "            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 4096,\n"
        "                                                       resource.RLIM_INFINITY))\n"
        "        else:                 # another process fills the disk\n"
        "            subprocess.run([sys.executable, '-c', {fill!r}], check=True)\n"
        "        if mode == 'rows':\n"
        "            for layer in range(cfg['num_hidden_layers']):\n"
        "                rec.rows(layer, 'x_in', 0, np.ones((3, cfg['hidden_size']), np.float32))\n"
        "except RecorderError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n")
    FILL = (
        "import os\n"
        "fd = os.open({0!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
        "try:\n"
        "    while True:\n"
        "        os.write(fd, bytes(65536))\n"
        "except OSError:\n"
        "    pass\n")

    def run_script(self, path, mode, take, fill=""):
        cfg = model_config_from_hf(self.path("tiny-llama"))
        script = self.SCRIPT.format(cfg=cfg, path=path, mode=mode, take=take, fill=fill)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, env=env)

    def test_limit_drops_between_rows(self):
        for mode in ("rows", "close"):
            for existed in (False, True):
                with self.subTest(mode=mode, existed=existed):
                    path = self.path(f"dropped-{mode}-{existed}.h5")
                    if existed:
                        with open(path, "w") as f:
                            f.write("an old file\n")
                    p = self.run_script(path, mode, "limit")
                    self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                    self.assertEqual(p.stdout.strip(), f"{path}: file size limit reached "
                                                       f"(ulimit -f): no dump written")
                    self.assertEqual(p.stderr, "")
                    if existed:   # not the recorder's to remove: left empty
                        self.assertEqual(os.path.getsize(path), 0)
                    else:
                        self.assertFalse(os.path.lexists(path))

    @unittest.skipUnless(os.geteuid() == 0, "mounting a small tmpfs needs root")
    def test_disk_filled_by_another_process(self):
        mnt = tempfile.mkdtemp(dir=self.dir)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt],
                          capture_output=True).returncode != 0:
            self.skipTest("cannot mount a tmpfs here")
        try:
            for mode in ("rows", "close"):
                with self.subTest(mode=mode):
                    path = os.path.join(mnt, f"full-{mode}.h5")
                    filler = os.path.join(mnt, "filler")
                    p = self.run_script(path, mode, "disk", self.FILL.format(filler))
                    self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                    self.assertEqual(p.stdout.strip(), f"{path}: no space left on the device: "
                                                       f"no dump written")
                    self.assertEqual(p.stderr, "")
                    self.assertFalse(os.path.lexists(path))
                    os.unlink(filler)
        finally:
            subprocess.run(["umount", mnt], check=False)


if __name__ == "__main__":
    unittest.main()
