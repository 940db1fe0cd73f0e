/*
 * tree.c -- a depth-bounded generalized suffix tree over int32 token ids.
 *
 * What is indexed.  For every sequence s and start i the tree holds the
 * window s[i : i + max_depth] (shorter at the end of s).  The count of a
 * node is the number of windows whose path passes through the node's edge,
 * which equals the number of occurrences of the node's path string.  Counts
 * are uniform along an edge because every point where a window ends is a
 * node ("termination point"); a node is therefore either a branching point
 * or a termination point (or both), and a unary node whose count equals its
 * only child's is merged into that child.
 *
 *            root
 *           /    \            sequences: [7 8 9] and [7 8 5], max_depth 3
 *      [7 8] 2   [8] 2  [9]1 [5]1
 *       /  \      / \
 *    [9]1 [5]1 [9]1 [5]1
 *
 * Appending a token (the decode loop).  An open sequence keeps, in a ring,
 * the endpoint node of each window that is still shorter than max_depth.
 * Appending token t extends every such window by t, plus a new window from
 * the root: O(max_depth) child-map steps.  Each extension from endpoint E is
 * one of: extend E's own edge (E is a leaf only this window uses), move into
 * an existing child of edge length 1 (count + 1), split a longer child edge
 * after its first token, or add a new leaf.  E then lost one termination and
 * may merge into its only child.
 *
 * Removing a sequence walks each of its windows from the root, decrements
 * the counts on the path, frees the nodes that reach zero and merges the
 * deepest survivor if it became unary.  Nodes keep reading their label from
 * a removed sequence until they are relabelled (any window that reaches a
 * node relabels it), so a removed sequence's tokens live on, accounted as
 * retained_tokens, until no node refers to them.
 *
 * Failure atomicity.  Every allocation one appended token needs (nodes,
 * child-map growth, token storage) is made before the tree is touched, so
 * AS_ERR_NOMEM leaves whole tokens appended and the tree consistent.
 */
#include <stdatomic.h>
#include <string.h>

#include "alloc.h"
#include "tree_internal.h"

static _Atomic uint64_t next_uid = 1;

/* ---------- nodes ---------------------------------------------------- */

/* Capacity of chunk c: the first chunk starts small and doubles up to
 * CHUNK_SIZE (per-request trees stay small); later chunks are full size. */
static inline uint32_t chunk_cap(const as_tree *t, uint32_t c) {
    return c == 0 ? t->chunk0_cap : CHUNK_SIZE;
}

static int node_reserve(as_tree *t, uint32_t k) {
    for (;;) {
        uint64_t cap = t->nchunks == 0 ? 0 : (uint64_t)(t->nchunks - 1) * CHUNK_SIZE + chunk_cap(t, t->nchunks - 1);
        if ((uint64_t)t->n_free_nodes + (cap - t->node_hw) >= k) return AS_OK;
        if (t->nchunks == 1 && t->chunk0_cap < CHUNK_SIZE) { /* grow the first chunk in place */
            uint32_t nc = t->chunk0_cap * 2;
            node *c0 = as_xrealloc(&t->bytes, t->chunks[0], sizeof(node) * t->chunk0_cap,
                                   sizeof(node) * nc);
            if (c0 == NULL) return AS_ERR_NOMEM;
            t->chunks[0] = c0;
            t->chunk0_cap = nc;
            continue;
        }
        if (t->nchunks >= (NIL >> CHUNK_BITS)) return AS_ERR_CAPACITY;
        if (t->nchunks == t->chunks_cap) {
            uint32_t cap2 = t->chunks_cap ? t->chunks_cap * 2 : 4;
            node **c = as_xrealloc(&t->bytes, t->chunks, sizeof(node *) * t->chunks_cap,
                                   sizeof(node *) * cap2);
            if (c == NULL) return AS_ERR_NOMEM;
            t->chunks = c;
            t->chunks_cap = cap2;
        }
        uint32_t size = t->nchunks == 0 ? CHUNK0_MIN : CHUNK_SIZE;
        node *chunk = as_xmalloc(&t->bytes, sizeof(node) * size);
        if (chunk == NULL) return AS_ERR_NOMEM;
        if (t->nchunks == 0) t->chunk0_cap = size;
        t->chunks[t->nchunks++] = chunk;
    }
}

/* Take a reserved node (node_reserve must have succeeded). */
static uint32_t node_take(as_tree *t) {
    uint32_t id;
    node *n;
    if (t->free_node != NIL) {
        id = t->free_node;
        n = N(t, id);
        t->free_node = n->parent;
        t->n_free_nodes--;
    } else {
        id = t->node_hw++;
        n = N(t, id);
        n->gen = 0;
    }
    uint32_t gen = n->gen;
    memset(n, 0, sizeof *n);
    n->gen = gen;
    n->seq = NIL;
    n->parent = NIL;
    t->live_nodes++;
    return id;
}

static void seq_unref(as_tree *t, uint32_t si);

static void label_set(as_tree *t, node *n, uint32_t si, uint32_t start) {
    if (n->seq == si) {
        n->start = start;
        return;
    }
    uint32_t old = n->seq;
    n->seq = si;
    n->start = start;
    t->seqs[si].refs++;
    if (old != NIL) seq_unref(t, old);
}

static void node_release(as_tree *t, uint32_t id) {
    node *n = N(t, id);
    if (n->flags & NF_MAP) cm_free(&t->bytes, n->ch.map);
    uint32_t si = n->seq;
    n->flags = NF_FREE;
    n->seq = NIL;
    n->gen++;
    n->count = 0;
    n->parent = t->free_node;
    t->free_node = id;
    t->n_free_nodes++;
    t->live_nodes--;
    if (si != NIL) seq_unref(t, si);
}

