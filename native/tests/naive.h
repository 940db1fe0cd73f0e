/*
 * naive.h -- a brute-force model of agentspec's semantics, for tests and
 * fuzzers.  It stores sequences as plain arrays and recomputes everything
 * by scanning them, straight from docs/design-native.md:
 *
 *   count(x)   = number of (sequence, start) pairs where x occurs, len(x) <= D
 *   children   = tokens t with count(x+[t]) > 0, only when len(x) < D
 *   drafting   = candidates p, budget B(p), linear or best-first tree drafts,
 *                score selection, local-vs-global choice, merge, min_score
 *
 * It is deliberately slow and simple (no index at all) so that it can serve
 * as an oracle for the engine.  Header-only, everything static.
 */
#ifndef AGENTSPEC_NAIVE_H
#define AGENTSPEC_NAIVE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "agentspec.h"

/* ---- A tree as a list of sequences ------------------------------------- */

typedef struct nv_seq {
    int64_t id;
    int32_t *tok;
    size_t n, cap;
    int open;
} nv_seq;

typedef struct nv_tree {
    uint32_t depth;
    nv_seq *seqs; /* insertion order */
    size_t n, cap;
} nv_tree;

static inline void *nv_xrealloc(void *p, size_t size) {
    void *q = realloc(p, size == 0 ? 1 : size);
    if (q == NULL) abort(); /* the oracle itself must not fail silently */
    return q;
}

static inline void nv_init(nv_tree *t, uint32_t depth) {
    memset(t, 0, sizeof *t);
    t->depth = depth;
}

static inline void nv_free(nv_tree *t) {
    for (size_t i = 0; i < t->n; i++) free(t->seqs[i].tok);
    free(t->seqs);
    memset(t, 0, sizeof *t);
}

static inline nv_seq *nv_find(const nv_tree *t, int64_t id) {
    for (size_t i = 0; i < t->n; i++)
        if (t->seqs[i].id == id) return &t->seqs[i];
    return NULL;
}

static inline int nv_tokens_valid(const int32_t *tok, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (tok[i] < 0) return 0;
    return 1;
}

static inline void nv_push_tokens(nv_seq *s, const int32_t *tok, size_t n) {
    if (s->n + n > s->cap) {
        size_t cap = s->cap ? s->cap : 8;
        while (cap < s->n + n) cap *= 2;
        s->tok = (int32_t *)nv_xrealloc(s->tok, cap * sizeof(int32_t));
        s->cap = cap;
    }
    if (n) memcpy(s->tok + s->n, tok, n * sizeof(int32_t));
    s->n += n;
}

static inline nv_seq *nv_new_seq(nv_tree *t, int64_t id, int open) {
    if (t->n == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 8;
        t->seqs = (nv_seq *)nv_xrealloc(t->seqs, t->cap * sizeof(nv_seq));
    }
    nv_seq *s = &t->seqs[t->n++];
    memset(s, 0, sizeof *s);
    s->id = id;
    s->open = open;
    return s;
}

/* The status the engine must give for as_tree_add, applied to the model. */
static inline int nv_add(nv_tree *t, int64_t id, const int32_t *tok, size_t n) {
    if (!nv_tokens_valid(tok, n)) return AS_ERR_INVALID_TOKEN;
    if (nv_find(t, id)) return AS_ERR_SEQ_EXISTS;
    nv_push_tokens(nv_new_seq(t, id, 0), tok, n);
    return AS_OK;
}

/* The status the engine must give for as_tree_append, applied to the model. */
static inline int nv_append(nv_tree *t, int64_t id, const int32_t *tok, size_t n) {
    if (!nv_tokens_valid(tok, n)) return AS_ERR_INVALID_TOKEN;
    nv_seq *s = nv_find(t, id);
    if (s && !s->open) return AS_ERR_SEQ_CLOSED;
    if (!s) s = nv_new_seq(t, id, 1);
    nv_push_tokens(s, tok, n);
    return AS_OK;
}

