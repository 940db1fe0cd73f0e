/*
 * cursor.c -- one request's drafting state.
 *
 * A cursor holds the request's context (the last max_depth tokens in a
 * ring), an optional per-request tree whose single open sequence IS the
 * context, and an incremental match state against the last global tree it
 * drafted from.
 *
 * Per-request tree: the open sequence already keeps the endpoint node of
 * each of its windows shorter than max_depth, and the window of length p
 * ending at the context's end spells exactly the pattern of length p.  So
 * the match points of all patterns come for free from that ring: no walk.
 *
 * Global trees: the cursor keeps one match state per global tree it drafts
 * from (up to AS_MAX_GLOBALS, least recently used replaced), keyed by the
 * tree's uid.  In each, gloc[p] is the point of the pattern of length p, for
 * p = 1..gm (patterns are suffix-closed: if length p occurs, so does every
 * shorter one).  A new context token t turns gloc[p] into gloc'[p+1] =
 * step(gloc[p], t) and adds gloc'[1] = step(root, t): O(gm) per token, no
 * re-walk per p.  Points name a node plus its generation; a node that was
 * freed since (eviction, merge) fails the generation check and the state is
 * rebuilt from the last max_depth tokens.  A split above a point's node is
 * repaired by climbing to the ancestor whose edge holds the point.  Points
 * are checked only when the tree's epoch moved since the last sync (while a
 * request decodes, its shards are mostly unchanged).  If the
 * tree grew since the last sync, patterns longer than gm may now occur;
 * they are tried by root walks until the first miss.
 */
#include <string.h>

#include "alloc.h"
#include "draft_internal.h"

typedef struct gpoint {
    uint32_t node, gen, x;
} gpoint;

/* Incremental match state against one global tree. */
typedef struct gstate {
    uint64_t uid;  /* tree instance (0: slot unused) */
    uint64_t grow;  /* tree's grow_epoch at the last sync */
    uint64_t epoch; /* tree's epoch at the last sync: unchanged means no point moved */
    uint64_t pos;  /* context length at the last sync */
    uint64_t used; /* last use, for LRU replacement */
    uint32_t m;    /* patterns 1..m occur */
    gpoint *loc, *tmp;
} gstate;

struct as_cursor {
    uint64_t bytes;
    uint32_t max_depth; /* ring size; patterns are at most max_depth - 1 long */
    uint32_t flags;
    as_tree *local;
    int32_t *hist;
    uint64_t len;
    uint64_t clock;
    gstate gs[AS_MAX_GLOBALS];
    point *pts[MAX_SIDES]; /* candidate points handed to draft_select */
    scratch sc;
};

#define LOCAL_SEQ 0

static size_t gp_bytes(const as_cursor *c) { return sizeof(gpoint) * ((size_t)c->max_depth + 1); }
static size_t pt_bytes(const as_cursor *c) { return sizeof(point) * ((size_t)c->max_depth + 1); }

as_cursor *as_cursor_create(uint32_t max_depth, uint32_t flags, int *status) {
    int rc = AS_OK;
    as_cursor *c = NULL;
    if (max_depth < 2 || max_depth > AS_MAX_DEPTH_LIMIT || (flags & ~AS_CURSOR_LOCAL_TREE)) {
        rc = AS_ERR_INVALID_ARG;
        goto out;
    }
    uint64_t bytes = 0;
    c = as_xcalloc(&bytes, 1, sizeof *c);
    if (c == NULL) {
        rc = AS_ERR_NOMEM;
        goto out;
    }
    as_handle_opened();
    c->bytes = bytes;
    c->max_depth = max_depth;
    c->flags = flags;
    c->sc.acct = &c->bytes;
    c->hist = as_xmalloc(&c->bytes, sizeof(int32_t) * max_depth);
    if (c->hist == NULL) rc = AS_ERR_NOMEM;
    if (rc == AS_OK && (flags & AS_CURSOR_LOCAL_TREE)) {
        c->local = as_tree_create(max_depth, &rc);
        if (rc == AS_OK) rc = as_tree_append(c->local, LOCAL_SEQ, NULL, 0);
    }
    if (rc != AS_OK) {
        as_cursor_free(c);
        c = NULL;
    }
out:
    if (status) *status = rc;
    return c;
}

void as_cursor_free(as_cursor *c) {
    if (c == NULL) return;
    as_tree_free(c->local);
    uint64_t *acct = &c->bytes;
    scratch_free(&c->sc);
    as_xfree(acct, c->hist, sizeof(int32_t) * c->max_depth);
    for (int i = 0; i < AS_MAX_GLOBALS; i++) {
        as_xfree(acct, c->gs[i].loc, gp_bytes(c));
        as_xfree(acct, c->gs[i].tmp, gp_bytes(c));
    }
    for (int i = 0; i < MAX_SIDES; i++) as_xfree(acct, c->pts[i], pt_bytes(c));
    uint64_t self = 0;
    as_xfree(&self, c, sizeof *c);
    as_handle_closed();
}

