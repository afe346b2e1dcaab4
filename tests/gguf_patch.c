/* gguf_patch.c — a GGUF copy with one metadata value rewritten, and the
 * llama.cpp recorder run from the tests (gguf_patch.h). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "gguf_patch.h"
#include "testutil.h"

/* Runs KVDIFF_LLAMA_BIN (or ./kvdiff-llama) with args; output into buf. */
int test_run_recorder(const char *args, char *buf, size_t n)
{
    const char *bin = getenv("KVDIFF_LLAMA_BIN");
    return test_run_program(bin ? bin : "./kvdiff-llama", args, buf, n);
}

int test_gemma3_gguf(const char *dir, char *out, size_t n)
{
    char args[1024];
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/hf --gguf %s/m.gguf", dir, dir);
    if (test_run_cli(args, out, n) != 0)
        return -1;
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    return test_run_cli(args, out, n) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------ */
/* One GGUF metadata value rewritten in place                           */

enum { G_U32 = 4, G_F32 = 6, G_STR = 8, G_ARR = 9 };

static size_t gguf_scalar_size(uint32_t t)
{
    static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < sizeof sz / sizeof sz[0] ? sz[t] : 0;
}

/* Offset just past the value of type t at off, or 0 when malformed. */
static size_t gguf_skip(const unsigned char *b, size_t n, size_t off, uint32_t t)
{
    if (t == G_STR) {
        uint64_t len;
        if (off + 8 > n)
            return 0;
        memcpy(&len, b + off, 8);
        return off + 8 + len <= n ? off + 8 + (size_t)len : 0;
    }
    if (t == G_ARR) {
        uint32_t at;
        uint64_t cnt;
        if (off + 12 > n)
            return 0;
        memcpy(&at, b + off, 4);
        memcpy(&cnt, b + off + 4, 8);
        off += 12;
        for (uint64_t i = 0; i < cnt && off; i++)
            off = gguf_skip(b, n, off, at);
        return off;
    }
    size_t sz = gguf_scalar_size(t);
    return sz && off + sz <= n ? off + sz : 0;
}

/* Copies the GGUF `in` to `out` with the value of `key` (a u32 or f32)
 * replaced by v. Returns 0, -1 when the key is absent or the file bad. */
int gguf_patch(const char *in, const char *outp, const char *key, double v)
{
    FILE *f = fopen(in, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n);
    int rc = b && fread(b, 1, (size_t)n, f) == (size_t)n ? 0 : -1;
    fclose(f);
    uint64_t nkv = 0;
    if (rc == 0 && n >= 24 && !memcmp(b, "GGUF", 4))
        memcpy(&nkv, b + 16, 8);
    size_t off = 24;
    bool done = false;
    /* "name[i]": element i of an array */
    const char *br = strchr(key, '[');
    const size_t kn = br ? (size_t)(br - key) : strlen(key);
    const long elem = br ? strtol(br + 1, NULL, 10) : -1;
    for (uint64_t i = 0; rc == 0 && i < nkv && off && !done; i++) {
        uint64_t klen;
        uint32_t t;
        memcpy(&klen, b + off, 8);
        const bool hit = klen == kn && !memcmp(b + off + 8, key, klen);
        off += 8 + (size_t)klen;
        memcpy(&t, b + off, 4);
        off += 4;
        if (hit && br && t == G_ARR) {
            uint32_t at;
            uint64_t cnt;
            memcpy(&at, b + off, 4);
            memcpy(&cnt, b + off + 4, 8);
            const size_t es = gguf_scalar_size(at);
            const size_t at_off = off + 12 + (size_t)elem * es;
            if (elem >= 0 && (uint64_t)elem < cnt && es > 0 && at_off + es <= (size_t)n) {
                if (at == G_F32) {
                    float x = (float)v;
                    memcpy(b + at_off, &x, 4);
                } else if (es == 1) {
                    b[at_off] = (unsigned char)v;
                } else if (es == 4) {
                    uint32_t u = (uint32_t)(int64_t)v;
                    memcpy(b + at_off, &u, 4);
                }
                done = es == 1 || es == 4;
            }
        } else if (hit && br) {
            /* not an array: nothing to patch */
        } else if (hit && t == G_U32) {
            uint32_t u = (uint32_t)v;
            memcpy(b + off, &u, 4);
            done = true;
        } else if (hit && t == G_F32) {
            float x = (float)v;
            memcpy(b + off, &x, 4);
            done = true;
        }
        off = gguf_skip(b, (size_t)n, off, t);
    }
    if (rc == 0 && done) {
        FILE *o = fopen(outp, "wb");
        rc = o && fwrite(b, 1, (size_t)n, o) == (size_t)n ? 0 : -1;
        if (o && fclose(o) != 0)
            rc = -1;
    }
    free(b);
    return rc == 0 && done ? 0 : -1;
}


/* ------------------------------------------------------------------ */
/* F32 tensors scaled and shifted                                       */

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = len > 0 ? malloc((size_t)len) : NULL;
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)len;
    return b;
}

