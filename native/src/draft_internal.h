/*
 * draft_internal.h -- pieces shared by draft.c (drafting), cursor.c
 * (per-request state) and batch.c.
 */
#ifndef AS_DRAFT_INTERNAL_H
#define AS_DRAFT_INTERNAL_H

#include "tree_internal.h"

/* A match point in up to two trees at once (side 0 global, side 1 local). */
typedef struct mpoint {
    point p[2];
    uint8_t has[2];
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

typedef struct cand_p {
    uint32_t p, bound;
} cand_p;

/* Growable scratch owned by a cursor (or by one as_draft_context call). */
typedef struct scratch {
    uint64_t *acct;
    cont *conts;
    uint32_t conts_cap;
    heap_ent *heap;
    uint32_t heap_cap;
    cand_p *order; /* candidate patterns sorted by bound */
    uint32_t order_cap;
    int32_t *tok[2];
    int32_t *par[2];
    float *prob[2];
    uint32_t cap;
} scratch;

void scratch_free(scratch *s);

/* Candidate patterns for one draft: for p in [1, P], where each side has
 * a point (or not).  side_ok[s] says the side is in use at all. */
typedef struct candidates {
    const as_tree *tree[2];
    uint32_t plen_max[2];      /* longest p with a point, per side */
    const point *pts[2];       /* pts[s][p] for 1 <= p <= plen_max[s] */
} candidates;

int draft_select(scratch *sc, const candidates *cand, const as_draft_params *params,
                 as_draft_out *out);

int draft_params_check(const as_draft_params *p);

#endif
