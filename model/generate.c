/* generate.c — the prefill-then-decode loop shared by every engine. */
#include "generate.h"

#include <stdlib.h>
#include <string.h>

bool config_is_eos(const kv_config *c, int32_t id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id)
            return true;
    return false;
}

static int announce(kv_observer *obs, int64_t pos, int32_t id, int is_prompt)
{
    return (obs && obs->token) ? obs->token(obs, pos, id, is_prompt) : 0;
}

int generate(kv_engine *eng, const kv_config *c, const int32_t *prompt, int n_prompt,
             const gen_opts *o, kv_observer *obs, gen_result *out, kv_err *e)
{
    const size_t V = (size_t)c->vocab;
    sampler smp;
    memset(&smp, 0, sizeof smp);
    memset(out, 0, sizeof *out);
    if (n_prompt <= 0)
        return kv_errf(e, "the prompt is empty");
    if (o->max_new < 0)
        return kv_errf(e, "max-new %d must be >= 0", o->max_new);
    out->tokens = malloc(((size_t)n_prompt + (size_t)o->max_new) * sizeof(int32_t));
    out->prefill_logits = malloc(V * sizeof(float));
    if (o->keep_logits && o->max_new > 0)
        out->step_logits = malloc((size_t)o->max_new * V * sizeof(float));
    if (!out->tokens || !out->prefill_logits || (o->keep_logits && o->max_new > 0 && !out->step_logits))
        return kv_errf(e, "out of memory for %d tokens", n_prompt + o->max_new);
    for (int i = 0; o->follow && i < o->max_new; i++)
        if (o->follow[i] < 0 || o->follow[i] >= c->vocab)
            return kv_errf(e, "followed token %d (generated token %d) is outside the "
                           "vocabulary (0..%d)", o->follow[i], i, c->vocab - 1);
    if (!o->follow && sampler_init(&smp, &o->samp, o->seed, c->vocab, e) < 0)
        return -1;

    memcpy(out->tokens, prompt, (size_t)n_prompt * sizeof(int32_t));
    out->n_prompt = n_prompt;
    int64_t pos0 = eng->position(eng);
    int rc = 0;
    for (int i = 0; i < n_prompt && rc == 0; i++)
        if (announce(obs, pos0 + i, prompt[i], 1))
            rc = 1, kv_errf(e, "stopped by the observer");
    if (rc == 0)
        rc = eng->forward(eng, prompt, n_prompt, out->prefill_logits, e);
    float *cur = malloc(V * sizeof(float));
    if (!cur && rc == 0)
        rc = kv_errf(e, "out of memory");
    const float *logits = out->prefill_logits;
    while (rc == 0 && out->n_new < o->max_new) {
        if (o->keep_logits)
            memcpy(out->step_logits + (size_t)out->n_new * V, logits, V * sizeof(float));
        /* followed: the other run's token, whatever these logits prefer */
        int32_t next = o->follow ? o->follow[out->n_new] : sampler_pick(&smp, logits);
        out->tokens[n_prompt + out->n_new++] = next;
        if (announce(obs, eng->position(eng), next, 0)) {
            rc = 1;
            kv_errf(e, "stopped by the observer");
            break;
        }
        if (!o->ignore_eos && !o->follow && config_is_eos(c, next)) {
            out->stopped_at_eos = true;
            break;
        }
        if (out->n_new == o->max_new)
            break;
        rc = eng->forward(eng, &next, 1, cur, e);
        logits = cur;
    }
    free(cur);
    sampler_free(&smp);
    return rc;
}

void gen_result_free(gen_result *r)
{
    if (!r)
        return;
    free(r->tokens);
    free(r->step_logits);
    free(r->prefill_logits);
    memset(r, 0, sizeof *r);
}
