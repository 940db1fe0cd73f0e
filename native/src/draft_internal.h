/*
 * draft_internal.h -- pieces shared by draft.c (drafting), cursor.c
 * (per-request state) and batch.c.
 */
#ifndef AS_DRAFT_INTERNAL_H
#define AS_DRAFT_INTERNAL_H

#include "tree_internal.h"

/* Trees one draft may use: up to AS_MAX_GLOBALS global trees plus the
 * per-request tree. */
#define MAX_SIDES (AS_MAX_GLOBALS + 1)

/* A match point in several trees at once (one per side). */
typedef struct mpoint {
    point p[MAX_SIDES];
    uint8_t has[MAX_SIDES];
} mpoint;

typedef struct cont {
    int32_t tok;
    uint32_t cnt; /* summed over sides */
    mpoint next;
} cont;

typedef struct heap_ent {
    double d;
    uint64_t order;
    int32_t parent;
    int32_t tok;
    uint32_t depth; /* pattern length + depth in the draft */
    mpoint pt;
} heap_ent;

/* Growable scratch owned by a cursor (or by one as_draft_context call). */
typedef struct scratch {
    uint64_t *acct;
    cont *conts;
    uint32_t conts_cap;
    heap_ent *heap;
    uint32_t heap_cap;
    int32_t *tok[2];
    int32_t *par[2];
    float *prob[2];
    double *sum; /* sum[k]: score of the first k tokens of the last run walk */
    uint32_t cap;
} scratch;

void scratch_free(scratch *s);

/* Candidate patterns for one draft.  Side s is a tree with a match point
 * pts[s][p] for every pattern length 1 <= p <= plen_max[s]. */
typedef struct candidates {
    uint32_t n;                        /* sides in use */
    const as_tree *tree[MAX_SIDES];
    uint32_t plen_max[MAX_SIDES];
    const point *pts[MAX_SIDES];
    uint32_t source[MAX_SIDES];        /* 1 global, 2 per-request */
    uint32_t gindex[MAX_SIDES];        /* index among the caller's global trees */
} candidates;

int draft_select(scratch *sc, const candidates *cand, const as_draft_params *params,
                 as_draft_out *out);

int draft_params_check(const as_draft_params *p);

#endif