/* The status the engine must give for as_tree_close, applied to the model. */
static inline int nv_close(nv_tree *t, int64_t id) {
    nv_seq *s = nv_find(t, id);
    if (!s) return AS_ERR_SEQ_NOT_FOUND;
    s->open = 0;
    return AS_OK;
}

/* The status the engine must give for as_tree_remove, applied to the model. */
static inline int nv_remove(nv_tree *t, int64_t id) {
    nv_seq *s = nv_find(t, id);
    if (!s) return AS_ERR_SEQ_NOT_FOUND;
    size_t i = (size_t)(s - t->seqs);
    free(s->tok);
    memmove(&t->seqs[i], &t->seqs[i + 1], (t->n - i - 1) * sizeof(nv_seq));
    t->n--;
    return AS_OK;
}

static inline uint64_t nv_total_tokens(const nv_tree *t) {
    uint64_t sum = 0;
    for (size_t i = 0; i < t->n; i++) sum += t->seqs[i].n;
    return sum;
}

static inline uint64_t nv_open_count(const nv_tree *t) {
    uint64_t sum = 0;
    for (size_t i = 0; i < t->n; i++) sum += (uint64_t)t->seqs[i].open;
    return sum;
}

/* ---- Counting over one or more trees (several = merged view) ---------- */

typedef struct nv_view {
    const nv_tree *trees[2];
    size_t n_trees;
    uint32_t depth;
} nv_view;

static inline uint64_t nv_view_count(const nv_view *v, const int32_t *x, size_t len) {
    if (len == 0 || len > v->depth) return 0;
    uint64_t c = 0;
    for (size_t k = 0; k < v->n_trees; k++) {
        const nv_tree *t = v->trees[k];
        for (size_t s = 0; s < t->n; s++) {
            const nv_seq *q = &t->seqs[s];
            for (size_t i = 0; i + len <= q->n; i++)
                if (memcmp(q->tok + i, x, len * sizeof(int32_t)) == 0) c++;
        }
    }
    return c;
}

/* Count of x in a single model tree. */
static inline uint64_t nv_count(const nv_tree *t, const int32_t *x, size_t len) {
    nv_view v = {{t, NULL}, 1, t->depth};
    return nv_view_count(&v, x, len);
}

typedef struct nv_child {
    int32_t token;
    uint64_t count;
} nv_child;

static inline int nv_child_cmp(const void *a, const void *b) {
    const nv_child *x = (const nv_child *)a, *y = (const nv_child *)b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return x->token < y->token ? -1 : (x->token > y->token);
}

/* Children of x sorted by (count desc, token asc); returns how many, sets
 * *total.  The caller frees *out. */
static inline size_t nv_children(const nv_view *v, const int32_t *x, size_t len, nv_child **out,
                          uint64_t *total) {
    nv_child *ch = NULL;
    size_t n = 0, cap = 0;
    *total = 0;
    *out = NULL;
    if (len >= v->depth) return 0;
    for (size_t k = 0; k < v->n_trees; k++) {
        const nv_tree *t = v->trees[k];
        for (size_t s = 0; s < t->n; s++) {
            const nv_seq *q = &t->seqs[s];
            for (size_t i = 0; i + len < q->n; i++) {
                if (len && memcmp(q->tok + i, x, len * sizeof(int32_t)) != 0) continue;
                int32_t tok = q->tok[i + len];
                size_t j = 0;
                while (j < n && ch[j].token != tok) j++;
                if (j == n) {
                    if (n == cap) {
                        cap = cap ? cap * 2 : 8;
                        ch = (nv_child *)nv_xrealloc(ch, cap * sizeof(nv_child));
                    }
                    ch[n].token = tok;
                    ch[n].count = 0;
                    n++;
                }
                ch[j].count++;
                (*total)++;
            }
        }
    }
    if (n) qsort(ch, n, sizeof(nv_child), nv_child_cmp);
    *out = ch;
    return n;
}

