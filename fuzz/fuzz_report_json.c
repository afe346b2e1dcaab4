// fuzz-sources: model/err.c model/config.c model/outfile.c model/tokens.c model/kernels.c model/kernels_x86.c model/pool.c model/observer.c compare/compare.c compare/core.c compare/metrics.c compare/render.c compare/diag/diagnose.c compare/diag/core.c compare/diag/keysets.c compare/diag/keyfams.c compare/diag/rows.c compare/diag/rope.c compare/diag/norms.c compare/diag/sharing.c compare/recompute.c compare/tokens.c compare/memrec.c reports/jsonin.c model/infile.c compare/crossrt.c compare/structure.c compare/diag/maps.c compare/attn_audit.c compare/f16acc.c model/safetensors.c compare/hashcheck.c compare/roles.c compare/rotations.c compare/diag/mla.c compare/diag/sinks.c model/forward.c model/mla.c model/model.c dump/settings.c model/families/*.c model/pcg32.c
// fuzz-pkgs: libxxhash
/* fuzz_report_json.c — the reader of saved compare results (`kvdiff report
 * result.json`) on arbitrary bytes: it must never crash, refuse with one
 * line naming the file, and on success hand back a result the renderers
 * can print (text and JSON) without reading outside it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "reports/report.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/fuzz_report_%ld.json", (long)getpid());
    FILE *f = fopen(path, "wb");
    if (!f)
        return 0;
    if (fwrite(data, 1, size, f) != size) {
        fclose(f);
        return 0;
    }
    fclose(f);
    report_json j;
    kv_err e = {{0}};
    if (report_json_load(path, &j, &e) < 0) {
        if (!strstr(e.msg, path) || strchr(e.msg, '\n'))
            abort();   /* one line, naming the file */
    } else {
        char *t = cmp_render_text(&j.r, CMP_RENDER_STAGES);
        char *js = cmp_render_json(&j.r, CMP_RENDER_STAGES);
        if (!t || !js)
            abort();
        free(t);
        free(js);
    }
    report_json_free(&j);
    unlink(path);
    return 0;
}