static inline int32_t node_key(const as_tree *t, const node *n) {
    return label_at(t, n, N(t, n->parent)->depth);
}

/* ---------- children ------------------------------------------------- */

/* Is child a better "best" than child b?  (count desc, token asc) */
static int better(const as_tree *t, uint32_t a, int32_t akey, uint32_t b) {
    if (b == NIL) return 1;
    const node *na = N(t, a), *nb = N(t, b);
    if (na->count != nb->count) return na->count > nb->count;
    return akey < node_key(t, nb);
}

static void rescan_best(const as_tree *t, childmap *m) {
    uint32_t best = NIL, bc = 0;
    int32_t bk = 0;
    for (uint32_t i = 0; i < m->cap; i++) {
        int32_t k = m->slots[i].key;
        if (k < 0) continue;
        uint32_t c = N(t, m->slots[i].val)->count;
        if (best == NIL || c > bc || (c == bc && k < bk)) {
            best = m->slots[i].val;
            bc = c;
            bk = k;
        }
    }
    m->best = best;
}

/* Make sure node id can take one more child without allocating later. */
static int child_room(as_tree *t, uint32_t id) {
    node *n = N(t, id);
    if (n->flags & NF_MAP) {
        childmap *m = n->ch.map;
        if ((uint64_t)(m->size + m->tombs + 1) * 8 <= (uint64_t)m->cap * 6) return AS_OK;
        /* grow (or clean) now: insert+erase of nothing is not possible, so rebuild */
        childmap *g = cm_create(&t->bytes, m->size + 1);
        if (g == NULL) return AS_ERR_NOMEM;
        g->best = m->best;
        g->sum = m->sum;
        for (uint32_t i = 0; i < m->cap; i++)
            if (m->slots[i].key >= 0) (void)cm_insert(&t->bytes, &g, m->slots[i].key, m->slots[i].val);
        cm_free(&t->bytes, m);
        n->ch.map = g;
        return AS_OK;
    }
    if ((n->flags & NF_NCHILD) < 2) return AS_OK;
    childmap *m = cm_create(&t->bytes, 3);
    if (m == NULL) return AS_ERR_NOMEM;
    for (int i = 0; i < 2; i++) (void)cm_insert(&t->bytes, &m, n->ch.in.key[i], n->ch.in.child[i]);
    m->sum = child_total(t, n);
    m->best = NIL;
    if (id != ROOT) {
        int32_t k;
        m->best = best_child(t, n, &k);
    }
    n->ch.map = m;
    n->flags = (uint16_t)((n->flags & ~NF_NCHILD) | NF_MAP);
    return AS_OK;
}

/* Add child c (count already set) under key; child_room must have run. */
static void child_add(as_tree *t, uint32_t id, int32_t key, uint32_t c) {
    node *n = N(t, id);
    N(t, c)->parent = id;
    if (n->flags & NF_MAP) {
        childmap *m = n->ch.map;
        (void)cm_insert(&t->bytes, &n->ch.map, key, c); /* room reserved: cannot fail */
        m = n->ch.map;
        m->sum += N(t, c)->count;
        if (id != ROOT && better(t, c, key, m->best)) m->best = c;
        return;
    }
    uint32_t k = n->flags & NF_NCHILD;
    n->ch.in.key[k] = key;
    n->ch.in.child[k] = c;
    n->flags = (uint16_t)((n->flags & ~NF_NCHILD) | (k + 1));
}

/* Point key at new child c instead of old (same key). */
static void child_replace(as_tree *t, uint32_t id, int32_t key, uint32_t old, uint32_t c) {
    node *n = N(t, id);
    N(t, c)->parent = id;
    if (n->flags & NF_MAP) {
        uint32_t *v = cm_ref(n->ch.map, key);
        if (v != NULL) *v = c;
        childmap *m = n->ch.map;
        m->sum = m->sum - N(t, old)->count + N(t, c)->count;
        if (m->best == old) m->best = c;
        if (id != ROOT && better(t, c, key, m->best)) m->best = c;
        return;
    }
    for (uint32_t i = 0; i < (n->flags & NF_NCHILD); i++)
        if (n->ch.in.key[i] == key) n->ch.in.child[i] = c;
}

/* Remove the child under key (its count no longer matters). */
static void child_del(as_tree *t, uint32_t id, int32_t key, uint32_t c) {
    node *n = N(t, id);
    if (n->flags & NF_MAP) {
        childmap *m = n->ch.map;
        m->sum -= N(t, c)->count;
        (void)cm_erase(&t->bytes, &n->ch.map, key);
        m = n->ch.map;
        if (m->size <= 2) { /* back to the inline form */
            int32_t keys[2];
            uint32_t kids[2];
            uint32_t k = 0;
            for (uint32_t i = 0; i < m->cap; i++)
                if (m->slots[i].key >= 0) {
                    keys[k] = m->slots[i].key;
                    kids[k] = m->slots[i].val;
                    k++;
                }
            cm_free(&t->bytes, m);
            n->flags = (uint16_t)((n->flags & ~NF_MAP) | k);
            for (uint32_t i = 0; i < k; i++) {
                n->ch.in.key[i] = keys[i];
                n->ch.in.child[i] = kids[i];
            }
            return;
        }
        if (m->best == c && id != ROOT) rescan_best(t, m);
        return;
    }
    uint32_t k = n->flags & NF_NCHILD;
    for (uint32_t i = 0; i < k; i++)
        if (n->ch.in.key[i] == key) {
            if (i == 0 && k == 2) {
                n->ch.in.key[0] = n->ch.in.key[1];
                n->ch.in.child[0] = n->ch.in.child[1];
            }
            n->flags = (uint16_t)((n->flags & ~NF_NCHILD) | (k - 1));
            return;
        }
}

