/* gguf.h — writing kvdiff's weights as a GGUF file that llama.cpp runs.
 *
 * A file format writer only (no libllama): the same weights the engines
 * run, laid out and named the way llama.cpp's own converter
 * (convert_hf_to_gguf.py, release v0.5.0) writes them, so that llama.cpp
 * computes the same function as kvdiff's reference:
 *   - tensor names token_embd, blk.N.attn_q, ..., output_norm, output;
 *   - Llama: q/k rows (and q/k biases, with attention_bias) permuted to
 *     llama.cpp's interleaved RoPE layout; o_proj's bias as attn_output.bias;
 *   - Qwen3: arch "qwen3", q_norm/k_norm as attn_q_norm/attn_k_norm, rows as
 *     they are (NEOX RoPE rotates halves, as Hugging Face does);
 *   - Gemma 3: every RMSNorm weight stored as 1 + w; when llama.cpp's fixed
 *     attention scale (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for a
 *     62-layer model) differs from query_pre_attn_scalar^-0.5, the ratio
 *     is folded into the q_norm weights (recorded in kvdiff.q_scale_folded);
 *     sliding window, per-layer pattern (a bool array) and both RoPE bases;
 *   - RoPE scaling: linear as rope.scaling.*, llama3 as a rope_freqs tensor.
 * docs/gguf-export.md lists every key and tensor. */
#ifndef KV_GGUF_H
#define KV_GGUF_H

#include <stdint.h>
#include "config.h"
#include "err.h"
#include "model.h"

typedef enum { GGUF_OUT_F32, GGUF_OUT_F16, GGUF_OUT_BF16 } gguf_out_type;

/* Parses "f32", "f16" or "bf16". Returns 0, or -1 with e filled. */
int gguf_out_type_parse(const char *s, gguf_out_type *out, kv_err *e);

/* "f32", "f16" or "bf16" (static). */
const char *gguf_out_type_name(gguf_out_type t);

/* The type `kvdiff gen --from DIR` writes when not told: the one the
 * folder's weight matrices have (bf16 stays bf16, f16 stays f16, f32
 * f32), so the GGUF holds the checkpoint's values as they are. Matrices
 * of several types give f32, the one type holding them all exactly; note
 * (note_n bytes, "" otherwise) then says so. Norms and biases are f32
 * whatever the type. Returns 0, or -1 with e filled (no config.json or
 * weights). */
int gguf_dir_out_type(const char *dir, gguf_out_type *out, char *note, size_t note_n,
                      kv_err *e);

/* Checks that llama.cpp can run a model of config c exactly as kvdiff
 * does (architecture it has, KV-shared layers only on Gemma 4 laid out as
 * llama.cpp wires them, no sliding layers outside Gemma 3 and 4, shapes
 * its loader accepts). Returns 0, or -1 with e
 * saying what llama.cpp lacks. */
int gguf_export_check(const kv_config *c, kv_err *e);

/* Writes preset `preset` with weights drawn from `seed` (the weights
 * `kvdiff run --model PRESET --weights-seed SEED` runs) to path. The
 * tokenizer section is llama.cpp's "none" vocabulary of vocab_size ids.
 * The file is written under a temporary name in path's folder and renamed
 * into place only when complete; on error nothing is left at path (an
 * existing file there is untouched) and e says why. */
int gguf_export_preset(const char *preset, uint64_t seed, gguf_out_type t,
                       const char *path, kv_err *e);

/* Progress of the exports below: called after each tensor is written with
 * the weights written so far and in all (model.h's model_progress_fn).
 * NULL: none. The library prints nothing itself. */
typedef struct {
    model_progress_fn fn;
    void *ctx;
} gguf_progress;

/* gguf_export_preset, reporting progress to p (may be NULL). */
int gguf_export_preset_progress(const char *preset, uint64_t seed, gguf_out_type t,
                                const char *path, const gguf_progress *p, kv_err *e);

/* Writes the Hugging Face folder dir (config.json, safetensors, and
 * tokenizer.json when present: its tokens, types and merges as llama.cpp's
 * "gpt2" BPE vocabulary of vocab_size ids) to path, as gguf_export_preset
 * does. Refuses a path that is one of the folder's input files. Added
 * tokens with an id past vocab_size (Gemma 3's image placeholder) are left
 * out, as llama.cpp's converter does. */
int gguf_export_dir(const char *dir, gguf_out_type t, const char *path, kv_err *e);

/* The same, reporting progress to p (may be NULL) and filling note
 * (note_n bytes; "" when there is nothing to say) with a remark worth
 * printing: the added tokens left out. */
int gguf_export_dir_progress(const char *dir, gguf_out_type t, const char *path,
                             const gguf_progress *p, char *note, size_t note_n, kv_err *e);

#endif
