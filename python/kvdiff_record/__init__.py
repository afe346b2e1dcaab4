"""kvdiff_record: write kvdiff dumps (schema v1, docs/dump-format.md) from
Python runtimes -- PyTorch, JAX, CoreML, anything numpy.asarray reads.

    from kvdiff_record import Recorder, model_config_from_hf
    with Recorder("mine.h5", model_config_from_hf("my-model"), engine="pytorch") as rec:
        rec.tokens(ids, prompt_length=len(prompt))
        rec.rows(layer, "k", first_position, k_rows)      # [positions, KV*D]

A Hugging Face transformers model in one call (kvdiff_record.transformers):

    from kvdiff_record.transformers import record
    record(model, prompt_ids, "hf.h5", max_new=16, chunk=32)

docs/python-recorder.md has the whole story and recipes."""

from .recorder import (LAYER_STAGES, MODEL_STAGES, Recorder, RecorderError,
                       stage_width)
from .config import model_config_from_hf
from .layouts import (heads_first, from_interleaved_rope, unpad_head_dim,
                      ring_rows)

__version__ = "0.1.0"

__all__ = ["Recorder", "RecorderError", "LAYER_STAGES", "MODEL_STAGES", "stage_width",
           "model_config_from_hf", "heads_first", "from_interleaved_rope",
           "unpad_head_dim", "ring_rows", "__version__"]