/* Change a node's count by +1 / -1, keeping the parent's sum and best. */
static void count_inc(as_tree *t, uint32_t id) {
    node *n = N(t, id);
    n->count++;
    node *p = N(t, n->parent);
    if (p->flags & NF_MAP) {
        childmap *m = p->ch.map;
        m->sum++;
        if (n->parent != ROOT && m->best != id && better(t, id, node_key(t, n), m->best)) m->best = id;
    }
}

static void count_dec(as_tree *t, uint32_t id) {
    node *n = N(t, id);
    n->count--;
    node *p = N(t, n->parent);
    if (p->flags & NF_MAP) {
        childmap *m = p->ch.map;
        m->sum--;
        if (n->parent != ROOT && m->best == id) rescan_best(t, m);
    }
}

/* Merge a unary node whose count equals its child's into the child. */
static void maybe_merge(as_tree *t, uint32_t id) {
    if (id == ROOT) return;
    node *n = N(t, id);
    if (nchild(n) != 1 || (n->flags & NF_MAP)) return;
    uint32_t x = n->ch.in.child[0];
    if (N(t, x)->count != n->count) return;
    uint32_t p = n->parent;
    int32_t key = node_key(t, n);
    child_replace(t, p, key, id, x);
    node_release(t, id);
}

/* ---------- sequences ------------------------------------------------ */

static void seq_slot_free(as_tree *t, uint32_t si) {
    seqrec *s = &t->seqs[si];
    as_xfree(&t->bytes, s->tok, sizeof(int32_t) * (size_t)s->cap);
    if (s->ring) as_xfree(&t->bytes, s->ring, sizeof(uint32_t) * (size_t)t->max_depth);
    memset(s, 0, sizeof *s);
    s->next = t->free_seq;
    t->free_seq = si;
}

static void seq_unref(as_tree *t, uint32_t si) {
    seqrec *s = &t->seqs[si];
    s->refs--;
    if (s->refs == 0 && !s->live) {
        t->retained_tokens -= s->len;
        seq_slot_free(t, si);
    }
}

uint32_t tree_seq_index(const as_tree *t, int64_t seq_id) {
    uint32_t v = idm_get(&t->ids, seq_id);
    return v == IDM_EMPTY ? NIL : v;
}

/* New live, open sequence slot registered under seq_id. */
static int seq_new(as_tree *t, int64_t seq_id, uint32_t *out) {
    int rc = idm_reserve(&t->bytes, &t->ids);
    if (rc != AS_OK) return rc;
    uint32_t *ring = as_xmalloc(&t->bytes, sizeof(uint32_t) * (size_t)t->max_depth);
    if (ring == NULL) return AS_ERR_NOMEM;
    uint32_t si;
    if (t->free_seq != NIL) {
        si = t->free_seq;
        t->free_seq = t->seqs[si].next;
    } else {
        if (t->nseqs == t->seqs_cap) {
            if (t->seqs_cap >= (NIL >> 2)) {
                as_xfree(&t->bytes, ring, sizeof(uint32_t) * (size_t)t->max_depth);
                return AS_ERR_CAPACITY;
            }
            uint32_t cap = t->seqs_cap ? t->seqs_cap * 2 : 8;
            seqrec *s = as_xrealloc(&t->bytes, t->seqs, sizeof(seqrec) * t->seqs_cap,
                                    sizeof(seqrec) * (size_t)cap);
            if (s == NULL) {
                as_xfree(&t->bytes, ring, sizeof(uint32_t) * (size_t)t->max_depth);
                return AS_ERR_NOMEM;
            }
            t->seqs = s;
            t->seqs_cap = cap;
        }
        si = t->nseqs++;
    }
    seqrec *s = &t->seqs[si];
    memset(s, 0, sizeof *s);
    s->id = seq_id;
    s->ring = ring;
    s->open = 1;
    s->live = 1;
    s->used = 1;
    s->prev = t->tail;
    s->next = NIL;
    if (t->tail != NIL) t->seqs[t->tail].next = si;
    else t->head = si;
    t->tail = si;
    (void)idm_put(&t->bytes, &t->ids, seq_id, si); /* reserved */
    t->n_live++;
    t->n_open++;
    *out = si;
    return AS_OK;
}

static void seq_close(as_tree *t, uint32_t si) {
    seqrec *s = &t->seqs[si];
    if (!s->open) return;
    as_xfree(&t->bytes, s->ring, sizeof(uint32_t) * (size_t)t->max_depth);
    s->ring = NULL;
    s->open = 0;
    t->n_open--;
    if (s->cap > s->len) { /* give back slack */
        int32_t *tok = as_xrealloc(&t->bytes, s->tok, sizeof(int32_t) * (size_t)s->cap,
                                   sizeof(int32_t) * (size_t)(s->len ? s->len : 1));
        if (tok != NULL) {
            s->tok = tok;
            s->cap = s->len ? s->len : 1;
        }
    }
}

uint32_t tree_open_points(const as_tree *t, uint32_t si, uint32_t pmax, point *pts) {
    const seqrec *s = &t->seqs[si];
    if (!s->open || s->len == 0) return 0;
    uint32_t d = t->max_depth;
    if (pmax > d - 1) pmax = d - 1;
    if (pmax > s->len) pmax = s->len;
    uint32_t r = (s->len - 1) % d, m = 0; /* ring slot of the window of length 1 */
    for (uint32_t len = 1; len <= pmax; len++) {
        uint32_t e = s->ring[r];
        if (e == NIL) break;
        pts[len].node = e;
        pts[len].x = len;
        m = len;
        r = r == 0 ? d - 1 : r - 1;
    }
    return m;
}

