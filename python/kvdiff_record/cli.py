"""kvdiff-record: a Hugging Face transformers model folder's greedy
generation recorded to a kvdiff dump from the command line, through
kvdiff_record.transformers.record() (the one call, with its q and k after
RoPE and every stage the modules give). The options are kvdiff-llama's,
so the same prompt reaches both runtimes:

    kvdiff-record --model gemma-3-1b-it/ --prompt-from ref.h5 --max-new 16 --dump hf.h5
    kvdiff-record --model gemma-3-1b-it/ --prompt-text "The capital of France is" \\
                  --dtype bf16 --chunk 32 --dump hf.h5

Exit 0 when the dump is written complete, 2 on bad input or a run that
fails (one line on stderr, `kvdiff-record: ...`)."""

import argparse
import os
import sys

from . import __version__
from .recorder import RecorderError

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Usage(f"{message}; see kvdiff-record --help")


def _parser():
    p = _Parser(prog="kvdiff-record", description=__doc__.split("\n\n")[0],
                epilog="Examples:\n" + __doc__.split("\n\n")[1] + "\n\n" +
                "The prompt: exactly one of --prompt-*. --prompt-text needs the folder's "
                "tokenizer (transformers' AutoTokenizer).",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a Hugging Face model folder (config.json, safetensors)")
    p.add_argument("--prompt-tokens", metavar="L", help="ids, e.g. 5,17,42")
    p.add_argument("--prompt-ids-file", metavar="F",
                   help="a file of ids separated by spaces, commas or newlines")
    p.add_argument("--prompt-from", metavar="DUMP",
                   help="the prompt of a kvdiff dump (its first prompt_length tokens)")
    p.add_argument("--prompt-text", metavar="S", help="text, encoded by the folder's tokenizer")
    p.add_argument("--max-new", type=int, default=16, metavar="N",
                   help="tokens to generate, greedy (default 16)")
    p.add_argument("--chunk", type=int, default=None, metavar="N",
                   help="prefill in forwards of N tokens (default: the prompt in one)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the dtype transformers loads the weights in (default: the checkpoint's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at an end-of-sequence token")
    p.add_argument("--dump", required=True, metavar="FILE", help="the dump to write")
    p.add_argument("-V", "--version", action="version", version=f"kvdiff-record {__version__}")
    return p


def _ids_from_text(text, where):
    ids = []
    for tok in text.replace(",", " ").split():
        try:
            v = int(tok, 10)
        except ValueError:
            raise _Usage(f"{where}: '{tok}' is not a token id") from None
        if v < 0 or v >= 1 << 31:
            raise _Usage(f"{where}: token id {v} is out of range")
        ids.append(v)
    if not ids:
        raise _Usage(f"{where}: no token ids")
    return ids


def _prompt(a):
    given = [n for n in ("prompt_tokens", "prompt_ids_file", "prompt_from", "prompt_text")
             if getattr(a, n) is not None]
    if len(given) != 1:
        raise _Usage("give exactly one of --prompt-tokens, --prompt-ids-file, --prompt-from, "
                     "--prompt-text; see kvdiff-record --help")
    if a.prompt_tokens is not None:
        return _ids_from_text(a.prompt_tokens, "--prompt-tokens")
    if a.prompt_ids_file is not None:
        try:
            with open(a.prompt_ids_file, encoding="utf-8") as f:
                text = f.read(1 << 26)
        except (OSError, UnicodeDecodeError) as e:
            raise _Usage(f"--prompt-ids-file {a.prompt_ids_file}: {e.strerror or e}") from None
        return _ids_from_text(text, a.prompt_ids_file)
    if a.prompt_from is not None:
        import h5py
        try:
            with h5py.File(a.prompt_from, "r") as f:
                tokens = f["tokens"]
                n = int(tokens.attrs["prompt_length"])
                ids = [int(x) for x in tokens[:n]]
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise _Usage(f"--prompt-from {a.prompt_from}: not a kvdiff dump with tokens and "
                         f"prompt_length ({e})") from None
        if not ids:
            raise _Usage(f"--prompt-from {a.prompt_from}: its prompt is empty")
        return ids
    return None     # text: encoded once the tokenizer is loaded


def _transformers():
    try:
        import transformers
    except ImportError:
        raise _Usage("the transformers package is not installed (pip install transformers "
                     "in this environment; Debian does not package it)") from None
    return transformers


def run(argv=None):
    """The command: returns the exit code."""
    a = _parser().parse_args(argv)
    ids = _prompt(a)
    if not os.path.isdir(a.model):
        raise _Usage(f"--model {a.model}: not a folder")
    tf = _transformers()
    kw = {}
    if a.dtype:
        import torch
        kw["torch_dtype"] = getattr(torch, DTYPES[a.dtype])
    if ids is None:
        tok = tf.AutoTokenizer.from_pretrained(a.model)
        ids = list(tok(a.prompt_text)["input_ids"])
        if not ids:
            raise _Usage("--prompt-text: the tokenizer gave no ids")
    model = tf.AutoModelForCausalLM.from_pretrained(a.model, **kw)
    model.eval()
    from .transformers import record
    record(model, ids, a.dump, max_new=a.max_new, chunk=a.chunk, ignore_eos=a.ignore_eos)
    return 0


def main(argv=None):
    """The console entry point (kvdiff-record): one line on an error."""
    try:
        return run(argv)
    except (_Usage, RecorderError) as e:
        print(f"kvdiff-record: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"kvdiff-record: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvdiff-record: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