/* What to do to one F32 tensor of ne0 x ne1 values (x, row-major). */
typedef struct {
    double mul, add;             /* x * mul + add */
    int unpermute_head_dim;      /* > 0: undo the Llama q/k row permutation;
                                  * < 0: apply it (head_dim -value) */
    const char *swap_with;       /* the tensor named exactly `part` trades its data
                                  * with the one named this (same size) */
} tensor_edit;

static void edit_tensor(float *x, uint64_t ne0, uint64_t ne1, const tensor_edit *ed)
{
    if (ed->unpermute_head_dim == 0) {
        for (uint64_t k = 0; k < ne0 * ne1; k++)
            x[k] = (float)(x[k] * ed->mul + ed->add);
        return;
    }
    /* LlamaModel.permute moved row t*(D/2)+j of each head to 2j+t; put
     * every row back where the Hugging Face layout has it (or, negative,
     * move it there as the converter does). */
    const bool forward = ed->unpermute_head_dim < 0;
    const uint64_t D = (uint64_t)(forward ? -ed->unpermute_head_dim : ed->unpermute_head_dim),
                   half = D / 2;
    float *tmp = malloc((size_t)(ne0 * D) * sizeof(float));
    if (!tmp)
        return;
    for (uint64_t h = 0; h + D <= ne1; h += D) {
        float *head = x + h * ne0;
        for (uint64_t j = 0; j < half; j++)
            for (uint64_t t = 0; t < 2; t++)
                memcpy(tmp + (forward ? 2 * j + t : t * half + j) * ne0,
                       head + (forward ? t * half + j : 2 * j + t) * ne0,
                       (size_t)ne0 * sizeof(float));
        memcpy(head, tmp, (size_t)(ne0 * D) * sizeof(float));
    }
    free(tmp);
}

/* Copies in to outp with every F32 tensor whose name holds part edited.
 * Returns the number of tensors changed, -1 when the file is bad. */
static int gguf_edit_tensors(const char *in, const char *outp, const char *part,
                             const tensor_edit *ed)
{
    size_t n = 0;
    unsigned char *b = slurp(in, &n);
    if (!b || n < 24 || memcmp(b, "GGUF", 4)) {
        free(b);
        return -1;
    }
    uint64_t nt, nkv, align = 32;
    memcpy(&nt, b + 8, 8);
    memcpy(&nkv, b + 16, 8);
    size_t off = 24;
    for (uint64_t i = 0; i < nkv && off && off + 12 <= n; i++) {
        uint64_t klen;
        uint32_t t;
        memcpy(&klen, b + off, 8);
        const bool al = klen == 17 && !memcmp(b + off + 8, "general.alignment", 17);
        off += 8 + (size_t)klen;
        memcpy(&t, b + off, 4);
        off += 4;
        if (al && t == G_U32) {
            uint32_t a;
            memcpy(&a, b + off, 4);
            align = a;
        }
        off = gguf_skip(b, n, off, t);
    }
    /* Tensor infos: name, dims, type, offset into the aligned data. */
    struct { size_t name, nlen; uint64_t ne0, ne1, at; uint32_t type; } *ti =
        calloc((size_t)nt + 1, sizeof *ti);
    for (uint64_t i = 0; ti && i < nt && off && off + 8 <= n; i++) {
        memcpy(&ti[i].nlen, b + off, 8);
        ti[i].name = off + 8;
        off += 8 + ti[i].nlen;
        uint32_t nd;
        memcpy(&nd, b + off, 4);
        off += 4;
        ti[i].ne1 = 1;
        for (uint32_t k = 0; k < nd; k++, off += 8) {
            uint64_t dim;
            memcpy(&dim, b + off, 8);
            if (k == 0)
                ti[i].ne0 = dim;
            else
                ti[i].ne1 *= dim;
        }
        memcpy(&ti[i].type, b + off, 4);
        memcpy(&ti[i].at, b + off + 4, 8);
        off += 12;
    }
    const size_t data = (off + align - 1) / align * align;
    int changed = ti && off ? 0 : -1;
    if (changed >= 0 && ed->swap_with) {
        /* Two weights exchanged (an exporter that mixed up their names). */
        int64_t x = -1, y = -1;
        for (uint64_t i = 0; i < nt; i++) {
            const char *nm = (const char *)b + ti[i].name;
            if (ti[i].nlen == strlen(part) && !memcmp(nm, part, ti[i].nlen))
                x = (int64_t)i;
            if (ti[i].nlen == strlen(ed->swap_with) && !memcmp(nm, ed->swap_with, ti[i].nlen))
                y = (int64_t)i;
        }
        const uint64_t cnt = x >= 0 ? ti[x].ne0 * ti[x].ne1 : 0;
        unsigned char *tmp = cnt ? malloc((size_t)cnt * 4) : NULL;
        if (x < 0 || y < 0 || ti[x].type != 0 || ti[y].type != 0 ||
            ti[y].ne0 * ti[y].ne1 != cnt || data + ti[x].at + cnt * 4 > n ||
            data + ti[y].at + cnt * 4 > n || !tmp) {
            changed = -1;
        } else {
            memcpy(tmp, b + data + ti[x].at, (size_t)cnt * 4);
            memmove(b + data + ti[x].at, b + data + ti[y].at, (size_t)cnt * 4);
            memcpy(b + data + ti[y].at, tmp, (size_t)cnt * 4);
            changed = 2;
        }
        free(tmp);
        nt = 0;   /* nothing else edited */
    }
    for (uint64_t i = 0; changed >= 0 && i < nt; i++) {
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)ti[i].nlen, (const char *)b + ti[i].name);
        if (!strstr(name, part) || ti[i].type != 0)
            continue;
        const uint64_t count = ti[i].ne0 * ti[i].ne1;
        if (data + ti[i].at + count * 4 > n || (data + ti[i].at) % 4) {
            changed = -1;
            break;
        }
        float *x = malloc((size_t)count * sizeof(float));
        if (!x) {
            changed = -1;
            break;
        }
        memcpy(x, b + data + ti[i].at, (size_t)count * 4);
        edit_tensor(x, ti[i].ne0, ti[i].ne1, ed);
        memcpy(b + data + ti[i].at, x, (size_t)count * 4);
        free(x);
        changed++;
    }
    if (changed >= 0) {
        FILE *o = fopen(outp, "wb");
        if (!o || fwrite(b, 1, n, o) != n)
            changed = -1;
        if (o && fclose(o) != 0)
            changed = -1;
    }
    free(ti);
    free(b);
    return changed;
}