/* ---------- append --------------------------------------------------- */

/* Extend the window (si, start) ending at node e by token tok; return its new
 * endpoint.  All allocations were reserved by the caller. */
/* An open leaf that another window reaches stops being private. */
static void materialize(as_tree *t, node *n) {
    if (!(n->flags & NF_OPEN)) return;
    n->depth = (uint16_t)ndepth(t, n);
    n->flags &= (uint16_t)~NF_OPEN;
    seqrec *owner = &t->seqs[n->seq];
    if (owner->open && n->start < owner->implicit_end) owner->implicit_end = n->start;
}

/* Extend the window (si, start) ending at node e by token tok; return its new
 * endpoint.  c is the child under tok if already looked up, else UNKNOWN.
 * All allocations were reserved by the caller.  s->len already counts tok. */
static uint32_t extend_window(as_tree *t, uint32_t e, int32_t tok, uint32_t si, uint32_t start,
                              uint32_t c) {
    node *en = N(t, e);
    if (en->flags & NF_OPEN) return e; /* grew with the sequence already */
    if (e != ROOT && en->count == 1 && nchild(en) == 0) { /* a leaf only this window uses */
        label_set(t, en, si, start);
        en->flags |= NF_OPEN;
        return e;
    }
    uint32_t res;
    if (c == UNKNOWN) c = child_get(t, en, tok);
    if (c == NIL) {
        res = node_take(t);
        node *l = N(t, res);
        en = N(t, e);
        l->count = 1;
        label_set(t, l, si, start);
        l->flags = NF_OPEN;
        child_add(t, e, tok, res);
    } else if (ndepth(t, N(t, c)) == en->depth + 1u) {
        node *cn = N(t, c);
        materialize(t, cn);
        label_set(t, cn, si, start);
        count_inc(t, c);
        res = c;
    } else {
        res = node_take(t);
        node *m = N(t, res);
        node *cn = N(t, c);
        en = N(t, e);
        int32_t ckey = label_at(t, cn, en->depth + 1u);
        m->depth = (uint16_t)(en->depth + 1);
        m->count = cn->count;
        label_set(t, m, si, start);
        m->ch.in.key[0] = ckey;
        m->ch.in.child[0] = c;
        m->flags = 1;
        child_replace(t, e, tok, c, res);
        cn->parent = res;
        count_inc(t, res);
    }
    maybe_merge(t, e);
    return res;
}

/* Appending one token extends the windows starting at lo..pos, shortest
 * (the new one, at the root) first.  In that order an extension only
 * changes nodes that no later (longer) window still has to look at: a merge
 * touches the parent of a shallower endpoint, a split inserts a node above
 * a child of its own endpoint, and children are only added under one's own
 * endpoint.  So the child each window needs can be looked up once, in the
 * reserving pass, and reused when applying. */
/* Windows an append must visit: starting at max(lo, implicit_end) .. pos. */
static uint32_t visit_count(const seqrec *s, uint32_t d) {
    uint32_t pos = s->len;
    uint32_t lo = pos >= d - 1 ? pos - (d - 1) : 0;
    if (s->implicit_end > lo) lo = s->implicit_end;
    return pos - lo + 1;
}

static int reserve_token(as_tree *t, uint32_t si, int32_t tok) {
    uint32_t d = t->max_depth;
    int rc = node_reserve(t, d + 1);
    if (rc != AS_OK) return rc;
    seqrec *s = &t->seqs[si];
    uint32_t nwin = visit_count(s, d);
    t->lookup[0] = child_get(t, N(t, ROOT), tok);
    if (t->lookup[0] == NIL && (rc = child_room(t, ROOT)) != AS_OK) return rc;
    uint32_t r = s->len % d;
    for (uint32_t k = 1; k < nwin; k++) {
        r = r == 0 ? d - 1 : r - 1;
        uint32_t e = s->ring[r];
        node *en = N(t, e);
        uint32_t *rec = &t->lookup[k];
        *rec = UNKNOWN;
        if ((en->flags & NF_OPEN) || (en->count == 1 && nchild(en) == 0)) continue; /* no child needed */
        *rec = child_get(t, en, tok);
        if (*rec != NIL) continue;
        rc = child_room(t, e);
        if (rc != AS_OK) return rc;
    }
    return AS_OK;
}

static void append_token(as_tree *t, uint32_t si, int32_t tok) {
    uint32_t d = t->max_depth;
    seqrec *s = &t->seqs[si];
    uint32_t pos = s->len;
    uint32_t nwin = visit_count(s, d);
    s->tok[pos] = tok;
    s->len++; /* open leaves of this sequence are one longer from here on */
    t->live_tokens++;
    uint32_t *ring = s->ring;
    uint32_t r = pos % d;
    ring[r] = extend_window(t, ROOT, tok, si, pos, t->lookup[0]);
    for (uint32_t k = 1; k < nwin; k++) { /* window starting at pos - k, now k + 1 long */
        r = r == 0 ? d - 1 : r - 1;
        uint32_t ne = extend_window(t, ring[r], tok, si, pos - k, t->lookup[k]);
        if (k + 1 < d) ring[r] = ne;
    }
    /* longest windows that became private leaves need no visit from now on */
    uint32_t lo = s->len >= d - 1 ? s->len - (d - 1) : 0;
    uint32_t b = s->implicit_end > lo ? s->implicit_end : lo;
    while (b < s->len && (N(t, ring[b % d])->flags & NF_OPEN)) b++;
    s->implicit_end = b;
}

