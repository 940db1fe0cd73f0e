/*
 * shard.c -- the binary shard format: save a tree (or a delta) to bytes and
 * load untrusted bytes back.
 *
 *   offset  size  field
 *        0     4  magic "ASHD"
 *        4     2  version (1)
 *        6     2  kind: 0 snapshot, 1 delta
 *        8     4  max_depth
 *       12     4  reserved, 0
 *       16     8  n_sequences
 *       24     8  n_removals
 *       32     8  payload_bytes
 *       40     8  checksum64 of header bytes 0..39 and of the payload
 *       48        payload: n_removals x i64 id, then per sequence
 *                 i64 id, u32 n, n x i32 token
 *
 * All integers are little-endian.  A shard stores sequences, not nodes: the
 * tree is a deterministic function of its sequences, and loading only has
 * to validate lengths and token ranges -- there is no pointer structure in
 * the bytes that could be forged.  Validation reads every field through
 * bounds-checked readers before the tree is touched; nothing trusts a count
 * before the bytes behind it have been checked to exist.
 */
#include <string.h>

#include "alloc.h"
#include "tree_internal.h"

#define SHARD_VERSION 1
static const uint8_t MAGIC[4] = {'A', 'S', 'H', 'D'};

/* ---------- little-endian helpers ---------------------------------------- */

static void put16(uint8_t *b, uint16_t v) {
    b[0] = (uint8_t)v;
    b[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *b) { return (uint16_t)(b[0] | (b[1] << 8)); }
static uint32_t get32(const uint8_t *b) {
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}
static uint64_t get64(const uint8_t *b) { return (uint64_t)get32(b) | ((uint64_t)get32(b + 4) << 32); }

/* checksum64: 8-byte words mixed with two odd constants, then avalanched.
 * An integrity check against corruption, not a cryptographic MAC. */
static uint64_t checksum64(const uint8_t *p, size_t n) {
    const uint64_t k1 = 0x9E3779B185EBCA87ull, k2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t h = 0x27D4EB2F165667C5ull ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = get64(p + i) * k2;
        w = (w << 31) | (w >> 33);
        h ^= w * k1;
        h = ((h << 27) | (h >> 37)) * k1 + 0x52DCE729u;
    }
    for (; i < n; i++) {
        h ^= (uint64_t)p[i] * k1;
        h = ((h << 11) | (h >> 53)) * k2;
    }
    h ^= h >> 33;
    h *= k2;
    h ^= h >> 29;
    h *= 0x165667B19E3779F9ull;
    h ^= h >> 32;
    return h;
}

/* Checksum of a shard: covers the header fields before it and the payload. */
static uint64_t shard_checksum(const uint8_t *buf, size_t payload) {
    uint64_t h = checksum64(buf, 40);
    return checksum64(buf + AS_SHARD_HEADER_BYTES, payload) ^ (h * 0x9E3779B97F4A7C15ull + (h >> 29));
}

/* ---------- saving ------------------------------------------------------- */

static int seq_bytes(const as_tree *t, int64_t id, uint64_t *out) {
    uint32_t si = tree_seq_index(t, id);
    if (si == NIL) return AS_ERR_SEQ_NOT_FOUND;
    *out = 12 + 4 * (uint64_t)t->seqs[si].len;
    return AS_OK;
}

int as_tree_save_bound(const as_tree *t, uint64_t *size) {
    if (t == NULL || size == NULL) return AS_ERR_INVALID_ARG;
    uint64_t n = AS_SHARD_HEADER_BYTES;
    for (uint32_t si = t->head; si != NIL; si = t->seqs[si].next) n += 12 + 4 * (uint64_t)t->seqs[si].len;
    *size = n;
    return AS_OK;
}

