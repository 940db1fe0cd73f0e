/*
 * draft.c -- growing and choosing drafts (SuffixDecoding).
 *
 * Input: for every pattern length p, a match point in the global tree
 * and/or the per-request tree (found by cursor.c incrementally, or by a
 * fresh walk in as_draft_context).  A point whose string has no
 * continuation is not a candidate -- which is why the context's own
 * occurrence in the per-request tree never matches: it ends the sequence.
 *
 * Growing.  D(match point) = 1 and D(child) = D(parent) * count(child) /
 * sum of the counts of the parent's children.  A linear draft follows the
 * most frequent child (ties: smaller token) while D >= min_token_prob; a
 * tree draft pops the frontier entry with the largest D (ties: pushed
 * first) and pushes its children in (count desc, token asc) order.  Inside
 * a compressed edge there is exactly one child, so D is unchanged there.
 * The draft for pattern length p holds at most
 * B(p) = min(max_spec_tokens, floor(alpha * p + offset + 1e-6)) tokens (the
 * 1e-6 keeps e.g. 0.7 * 10 from flooring to 6).  With a vocabulary bound
 * (params->vocab_size != 0) a token >= vocab_size ends its branch: a linear
 * draft stops before it, a tree draft never pushes it; D of the other
 * children is unchanged (the out-of-vocabulary counts still share the mass).
 *
 * Confidence (AS_DRAFT_CONF).  Counts alone call a continuation seen once
 * after a one-token match certain, so budgets above cap drafts by match
 * length.  With a table, every token's factor is multiplied by
 * conf[bin(L), bin(T)], the acceptance rate measured for tokens continuing L
 * matched tokens (pattern plus drafted tokens before it) whose string
 * occurred T times; D then falls along a draft as fast as the evidence
 * thins, min_token_prob ends it, and alpha may be large.  A factor of 0 ends
 * a branch.  Since D now depends on p, linear drafts from one tree take the
 * lengths whose patterns occur equally often (a run, see search_runs) as one
 * candidate: matched over its longest length hi (L = hi + j), continued from
 * its shortest length lo's point, at most min(B(hi), depth - lo) tokens.
 *
 * Choosing.  score = sum of D over the draft.  Since a draft of b tokens
 * scores at most b, candidates are tried in order of their bound
 * min(B(p), depth room), largest first, and a pattern whose bound cannot
 * beat the best score so far is skipped without growing it.  Within a tree the longer pattern
 * wins ties; between trees the per-request tree wins ties.  In merged mode
 * both trees are walked together and counts are added per token, which is
 * the same as drafting from one tree holding both trees' sequences.
 * Linear drafts from one tree (the default) take a shortcut with the same
 * result: lengths whose match points have equal counts share one walk
 * (see search_runs).
 */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "draft_internal.h"

_Static_assert(sizeof(((as_draft_params *)0)->conf) == sizeof(float) * AS_CONF_BINS * AS_CONF_BINS,
               "conf holds AS_CONF_BINS x AS_CONF_BINS factors");

void as_draft_params_default(as_draft_params *p) {
    if (p == NULL) return;
    memset(p, 0, sizeof *p);
    p->max_spec_tokens = 32;
    p->alpha = 1.0;
    p->offset = 0.0;
    p->min_token_prob = 0.1;
    p->min_score = 0.0;
}

int draft_params_check(const as_draft_params *p) {
    if (p == NULL) return AS_ERR_INVALID_ARG;
    if (p->max_spec_tokens < 1 || p->max_spec_tokens > AS_MAX_SPEC_LIMIT) return AS_ERR_INVALID_ARG;
    if (!isfinite(p->alpha) || !isfinite(p->offset) || !isfinite(p->min_score)) return AS_ERR_INVALID_ARG;
    if (p->alpha < 0.0) return AS_ERR_INVALID_ARG; /* budgets must not shrink as p grows */
    if (!(p->min_token_prob >= 0.0 && p->min_token_prob <= 1.0)) return AS_ERR_INVALID_ARG;
    if (p->flags &
        ~(uint32_t)(AS_DRAFT_TREE | AS_DRAFT_MERGE | AS_DRAFT_NO_LOCAL | AS_DRAFT_NO_GLOBAL | AS_DRAFT_CONF))
        return AS_ERR_INVALID_ARG;
    if (p->flags & AS_DRAFT_CONF)
        for (int i = 0; i < AS_CONF_BINS * AS_CONF_BINS; i++)
            if (!(p->conf[i] >= 0.0f && p->conf[i] <= 1.0f)) return AS_ERR_INVALID_ARG; /* NaN too */
    if (p->max_pattern != 0 && p->min_pattern > p->max_pattern) return AS_ERR_INVALID_ARG;
    return AS_OK;
}

