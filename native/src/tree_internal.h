/*
 * tree_internal.h -- the suffix tree's data layout, shared by tree.c (build,
 * remove, check), draft.c (matching, drafting), shard.c and cursor.c.
 *
 * Node layout (40 bytes):
 *
 *   +-------+--------+-----+-------+-----+-------+-------+----------------------+
 *   | count | parent | seq | start | gen | depth | flags | children (16 bytes)  |
 *   +-------+--------+-----+-------+-----+-------+-------+----------------------+
 *     u32     u32     u32    u32    u32    u16     u16    inline: 2 x {key, node}
 *                                                         or a childmap pointer
 *
 * A node is a point where the tree branches or where some indexed window
 * ends; edges between such points are path-compressed.  The edge into a
 * node spells tokens [depth(parent), depth) of the node's path, and the path
 * itself is read from a stored sequence: token k of the path is
 * seqs[seq].tok[start + k] ("label").  Nodes live in chunks of 4096 and are
 * named by uint32 index, so a tree never holds raw pointers to nodes.
 * `gen` is bumped whenever a node is freed, which lets a cursor's cached
 * match point detect that its node died.
 *
 * Open leaves (NF_OPEN).  A leaf that only one window uses, and whose window
 * still grows, would be touched by every append just to add 1 to its depth.
 * Instead its depth is implicit -- min(max_depth, len(seq) - start) -- so it
 * grows when the sequence grows, for free (Ukkonen's "once a leaf, always a
 * leaf").  If a window is such a leaf, so is every longer window of the same
 * sequence, so an open sequence only visits its windows from
 * `implicit_end` on.  An open leaf that another window moves into is made
 * explicit again ("materialized").  Always read depths through ndepth().
 */
#ifndef AS_TREE_INTERNAL_H
#define AS_TREE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "agentspec.h"
#include "childmap.h"
#include "idmap.h"

#define NIL UINT32_MAX
#define ROOT 0u
#define UNKNOWN (UINT32_MAX - 1) /* "not looked up"; never a node index */
#define CHUNK_BITS 12
#define CHUNK_SIZE (1u << CHUNK_BITS)
#define CHUNK0_MIN 16u

#define NF_NCHILD 3u /* number of inline children, 0..2 */
#define NF_MAP 4u    /* children are in ch.map */
#define NF_FREE 8u   /* on the free list */
#define NF_OPEN 16u  /* private leaf of a growing window: depth is implicit */

typedef struct node {
    uint32_t count;  /* windows whose path passes through this node's edge */
    uint32_t parent; /* parent index; next free node when NF_FREE */
    uint32_t seq;    /* sequence holding the label (NIL for the root) */
    uint32_t start;  /* start of the labelling window in that sequence */
    uint32_t gen;    /* bumped on free */
    uint16_t depth;  /* path length at the bottom of the edge */
    uint16_t flags;
    union {
        struct {
            int32_t key[2];
            uint32_t child[2];
        } in;
        childmap *map;
    } ch;
} node;

typedef struct seqrec {
    int64_t id;
    int32_t *tok;
    uint32_t len, cap;
    uint32_t refs;   /* nodes labelled from this sequence */
    uint32_t *ring;  /* open sequences: endpoint of window starting at i, at i % max_depth */
    uint32_t prev, next; /* insertion-order list of live sequences; free list via next */
    uint32_t implicit_end; /* open: windows starting before this are open leaves */
    uint8_t open;
    uint8_t live;    /* 0: removed, kept only while refs > 0 */
    uint8_t used;    /* slot in use (live or retained) */
} seqrec;

struct as_tree {
    uint64_t bytes;      /* exact bytes held (this struct included) */
    uint64_t uid;        /* unique per tree instance */
    uint64_t epoch;      /* bumped by every modification */
    uint64_t grow_epoch; /* bumped whenever windows are added */
    uint32_t max_depth;
    node **chunks;
    uint32_t nchunks, chunks_cap;
    uint32_t chunk0_cap; /* the first chunk grows from CHUNK0_MIN to CHUNK_SIZE */
    uint32_t node_hw;    /* nodes ever handed out from the chunks */
    uint32_t free_node;
    uint32_t n_free_nodes;
    uint64_t live_nodes;
    seqrec *seqs;
    uint32_t nseqs, seqs_cap; /* slots in use or on the free list: [0, nseqs) */
    uint32_t free_seq;
    uint32_t head, tail;      /* oldest / newest live sequence */
    idmap ids;
    uint32_t *lookup; /* per appended token: the child each window steps into */
    uint64_t n_live, n_open, live_tokens, retained_tokens;
};