int as_tree_delta_bound(const as_tree *t, const int64_t *ids, size_t n_ids, size_t n_remove,
                        uint64_t *size) {
    if (t == NULL || size == NULL || (ids == NULL && n_ids > 0)) return AS_ERR_INVALID_ARG;
    if (n_remove > (UINT64_MAX / 16)) return AS_ERR_CAPACITY;
    uint64_t n = AS_SHARD_HEADER_BYTES + 8 * (uint64_t)n_remove;
    for (size_t i = 0; i < n_ids; i++) {
        uint64_t b;
        int rc = seq_bytes(t, ids[i], &b);
        if (rc != AS_OK) return rc;
        n += b;
    }
    *size = n;
    return AS_OK;
}

static uint8_t *put_seq(const seqrec *s, uint8_t *w) {
    put64(w, (uint64_t)s->id);
    put32(w + 8, s->len);
    w += 12;
    for (uint32_t k = 0; k < s->len; k++, w += 4) put32(w, (uint32_t)s->tok[k]);
    return w;
}

static void put_header(uint8_t *b, uint16_t kind, uint32_t depth, uint64_t nseq, uint64_t nrem,
                       uint64_t payload) {
    memcpy(b, MAGIC, 4);
    put16(b + 4, SHARD_VERSION);
    put16(b + 6, kind);
    put32(b + 8, depth);
    put32(b + 12, 0);
    put64(b + 16, nseq);
    put64(b + 24, nrem);
    put64(b + 32, payload);
    put64(b + 40, shard_checksum(b, (size_t)payload));
}

int as_tree_save(const as_tree *t, uint8_t *buf, size_t cap, size_t *written) {
    if (t == NULL || buf == NULL || written == NULL) return AS_ERR_INVALID_ARG;
    uint64_t need;
    (void)as_tree_save_bound(t, &need);
    if (need > cap) return AS_ERR_CAPACITY;
    uint8_t *w = buf + AS_SHARD_HEADER_BYTES;
    for (uint32_t si = t->head; si != NIL; si = t->seqs[si].next) w = put_seq(&t->seqs[si], w);
    put_header(buf, AS_SHARD_SNAPSHOT, t->max_depth, t->n_live, 0, need - AS_SHARD_HEADER_BYTES);
    *written = (size_t)need;
    return AS_OK;
}

int as_tree_save_delta(const as_tree *t, const int64_t *ids, size_t n_ids, const int64_t *remove_ids,
                       size_t n_remove, uint8_t *buf, size_t cap, size_t *written) {
    if (t == NULL || buf == NULL || written == NULL || (remove_ids == NULL && n_remove > 0))
        return AS_ERR_INVALID_ARG;
    uint64_t need;
    int rc = as_tree_delta_bound(t, ids, n_ids, n_remove, &need);
    if (rc != AS_OK) return rc;
    if (need > cap) return AS_ERR_CAPACITY;
    uint8_t *w = buf + AS_SHARD_HEADER_BYTES;
    for (size_t i = 0; i < n_remove; i++, w += 8) put64(w, (uint64_t)remove_ids[i]);
    for (size_t i = 0; i < n_ids; i++) w = put_seq(&t->seqs[tree_seq_index(t, ids[i])], w);
    put_header(buf, AS_SHARD_DELTA, t->max_depth, n_ids, n_remove, need - AS_SHARD_HEADER_BYTES);
    *written = (size_t)need;
    return AS_OK;
}

/* ---------- validating --------------------------------------------------- */

typedef struct shard_view {
    uint32_t kind, max_depth;
    uint64_t n_seq, n_rem, n_tokens;
    uint32_t longest;
    int32_t max_token; /* -1 when no sequence holds a token */
    const uint8_t *rem;  /* n_rem x 8 bytes */
    const uint8_t *seqs; /* first sequence record */
} shard_view;

/* The fixed header alone: magic, version, kind, reserved, max_depth and the
 * payload length against len.  O(1); the checksum and the payload are not read. */