void scratch_free(scratch *s) {
    as_xfree(s->acct, s->conts, sizeof(cont) * (size_t)s->conts_cap);
    as_xfree(s->acct, s->heap, sizeof(heap_ent) * (size_t)s->heap_cap);
    for (int i = 0; i < 2; i++) {
        as_xfree(s->acct, s->tok[i], sizeof(int32_t) * (size_t)s->cap);
        as_xfree(s->acct, s->par[i], sizeof(int32_t) * (size_t)s->cap);
        as_xfree(s->acct, s->prob[i], sizeof(float) * (size_t)s->cap);
    }
    as_xfree(s->acct, s->sum, sizeof(double) * ((size_t)s->cap + 1));
    uint64_t *acct = s->acct;
    memset(s, 0, sizeof *s);
    s->acct = acct;
}

static int grow(uint64_t *acct, void **buf, uint32_t *cap, uint32_t need, size_t elem) {
    if (need <= *cap) return AS_OK;
    uint64_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    if (c > UINT32_MAX / 2) return AS_ERR_CAPACITY;
    size_t bytes = as_mul_size((size_t)c, elem);
    if (bytes == 0) return AS_ERR_CAPACITY;
    void *p = as_xrealloc(acct, *buf, elem * (size_t)*cap, bytes);
    if (p == NULL) return AS_ERR_NOMEM;
    *buf = p;
    *cap = (uint32_t)c;
    return AS_OK;
}

static int scratch_drafts(scratch *s, uint32_t need) {
    if (need <= s->cap) return AS_OK;
    enum { NBUF = 7 };
    void *fresh[NBUF] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    size_t sizes[NBUF] = {sizeof(int32_t) * need, sizeof(int32_t) * need, sizeof(float) * need,
                          sizeof(int32_t) * need, sizeof(int32_t) * need, sizeof(float) * need,
                          sizeof(double) * ((size_t)need + 1)};
    for (int i = 0; i < NBUF; i++) {
        fresh[i] = as_xmalloc(s->acct, sizes[i]);
        if (fresh[i] == NULL) {
            for (int j = 0; j < i; j++) as_xfree(s->acct, fresh[j], sizes[j]);
            return AS_ERR_NOMEM;
        }
    }
    for (int i = 0; i < 2; i++) { /* contents need not survive: drafts are rebuilt per call */
        as_xfree(s->acct, s->tok[i], sizeof(int32_t) * (size_t)s->cap);
        as_xfree(s->acct, s->par[i], sizeof(int32_t) * (size_t)s->cap);
        as_xfree(s->acct, s->prob[i], sizeof(float) * (size_t)s->cap);
        s->tok[i] = fresh[3 * i];
        s->par[i] = fresh[3 * i + 1];
        s->prob[i] = fresh[3 * i + 2];
    }
    as_xfree(s->acct, s->sum, sizeof(double) * ((size_t)s->cap + 1));
    s->sum = fresh[6];
    s->cap = need;
    return AS_OK;
}

/* ---------- continuations ------------------------------------------- */

/* Append the continuations of one side's point to sc->conts[*n..]. */
static int enum_side(scratch *sc, const as_tree *t, point p, int side, uint32_t *n) {
    const node *nd = N(t, p.node);
    if (p.x < ndepth(t, nd)) {
        int rc = grow(sc->acct, (void **)&sc->conts, &sc->conts_cap, *n + 1, sizeof(cont));
        if (rc != AS_OK) return rc;
        cont *c = &sc->conts[(*n)++];
        memset(&c->next, 0, sizeof c->next);
        c->tok = label_at(t, nd, p.x);
        c->cnt = nd->count;
        c->next.has[side] = 1;
        c->next.p[side].node = p.node;
        c->next.p[side].x = p.x + 1;
        return AS_OK;
    }
    uint32_t k = nchild(nd);
    int rc = grow(sc->acct, (void **)&sc->conts, &sc->conts_cap, *n + k, sizeof(cont));
    if (rc != AS_OK) return rc;
    for (uint32_t i = 0, seen = 0; seen < k; i++) {
        int32_t key;
        uint32_t ch;
        if (nd->flags & NF_MAP) {
            key = nd->ch.map->slots[i].key;
            if (key < 0) continue;
            ch = nd->ch.map->slots[i].val;
        } else {
            key = nd->ch.in.key[i];
            ch = nd->ch.in.child[i];
        }
        seen++;
        cont *c = &sc->conts[(*n)++];
        memset(&c->next, 0, sizeof c->next);
        c->tok = key;
        c->cnt = N(t, ch)->count;
        c->next.has[side] = 1;
        c->next.p[side].node = ch;
        c->next.p[side].x = p.x + 1;
    }
    return AS_OK;
}

