/*
 * batch.c -- one call drafts for a whole decode step.
 *
 * Item i appends its new tokens to cursor i and drafts from it and its
 * global trees (as_draft_multi: e.g. a stage shard, a pipeline-wide tree and
 * a pushed shard) into row i of caller-owned arrays, with at most caps[i]
 * tokens.  as_draft_batch is the one-global-tree-per-item special case.  Items are independent, so with n_threads > 1
 * worker threads take items from a shared atomic counter (cheap dynamic
 * balancing: one long match does not stall a static slice).  The calling
 * thread works too.  Nothing here touches Python, so a CFFI caller runs
 * with the GIL released.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "alloc.h"
#include "draft_internal.h"

typedef struct batch_job {
    as_cursor *const *cursors;
    const as_tree *const *globals;
    uint32_t globals_stride;
    const uint32_t *n_globals;
    size_t n_items;
    const int32_t *new_tokens;
    const uint64_t *offsets;
    const as_draft_params *params;
    const uint32_t *caps;
    int32_t *tokens, *parents;
    float *probs;
    uint32_t stride;
    uint32_t *n_out, *match_len, *source, *global_index;
    double *score;
    int32_t *statuses;
    _Atomic size_t next;
    _Atomic int first_error;
} batch_job;

static void run_item(batch_job *j, size_t i) {
    int rc = AS_OK;
    as_cursor *c = j->cursors[i];
    if (c == NULL) rc = AS_ERR_INVALID_ARG;
    if (rc == AS_OK && j->new_tokens != NULL) {
        uint64_t a = j->offsets[i], b = j->offsets[i + 1];
        rc = as_cursor_extend(c, j->new_tokens + a, (size_t)(b - a));
    }
    as_draft_out out;
    memset(&out, 0, sizeof out);
    uint32_t cap = j->caps != NULL ? j->caps[i] : j->params->max_spec_tokens;
    if (rc == AS_OK && cap > 0) {
        size_t row = i * (size_t)j->stride;
        out.tokens = j->tokens + row;
        out.parents = j->parents + row;
        out.probs = j->probs + row;
        out.cap = j->stride;
        const as_tree *const *g = NULL;
        size_t ng = 0;
        if (j->globals != NULL) {
            g = j->globals + i * (size_t)j->globals_stride;
            ng = j->n_globals != NULL ? j->n_globals[i] : 1;
        }
        if (cap < j->params->max_spec_tokens) {
            as_draft_params p = *j->params;
            p.max_spec_tokens = cap;
            rc = as_draft_multi(c, g, ng, &p, &out);
        } else {
            rc = as_draft_multi(c, g, ng, j->params, &out);
        }
    }
    if (rc != AS_OK) {
        out.n = 0;
        out.match_len = 0;
        out.source = 0;
        out.score = 0.0;
        out.global_index = 0;
        int expected = AS_OK;
        atomic_compare_exchange_strong(&j->first_error, &expected, rc);
    }
    j->n_out[i] = out.n;
    if (j->match_len) j->match_len[i] = out.match_len;
    if (j->source) j->source[i] = out.source;
    if (j->global_index) j->global_index[i] = out.global_index;
    if (j->score) j->score[i] = out.score;
    if (j->statuses) j->statuses[i] = rc;
}

static void *worker(void *arg) {
    batch_job *j = arg;
    for (;;) {
        size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items) break;
        run_item(j, i);
    }
    return NULL;
}

#define MAX_THREADS 64

int as_draft_batch_multi(as_cursor *const *cursors, const as_tree *const *globals,
                         uint32_t globals_stride, const uint32_t *n_globals, size_t n_items,
                         const int32_t *new_tokens, const uint64_t *offsets, const uint32_t *caps,
                         const as_draft_params *params, const as_batch_out *out,
                         uint32_t n_threads) {
    if (n_items == 0) return AS_OK;
    if (cursors == NULL || out == NULL || out->tokens == NULL || out->parents == NULL ||
        out->probs == NULL || out->n_out == NULL)
        return AS_ERR_INVALID_ARG;
    if (new_tokens != NULL && offsets == NULL) return AS_ERR_INVALID_ARG;
    if (globals != NULL && n_globals != NULL) {
        if (globals_stride == 0 || globals_stride > AS_MAX_GLOBALS) return AS_ERR_INVALID_ARG;
        for (size_t i = 0; i < n_items; i++)
            if (n_globals[i] > globals_stride) return AS_ERR_INVALID_ARG;
    } else if (globals != NULL && globals_stride == 0) {
        return AS_ERR_INVALID_ARG; /* one tree per item needs a stride >= 1 */
    }
    int rc = draft_params_check(params);
    if (rc != AS_OK) return rc;
    if (out->stride < params->max_spec_tokens) return AS_ERR_CAPACITY;
    if (as_mul_size(n_items, out->stride) == 0) return AS_ERR_CAPACITY;
    if (new_tokens != NULL)
        for (size_t i = 0; i < n_items; i++)
            if (offsets[i + 1] < offsets[i]) return AS_ERR_INVALID_ARG;
    batch_job j;
    memset(&j, 0, sizeof j);
    j.cursors = cursors;
    j.globals = globals;
    j.globals_stride = globals_stride;
    j.n_globals = n_globals;
    j.n_items = n_items;
    j.new_tokens = new_tokens;
    j.offsets = offsets;
    j.params = params;
    j.caps = caps;
    j.tokens = out->tokens;
    j.parents = out->parents;
    j.probs = out->probs;
    j.stride = out->stride;
    j.n_out = out->n_out;
    j.match_len = out->match_len;
    j.source = out->source;
    j.global_index = out->global_index;
    j.score = out->score;
    j.statuses = out->statuses;
    atomic_init(&j.next, 0);
    atomic_init(&j.first_error, AS_OK);
    uint32_t extra = n_threads > 1 ? n_threads - 1 : 0;
    if (extra > MAX_THREADS) extra = MAX_THREADS;
    if (extra >= n_items) extra = (uint32_t)(n_items - 1);
    pthread_t tid[MAX_THREADS];
    uint32_t started = 0;
    /* A thread that cannot start only means fewer workers: the calling
     * thread drains the queue either way, so every item is processed. */
    while (started < extra && pthread_create(&tid[started], NULL, worker, &j) == 0) started++;
    worker(&j);
    for (uint32_t k = 0; k < started; k++) pthread_join(tid[k], NULL);
    return atomic_load(&j.first_error);
}

int as_draft_batch(as_cursor *const *cursors, const as_tree *const *globals, size_t n_items,
                   const int32_t *new_tokens, const uint64_t *offsets,
                   const as_draft_params *params, int32_t *tokens, int32_t *parents,
                   float *probs, uint32_t stride, uint32_t *n_out, uint32_t *match_len,
                   uint32_t *source, double *score, int32_t *statuses, uint32_t n_threads) {
    as_batch_out out = {tokens, parents, probs, stride, n_out, match_len, source, NULL, score,
                        statuses};
    return as_draft_batch_multi(cursors, globals, 1, NULL, n_items, new_tokens, offsets, NULL,
                                params, &out, n_threads);
}