static int parse_header(const uint8_t *buf, size_t len, shard_view *v, uint64_t *payload) {
    if (buf == NULL) return AS_ERR_INVALID_ARG;
    if (len < AS_SHARD_HEADER_BYTES) return AS_ERR_TRUNCATED;
    if (memcmp(buf, MAGIC, 4) != 0) return AS_ERR_FORMAT;
    if (get16(buf + 4) != SHARD_VERSION) return AS_ERR_VERSION;
    v->kind = get16(buf + 6);
    v->max_depth = get32(buf + 8);
    if (v->kind > AS_SHARD_DELTA || get32(buf + 12) != 0) return AS_ERR_FORMAT;
    if (v->max_depth < 2 || v->max_depth > AS_MAX_DEPTH_LIMIT) return AS_ERR_FORMAT;
    v->n_seq = get64(buf + 16);
    v->n_rem = get64(buf + 24);
    *payload = get64(buf + 32);
    uint64_t avail = (uint64_t)len - AS_SHARD_HEADER_BYTES;
    if (*payload > avail) return AS_ERR_TRUNCATED;
    if (*payload < avail) return AS_ERR_FORMAT; /* trailing bytes */
    return AS_OK;
}

static int parse(const uint8_t *buf, size_t len, shard_view *v) {
    uint64_t payload = 0;
    int rc = parse_header(buf, len, v, &payload);
    if (rc != AS_OK) return rc;
    const uint8_t *p = buf + AS_SHARD_HEADER_BYTES;
    if (shard_checksum(buf, (size_t)payload) != get64(buf + 40)) return AS_ERR_CHECKSUM;
    if (v->kind == AS_SHARD_SNAPSHOT && v->n_rem != 0) return AS_ERR_FORMAT;
    if (v->n_rem > payload / 8) return AS_ERR_FORMAT;
    if (v->n_seq > (payload - v->n_rem * 8) / 12) return AS_ERR_FORMAT;
    v->rem = p;
    uint64_t off = v->n_rem * 8;
    v->seqs = p + off;
    v->n_tokens = 0;
    v->longest = 0;
    uint32_t top = 0;
    for (uint64_t s = 0; s < v->n_seq; s++) {
        if (payload - off < 12) return AS_ERR_FORMAT;
        uint32_t n = get32(p + off + 8);
        off += 12;
        if ((uint64_t)n > (payload - off) / 4) return AS_ERR_FORMAT;
        for (uint32_t k = 0; k < n; k++) {
            uint32_t tok = get32(p + off + 4 * (uint64_t)k);
            if (tok > (uint32_t)INT32_MAX) return AS_ERR_FORMAT;
            if (tok > top) top = tok;
        }
        off += 4 * (uint64_t)n;
        v->n_tokens += n;
        if (n > v->longest) v->longest = n;
    }
    if (off != payload) return AS_ERR_FORMAT;
    v->max_token = v->n_tokens > 0 ? (int32_t)top : -1;
    return AS_OK;
}

int as_shard_inspect(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                     uint64_t *n_sequences, uint64_t *n_removals, uint64_t *n_tokens) {
    shard_view v;
    int rc = parse(buf, len, &v);
    if (rc != AS_OK) return rc;
    if (kind) *kind = v.kind;
    if (max_depth) *max_depth = v.max_depth;
    if (n_sequences) *n_sequences = v.n_seq;
    if (n_removals) *n_removals = v.n_rem;
    if (n_tokens) *n_tokens = v.n_tokens;
    return AS_OK;
}

int as_shard_peek(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                  uint64_t *n_sequences, uint64_t *n_removals) {
    shard_view v;
    uint64_t payload = 0;
    int rc = parse_header(buf, len, &v, &payload);
    if (rc != AS_OK) return rc;
    /* counts that cannot fit the payload (the same checks as parse) */
    if (v.kind == AS_SHARD_SNAPSHOT && v.n_rem != 0) return AS_ERR_FORMAT;
    if (v.n_rem > payload / 8) return AS_ERR_FORMAT;
    if (v.n_seq > (payload - v.n_rem * 8) / 12) return AS_ERR_FORMAT;
    if (kind) *kind = v.kind;
    if (max_depth) *max_depth = v.max_depth;
    if (n_sequences) *n_sequences = v.n_seq;
    if (n_removals) *n_removals = v.n_rem;
    return AS_OK;
}