/* All continuations of a (merged) point, counts added per token. */
static int enum_conts(scratch *sc, const candidates *cand, const mpoint *mp, uint32_t *n_out) {
    uint32_t n = 0;
    int rc = AS_OK;
    int first = -1;
    for (int s = 0; s < (int)cand->n; s++) {
        if (!mp->has[s]) continue;
        if (first < 0) {
            first = s;
            rc = enum_side(sc, cand->tree[s], mp->p[s], s, &n);
            if (rc != AS_OK) return rc;
            continue;
        }
        /* second side: add into existing tokens, append new ones */
        uint32_t base = n;
        for (uint32_t i = 0; i < base; i++) {
            point q;
            if (point_step(cand->tree[s], mp->p[s], sc->conts[i].tok, &q) == 0) {
                sc->conts[i].cnt += N(cand->tree[s], q.node)->count;
                sc->conts[i].next.has[s] = 1;
                sc->conts[i].next.p[s] = q;
            }
        }
        uint32_t m = n;
        rc = enum_side(sc, cand->tree[s], mp->p[s], s, &m);
        if (rc != AS_OK) return rc;
        for (uint32_t i = n; i < m; i++) {
            point q;
            if (point_step(cand->tree[first], mp->p[first], sc->conts[i].tok, &q) == 0) continue;
            sc->conts[n++] = sc->conts[i];
        }
    }
    *n_out = n;
    return AS_OK;
}

static int cont_before(const cont *a, const cont *b) {
    if (a->cnt != b->cnt) return a->cnt > b->cnt;
    return a->tok < b->tok;
}

/* Insertion sort of the few continuations that pass the probability cut. */
static void sort_conts(cont *c, uint32_t n) {
    for (uint32_t i = 1; i < n; i++) {
        cont v = c[i];
        uint32_t j = i;
        while (j > 0 && cont_before(&v, &c[j - 1])) {
            c[j] = c[j - 1];
            j--;
        }
        c[j] = v;
    }
}

/* ---------- growing ---------------------------------------------------- */

/* Whether a drafted token is below the vocabulary bound (0: no bound).  A
 * token outside it ends its branch: linear drafts stop before it, tree
 * drafts never push it (nor, therefore, anything below it). */
static inline int in_vocab(int32_t tok, uint32_t vocab) {
    return vocab == 0 || (uint32_t)tok < vocab;
}

/* The confidence table's bin of a length or count: bit length of min(x, 127). */
static inline uint32_t conf_bin(uint64_t x) {
    uint32_t b = 0;
    if (x > 127) x = 127;
    while (x) {
        b++;
        x >>= 1;
    }
    return b;
}

/* The factor of a token continuing a match of length L seen T times: 1 without a table. */
static inline double conf_at(const float *conf, uint64_t L, uint64_t T) {
    return conf == NULL ? 1.0 : (double)conf[conf_bin(L) * AS_CONF_BINS + conf_bin(T)];
}

typedef struct grown {
    uint32_t n;
    double score;
} grown;

/* Linear draft over a merged point. */
static int linear_merged(scratch *sc, const candidates *cand, mpoint mp, uint32_t plen, uint32_t dcap,
                         uint32_t budget, double min_prob, uint32_t vocab, const float *conf, int buf,
                         grown *g) {
    g->n = 0;
    g->score = 0.0;
    double d = 1.0;
    while (g->n < budget && plen + g->n < dcap) {
        uint32_t n;
        int rc = enum_conts(sc, cand, &mp, &n);
        if (rc != AS_OK) return rc;
        if (n == 0) break;
        uint64_t total = 0;
        uint32_t b = 0;
        for (uint32_t i = 0; i < n; i++) {
            total += sc->conts[i].cnt;
            if (i > 0 && cont_before(&sc->conts[i], &sc->conts[b])) b = i;
        }
        if (!in_vocab(sc->conts[b].tok, vocab)) break;
        d = d * ((double)sc->conts[b].cnt / (double)total) * conf_at(conf, plen + g->n, total);
        if (d < min_prob || !(d > 0.0)) break;
        sc->tok[buf][g->n] = sc->conts[b].tok;
        sc->par[buf][g->n] = (int32_t)g->n - 1;
        sc->prob[buf][g->n] = (float)d;
        g->score += d;
        g->n++;
        mp = sc->conts[b].next;
    }
    return AS_OK;
}