static int append_validated(as_tree *t, uint32_t si, const int32_t *tokens, size_t n) {
    seqrec *s = &t->seqs[si];
    if ((uint64_t)s->len + n > UINT32_MAX - 1 || t->live_tokens + n > UINT32_MAX - 1)
        return AS_ERR_CAPACITY;
    if (n == 0) return AS_OK;
    if (s->len + n > s->cap) {
        uint64_t cap = s->cap ? s->cap : 16;
        while (cap < s->len + n) cap *= 2;
        if (cap > UINT32_MAX) cap = UINT32_MAX;
        int32_t *tok = as_xrealloc(&t->bytes, s->tok, sizeof(int32_t) * (size_t)s->cap,
                                   sizeof(int32_t) * (size_t)cap);
        if (tok == NULL) return AS_ERR_NOMEM;
        s->tok = tok;
        s->cap = (uint32_t)cap;
    }
    t->epoch++;
    t->grow_epoch++;
    for (size_t i = 0; i < n; i++) {
        int rc = reserve_token(t, si, tokens[i]);
        if (rc != AS_OK) return rc;
        append_token(t, si, tokens[i]);
    }
    return AS_OK;
}

/* ---------- remove --------------------------------------------------- */

static void relabel_from(as_tree *t, uint32_t id, uint32_t dead) {
    node *n = N(t, id);
    if (n->seq != dead) return;
    int32_t k;
    uint32_t b = best_child(t, n, &k);
    if (b == NIL && nchild(n) > 0) b = n->ch.in.child[0];
    if (b != NIL && N(t, b)->seq != dead) label_set(t, n, N(t, b)->seq, N(t, b)->start);
}

static int remove_windows(as_tree *t, uint32_t si) {
    seqrec *s = &t->seqs[si];
    uint32_t d = t->max_depth;
    uint32_t path[AS_MAX_DEPTH_LIMIT + 1];
    int rc = AS_OK;
    for (uint32_t i = 0; i < s->len; i++) {
        uint32_t len = s->len - i < d ? s->len - i : d;
        uint32_t k = 0, cur = ROOT;
        while (ndepth(t, N(t, cur)) < len) {
            uint32_t c = child_get(t, N(t, cur), s->tok[i + ndepth(t, N(t, cur))]);
            if (c == NIL) break;
            path[k++] = c;
            cur = c;
        }
        if (ndepth(t, N(t, cur)) != len) rc = AS_ERR_FORMAT; /* cannot happen in a sound tree */
        for (uint32_t j = 0; j < k; j++) count_dec(t, path[j]);
        int32_t j = (int32_t)k - 1;
        while (j >= 0 && N(t, path[j])->count == 0) {
            node *n = N(t, path[j]);
            child_del(t, n->parent, node_key(t, n), path[j]);
            node_release(t, path[j]);
            j--;
        }
        for (int32_t q = j; q >= 0; q--) relabel_from(t, path[q], si);
        if (j >= 0) maybe_merge(t, path[j]);
    }
    return rc;
}

/* ---------- compaction ----------------------------------------------- */

/* Slots the node storage can hold. */
static uint64_t node_capacity(const as_tree *t) {
    return t->nchunks == 0 ? 0 : (uint64_t)(t->nchunks - 1) * CHUNK_SIZE + chunk_cap(t, t->nchunks - 1);
}

/* Storage a tree with `live` nodes is compacted to. */
static uint32_t compact_target(uint64_t live) {
    if (live > CHUNK_SIZE) return (uint32_t)((live + CHUNK_SIZE - 1) / CHUNK_SIZE * CHUNK_SIZE);
    uint32_t c = CHUNK0_MIN;
    while (c < live) c <<= 1;
    return c;
}

/* Move every node stored at index >= B into a free slot below B, fix all
 * references, and give the storage above B back to the allocator.  Node
 * indices change, so the tree gets a new uid: cursors re-match from scratch.
 * Best effort: if the remap table cannot be allocated nothing changes. */