int as_shard_max_token(const uint8_t *buf, size_t len, int32_t *max_token) {
    if (max_token == NULL) return AS_ERR_INVALID_ARG;
    shard_view v;
    int rc = parse(buf, len, &v);
    if (rc != AS_OK) return rc;
    *max_token = v.max_token;
    return AS_OK;
}

/* Reject snapshot ids that repeat (a delta's repeats are skipped on apply). */
static int check_unique(const shard_view *v) {
    uint64_t acct = 0;
    idmap seen;
    int rc = idm_init(&acct, &seen);
    const uint8_t *p = v->seqs;
    for (uint64_t s = 0; rc == AS_OK && s < v->n_seq; s++) {
        int64_t id = (int64_t)get64(p);
        if (idm_get(&seen, id) != IDM_EMPTY) rc = AS_ERR_FORMAT;
        else rc = idm_put(&acct, &seen, id, 0);
        p += 12 + 4 * (uint64_t)get32(p + 8);
    }
    idm_destroy(&acct, &seen);
    return rc;
}

/* ---------- loading ------------------------------------------------------ */

int as_tree_load(as_tree *t, const uint8_t *buf, size_t len) {
    if (t == NULL) return AS_ERR_INVALID_ARG;
    shard_view v;
    int rc = parse(buf, len, &v);
    if (rc != AS_OK) return rc;
    if (v.max_depth != t->max_depth) return AS_ERR_DEPTH_MISMATCH;
    if (v.kind == AS_SHARD_SNAPSHOT) {
        if (t->n_live != 0) return AS_ERR_INVALID_ARG;
        rc = check_unique(&v);
        if (rc != AS_OK) return rc;
    }
    if (t->live_tokens + v.n_tokens > UINT32_MAX - 1) return AS_ERR_CAPACITY;
    uint64_t acct = 0;
    int32_t *tmp = as_xmalloc(&acct, sizeof(int32_t) * ((size_t)v.longest + 1));
    if (tmp == NULL) return AS_ERR_NOMEM;
    for (uint64_t r = 0; r < v.n_rem; r++) {
        int64_t id = (int64_t)get64(v.rem + 8 * r);
        if (as_tree_contains(t, id)) (void)as_tree_remove(t, id);
    }
    const uint8_t *p = v.seqs;
    uint64_t added = 0;
    for (uint64_t s = 0; s < v.n_seq && rc == AS_OK; s++) {
        int64_t id = (int64_t)get64(p);
        uint32_t n = get32(p + 8);
        p += 12;
        if (!as_tree_contains(t, id)) {
            for (uint32_t k = 0; k < n; k++) tmp[k] = (int32_t)get32(p + 4 * (uint64_t)k);
            rc = tree_add_validated(t, id, tmp, n);
            if (rc == AS_OK) added++;
        }
        p += 4 * (uint64_t)n;
    }
    if (rc != AS_OK && v.kind == AS_SHARD_SNAPSHOT) { /* leave the tree empty again */
        p = v.seqs;
        for (uint64_t s = 0; s < added; s++) {
            (void)as_tree_remove(t, (int64_t)get64(p));
            p += 12 + 4 * (uint64_t)get32(p + 8);
        }
    }
    as_xfree(&acct, tmp, sizeof(int32_t) * ((size_t)v.longest + 1));
    return rc;
}

as_tree *as_tree_from_bytes(const uint8_t *buf, size_t len, int *status) {
    shard_view v;
    int rc = parse(buf, len, &v);
    as_tree *t = NULL;
    if (rc == AS_OK && v.kind != AS_SHARD_SNAPSHOT) rc = AS_ERR_FORMAT;
    if (rc == AS_OK) t = as_tree_create(v.max_depth, &rc);
    if (rc == AS_OK) {
        rc = as_tree_load(t, buf, len);
        if (rc != AS_OK) {
            as_tree_free(t);
            t = NULL;
        }
    }
    if (status) *status = rc;
    return t;
}