static void heap_push(heap_ent *h, uint32_t *n, heap_ent e) {
    uint32_t i = (*n)++;
    while (i > 0) {
        uint32_t up = (i - 1) / 2;
        if (h[up].d > e.d || (h[up].d == e.d && h[up].order < e.order)) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static heap_ent heap_pop(heap_ent *h, uint32_t *n) {
    heap_ent top = h[0];
    heap_ent last = h[--(*n)];
    uint32_t i = 0;
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, m = i;
        heap_ent *best = &last;
        if (l < *n && (h[l].d > best->d || (h[l].d == best->d && h[l].order < best->order))) {
            m = l;
            best = &h[l];
        }
        if (r < *n && (h[r].d > best->d || (h[r].d == best->d && h[r].order < best->order))) m = r;
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n > 0) h[i] = last;
    return top;
}

/* Push the children of mp (D = d) that pass the cut, at most `room`. */
static int push_children(scratch *sc, const candidates *cand, const mpoint *mp, double d,
                         int32_t parent, uint32_t depth, uint32_t dcap, double min_prob,
                         uint32_t vocab, const float *conf, uint32_t room, uint32_t *hn,
                         uint64_t *order) {
    if (depth >= dcap || room == 0) return AS_OK;
    /* One tree: if even the most frequent child misses the cut, none passes --
     * decided in O(1) instead of listing every child of a busy node. */
    int sides = 0, only = 0;
    for (int s = 0; s < (int)cand->n; s++)
        if (mp->has[s]) {
            sides++;
            only = s;
        }
    if (sides == 1) {
        const as_tree *t = cand->tree[only];
        const node *nd = N(t, mp->p[only].node);
        if (mp->p[only].node != ROOT && mp->p[only].x >= ndepth(t, nd)) {
            int32_t key;
            uint32_t b = best_child(t, nd, &key);
            uint64_t tot = b == NIL ? 0 : child_total(t, nd);
            double db = b == NIL ? 0.0 : d * ((double)N(t, b)->count / (double)tot) * conf_at(conf, depth, tot);
            if (db < min_prob || !(db > 0.0)) return AS_OK;
        }
    }
    uint32_t n;
    int rc = enum_conts(sc, cand, mp, &n);
    if (rc != AS_OK) return rc;
    if (n == 0) return AS_OK;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) total += sc->conts[i].cnt;
    double f = conf_at(conf, depth, total);
    /* keep those whose D passes the cut (and in the vocabulary), then order them */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        double dc = d * ((double)sc->conts[i].cnt / (double)total) * f;
        if (dc >= min_prob && dc > 0.0 && in_vocab(sc->conts[i].tok, vocab)) sc->conts[k++] = sc->conts[i];
    }
    sort_conts(sc->conts, k);
    if (k > room) k = room;
    rc = grow(sc->acct, (void **)&sc->heap, &sc->heap_cap, *hn + k, sizeof(heap_ent));
    if (rc != AS_OK) return rc;
    for (uint32_t i = 0; i < k; i++) {
        heap_ent e;
        e.d = d * ((double)sc->conts[i].cnt / (double)total) * f;
        e.order = (*order)++;
        e.parent = parent;
        e.tok = sc->conts[i].tok;
        e.depth = depth + 1;
        e.pt = sc->conts[i].next;
        heap_push(sc->heap, hn, e);
    }
    return AS_OK;
}

static int tree_draft(scratch *sc, const candidates *cand, mpoint mp, uint32_t plen, uint32_t dcap,
                      uint32_t budget, double min_prob, uint32_t vocab, const float *conf, int buf,
                      grown *g) {
    g->n = 0;
    g->score = 0.0;
    uint32_t hn = 0;
    uint64_t order = 0;
    int rc =
        push_children(sc, cand, &mp, 1.0, -1, plen, dcap, min_prob, vocab, conf, budget, &hn, &order);
    while (rc == AS_OK && g->n < budget && hn > 0) {
        heap_ent e = heap_pop(sc->heap, &hn);
        uint32_t idx = g->n++;
        sc->tok[buf][idx] = e.tok;
        sc->par[buf][idx] = e.parent;
        sc->prob[buf][idx] = (float)e.d;
        g->score += e.d;
        rc = push_children(sc, cand, &e.pt, e.d, (int32_t)idx, e.depth, dcap, min_prob, vocab, conf,
                           budget - g->n, &hn, &order);
    }
    return rc;
}

/* ---------- choosing --------------------------------------------------- */

/* floor(alpha * p + offset), at most max_spec_tokens, 0 when below 1 (or NaN);
 * the cast truncates, which is floor for the values that reach it. */