/* ---- Drafting ---------------------------------------------------------- */

typedef struct nv_draft {
    int32_t tokens[AS_MAX_SPEC_LIMIT];
    int32_t parents[AS_MAX_SPEC_LIMIT];
    double probs[AS_MAX_SPEC_LIMIT];
    uint32_t n;
    uint32_t match_len;
    uint32_t source;
    double score;
} nv_draft;

/* B(p) = min(max_spec_tokens, floor(alpha*p + offset + 1e-6)), never < 0. */
static inline uint32_t nv_budget(const as_draft_params *pr, uint32_t p) {
    double v = floor(pr->alpha * (double)p + pr->offset + 1e-6);
    if (!(v > 0)) return 0;
    if (v >= (double)pr->max_spec_tokens) return pr->max_spec_tokens;
    return (uint32_t)v;
}

/* The confidence factor of a token continuing L matched tokens seen T times
 * (1 without AS_DRAFT_CONF). */
static inline double nv_conf(const as_draft_params *pr, size_t L, uint64_t T) {
    if (!(pr->flags & AS_DRAFT_CONF)) return 1.0;
    uint32_t bl = 0, bt = 0;
    for (uint64_t x = L > 127 ? 127 : L; x; x >>= 1) bl++;
    for (uint64_t x = T > 127 ? 127 : T; x; x >>= 1) bt++;
    return (double)pr->conf[bl * AS_CONF_BINS + bt];
}

/* A path from the match point: the pattern followed by the draft's tokens. */
typedef struct nv_path {
    int32_t tok[AS_MAX_DEPTH_LIMIT + AS_MAX_SPEC_LIMIT + 1];
    size_t len;
} nv_path;

static inline void nv_linear(const nv_view *v, const int32_t *pat, size_t p, uint32_t budget,
                      size_t loff, const as_draft_params *pr, nv_draft *d) {
    double min_prob = pr->min_token_prob;
    static nv_path path;
    memcpy(path.tok, pat, p * sizeof(int32_t));
    path.len = p;
    double prob = 1.0;
    while (d->n < budget) {
        nv_child *ch;
        uint64_t total;
        size_t nch = nv_children(v, path.tok, path.len, &ch, &total);
        if (nch == 0) {
            free(ch);
            break;
        }
        prob = prob * ((double)ch[0].count / (double)total) * nv_conf(pr, path.len + loff, total);
        int32_t tok = ch[0].token;
        free(ch);
        if (prob < min_prob || !(prob > 0.0)) break;
        d->tokens[d->n] = tok;
        d->parents[d->n] = (int32_t)d->n - 1;
        d->probs[d->n] = prob;
        d->n++;
        path.tok[path.len++] = tok;
    }
}

typedef struct nv_entry {
    double d;
    uint64_t order;
    int32_t token;
    int32_t parent; /* index in the draft, -1 for the match point */
    int live;
} nv_entry;

typedef struct nv_heap {
    nv_entry *e;
    size_t n, cap;
    uint64_t pushes;
} nv_heap;

/* Rebuild the token path of draft node `idx` (pattern + tokens). */
static inline void nv_node_path(const int32_t *pat, size_t p, const nv_draft *d, int32_t idx,
                         nv_path *path) {
    int32_t stack[AS_MAX_SPEC_LIMIT];
    size_t k = 0;
    while (idx >= 0) {
        stack[k++] = d->tokens[idx];
        idx = d->parents[idx];
    }
    memcpy(path->tok, pat, p * sizeof(int32_t));
    path->len = p;
    while (k) path->tok[path->len++] = stack[--k];
}

