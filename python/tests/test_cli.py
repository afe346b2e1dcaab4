"""Tests of kvdiff-record (kvdiff_record/cli.py), the command line over
kvdiff_record.transformers.record(). transformers is not packaged by
Debian: a stand-in `transformers` module whose AutoModelForCausalLM loads
tiny_torch's TinyCausalLM (a model called as transformers models are) is put
first on the path, so the command runs end to end on a folder `kvdiff gen`
writes and its dump is compared with kvdiff's reference.
KVDIFF_BIN names the kvdiff binary (default: build/kvdiff)."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import h5py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KVDIFF = os.environ.get("KVDIFF_BIN", os.path.join(ROOT, "build", "kvdiff"))

FAKE_TRANSFORMERS = '''
from tiny_torch import TinyCausalLM

__version__ = "0 (a test stand-in)"

class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(folder, **kw):
        return TinyCausalLM(folder)

class AutoTokenizer:
    @staticmethod
    def from_pretrained(folder, **kw):
        raise OSError(folder + ": no tokenizer in this stand-in")
'''


def kvdiff(*args):
    p = subprocess.run([KVDIFF, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


class TestCli(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvdiff-cli-")
        os.mkdir(os.path.join(cls.dir, "fake"))
        with open(os.path.join(cls.dir, "fake", "transformers.py"), "w") as f:
            f.write(FAKE_TRANSFORMERS)
        cls.model = os.path.join(cls.dir, "tiny-llama")
        rc, out = kvdiff("gen", "--preset", "tiny-llama", "-o", cls.model)
        assert rc == 0, out
        cls.ref = os.path.join(cls.dir, "ref.h5")
        rc, out = kvdiff("run", "--model", cls.model, "--prompt-random", "20", "--seed", "4",
                         "--max-new", "4", "--ignore-eos", "--dump", cls.ref)
        assert rc == 0, out

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def record(self, *args, fake=True):
        env = dict(os.environ)
        path = [os.path.join(ROOT, "python"), os.path.join(ROOT, "python", "examples")]
        if fake:
            path.insert(0, os.path.join(self.dir, "fake"))
        env["PYTHONPATH"] = os.pathsep.join(path)
        p = subprocess.run([sys.executable, "-m", "kvdiff_record.cli", *args], env=env,
                           capture_output=True, text=True, timeout=300, cwd=self.dir)
        return p.returncode, p.stdout + p.stderr

    def test_records_what_kvdiff_compares_as_drift(self):
        dump = os.path.join(self.dir, "hf.h5")
        rc, out = self.record("--model", self.model, "--prompt-from", self.ref, "--max-new", "4",
                              "--ignore-eos", "--chunk", "7", "--dump", dump)
        self.assertEqual(rc, 0, out)
        with h5py.File(dump, "r") as f:
            self.assertEqual(f.attrs["engine"], "transformers")
            self.assertEqual(f.attrs["status"], "complete")
        rc, out = kvdiff("validate", dump)
        self.assertEqual(rc, 0, out)
        rc, out = kvdiff("compare", self.ref, dump)
        self.assertEqual(rc, 0, out)
        self.assertIn("no bug: drift (cross-runtime", out)

    def test_errors_are_one_line_exit_2(self):
        dump = os.path.join(self.dir, "never.h5")
        cases = [(("--model", self.model, "--dump", dump), "give exactly one of --prompt"),
                 (("--model", self.model, "--prompt-tokens", "1,x", "--dump", dump),
                  "'x' is not a token id"),
                 (("--model", os.path.join(self.dir, "nope"), "--prompt-tokens", "1,2",
                   "--dump", dump), "not a folder"),
                 (("--model", self.model, "--prompt-from", self.model + "/config.json",
                   "--dump", dump), "not a kvdiff dump"),
                 (("--model", self.model, "--prompt-tokens", "1,2", "--max-new", "-1",
                   "--dump", dump), "max_new"),
                 (("--model", self.model, "--prompt-text", "hello", "--dump", dump),
                  "no tokenizer")]
        for args, want in cases:
            with self.subTest(args=args):
                rc, out = self.record(*args)
                self.assertEqual(rc, 2, out)
                self.assertIn(want, out)
                lines = out.strip().splitlines()
                self.assertEqual(len(lines), 1, out)
                self.assertTrue(lines[0].startswith("kvdiff-record: "), out)
                self.assertFalse(os.path.exists(dump))

    def test_versions_agree(self):
        """The package's version (pyproject.toml, __version__, --version) is kvdiff's."""
        with open(os.path.join(ROOT, "python", "pyproject.toml")) as f:
            declared = [line.split('"')[1] for line in f if line.startswith("version = ")]
        rc, out = kvdiff("-V")
        self.assertEqual(rc, 0, out)
        tool = out.split()[1]
        rc, out = self.record("--version")
        self.assertEqual(rc, 0, out)
        self.assertEqual(declared, [tool])
        self.assertEqual(out.strip(), f"kvdiff-record {tool}")

    def test_without_transformers_says_so(self):
        rc, out = self.record("--model", self.model, "--prompt-tokens", "1,2", "--dump",
                              os.path.join(self.dir, "x.h5"), fake=False)
        try:
            import transformers  # noqa: F401
            self.skipTest("transformers is installed here")
        except ImportError:
            pass
        self.assertEqual(rc, 2, out)
        self.assertIn("transformers package is not installed", out)


if __name__ == "__main__":
    unittest.main()