int gguf_scale_tensors(const char *in, const char *outp, const char *part, double mul)
{
    return gguf_affine_tensors(in, outp, part, mul, 0.0);
}

int gguf_swap_tensors(const char *in, const char *outp, const char *a, const char *b)
{
    const tensor_edit ed = {.mul = 1, .swap_with = b};
    return gguf_edit_tensors(in, outp, a, &ed);
}

int gguf_affine_tensors(const char *in, const char *outp, const char *part, double mul,
                        double add)
{
    const tensor_edit ed = {.mul = mul, .add = add};
    return gguf_edit_tensors(in, outp, part, &ed);
}

int gguf_unpermute_rows(const char *in, const char *outp, const char *part, int head_dim)
{
    const tensor_edit ed = {.mul = 1, .unpermute_head_dim = head_dim};
    return head_dim >= 2 && head_dim % 2 == 0 ? gguf_edit_tensors(in, outp, part, &ed) : -1;
}

int gguf_permute_rows(const char *in, const char *outp, const char *part, int head_dim)
{
    const tensor_edit ed = {.mul = 1, .unpermute_head_dim = -head_dim};
    return head_dim >= 2 && head_dim % 2 == 0 ? gguf_edit_tensors(in, outp, part, &ed) : -1;
}

/* ------------------------------------------------------------------ */
/* The same weights under another architecture                          */

/* Bytes per element of the tensor types the exporter writes (F32, F16,
 * BF16); 0 for any other. */
static size_t tensor_type_size(uint32_t type)
{
    return type == 0 ? 4 : type == 1 || type == 30 ? 2 : 0;
}

static bool put(FILE *o, const void *p, size_t n)
{
    return fwrite(p, 1, n, o) == n;
}

static bool put_str(FILE *o, const char *s, size_t n)
{
    const uint64_t len = n;
    return put(o, &len, 8) && put(o, s, n);
}

static bool put_pad(FILE *o, uint64_t *at, uint64_t align)
{
    static const unsigned char zero[256];
    const uint64_t pad = (align - *at % align) % align;
    *at += pad;
    return pad <= sizeof zero && put(o, zero, (size_t)pad);
}