static void compact(as_tree *t) {
    uint32_t B = compact_target(t->live_nodes);
    if (B >= node_capacity(t)) return;
    uint32_t hw = t->node_hw;
    uint32_t *remap = NULL;
    uint64_t tmp = 0;
    if (hw > B) {
        remap = as_xmalloc(&tmp, sizeof(uint32_t) * (size_t)(hw - B));
        if (remap == NULL) return;
        uint32_t slot = 1;
        for (uint32_t id = B; id < hw; id++) {
            node *n = N(t, id);
            if (n->flags & NF_FREE) continue;
            while (slot < B && !(N(t, slot)->flags & NF_FREE)) slot++; /* live <= B: one exists */
            if (slot >= B) break;
            node *dst = N(t, slot);
            uint32_t gen = dst->gen;
            *dst = *n;
            dst->gen = gen + 1;
            n->flags = NF_FREE;
            remap[id - B] = slot;
        }
        for (uint32_t id = 0; id < B && id < hw; id++) { /* fix references */
            node *n = N(t, id);
            if (n->flags & NF_FREE) continue;
            if (n->parent != NIL && n->parent >= B) n->parent = remap[n->parent - B];
            if (n->flags & NF_MAP) {
                childmap *m = n->ch.map;
                for (uint32_t i = 0; i < m->cap; i++)
                    if (m->slots[i].key >= 0 && m->slots[i].val >= B) m->slots[i].val = remap[m->slots[i].val - B];
                if (m->best != NIL && m->best >= B) m->best = remap[m->best - B];
            } else {
                for (uint32_t i = 0; i < (n->flags & NF_NCHILD); i++)
                    if (n->ch.in.child[i] >= B) n->ch.in.child[i] = remap[n->ch.in.child[i] - B];
            }
        }
        for (uint32_t si = 0; si < t->nseqs; si++) {
            seqrec *s = &t->seqs[si];
            if (!s->used || !s->open) continue;
            for (uint32_t r = 0; r < t->max_depth; r++)
                if (s->ring[r] >= B && s->ring[r] < hw) s->ring[r] = remap[s->ring[r] - B];
        }
        as_xfree(&tmp, remap, sizeof(uint32_t) * (size_t)(hw - B));
        hw = B;
    }
    /* release storage above B */
    uint32_t keep = B <= CHUNK_SIZE ? 1 : B / CHUNK_SIZE;
    for (uint32_t c = keep; c < t->nchunks; c++) as_xfree(&t->bytes, t->chunks[c], sizeof(node) * CHUNK_SIZE);
    t->nchunks = keep;
    if (B <= CHUNK_SIZE && t->chunk0_cap > B) {
        node *c0 = as_xrealloc(&t->bytes, t->chunks[0], sizeof(node) * t->chunk0_cap, sizeof(node) * B);
        if (c0 != NULL) { /* on failure the chunk simply stays larger */
            t->chunks[0] = c0;
            t->chunk0_cap = B;
        }
    }
    /* rebuild the free list, lowest index first */
    t->node_hw = hw;
    t->free_node = NIL;
    t->n_free_nodes = 0;
    for (uint32_t id = hw; id-- > 0;) {
        node *n = N(t, id);
        if (!(n->flags & NF_FREE)) continue;
        n->parent = t->free_node;
        t->free_node = id;
        t->n_free_nodes++;
    }
    t->uid = atomic_fetch_add(&next_uid, 1);
}

/* Compact once at least half the node storage is free (amortised O(1)). */
static void maybe_compact(as_tree *t) {
    uint64_t cap = node_capacity(t);
    if (cap > CHUNK0_MIN && t->live_nodes * 2 < cap && cap - compact_target(t->live_nodes) >= CHUNK0_MIN)
        compact(t);
    if (t->n_live == 0 && t->retained_tokens == 0 && t->seqs_cap > 0) { /* all slots free */
        as_xfree(&t->bytes, t->seqs, sizeof(seqrec) * t->seqs_cap);
        t->seqs = NULL;
        t->seqs_cap = t->nseqs = 0;
        t->free_seq = NIL;
    }
}

/* ---------- public API ----------------------------------------------- */

as_tree *as_tree_create(uint32_t max_depth, int *status) {
    int rc = AS_OK;
    as_tree *t = NULL;
    if (max_depth < 2 || max_depth > AS_MAX_DEPTH_LIMIT) {
        rc = AS_ERR_INVALID_ARG;
        goto out;
    }
    uint64_t bytes = 0;
    t = as_xcalloc(&bytes, 1, sizeof *t);
    if (t == NULL) {
        rc = AS_ERR_NOMEM;
        goto out;
    }
    t->bytes = bytes;
    t->max_depth = max_depth;
    t->uid = atomic_fetch_add(&next_uid, 1);
    t->free_node = NIL;
    t->free_seq = NIL;
    t->head = t->tail = NIL;
    rc = idm_init(&t->bytes, &t->ids);
    if (rc == AS_OK) {
        t->lookup = as_xmalloc(&t->bytes, sizeof(uint32_t) * ((size_t)max_depth + 1));
        if (t->lookup == NULL) rc = AS_ERR_NOMEM;
    }
    if (rc == AS_OK) rc = node_reserve(t, 1);
    if (rc != AS_OK) {
        as_handle_opened();
        as_tree_free(t);
        t = NULL;
        goto out;
    }
    uint32_t root = node_take(t);
    (void)root; /* always index 0 */
    as_handle_opened();
out:
    if (status) *status = rc;
    return t;
}

void as_tree_free(as_tree *t) {
    if (t == NULL) return;
    uint64_t *acct = &t->bytes;
    for (uint32_t c = 0; c < t->nchunks; c++) {
        for (uint32_t i = 0; i < chunk_cap(t, c) && c * CHUNK_SIZE + i < t->node_hw; i++) {
            node *n = &t->chunks[c][i];
            if (!(n->flags & NF_FREE) && (n->flags & NF_MAP)) cm_free(acct, n->ch.map);
        }
        as_xfree(acct, t->chunks[c], sizeof(node) * chunk_cap(t, c));
    }
    as_xfree(acct, t->chunks, sizeof(node *) * t->chunks_cap);
    for (uint32_t i = 0; i < t->nseqs; i++) {
        seqrec *s = &t->seqs[i];
        if (!s->used) continue;
        as_xfree(acct, s->tok, sizeof(int32_t) * (size_t)s->cap);
        if (s->ring) as_xfree(acct, s->ring, sizeof(uint32_t) * (size_t)t->max_depth);
    }
    as_xfree(acct, t->seqs, sizeof(seqrec) * t->seqs_cap);
    idm_destroy(acct, &t->ids);
    as_xfree(acct, t->lookup, sizeof(uint32_t) * ((size_t)t->max_depth + 1));
    uint64_t self = 0;
    as_xfree(&self, t, sizeof *t);
    as_handle_closed();
}

uint32_t as_tree_max_depth(const as_tree *t) { return t ? t->max_depth : 0; }

