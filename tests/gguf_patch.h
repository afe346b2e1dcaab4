/* gguf_patch.h — test helpers for bugs made inside real llama.cpp: a GGUF
 * copy with one metadata value rewritten (the exporter writing a wrong
 * value), and running the llama.cpp recorder. */
#ifndef KV_TEST_GGUF_PATCH_H
#define KV_TEST_GGUF_PATCH_H

#include <stddef.h>

/* Copies the GGUF `in` to `out` with the value of `key` (a u32 or f32)
 * replaced by v; "key[i]": element i of an array of 1- or 4-byte values
 * (a bool of a layer pattern). Returns 0, -1 when the key is absent or
 * the file bad. */
int gguf_patch(const char *in, const char *out, const char *key, double v);

/* Copies the GGUF `in` to `out` with every F32 tensor whose name holds
 * `part` multiplied by mul (a weight the exporter got wrong). Returns
 * the number of tensors changed, -1 when the file is bad. */
int gguf_scale_tensors(const char *in, const char *out, const char *part, double mul);

/* As gguf_scale_tensors, each value x written as x * mul + add (an
 * exporter that drops Gemma's + 1 from a norm weight: mul 1, add -1). */
int gguf_affine_tensors(const char *in, const char *out, const char *part, double mul,
                        double add);

/* Copies the GGUF `in` to `out` with the F32 tensors named exactly a and b
 * (of one size) trading their data: an exporter that swapped two weights.
 * Returns 2, -1 when the file is bad or either is missing. */
int gguf_swap_tensors(const char *in, const char *out, const char *a, const char *b);

/* Copies the GGUF `in` to `out` with the rows of every F32 tensor whose
 * name holds `part` put back in the Hugging Face order, undoing the
 * Llama q/k permutation the exporter applies (head_dim rows per head):
 * a Llama GGUF exported without it. Returns the number of tensors
 * changed, -1 when the file is bad. */
int gguf_unpermute_rows(const char *in, const char *out, const char *part, int head_dim);

/* The inverse of gguf_unpermute_rows: Hugging Face rows put in the order
 * llama.cpp's converter gives a Llama GGUF's q and k. */
int gguf_permute_rows(const char *in, const char *out, const char *part, int head_dim);

/* Copies the GGUF `in` to `out` as architecture `arch`: general.architecture
 * set to it, every key under the old architecture's prefix renamed ("qwen3.
 * rope.freq_base" to "llama.rope.freq_base"), and every tensor whose name
 * holds one of the NULL-terminated `drop` left out (a converter that
 * exports a model as an architecture without those weights). Tensors must
 * be F32, F16 or BF16. Returns the number of tensors dropped, -1 when the
 * file is bad. */
int gguf_rearch(const char *in, const char *out, const char *arch, const char *const *drop);

/* Runs KVDIFF_LLAMA_BIN (or ./kvdiff-llama) with args (a shell-quoted
 * string); stdout and stderr into buf (NUL-terminated, truncated to n).
 * Returns the exit code. */
int test_run_recorder(const char *args, char *buf, size_t n);

/* tiny-gemma3 (window 12, local RoPE base 1e4, global 1e6) as dir/hf and
 * exported as dir/m.gguf, and the reference on a 100-token prompt past
 * the window as dir/ref.h5. 0, or -1 with the failing step's output in out. */
int test_gemma3_gguf(const char *dir, char *out, size_t n);

#endif