static inline void nv_push_children(const nv_view *v, const nv_path *path, double dnode, int32_t parent,
                             const as_draft_params *pr, nv_heap *h) {
    double min_prob = pr->min_token_prob;
    nv_child *ch;
    uint64_t total;
    size_t nch = nv_children(v, path->tok, path->len, &ch, &total);
    double f = nch ? nv_conf(pr, path->len, total) : 1.0;
    for (size_t i = 0; i < nch; i++) {
        double dd = dnode * ((double)ch[i].count / (double)total) * f;
        if (dd < min_prob || !(dd > 0.0)) break;
        if (h->n == h->cap) {
            h->cap = h->cap ? h->cap * 2 : 16;
            h->e = (nv_entry *)nv_xrealloc(h->e, h->cap * sizeof(nv_entry));
        }
        nv_entry *e = &h->e[h->n++];
        e->d = dd;
        e->order = h->pushes++;
        e->token = ch[i].token;
        e->parent = parent;
        e->live = 1;
    }
    free(ch);
}

static inline void nv_tree_draft(const nv_view *v, const int32_t *pat, size_t p, uint32_t budget,
                          const as_draft_params *pr, nv_draft *d) {
    static nv_path path;
    nv_heap h = {NULL, 0, 0, 0};
    memcpy(path.tok, pat, p * sizeof(int32_t));
    path.len = p;
    nv_push_children(v, &path, 1.0, -1, pr, &h);
    while (d->n < budget) {
        size_t best = (size_t)-1;
        for (size_t i = 0; i < h.n; i++) {
            if (!h.e[i].live) continue;
            if (best == (size_t)-1 || h.e[i].d > h.e[best].d ||
                (h.e[i].d == h.e[best].d && h.e[i].order < h.e[best].order))
                best = i;
        }
        if (best == (size_t)-1) break;
        nv_entry e = h.e[best];
        h.e[best].live = 0;
        d->tokens[d->n] = e.token;
        d->parents[d->n] = e.parent;
        d->probs[d->n] = e.d;
        int32_t idx = (int32_t)d->n;
        d->n++;
        nv_node_path(pat, p, d, idx, &path);
        nv_push_children(v, &path, e.d, idx, pr, &h);
    }
    free(h.e);
}

/* Best draft of one view (one tree, or a merged pair) over all candidates.
 * pcap (0 = none) further bounds the pattern length (a cursor's depth - 1). */
static inline void nv_draft_view(const nv_view *v, const int32_t *ctx, size_t n,
                          const as_draft_params *pr, uint32_t pcap, nv_draft *best) {
    static nv_draft cur;
    memset(best, 0, sizeof *best);
    if (v->depth < 2) return;
    uint32_t pmax = v->depth - 1;
    if (pcap && pcap < pmax) pmax = pcap;
    if (pr->max_pattern && pr->max_pattern < pmax) pmax = pr->max_pattern;
    uint32_t pmin = pr->min_pattern ? pr->min_pattern : 1;
    /* Linear drafts from one tree with a confidence table: lengths whose
     * patterns occur equally often are one candidate. */
    int runs = (pr->flags & AS_DRAFT_CONF) && !(pr->flags & AS_DRAFT_TREE) && v->n_trees == 1;
    /* (a run: the lengths lo..hi whose patterns occur equally often; its draft
     * continues lo's pattern, weighed as matched over hi tokens, for at most
     * min(B(hi), depth - lo) tokens) */
    for (uint32_t p = pmin; p <= pmax && p <= n; p++) {
        if (runs) {
            uint64_t c = nv_view_count(v, ctx + (n - p), p);
            uint32_t lo = p, hi = p;
            while (hi + 1 <= pmax && hi + 1 <= n && nv_view_count(v, ctx + (n - hi - 1), hi + 1) == c)
                hi++;
            p = hi; /* the loop goes on after the run */
            const int32_t *pat = ctx + (n - lo);
            nv_child *ch;
            uint64_t total;
            nv_children(v, pat, lo, &ch, &total);
            free(ch);
            if (total == 0) continue;
            uint32_t budget = nv_budget(pr, hi), room = v->depth - lo;
            memset(&cur, 0, sizeof cur);
            nv_linear(v, pat, lo, budget < room ? budget : room, hi - lo, pr, &cur);
            double score = 0.0;
            for (uint32_t i = 0; i < cur.n; i++) score += cur.probs[i];
            cur.score = score;
            cur.match_len = hi;
            if (cur.n && (cur.score > best->score || (cur.score == best->score && hi > best->match_len)))
                *best = cur;
            continue;
        }
        const int32_t *pat = ctx + (n - p);
        nv_child *ch;
        uint64_t total;
        nv_children(v, pat, p, &ch, &total);
        free(ch);
        if (total == 0) continue;
        memset(&cur, 0, sizeof cur);
        uint32_t budget = nv_budget(pr, p);
        if (pr->flags & AS_DRAFT_TREE)
            nv_tree_draft(v, pat, p, budget, pr, &cur);
        else
            nv_linear(v, pat, p, budget, 0, pr, &cur);
        double score = 0.0;
        for (uint32_t i = 0; i < cur.n; i++) score += cur.probs[i];
        cur.score = score;
        cur.match_len = p;
        if (cur.score > best->score || (cur.score == best->score && p > best->match_len))
            *best = cur;
    }
    if (best->n == 0) memset(best, 0, sizeof *best);
}