int gguf_rearch(const char *in, const char *outp, const char *arch, const char *const *drop)
{
    size_t n = 0;
    unsigned char *b = slurp(in, &n);
    if (!b || n < 24 || memcmp(b, "GGUF", 4)) {
        free(b);
        return -1;
    }
    uint64_t nt, nkv, align = 32;
    memcpy(&nt, b + 8, 8);
    memcpy(&nkv, b + 16, 8);
    /* First pass: the old architecture and the alignment. */
    char old[64] = "";
    size_t off = 24;
    for (uint64_t i = 0; i < nkv && off && off + 12 <= n; i++) {
        uint64_t klen, vlen;
        uint32_t t;
        memcpy(&klen, b + off, 8);
        const char *key = (const char *)b + off + 8;
        off += 8 + (size_t)klen;
        memcpy(&t, b + off, 4);
        off += 4;
        if (klen == 20 && !memcmp(key, "general.architecture", 20) && t == G_STR) {
            memcpy(&vlen, b + off, 8);
            snprintf(old, sizeof old, "%.*s", (int)(vlen < 63 ? vlen : 63),
                     (const char *)b + off + 8);
        }
        if (klen == 17 && !memcmp(key, "general.alignment", 17) && t == G_U32) {
            uint32_t a;
            memcpy(&a, b + off, 4);
            align = a;
        }
        off = gguf_skip(b, n, off, t);
    }
    FILE *o = off && old[0] && align > 0 && align <= 256 ? fopen(outp, "wb") : NULL;
    if (!o) {
        free(b);
        return -1;
    }
    const size_t olen = strlen(old);
    bool ok = put(o, b, 24);
    /* Metadata: the architecture's value and every "<old>." key renamed. */
    off = 24;
    for (uint64_t i = 0; ok && i < nkv; i++) {
        uint64_t klen;
        uint32_t t;
        memcpy(&klen, b + off, 8);
        const char *key = (const char *)b + off + 8;
        const size_t vstart = off + 8 + (size_t)klen + 4;
        memcpy(&t, b + vstart - 4, 4);
        const size_t vend = gguf_skip(b, n, vstart, t);
        ok = vend != 0;
        if (ok && klen == 20 && !memcmp(key, "general.architecture", 20)) {
            ok = put(o, b + off, vstart - off) && put_str(o, arch, strlen(arch));
        } else if (ok && klen > olen && !memcmp(key, old, olen) && key[olen] == '.') {
            char name[256];
            snprintf(name, sizeof name, "%s%.*s", arch, (int)(klen - olen), key + olen);
            ok = put_str(o, name, strlen(name)) && put(o, b + vstart - 4, vend - vstart + 4);
        } else if (ok) {
            ok = put(o, b + off, vend - off);
        }
        off = vend;
    }
    /* Tensor infos: the dropped ones left out, the others' data packed. */
    struct { size_t info, info_len, src, bytes; bool keep; } *ti =
        calloc((size_t)nt + 1, sizeof *ti);
    uint64_t kept = 0, at = 0;
    ok = ok && ti;
    for (uint64_t i = 0; ok && i < nt; i++) {
        uint64_t nlen, count = 1, src;
        uint32_t nd, type;
        memcpy(&nlen, b + off, 8);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(nlen < 255 ? nlen : 255),
                 (const char *)b + off + 8);
        ti[i].info = off;
        off += 8 + nlen;
        memcpy(&nd, b + off, 4);
        off += 4;
        for (uint32_t k = 0; k < nd; k++, off += 8) {
            uint64_t dim;
            memcpy(&dim, b + off, 8);
            count *= dim;
        }
        memcpy(&type, b + off, 4);
        memcpy(&src, b + off + 4, 8);
        ti[i].info_len = off + 4 - ti[i].info;
        off += 12;
        ti[i].src = (size_t)src;
        ti[i].bytes = (size_t)(count * tensor_type_size(type));
        ti[i].keep = true;
        for (const char *const *d = drop; d && *d; d++)
            if (strstr(name, *d))
                ti[i].keep = false;
        ok = ti[i].bytes > 0 && off <= n;
        kept += ti[i].keep;
    }
    const size_t data = (off + align - 1) / align * align;
    for (uint64_t i = 0; ok && i < nt; i++)
        ok = data + ti[i].src + ti[i].bytes <= n;
    if (ok) {
        /* The tensor count in the header, then the kept infos. */
        ok = fseek(o, 8, SEEK_SET) == 0 && put(o, &kept, 8) && fseek(o, 0, SEEK_END) == 0;
    }
    for (uint64_t i = 0; ok && i < nt; i++) {
        if (!ti[i].keep)
            continue;
        ok = put(o, b + ti[i].info, ti[i].info_len) && put(o, &at, 8);
        at += ti[i].bytes;
        at = (at + align - 1) / align * align;
    }
    long pos = ok ? ftell(o) : -1;
    uint64_t here = pos >= 0 ? (uint64_t)pos : 0;
    ok = ok && pos >= 0 && put_pad(o, &here, align);
    for (uint64_t i = 0, rel = 0; ok && i < nt; i++) {
        if (!ti[i].keep)
            continue;
        ok = put(o, b + data + ti[i].src, ti[i].bytes);
        rel += ti[i].bytes;
        ok = ok && put_pad(o, &rel, align);
    }
    if (fclose(o) != 0)
        ok = false;
    free(ti);
    free(b);
    return ok ? (int)(nt - kept) : -1;
}