int as_cursor_extend(as_cursor *c, const int32_t *tokens, size_t n) {
    if (c == NULL || (tokens == NULL && n > 0)) return AS_ERR_INVALID_ARG;
    int rc = tokens_valid(tokens, n);
    if (rc != AS_OK) return rc;
    if (c->local != NULL) {
        rc = as_tree_append(c->local, LOCAL_SEQ, tokens, n);
        if (rc != AS_OK) {
            /* keep the history in step with whatever prefix the tree took */
            uint64_t len = 0;
            (void)as_tree_seq_len(c->local, LOCAL_SEQ, &len);
            n = (size_t)(len - c->len);
            for (size_t i = 0; i < n; i++) c->hist[(c->len + i) % c->max_depth] = tokens[i];
            c->len += n;
            return rc;
        }
    }
    for (size_t i = 0; i < n; i++) c->hist[(c->len + i) % c->max_depth] = tokens[i];
    c->len += n;
    return AS_OK;
}

uint64_t as_cursor_len(const as_cursor *c) { return c ? c->len : 0; }

const as_tree *as_cursor_local_tree(const as_cursor *c) { return c ? c->local : NULL; }

static inline int32_t ctx_at(const as_cursor *c, uint64_t i) { return c->hist[i % c->max_depth]; }

/* Is a cached point still valid?  Repairs splits in place. */
static int gpoint_fix(const as_tree *t, gpoint *g) {
    if (g->node >= t->node_hw) return 0;
    const node *n = N(t, g->node);
    if ((n->flags & NF_FREE) || n->gen != g->gen || g->x > ndepth(t, n)) return 0;
    while (g->node != ROOT && g->x <= N(t, n->parent)->depth) {
        g->node = n->parent;
        n = N(t, g->node);
        g->gen = n->gen;
    }
    return 1;
}

static int gstep(const as_tree *t, const gpoint *from, int32_t tok, gpoint *to) {
    point p = {from->node, from->x}, q;
    if (point_step(t, p, tok, &q) != 0) return 0;
    to->node = q.node;
    to->x = q.x;
    to->gen = N(t, q.node)->gen;
    return 1;
}

/* Feed one context token to a global match state. */
static void gfeed(gstate *g, const as_tree *t, uint32_t pmax, int32_t tok) {
    gpoint root = {ROOT, N(t, ROOT)->gen, 0};
    uint32_t m = 0;
    if (gstep(t, &root, tok, &g->tmp[1])) {
        m = 1;
        for (uint32_t p = 1; p <= g->m && p + 1 <= pmax; p++) {
            if (!gstep(t, &g->loc[p], tok, &g->tmp[p + 1])) break;
            m = p + 1;
        }
    }
    gpoint *swap = g->loc;
    g->loc = g->tmp;
    g->tmp = swap;
    g->m = m;
}

/* Walk patterns of length m+1, m+2, ... from the root until the first one
 * that does not occur (patterns are suffix-closed, so none longer does). */
static void gextend(const as_cursor *c, gstate *g, const as_tree *t, uint32_t pmax) {
    for (uint32_t p = g->m + 1; p <= pmax && p <= c->len; p++) {
        gpoint w = {ROOT, N(t, ROOT)->gen, 0};
        uint32_t i = 0;
        for (; i < p; i++)
            if (!gstep(t, &w, ctx_at(c, c->len - p + i), &w)) break;
        if (i < p) break;
        g->loc[p] = w;
        g->m = p;
    }
}

/* The match state for tree t (a fresh or least recently used slot if new). */
static int gstate_for(as_cursor *c, const as_tree *t, gstate **out) {
    gstate *pick = NULL;
    for (int i = 0; i < AS_MAX_GLOBALS; i++)
        if (c->gs[i].uid == t->uid && c->gs[i].loc != NULL) pick = &c->gs[i];
    if (pick == NULL) {
        pick = &c->gs[0];
        for (int i = 1; i < AS_MAX_GLOBALS; i++)
            if (c->gs[i].used < pick->used) pick = &c->gs[i];
        if (pick->loc == NULL) {
            pick->loc = as_xmalloc(&c->bytes, gp_bytes(c));
            pick->tmp = as_xmalloc(&c->bytes, gp_bytes(c));
            if (pick->loc == NULL || pick->tmp == NULL) {
                as_xfree(&c->bytes, pick->loc, gp_bytes(c));
                as_xfree(&c->bytes, pick->tmp, gp_bytes(c));
                pick->loc = pick->tmp = NULL;
                return AS_ERR_NOMEM;
            }
        }
        pick->uid = 0; /* force a fresh match below */
    }
    pick->used = ++c->clock;
    *out = pick;
    return AS_OK;
}