/* What as_draft_context(global, local, ctx, n, params) must return when pcap
 * is 0, and what as_draft on a cursor of depth Dc must return when pcap is
 * Dc - 1 (the cursor's depth bounds the pattern length).  Either tree may be
 * NULL.  source: 0 none, 1 global, 2 local, 3 merged. */
static inline void nv_draft_capped(const nv_tree *global, const nv_tree *local, const int32_t *ctx,
                            size_t n, const as_draft_params *pr, uint32_t pcap, nv_draft *out) {
    static nv_draft g, l;
    if (pr->flags & AS_DRAFT_NO_GLOBAL) global = NULL;
    if (pr->flags & AS_DRAFT_NO_LOCAL) local = NULL;
    memset(out, 0, sizeof *out);
    if ((pr->flags & AS_DRAFT_MERGE) && global && local) {
        nv_view v = {{global, local}, 2,
                     global->depth < local->depth ? global->depth : local->depth};
        nv_draft_view(&v, ctx, n, pr, pcap, out);
        if (out->n) out->source = 3;
    } else {
        memset(&g, 0, sizeof g);
        memset(&l, 0, sizeof l);
        if (global) {
            nv_view v = {{global, NULL}, 1, global->depth};
            nv_draft_view(&v, ctx, n, pr, pcap, &g);
            g.source = 1;
        }
        if (local) {
            nv_view v = {{local, NULL}, 1, local->depth};
            nv_draft_view(&v, ctx, n, pr, pcap, &l);
            l.source = 2;
        }
        if (l.n && l.score >= g.score)
            *out = l;
        else if (g.n)
            *out = g;
    }
    if (out->n == 0 || out->score < pr->min_score) memset(out, 0, sizeof *out);
}

/* What as_draft_context(global, local, ctx, n, params) must return. */
static inline void nv_draft_context(const nv_tree *global, const nv_tree *local, const int32_t *ctx,
                             size_t n, const as_draft_params *pr, nv_draft *out) {
    nv_draft_capped(global, local, ctx, n, pr, 0, out);
}

/* 1 if an engine draft equals the model's draft exactly (probs as floats). */
static inline int nv_draft_equal(const nv_draft *want, const as_draft_out *got) {
    if (want->n != got->n || want->match_len != got->match_len ||
        want->source != got->source || !(want->score == got->score))
        return 0;
    for (uint32_t i = 0; i < want->n; i++) {
        if (want->tokens[i] != got->tokens[i] || want->parents[i] != got->parents[i] ||
            (float)want->probs[i] != got->probs[i])
            return 0;
    }
    return 1;
}

#endif /* AGENTSPEC_NAIVE_H */