static inline node *N(const as_tree *t, uint32_t id) {
    return &t->chunks[id >> CHUNK_BITS][id & (CHUNK_SIZE - 1)];
}

static inline int32_t label_at(const as_tree *t, const node *n, uint32_t k) {
    return t->seqs[n->seq].tok[n->start + k];
}

/* Path length at the bottom of a node's edge. */
static inline uint32_t ndepth(const as_tree *t, const node *n) {
    if (!(n->flags & NF_OPEN)) return n->depth;
    uint32_t d = t->seqs[n->seq].len - n->start;
    return d < t->max_depth ? d : t->max_depth;
}

static inline uint32_t nchild(const node *n) {
    return (n->flags & NF_MAP) ? n->ch.map->size : (uint32_t)(n->flags & NF_NCHILD);
}

static inline uint32_t child_get(const as_tree *t, const node *n, int32_t key) {
    (void)t;
    if (n->flags & NF_MAP) return cm_get(n->ch.map, key);
    uint32_t k = n->flags & NF_NCHILD;
    if (k > 0 && n->ch.in.key[0] == key) return n->ch.in.child[0];
    if (k > 1 && n->ch.in.key[1] == key) return n->ch.in.child[1];
    return NIL;
}

/* Sum of the children's counts (the denominator of child probabilities). */
static inline uint64_t child_total(const as_tree *t, const node *n) {
    if (n->flags & NF_MAP) return n->ch.map->sum;
    uint32_t k = n->flags & NF_NCHILD;
    uint64_t s = 0;
    for (uint32_t i = 0; i < k; i++) s += N(t, n->ch.in.child[i])->count;
    return s;
}

/* Most frequent child (ties: smallest token), its token in *key; NIL if leaf. */
static inline uint32_t best_child(const as_tree *t, const node *n, int32_t *key) {
    if (n->flags & NF_MAP) {
        uint32_t b = n->ch.map->best;
        if (b != NIL) *key = label_at(t, N(t, b), n->depth);
        return b;
    }
    uint32_t k = n->flags & NF_NCHILD;
    if (k == 0) return NIL;
    uint32_t b = 0;
    if (k == 2) {
        uint32_t c0 = N(t, n->ch.in.child[0])->count, c1 = N(t, n->ch.in.child[1])->count;
        if (c1 > c0 || (c1 == c0 && n->ch.in.key[1] < n->ch.in.key[0])) b = 1;
    }
    *key = n->ch.in.key[b];
    return n->ch.in.child[b];
}

/* Occurrence point: node `node` at path length `x`, depth(parent) < x <= depth(node);
 * the root is {ROOT, 0}. */
typedef struct point {
    uint32_t node;
    uint32_t x;
} point;

/* Step a point by one token; returns 0 and fills *out, or -1 if absent. */
static inline int point_step(const as_tree *t, point p, int32_t tok, point *out) {
    const node *n = N(t, p.node);
    if (p.x < ndepth(t, n)) {
        if (label_at(t, n, p.x) != tok) return -1;
        out->node = p.node;
        out->x = p.x + 1;
        return 0;
    }
    uint32_t c = child_get(t, n, tok);
    if (c == NIL) return -1;
    out->node = c;
    out->x = p.x + 1;
    return 0;
}

/* Does the point have a continuation? */
static inline int point_has_next(const as_tree *t, point p) {
    const node *n = N(t, p.node);
    return p.x < ndepth(t, n) || nchild(n) > 0;
}

/* The points of the open sequence's last 1..pmax tokens (pmax capped at
 * max_depth - 1 and the sequence's length) into pts[1..m], for the longest
 * run of lengths that have an endpoint; returns m (0: closed or empty). */
uint32_t tree_open_points(const as_tree *t, uint32_t seq_index, uint32_t pmax, point *pts);

/* AS_OK if every token id is valid (>= 0), else AS_ERR_INVALID_TOKEN. */
static inline int tokens_valid(const int32_t *tokens, size_t n) {
    /* no early exit: an OR of every id is one branch-free pass (sign bit set: a bad id) */
    uint32_t any = 0;
    for (size_t i = 0; i < n; i++) any |= (uint32_t)tokens[i];
    return (any >> 31) ? AS_ERR_INVALID_TOKEN : AS_OK;
}

/* Internal sequence index of a caller id, or NIL. */
uint32_t tree_seq_index(const as_tree *t, int64_t seq_id);

/* Count stored sequence ids/tokens; helpers for shard.c. */
int tree_add_validated(as_tree *t, int64_t seq_id, const int32_t *tokens, size_t n);

#endif