static void gsync(as_cursor *c, gstate *g, const as_tree *t) {
    uint32_t pmax = (t->max_depth < c->max_depth ? t->max_depth : c->max_depth) - 1;
    int full = g->uid != t->uid || g->pos > c->len || c->len - g->pos > pmax;
    /* an unmodified tree (same epoch) cannot have freed or split a node */
    for (uint32_t p = 1; !full && g->epoch != t->epoch && p <= g->m; p++)
        if (!gpoint_fix(t, &g->loc[p])) full = 1;
    if (full) {
        /* from scratch: one root walk per pattern length, O(m^2) for the
         * longest match m -- cheaper than replaying the last pmax tokens */
        g->m = 0;
        gextend(c, g, t, pmax);
    } else {
        for (uint64_t i = g->pos; i < c->len; i++) gfeed(g, t, pmax, ctx_at(c, i));
        /* the tree may have grown since: longer patterns may occur now */
        if (g->grow != t->grow_epoch) gextend(c, g, t, pmax);
    }
    g->uid = t->uid;
    g->grow = t->grow_epoch;
    g->epoch = t->epoch;
    g->pos = c->len;
}

static point *pts_buffer(as_cursor *c, uint32_t side) {
    if (c->pts[side] == NULL) c->pts[side] = as_xmalloc(&c->bytes, pt_bytes(c));
    return c->pts[side];
}

int as_draft_multi(as_cursor *c, const as_tree *const *globals, size_t n_globals,
                   const as_draft_params *params, as_draft_out *out) {
    if (c == NULL || out == NULL || (globals == NULL && n_globals > 0)) return AS_ERR_INVALID_ARG;
    if (n_globals > AS_MAX_GLOBALS) return AS_ERR_CAPACITY;
    int rc = draft_params_check(params);
    if (rc != AS_OK) return rc;
    if (out->tokens == NULL || out->parents == NULL || out->probs == NULL) return AS_ERR_INVALID_ARG;
    if (out->cap < params->max_spec_tokens) return AS_ERR_CAPACITY;
    candidates cand;
    memset(&cand, 0, sizeof cand);
    if (!(params->flags & AS_DRAFT_NO_GLOBAL)) {
        for (size_t i = 0; i < n_globals; i++) {
            const as_tree *t = globals[i];
            if (t == NULL) continue;
            for (size_t j = 0; j < i; j++) /* the same tree twice: draft from it once */
                if (globals[j] == t) t = NULL;
            if (t == NULL) continue;
            gstate *g;
            rc = gstate_for(c, t, &g);
            if (rc != AS_OK) return rc;
            point *pts = pts_buffer(c, cand.n);
            if (pts == NULL) return AS_ERR_NOMEM;
            gsync(c, g, t);
            for (uint32_t p = 1; p <= g->m; p++) {
                pts[p].node = g->loc[p].node;
                pts[p].x = g->loc[p].x;
            }
            uint32_t k = cand.n++;
            cand.tree[k] = t;
            cand.pts[k] = pts;
            cand.plen_max[k] = g->m;
            cand.source[k] = 1;
            cand.gindex[k] = (uint32_t)i;
        }
    }
    if (c->local != NULL && !(params->flags & AS_DRAFT_NO_LOCAL)) {
        point *pts = pts_buffer(c, cand.n);
        if (pts == NULL) return AS_ERR_NOMEM;
        uint32_t si = tree_seq_index(c->local, LOCAL_SEQ);
        uint32_t pmax = c->len < c->max_depth - 1 ? (uint32_t)c->len : c->max_depth - 1;
        uint32_t m = tree_open_points(c->local, si, pmax, pts);
        uint32_t k = cand.n++;
        cand.tree[k] = c->local;
        cand.pts[k] = pts;
        cand.plen_max[k] = m;
        cand.source[k] = 2;
    }
    return draft_select(&c->sc, &cand, params, out);
}

int as_draft(as_cursor *c, const as_tree *global, const as_draft_params *params, as_draft_out *out) {
    return as_draft_multi(c, &global, global != NULL ? 1 : 0, params, out);
}

/* Whether ctx[0..n) ends with the cursor's last min(len, max_depth - 1) tokens
 * (every pattern length the cursor tracks) and is no longer than its context.
 * The ring buffer holds them in at most two runs: two memcmp, one division. */
static int hist_is_tail(const as_cursor *c, const int32_t *ctx, size_t n) {
    uint64_t need = c->len < c->max_depth - 1 ? c->len : c->max_depth - 1;
    if (n < need || n > c->len) return 0;
    if (need == 0) return 1;
    uint64_t start = (c->len - need) % c->max_depth; /* ring slot of the oldest needed token */
    uint64_t first = c->max_depth - start < need ? c->max_depth - start : need;
    const int32_t *want = ctx + (n - need);
    if (memcmp(want, c->hist + start, (size_t)first * sizeof(int32_t)) != 0) return 0;
    return memcmp(want + first, c->hist, (size_t)(need - first) * sizeof(int32_t)) == 0;
}

int as_draft_tail(as_cursor *c, const as_tree *global, const int32_t *ctx, size_t n,
                  const as_draft_params *params, as_draft_out *out) {
    if (c == NULL || out == NULL || (ctx == NULL && n > 0)) return AS_ERR_INVALID_ARG;
    int rc = tokens_valid(ctx, n);
    if (rc != AS_OK) return rc;
    if (hist_is_tail(c, ctx, n)) return as_draft(c, global, params, out);
    return as_draft_context(global, c->local, ctx, n, params, out);
}