int as_tree_append(as_tree *t, int64_t seq_id, const int32_t *tokens, size_t n) {
    if (t == NULL || (tokens == NULL && n > 0)) return AS_ERR_INVALID_ARG;
    int rc = tokens_valid(tokens, n);
    if (rc != AS_OK) return rc;
    uint32_t si = tree_seq_index(t, seq_id);
    if (si == NIL) {
        if (t->live_tokens + n > UINT32_MAX - 1) return AS_ERR_CAPACITY;
        rc = seq_new(t, seq_id, &si);
        if (rc != AS_OK) return rc;
        t->epoch++;
    } else if (!t->seqs[si].open) {
        return AS_ERR_SEQ_CLOSED;
    }
    return append_validated(t, si, tokens, n);
}

static void unlink_seq(as_tree *t, uint32_t si) {
    seqrec *s = &t->seqs[si];
    if (s->prev != NIL) t->seqs[s->prev].next = s->next;
    else t->head = s->next;
    if (s->next != NIL) t->seqs[s->next].prev = s->prev;
    else t->tail = s->prev;
}

static int remove_index(as_tree *t, uint32_t si) {
    t->epoch++;
    if (t->seqs[si].open) seq_close(t, si);
    int rc = remove_windows(t, si);
    seqrec *s = &t->seqs[si];
    idm_del(&t->bytes, &t->ids, s->id);
    unlink_seq(t, si);
    t->n_live--;
    t->live_tokens -= s->len;
    s->live = 0;
    if (s->refs == 0) seq_slot_free(t, si);
    else t->retained_tokens += s->len;
    maybe_compact(t);
    return rc;
}

int tree_add_validated(as_tree *t, int64_t seq_id, const int32_t *tokens, size_t n) {
    if (tree_seq_index(t, seq_id) != NIL) return AS_ERR_SEQ_EXISTS;
    if (t->live_tokens + n > UINT32_MAX - 1) return AS_ERR_CAPACITY;
    uint32_t si;
    int rc = seq_new(t, seq_id, &si);
    if (rc != AS_OK) return rc;
    t->epoch++;
    rc = append_validated(t, si, tokens, n);
    if (rc != AS_OK) {
        (void)remove_index(t, si);
        return rc;
    }
    seq_close(t, si);
    return AS_OK;
}

int as_tree_add(as_tree *t, int64_t seq_id, const int32_t *tokens, size_t n) {
    if (t == NULL || (tokens == NULL && n > 0)) return AS_ERR_INVALID_ARG;
    int rc = tokens_valid(tokens, n);
    if (rc != AS_OK) return rc;
    return tree_add_validated(t, seq_id, tokens, n);
}

int as_tree_close(as_tree *t, int64_t seq_id) {
    if (t == NULL) return AS_ERR_INVALID_ARG;
    uint32_t si = tree_seq_index(t, seq_id);
    if (si == NIL) return AS_ERR_SEQ_NOT_FOUND;
    if (t->seqs[si].open) {
        t->epoch++;
        seq_close(t, si);
    }
    return AS_OK;
}

int as_tree_remove(as_tree *t, int64_t seq_id) {
    if (t == NULL) return AS_ERR_INVALID_ARG;
    uint32_t si = tree_seq_index(t, seq_id);
    if (si == NIL) return AS_ERR_SEQ_NOT_FOUND;
    return remove_index(t, si);
}

int as_tree_contains(const as_tree *t, int64_t seq_id) {
    return t != NULL && tree_seq_index(t, seq_id) != NIL;
}

int as_tree_seq_len(const as_tree *t, int64_t seq_id, uint64_t *len) {
    if (t == NULL || len == NULL) return AS_ERR_INVALID_ARG;
    uint32_t si = tree_seq_index(t, seq_id);
    if (si == NIL) return AS_ERR_SEQ_NOT_FOUND;
    *len = t->seqs[si].len;
    return AS_OK;
}

int as_tree_seq_tokens(const as_tree *t, int64_t seq_id, int32_t *out, size_t cap) {
    if (t == NULL || (out == NULL && cap > 0)) return AS_ERR_INVALID_ARG;
    uint32_t si = tree_seq_index(t, seq_id);
    if (si == NIL) return AS_ERR_SEQ_NOT_FOUND;
    const seqrec *s = &t->seqs[si];
    if (cap < s->len) return AS_ERR_CAPACITY;
    if (s->len) memcpy(out, s->tok, sizeof(int32_t) * s->len);
    return AS_OK;
}

int as_tree_seq_ids(const as_tree *t, int64_t *out, size_t cap, size_t *n) {
    if (t == NULL || n == NULL || (out == NULL && cap > 0)) return AS_ERR_INVALID_ARG;
    size_t k = 0;
    for (uint32_t si = t->head; si != NIL; si = t->seqs[si].next) {
        if (k < cap) out[k] = t->seqs[si].id;
        k++;
    }
    *n = k;
    return AS_OK;
}

int as_tree_stats_get(const as_tree *t, as_tree_stats *out) {
    if (t == NULL || out == NULL) return AS_ERR_INVALID_ARG;
    out->sequences = t->n_live;
    out->open_sequences = t->n_open;
    out->tokens = t->live_tokens;
    out->nodes = t->live_nodes;
    out->bytes = t->bytes;
    out->retained_tokens = t->retained_tokens;
    out->free_bytes = (uint64_t)(t->n_free_nodes + (node_capacity(t) - t->node_hw)) * sizeof(node);
    out->max_depth = t->max_depth;
    return AS_OK;
}