static uint32_t budget_for(const as_draft_params *prm, uint32_t p) {
    double b = prm->alpha * (double)p + prm->offset + 1e-6;
    if (!(b >= 1.0)) return 0;
    if (b >= (double)prm->max_spec_tokens) return prm->max_spec_tokens;
    return (uint32_t)b;
}

typedef struct best_t {
    int buf; /* scratch buffer holding the best draft */
    grown g;
    uint32_t p;
    uint32_t source;
    uint32_t gindex;
    int side; /* which search produced it (-1: none yet) */
} best_t;

/* Slack on score bounds: sums of rounded path probabilities may exceed them by ulps. */
#define BOUND_SLACK 1e-9

/* Can a draft of pattern length p scoring `score` from `side` displace the best? */
static int wins(const best_t *best, int side, uint32_t p, double score) {
    if (score > best->g.score) return 1;
    return score == best->g.score && best->side == side && p > best->p;
}

/* Record a draft of n tokens scoring `score`, in scratch buffer buf, as the best. */
static void take(best_t *best, int buf, uint32_t n, double score, uint32_t p, uint32_t source,
                 uint32_t gindex, int side) {
    best->buf = buf;
    best->g.n = n;
    best->g.score = score;
    best->p = p;
    best->source = source;
    best->gindex = gindex;
    best->side = side;
}

/* Pattern lengths in the order `search` tries them: bound desc, then p desc,
 * with bound(p) = min(budget(p), dcap - p).  The budget never shrinks as p
 * grows while the room shrinks by one per step, so below a threshold q every
 * length is budget-bound (bounds non-decreasing in p: walked from q - 1 down)
 * and from q on room-bound (bounds decreasing in p: walked from q up).
 * Merging the two runs gives the next length in O(1), so a search that stops
 * early never looks at the other lengths. */
typedef struct porder {
    const as_draft_params *prm;
    uint32_t dcap, pmin, pmax;
    uint32_t up;       /* next room-bound length (> pmax: run done) */
    int64_t down;      /* next budget-bound length (< pmin: run done) */
    uint32_t down_b;   /* its budget */
} porder;

static void porder_down(porder *o, int64_t down) {
    o->down = down;
    o->down_b = down >= (int64_t)o->pmin ? budget_for(o->prm, (uint32_t)down) : 0;
}

/* q: the first p in [pmin, pmax] whose bound is room-bound (dcap - p <=
 * budget(p)), pmax + 1 if none. */
static uint32_t room_bound_from(const as_draft_params *prm, uint32_t dcap, uint32_t pmin,
                                uint32_t pmax) {
    uint32_t lo = pmin, hi = pmax + 1;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (dcap - mid <= budget_for(prm, mid)) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

static void porder_init(porder *o, const as_draft_params *prm, uint32_t dcap, uint32_t pmin,
                        uint32_t pmax) {
    o->prm = prm;
    o->dcap = dcap;
    o->pmin = pmin;
    o->pmax = pmax;
    o->up = room_bound_from(prm, dcap, pmin, pmax);
    porder_down(o, (int64_t)o->up - 1);
}

static int porder_next(porder *o, uint32_t *p, uint32_t *bound) {
    int has_down = o->down >= (int64_t)o->pmin, has_up = o->up <= o->pmax;
    if (!has_down && !has_up) return 0;
    uint32_t bu = has_up ? o->dcap - o->up : 0;
    if (has_up && (!has_down || bu >= o->down_b)) { /* equal bounds: the longer first */
        *p = o->up++;
        *bound = bu;
    } else {
        *p = (uint32_t)o->down;
        *bound = o->down_b;
        porder_down(o, o->down - 1);
    }
    return 1;
}

/* The points of pattern length p in the sides in `mask`; 0 if none of them
 * has a continuation. */
static int merged_point(const candidates *cand, uint32_t mask, uint32_t p, mpoint *mp) {
    int any = 0;
    memset(mp, 0, sizeof *mp);
    for (int s = 0; s < (int)cand->n; s++) {
        if (!(mask & (1u << s)) || p > cand->plen_max[s]) continue;
        mp->has[s] = 1;
        mp->p[s] = cand->pts[s][p];
        any = any || point_has_next(cand->tree[s], mp->p[s]);
    }
    return any;
}

/* One tree, linear drafts, by runs of equal counts.  Counts are occurrence
 * counts and the pattern of length p + 1 extends that of length p to the
 * left, so count(p) >= count(p + 1); when they are equal, every occurrence
 * of the shorter pattern sits inside one of the longer, and below both
 * points hang the same continuations with the same counts -- the longer
 * pattern's subtree is only cut sooner by the depth bound (its room
 * dcap - p is smaller).  So over a run [lo, hi] of lengths with equal
 * counts, the draft for p is the first n(p) = min(B(p), dcap - p, N) tokens
 * of one walk from pts[lo], N being where that walk stops by itself (the
 * probability cut, or no continuation).  One walk scores the whole run, and
 * its best length is the longest p with the largest n(p): the result equals
 * trying every length (as `search` does for the other modes), with a walk
 * per run instead of per length.  Runs are found from the longest pattern
 * down, by galloping then bisecting over the monotone counts. */

/* bound(p) = min(B(p), dcap - p), at most its budget. */
static uint32_t run_bound(const as_draft_params *prm, uint32_t dcap, uint32_t p) {
    uint32_t b = budget_for(prm, p), room = dcap - p;
    return b < room ? b : room;
}

/* The largest bound over [lo, hi]: bound(p) rises with p up to q (budget-bound,
 * the budget never shrinks) and falls from q on (room-bound). */
static uint32_t run_max_bound(const as_draft_params *prm, uint32_t dcap, uint32_t q, uint32_t lo,
                              uint32_t hi) {
    if (hi < q) return run_bound(prm, dcap, hi);
    if (lo >= q) return run_bound(prm, dcap, lo);
    uint32_t a = run_bound(prm, dcap, q - 1), b = run_bound(prm, dcap, q);
    return a > b ? a : b;
}

static uint32_t pt_count(const as_tree *t, const point *pts, uint32_t p) {
    return N(t, pts[p].node)->count;
}

/* Walk at most `cap` tokens from p, keeping the score of every prefix in sc->sum. */
static uint32_t run_walk(scratch *sc, const as_tree *t, point p, uint32_t cap, double min_prob,
                         uint32_t vocab, const float *conf, uint32_t plen, int buf) {
    int32_t *tok = sc->tok[buf], *par = sc->par[buf];
    float *prob = sc->prob[buf];
    double *sum = sc->sum;
    double d = 1.0;
    uint32_t n = 0;
    sum[0] = 0.0;
    while (n < cap) {
        const node *nd = N(t, p.node);
        int32_t key;
        if (p.x < ndepth(t, nd)) {
            key = label_at(t, nd, p.x);
            p.x++;
            if (conf != NULL) d *= conf_at(conf, plen + n, nd->count);
        } else {
            uint32_t c = best_child(t, nd, &key);
            if (c == NIL) break;
            uint64_t tot = child_total(t, nd);
            d = d * ((double)N(t, c)->count / (double)tot) * conf_at(conf, plen + n, tot);
            p.node = c;
            p.x++;
        }
        if (d < min_prob || !(d > 0.0) || !in_vocab(key, vocab)) break;
        tok[n] = key;
        par[n] = (int32_t)n - 1;
        prob[n] = (float)d;
        sum[n + 1] = sum[n] + d;
        n++;
    }
    return n;
}

static void search_runs(scratch *sc, const as_tree *t, const point *pts, const as_draft_params *prm,
                        uint32_t pmin, uint32_t pmax, uint32_t dcap, int side, uint32_t source,
                        uint32_t gindex, best_t *best) {
    const float *conf = (prm->flags & AS_DRAFT_CONF) ? prm->conf : NULL;
    uint32_t q = room_bound_from(prm, dcap, pmin, pmax);
    uint32_t hi = pmax; /* pmin >= 1, so hi = lo - 1 below never wraps */
    while (hi >= pmin) {
        uint32_t rest = run_max_bound(prm, dcap, q, pmin, hi);
        if (conf != NULL) { /* a run's draft may reach min(B(hi), dcap - lo) tokens */
            uint32_t b = budget_for(prm, hi);
            rest = b < dcap - pmin ? b : dcap - pmin;
        }
        if (rest == 0 || !wins(best, side, hi, (double)rest)) return;
        /* the run [lo, hi] of lengths whose count equals count(hi): gallop down
         * to a length `bad` outside it (pmin - 1 stands for none), then bisect */
        uint32_t c = pt_count(t, pts, hi), lo = hi, step = 1, bad = pmin - 1;
        while (lo > pmin) { /* lo falls by step, which doubles: O(log) probes */
            uint32_t probe = lo - pmin <= step ? pmin : lo - step;
            if (pt_count(t, pts, probe) != c) {
                bad = probe;
                break;
            }
            lo = probe;
            step *= 2; /* < 2 * max_depth: no overflow */
        }
        while (lo - bad > 1) {
            uint32_t mid = bad + (lo - bad) / 2;
            if (pt_count(t, pts, mid) == c) lo = mid;
            else bad = mid;
        }
        uint32_t cap = run_max_bound(prm, dcap, q, lo, hi);
        if (conf != NULL) {
            /* With a confidence table D depends on the matched length too.  The
             * lengths of a run share their occurrences, hence every
             * continuation: the run is one candidate, matched over hi tokens
             * (the most evidence, the largest budget) and continued from lo's
             * point (the most room in the depth-bounded tree). */
            uint32_t b = budget_for(prm, hi);
            uint32_t cc = b < dcap - lo ? b : dcap - lo;
            if (cc == 0 || !wins(best, side, hi, (double)cc)) {
                hi = lo - 1;
                continue;
            }
            int buf = 1 - best->buf;
            uint32_t n = run_walk(sc, t, pts[lo], cc, prm->min_token_prob, prm->vocab_size, conf,
                                  hi, buf);
            if (n > 0 && wins(best, side, hi, sc->sum[n]))
                take(best, buf, n, sc->sum[n], hi, source, gindex, side);
        } else if (cap > 0 && wins(best, side, hi, (double)cap)) {
            int buf = 1 - best->buf;
            uint32_t n =
                run_walk(sc, t, pts[lo], cap, prm->min_token_prob, prm->vocab_size, NULL, lo, buf);
            /* the longest p whose draft is longest: n(p) = min(bound(p), n) */
            uint32_t want = n < cap ? n : cap, bp = lo, bn = 0;
            for (uint32_t p = hi;; p--) {
                uint32_t m = run_bound(prm, dcap, p);
                if (m > n) m = n;
                if (m > bn) {
                    bn = m;
                    bp = p;
                    if (m == want) break;
                }
                if (p == lo) break;
            }
            if (bn > 0 && wins(best, side, bp, sc->sum[bn]))
                take(best, buf, bn, sc->sum[bn], bp, source, gindex, side);
        }
        hi = lo - 1;
    }
}

/* Try the candidate patterns of the sides in `mask` (merged when several),
 * most promising bound first (bound = the most a draft for p can score),
 * and stop once no remaining bound can displace the best draft.  Within a
 * tree a longer pattern wins a tie; a draft from another tree must score
 * strictly more.  `side` names this search for tie-breaking. */
static int search(scratch *sc, const candidates *cand, const as_draft_params *prm, uint32_t mask,
                  int side, uint32_t source, uint32_t gindex, best_t *best) {
    int nsides = 0, only = -1;
    uint32_t pmax = 0, dcap = UINT32_MAX;
    for (int s = 0; s < (int)cand->n; s++) {
        if (!(mask & (1u << s))) continue;
        nsides++;
        only = s;
        if (cand->plen_max[s] > pmax) pmax = cand->plen_max[s];
        if (cand->tree[s]->max_depth < dcap) dcap = cand->tree[s]->max_depth;
    }
    if (nsides == 0) return AS_OK;
    if (prm->max_pattern != 0 && prm->max_pattern < pmax) pmax = prm->max_pattern;
    if (pmax >= dcap) pmax = dcap - 1;
    uint32_t pmin = prm->min_pattern > 1 ? prm->min_pattern : 1;
    int tree_mode = (prm->flags & AS_DRAFT_TREE) != 0;
    if (nsides == 1 && !tree_mode) { /* the common case */
        search_runs(sc, cand->tree[only], cand->pts[only], prm, pmin, pmax, dcap, side, source, gindex,
                    best);
        return AS_OK;
    }
    porder o;
    porder_init(&o, prm, dcap, pmin, pmax);
    uint32_t p, bound;
    while (porder_next(&o, &p, &bound)) {
        if (bound == 0) break; /* every later bound is 0 too */
        /* A tree draft's score is at most its depth room only in exact arithmetic
         * (the D of a depth's nodes sum to at most 1); rounded products can sum
         * a few ulps above it, so the bound gets some slack before it prunes. */
        double limit = (double)bound + BOUND_SLACK;
        if (!wins(best, side, p, limit)) {
            if (limit < best->g.score) break;
            continue;
        }
        uint32_t b = budget_for(prm, p);
        int buf = 1 - best->buf;
        mpoint mp;
        if (!merged_point(cand, mask, p, &mp)) continue;
        grown g;
        const float *conf = (prm->flags & AS_DRAFT_CONF) ? prm->conf : NULL;
        int rc = tree_mode ? tree_draft(sc, cand, mp, p, dcap, b, prm->min_token_prob,
                                        prm->vocab_size, conf, buf, &g)
                           : linear_merged(sc, cand, mp, p, dcap, b, prm->min_token_prob,
                                           prm->vocab_size, conf, buf, &g);
        if (rc != AS_OK) return rc;
        if (g.n > 0 && wins(best, side, p, g.score))
            take(best, buf, g.n, g.score, p, source, gindex, side);
    }
    return AS_OK;
}

int draft_select(scratch *sc, const candidates *cand, const as_draft_params *prm, as_draft_out *out) {
    int rc = scratch_drafts(sc, prm->max_spec_tokens);
    if (rc != AS_OK) return rc;
    best_t best;
    memset(&best, 0, sizeof best);
    best.side = -1;
    if ((prm->flags & AS_DRAFT_MERGE) && cand->n > 1) {
        rc = search(sc, cand, prm, (1u << cand->n) - 1, 0, 3, 0, &best);
    } else {
        /* the per-request tree first (it wins ties), then globals in order */
        for (int pass = 0; pass < 2 && rc == AS_OK; pass++)
            for (uint32_t s = 0; s < cand->n && rc == AS_OK; s++)
                if ((cand->source[s] == 2) == (pass == 0))
                    rc = search(sc, cand, prm, 1u << s, (int)s, cand->source[s], cand->gindex[s],
                                &best);
    }
    if (rc != AS_OK) return rc;
    out->global_index = 0;
    if (best.g.n == 0 || best.g.score < prm->min_score) {
        out->n = 0;
        out->match_len = 0;
        out->source = 0;
        out->score = 0.0;
        return AS_OK;
    }
    memcpy(out->tokens, sc->tok[best.buf], sizeof(int32_t) * best.g.n);
    memcpy(out->parents, sc->par[best.buf], sizeof(int32_t) * best.g.n);
    memcpy(out->probs, sc->prob[best.buf], sizeof(float) * best.g.n);
    out->n = best.g.n;
    out->match_len = best.p;
    out->source = best.source;
    out->global_index = best.gindex;
    out->score = best.g.score;
    return AS_OK;
}

/* ---------- drafting from a plain context -------------------------------- */

/* Points of every suffix of ctx that occurs in t, by fresh root walks. */
static uint32_t match_fresh(const as_tree *t, const int32_t *ctx, size_t n, uint32_t pmax, point *pts) {
    uint32_t m = 0;
    for (uint32_t p = 1; p <= pmax && p <= n; p++) {
        point q = {ROOT, 0};
        const int32_t *pat = ctx + (n - p);
        uint32_t i = 0;
        for (; i < p; i++)
            if (point_step(t, q, pat[i], &q) != 0) break;
        if (i < p) break;
        pts[p] = q;
        m = p;
    }
    return m;
}

int as_draft_context(const as_tree *global, const as_tree *local, const int32_t *context, size_t n,
                     const as_draft_params *params, as_draft_out *out) {
    if (out == NULL || (context == NULL && n > 0)) return AS_ERR_INVALID_ARG;
    int rc = draft_params_check(params);
    if (rc != AS_OK) return rc;
    if (out->tokens == NULL || out->parents == NULL || out->probs == NULL) return AS_ERR_INVALID_ARG;
    if (out->cap < params->max_spec_tokens) return AS_ERR_CAPACITY;
    rc = tokens_valid(context, n);
    if (rc != AS_OK) return rc;
    if (params->flags & AS_DRAFT_NO_GLOBAL) global = NULL;
    if (params->flags & AS_DRAFT_NO_LOCAL) local = NULL;
    uint64_t acct = 0;
    scratch sc;
    memset(&sc, 0, sizeof sc);
    sc.acct = &acct;
    candidates cand;
    memset(&cand, 0, sizeof cand);
    point *buf[2] = {NULL, NULL};
    const as_tree *trees[2] = {global, local};
    for (int s = 0; s < 2 && rc == AS_OK; s++) {
        if (trees[s] == NULL) continue;
        buf[s] = as_xmalloc(&acct, sizeof(point) * trees[s]->max_depth);
        if (buf[s] == NULL) {
            rc = AS_ERR_NOMEM;
            break;
        }
        uint32_t k = cand.n++;
        cand.tree[k] = trees[s];
        cand.pts[k] = buf[s];
        cand.source[k] = s == 0 ? 1 : 2;
        cand.gindex[k] = 0;
        cand.plen_max[k] = match_fresh(trees[s], context, n, trees[s]->max_depth - 1, buf[s]);
    }
    if (rc == AS_OK) rc = draft_select(&sc, &cand, params, out);
    for (int s = 0; s < 2; s++)
        if (buf[s]) as_xfree(&acct, buf[s], sizeof(point) * trees[s]->max_depth);
    scratch_free(&sc);
    return rc;
}