int as_tree_count(const as_tree *t, const int32_t *tokens, size_t n, uint64_t *count) {
    if (t == NULL || count == NULL || tokens == NULL || n == 0) return AS_ERR_INVALID_ARG;
    int rc = tokens_valid(tokens, n);
    if (rc != AS_OK) return rc;
    *count = 0;
    if (n > t->max_depth) return AS_OK;
    point p = {ROOT, 0};
    for (size_t i = 0; i < n; i++)
        if (point_step(t, p, tokens[i], &p) != 0) return AS_OK;
    *count = N(t, p.node)->count;
    return AS_OK;
}

/* ---------- integrity check ------------------------------------------ */

#ifdef AS_TRACE_CHECK
#include <stdio.h>
#define CHECK_TRACE(what) fprintf(stderr, "as_tree_check: %s failed (line %d)\n", what, __LINE__)
#else
#define CHECK_TRACE(what) ((void)0)
#endif
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) { CHECK_TRACE(#cond); return AS_ERR_FORMAT; }                                 \
    } while (0)

static int check_node(const as_tree *t, uint32_t id, uint64_t *refs) {
    const node *n = N(t, id);
    uint32_t k = nchild(n);
    uint64_t sum = 0;
    uint32_t best = NIL;
    uint32_t bc = 0;
    int32_t bk = 0;
    for (uint32_t i = 0, seen = 0; seen < k; i++) {
        int32_t key;
        uint32_t c;
        if (n->flags & NF_MAP) {
            CHECK(i < n->ch.map->cap);
            key = n->ch.map->slots[i].key;
            if (key < 0) continue;
            c = n->ch.map->slots[i].val;
        } else {
            key = n->ch.in.key[i];
            c = n->ch.in.child[i];
        }
        seen++;
        CHECK(c < t->node_hw && c != ROOT);
        const node *cn = N(t, c);
        CHECK(!(cn->flags & NF_FREE));
        CHECK(cn->parent == id);
        CHECK(ndepth(t, cn) > n->depth && ndepth(t, cn) <= t->max_depth);
        CHECK(!(cn->flags & NF_OPEN) || (cn->count == 1 && nchild(cn) == 0));
        CHECK(cn->count > 0);
        CHECK(cn->seq < t->nseqs && t->seqs[cn->seq].used);
        CHECK((uint64_t)cn->start + ndepth(t, cn) <= t->seqs[cn->seq].len);
        CHECK(label_at(t, cn, n->depth) == key);
        if (id != ROOT)
            for (uint32_t q = 0; q < n->depth; q++) CHECK(label_at(t, cn, q) == label_at(t, n, q));
        sum += cn->count;
        if (best == NIL || cn->count > bc || (cn->count == bc && key < bk)) {
            best = c;
            bc = cn->count;
            bk = key;
        }
    }
    if (n->flags & NF_MAP) {
        CHECK(n->ch.map->sum == sum);
        if (id != ROOT) CHECK(n->ch.map->best == best);
    }
    if (id != ROOT) {
        CHECK(sum <= n->count);
        /* unary nodes with no termination must have been merged */
        CHECK(!(k == 1 && sum == n->count));
        refs[n->seq]++;
    } else {
        CHECK(sum == t->live_tokens);
    }
    return AS_OK;
}

int as_tree_check(const as_tree *t) {
    if (t == NULL) return AS_ERR_INVALID_ARG;
    uint64_t bytes = 0;
    uint64_t *refs = as_xcalloc(&bytes, t->nseqs ? t->nseqs : 1, sizeof(uint64_t));
    if (refs == NULL) return AS_ERR_NOMEM;
    int rc = AS_OK;
    uint64_t live = 0;
    for (uint32_t id = 0; id < t->node_hw && rc == AS_OK; id++) {
        if (N(t, id)->flags & NF_FREE) continue;
        live++;
        rc = check_node(t, id, refs);
    }
    if (rc == AS_OK && live != t->live_nodes) {
        CHECK_TRACE("live node count");
        rc = AS_ERR_FORMAT;
    }
    uint64_t retained = 0, tokens = 0, nlive = 0;
    for (uint32_t si = 0; si < t->nseqs && rc == AS_OK; si++) {
        const seqrec *s = &t->seqs[si];
        if (!s->used) continue;
        if (s->refs != refs[si]) {
            CHECK_TRACE("sequence reference count");
            rc = AS_ERR_FORMAT;
        }
        if (s->live && s->open) { /* windows before implicit_end end in their own open leaf */
            uint32_t d = t->max_depth;
            uint32_t lo = s->len >= d - 1 ? s->len - (d - 1) : 0;
            for (uint32_t i = lo; i < s->implicit_end && i < s->len; i++) {
                uint32_t e = s->ring[i % d];
                if (e >= t->node_hw || !(N(t, e)->flags & NF_OPEN) || N(t, e)->seq != si ||
                    N(t, e)->start != i) {
                    CHECK_TRACE("implicit window without its open leaf");
                    rc = AS_ERR_FORMAT;
                    break;
                }
            }
        }
        if (s->live) {
            tokens += s->len;
            nlive++;
        } else {
            retained += s->len;
            if (s->refs == 0) {
                CHECK_TRACE("retained sequence without references");
                rc = AS_ERR_FORMAT;
            }
        }
    }
    if (rc == AS_OK && (tokens != t->live_tokens || retained != t->retained_tokens || nlive != t->n_live)) {
        CHECK_TRACE("sequence totals");
        rc = AS_ERR_FORMAT;
    }
    as_xfree(&bytes, refs, sizeof(uint64_t) * (t->nseqs ? t->nseqs : 1));
    return rc;
}
