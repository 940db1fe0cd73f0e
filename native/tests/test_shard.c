/*
 * test_shard.c -- the shard format: snapshot and delta round trips, inspect,
 * header checks, every truncation and every single-bit flip of valid shards
 * (error, tree unchanged), and headers or records claiming huge lengths
 * (rejected without allocating them).
 */
#include "agentspec.h"
#include "shardfmt.h"
#include "testhelp.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- a counting allocator: the largest single request is recorded ------- */

static size_t largest_request = 0;

static void note(size_t n) {
    if (n > largest_request) largest_request = n;
}
static void *cnt_malloc(size_t n, void *ctx) { (void)ctx; note(n); return malloc(n); }
static void *cnt_realloc(void *p, size_t n, void *ctx) { (void)ctx; note(n); return realloc(p, n); }
static void cnt_free(void *p, void *ctx) { (void)ctx; free(p); }

/* ---- helpers -------------------------------------------------------------- */

/* Save a snapshot into a fresh malloc'd buffer. */
static uint8_t *save(const as_tree *t, size_t *len) {
    uint64_t bound = 0;
    if (as_tree_save_bound(t, &bound) != AS_OK) return NULL;
    uint8_t *buf = malloc((size_t)bound);
    if (buf == NULL) return NULL;
    if (as_tree_save(t, buf, (size_t)bound, len) != AS_OK || *len != bound) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* Save a delta into a fresh malloc'd buffer. */
static uint8_t *save_delta(const as_tree *t, const int64_t *ids, size_t n_ids, const int64_t *rm,
                           size_t n_rm, size_t *len) {
    uint64_t bound = 0;
    if (as_tree_delta_bound(t, ids, n_ids, n_rm, &bound) != AS_OK) return NULL;
    uint8_t *buf = malloc((size_t)bound);
    if (buf == NULL) return NULL;
    if (as_tree_save_delta(t, ids, n_ids, rm, n_rm, buf, (size_t)bound, len) != AS_OK ||
        *len != bound) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* 1 if both trees hold the same sequences (ids, order and tokens). */
static int same_content(const as_tree *a, const as_tree *b) {
    int64_t ia[256], ib[256];
    size_t na = 0, nb = 0;
    if (as_tree_seq_ids(a, ia, 256, &na) != AS_OK || as_tree_seq_ids(b, ib, 256, &nb) != AS_OK)
        return 0;
    if (na != nb || na > 256 || memcmp(ia, ib, na * sizeof(int64_t)) != 0) return 0;
    for (size_t i = 0; i < na; i++) {
        uint64_t la = 0, lb = 0;
        if (as_tree_seq_len(a, ia[i], &la) != AS_OK || as_tree_seq_len(b, ia[i], &lb) != AS_OK ||
            la != lb)
            return 0;
        int32_t *ta = malloc((size_t)la * 4 + 4), *tb = malloc((size_t)lb * 4 + 4);
        int ok = ta && tb && as_tree_seq_tokens(a, ia[i], ta, (size_t)la) == AS_OK &&
                 as_tree_seq_tokens(b, ia[i], tb, (size_t)lb) == AS_OK &&
                 memcmp(ta, tb, (size_t)la * 4) == 0;
        free(ta);
        free(tb);
        if (!ok) return 0;
    }
    return 1;
}

/* 1 if every string of length 1..maxlen over [0, k) has the same count in both. */
static int same_counts(const as_tree *a, const as_tree *b, int32_t k, size_t maxlen) {
    int32_t x[8];
    for (size_t len = 1; len <= maxlen && len <= 8; len++) {
        size_t combos = 1;
        for (size_t i = 0; i < len; i++) combos *= (size_t)k;
        for (size_t c = 0; c < combos; c++) {
            size_t v = c;
            for (size_t i = 0; i < len; i++, v /= (size_t)k) x[i] = (int32_t)(v % (size_t)k);
            uint64_t ca = 1, cb = 2;
            if (as_tree_count(a, x, len, &ca) != AS_OK || as_tree_count(b, x, len, &cb) != AS_OK ||
                ca != cb)
                return 0;
        }
    }
    return 1;
}

/* A fingerprint of a tree's observable state, to prove "unchanged". */
typedef struct snap {
    as_tree_stats st;
    uint8_t *bytes;
    size_t len;
} snap;

static snap take(const as_tree *t) {
    snap s;
    memset(&s, 0, sizeof s);
    as_tree_stats_get(t, &s.st);
    s.bytes = save(t, &s.len);
    return s;
}

static int unchanged(const as_tree *t, const snap *before) {
    snap now = take(t);
    int same = memcmp(&now.st, &before->st, sizeof now.st) == 0 && now.len == before->len &&
               now.bytes != NULL && before->bytes != NULL &&
               memcmp(now.bytes, before->bytes, now.len) == 0;
    free(now.bytes);
    return same;
}

/* A random tree with closed, open and removed sequences. */
static as_tree *random_tree(th_rng *r, uint32_t depth, int nseq, uint32_t maxlen, int32_t alphabet) {
    as_tree *t = as_tree_create(depth, NULL);
    if (t == NULL) return NULL;
    for (int i = 0; i < nseq; i++) {
        int32_t seq[256];
        size_t n = maxlen ? th_rng_below(r, maxlen) : 0;
        for (size_t k = 0; k < n; k++)
            seq[k] = th_rng_below(r, 10) == 0 ? INT32_MAX : (int32_t)th_rng_below(r, (uint32_t)alphabet);
        int64_t id = (int64_t)(th_rng_next(r) >> (th_rng_below(r, 64)));
        if (th_rng_below(r, 2)) id = -id;
        int rc = th_rng_below(r, 3) ? as_tree_add(t, id, seq, n) : as_tree_append(t, id, seq, n);
        if (rc != AS_OK && rc != AS_ERR_SEQ_EXISTS && rc != AS_ERR_SEQ_CLOSED) {
            as_tree_free(t);
            return NULL;
        }
        if (th_rng_below(r, 5) == 0) as_tree_remove(t, id);
    }
    return t;
}

/* ---- tests ------------------------------------------------------------------ */

/* The test's checksum agrees with the engine's (so resealed edits reach the parser). */
static void test_checksum_agrees(void) {
    th_rng r;
    th_rng_seed(&r, 1);
    for (int i = 0; i < 20; i++) {
        as_tree *t = random_tree(&r, 8, 1 + i, 30, 5);
        REQUIRE(t != NULL);
        size_t len = 0;
        uint8_t *b = save(t, &len);
        REQUIRE(b != NULL);
        CHECK_EQ_U64(sf_rd64(b + SF_OFF_SUM), sf_shard_checksum(b, len));
        CHECK_EQ_U64(sf_rd64(b + SF_OFF_PAYLOAD), len - 48);
        free(b);
        as_tree_free(t);
    }
}

/* Save, from_bytes and load give the same sequences, counts and bytes. */
static void test_round_trip(void) {
    th_rng r;
    th_rng_seed(&r, 2);
    for (int round = 0; round < 25; round++) {
        uint32_t depth = 2 + th_rng_below(&r, 10);
        as_tree *t = random_tree(&r, depth, (int)th_rng_below(&r, 20), 60, 3);
        REQUIRE(t != NULL);
        size_t len = 0;
        uint8_t *b = save(t, &len);
        REQUIRE(b != NULL);
        int st = -1;
        as_tree *u = as_tree_from_bytes(b, len, &st);
        REQUIRE(u != NULL);
        CHECK_EQ_INT(st, AS_OK);
        CHECK_EQ_INT(as_tree_max_depth(u), depth);
        CHECK(same_content(t, u));
        CHECK(same_counts(t, u, 3, depth + 1));
        CHECK_STATUS(as_tree_check(u), AS_OK);
        as_tree_stats a, c;
        REQUIRE_OK(as_tree_stats_get(t, &a));
        REQUIRE_OK(as_tree_stats_get(u, &c));
        CHECK_EQ_U64(c.sequences, a.sequences);
        CHECK_EQ_U64(c.tokens, a.tokens);
        CHECK_EQ_U64(c.nodes, a.nodes);
        CHECK_EQ_U64(c.open_sequences, 0); /* open sequences load closed */
        /* re-saving gives the same bytes */
        size_t len2 = 0;
        uint8_t *b2 = save(u, &len2);
        REQUIRE(b2 != NULL);
        CHECK(len2 == len && memcmp(b, b2, len) == 0);
        /* load into an empty tree of the same depth */
        as_tree *w = as_tree_create(depth, NULL);
        REQUIRE(w != NULL);
        CHECK_STATUS(as_tree_load(w, b, len), AS_OK);
        CHECK(same_content(t, w));
        uint32_t kind = 9, d = 0;
        uint64_t ns = 0, nr = 9, nt = 0;
        CHECK_STATUS(as_shard_inspect(b, len, &kind, &d, &ns, &nr, &nt), AS_OK);
        CHECK_EQ_INT(kind, AS_SHARD_SNAPSHOT);
        CHECK_EQ_INT(d, depth);
        CHECK_EQ_U64(ns, a.sequences);
        CHECK_EQ_U64(nr, 0);
        CHECK_EQ_U64(nt, a.tokens);
        CHECK_STATUS(as_shard_inspect(b, len, NULL, NULL, NULL, NULL, NULL), AS_OK);
        free(b);
        free(b2);
        as_tree_free(t);
        as_tree_free(u);
        as_tree_free(w);
    }
}

/* An empty tree saves to just a header and loads back. */
static void test_empty_round_trip(void) {
    as_tree *t = as_tree_create(5, NULL);
    REQUIRE(t != NULL);
    size_t len = 0;
    uint8_t *b = save(t, &len);
    REQUIRE(b != NULL);
    CHECK_EQ_U64(len, AS_SHARD_HEADER_BYTES);
    as_tree *u = as_tree_from_bytes(b, len, NULL);
    CHECK(u != NULL);
    if (u) CHECK_EQ_INT(as_tree_max_depth(u), 5);
    as_tree_free(u);
    free(b);
    as_tree_free(t);
}

/* save with too little room, NULL arguments. */
static void test_save_errors(void) {
    as_tree *t = as_tree_create(5, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2, 3};
    REQUIRE_OK(as_tree_add(t, 1, a, 3));
    uint64_t bound = 0;
    REQUIRE_OK(as_tree_save_bound(t, &bound));
    CHECK_EQ_U64(bound, AS_SHARD_HEADER_BYTES + 12 + 12);
    uint8_t buf[128];
    size_t w = 0;
    CHECK_STATUS(as_tree_save(t, buf, (size_t)bound - 1, &w), AS_ERR_CAPACITY);
    CHECK_STATUS(as_tree_save(t, NULL, 0, &w), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_save(t, buf, sizeof buf, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_save(NULL, buf, sizeof buf, &w), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_save_bound(t, NULL), AS_ERR_INVALID_ARG);
    const int64_t unknown[] = {77};
    CHECK_STATUS(as_tree_delta_bound(t, unknown, 1, 0, &bound), AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_save_delta(t, unknown, 1, NULL, 0, buf, sizeof buf, &w),
                 AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_save_delta(t, NULL, 0, NULL, 2, buf, sizeof buf, &w), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_load(t, NULL, 10), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_load(NULL, buf, 10), AS_ERR_INVALID_ARG);
    as_tree_free(t);
}

/* A snapshot only loads into an empty tree of the same depth. */
static void test_snapshot_preconditions(void) {
    th_rng r;
    th_rng_seed(&r, 3);
    as_tree *t = random_tree(&r, 6, 5, 20, 4);
    REQUIRE(t != NULL);
    size_t len = 0;
    uint8_t *b = save(t, &len);
    REQUIRE(b != NULL);
    snap before = take(t);
    CHECK(as_tree_load(t, b, len) != AS_OK);
    CHECK(unchanged(t, &before));
    as_tree *other = as_tree_create(7, NULL);
    REQUIRE(other != NULL);
    snap empty = take(other);
    CHECK_STATUS(as_tree_load(other, b, len), AS_ERR_DEPTH_MISMATCH);
    CHECK(unchanged(other, &empty));
    free(empty.bytes);
    free(before.bytes);
    free(b);
    as_tree_free(t);
    as_tree_free(other);
}

/* A delta removes and adds; applying it twice is a no-op; inspect reports it. */
static void test_delta(void) {
    as_tree *src = as_tree_create(6, NULL), *dst = as_tree_create(6, NULL);
    REQUIRE(src != NULL && dst != NULL);
    const int32_t s1[] = {1, 2, 3}, s2[] = {2, 3, 4, 5}, s3[] = {9}, s4[] = {4, 4};
    REQUIRE_OK(as_tree_add(src, 1, s1, 3));
    REQUIRE_OK(as_tree_add(src, 2, s2, 4));
    REQUIRE_OK(as_tree_append(src, 3, s3, 1)); /* open: saved with its tokens so far */
    REQUIRE_OK(as_tree_add(dst, 1, s1, 3));
    REQUIRE_OK(as_tree_add(dst, 4, s4, 2));
    const int64_t add[] = {2, 3}, rm[] = {1, 99};
    size_t len = 0;
    uint8_t *b = save_delta(src, add, 2, rm, 2, &len);
    REQUIRE(b != NULL);
    CHECK_EQ_U64(len, AS_SHARD_HEADER_BYTES + 16 + (12 + 16) + (12 + 4));
    uint32_t kind = 9;
    uint64_t ns = 0, nr = 0, nt = 0;
    CHECK_STATUS(as_shard_inspect(b, len, &kind, NULL, &ns, &nr, &nt), AS_OK);
    CHECK_EQ_INT(kind, AS_SHARD_DELTA);
    CHECK_EQ_U64(ns, 2);
    CHECK_EQ_U64(nr, 2);
    CHECK_EQ_U64(nt, 5);
    REQUIRE_OK(as_tree_load(dst, b, len));
    CHECK(!as_tree_contains(dst, 1));
    CHECK(as_tree_contains(dst, 2));
    CHECK(as_tree_contains(dst, 3));
    CHECK(as_tree_contains(dst, 4));
    int64_t ids[4];
    size_t n = 0;
    REQUIRE_OK(as_tree_seq_ids(dst, ids, 4, &n));
    CHECK_EQ_U64(n, 3);
    CHECK_EQ_INT(ids[0], 4);
    CHECK_EQ_INT(ids[1], 2);
    CHECK_EQ_INT(ids[2], 3);
    uint64_t c = 0;
    const int32_t q[] = {3, 4, 5};
    REQUIRE_OK(as_tree_count(dst, q, 3, &c));
    CHECK_EQ_U64(c, 1);
    as_tree_stats st;
    REQUIRE_OK(as_tree_stats_get(dst, &st));
    CHECK_EQ_U64(st.open_sequences, 0);
    snap once = take(dst);
    CHECK_STATUS(as_tree_load(dst, b, len), AS_OK);
    CHECK(unchanged(dst, &once));
    CHECK_STATUS(as_tree_check(dst), AS_OK);
    /* a delta is not a snapshot */
    int fst = AS_OK;
    CHECK(as_tree_from_bytes(b, len, &fst) == NULL);
    CHECK(fst != AS_OK);
    /* a delta of another depth is refused */
    as_tree *d7 = as_tree_create(7, NULL);
    REQUIRE(d7 != NULL);
    CHECK_STATUS(as_tree_load(d7, b, len), AS_ERR_DEPTH_MISMATCH);
    free(once.bytes);
    free(b);
    as_tree_free(d7);
    as_tree_free(src);
    as_tree_free(dst);
}

/* Duplicate ids: refused in a snapshot, skipped after the first in a delta. */
static void test_duplicate_ids_in_shard(void) {
    as_tree *t = as_tree_create(4, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2}, b2[] = {3, 4};
    REQUIRE_OK(as_tree_add(t, 10, a, 2));
    REQUIRE_OK(as_tree_add(t, 11, b2, 2));
    size_t len = 0;
    uint8_t *buf = save(t, &len);
    REQUIRE(buf != NULL);
    /* rewrite the second record's id to the first's and reseal */
    sf_wr64(buf + 48 + 12 + 8, 10);
    sf_reseal(buf, len);
    int st = AS_OK;
    CHECK(as_tree_from_bytes(buf, len, &st) == NULL);
    CHECK_EQ_INT(st, AS_ERR_FORMAT);
    /* the same records as a delta: the second is skipped */
    buf[SF_OFF_KIND] = AS_SHARD_DELTA;
    sf_reseal(buf, len);
    as_tree *u = as_tree_create(4, NULL);
    REQUIRE(u != NULL);
    CHECK_STATUS(as_tree_load(u, buf, len), AS_OK);
    uint64_t n = 0;
    CHECK_STATUS(as_tree_seq_len(u, 10, &n), AS_OK);
    int32_t got[2] = {0};
    CHECK_STATUS(as_tree_seq_tokens(u, 10, got, 2), AS_OK);
    CHECK_EQ_INT(got[0], 1);
    as_tree_stats s;
    REQUIRE_OK(as_tree_stats_get(u, &s));
    CHECK_EQ_U64(s.sequences, 1);
    free(buf);
    as_tree_free(t);
    as_tree_free(u);
}

/* Every proper prefix, and a trailing extra byte, is an error that changes nothing. */
static void test_truncations(void) {
    th_rng r;
    th_rng_seed(&r, 4);
    as_tree *t = random_tree(&r, 6, 6, 12, 4);
    REQUIRE(t != NULL);
    const int64_t rm[] = {5, 6};
    int64_t ids[8];
    size_t nids = 0;
    REQUIRE_OK(as_tree_seq_ids(t, ids, 8, &nids));
    for (int kind = 0; kind < 2; kind++) {
        size_t len = 0;
        uint8_t *b = kind == 0 ? save(t, &len) : save_delta(t, ids, nids, rm, 2, &len);
        REQUIRE(b != NULL);
        uint8_t *bigger = malloc(len + 1);
        REQUIRE(bigger != NULL);
        as_tree *target = as_tree_create(6, NULL);
        REQUIRE(target != NULL);
        snap before = take(target);
        for (size_t cut = 0; cut <= len + 1; cut++) {
            if (cut == len) continue;
            const uint8_t *p = b;
            if (cut == len + 1) { /* one byte too many */
                memcpy(bigger, b, len);
                bigger[len] = 0;
                p = bigger;
            }
            /* an exact-size copy, so ASan sees any read past the end */
            uint8_t *exact = malloc(cut ? cut : 1);
            REQUIRE(exact != NULL);
            memcpy(exact, p, cut);
            int st = as_shard_inspect(exact, cut, NULL, NULL, NULL, NULL, NULL);
            CHECK(st == AS_ERR_TRUNCATED || st == AS_ERR_FORMAT);
            CHECK(as_tree_load(target, exact, cut) != AS_OK);
            int fst = AS_OK;
            CHECK(as_tree_from_bytes(exact, cut, &fst) == NULL);
            CHECK(fst != AS_OK);
            free(exact);
        }
        CHECK(unchanged(target, &before));
        free(before.bytes);
        free(bigger);
        free(b);
        as_tree_free(target);
    }
    as_tree_free(t);
}

/* Every single-bit flip of a snapshot and of a delta is refused and changes nothing,
 * except the one flip that turns a snapshot's kind into "delta". */
static void test_bit_flips(void) {
    th_rng r;
    th_rng_seed(&r, 5);
    as_tree *t = random_tree(&r, 6, 5, 10, 4);
    REQUIRE(t != NULL);
    int64_t ids[8];
    size_t nids = 0;
    REQUIRE_OK(as_tree_seq_ids(t, ids, 8, &nids));
    REQUIRE(nids >= 2);
    const int64_t rm[] = {ids[0], 12345};
    int flips = 0;
    for (int kind = 0; kind < 2; kind++) {
        size_t len = 0;
        uint8_t *b = kind == 0 ? save(t, &len) : save_delta(t, ids + 1, nids - 1, rm, 2, &len);
        REQUIRE(b != NULL);
        as_tree *target = as_tree_create(6, NULL);
        REQUIRE(target != NULL);
        if (kind == 1) { /* the delta lands on a tree that has content */
            const int32_t x[] = {1, 2, 3};
            REQUIRE_OK(as_tree_add(target, ids[0], x, 3));
        }
        snap before = take(target);
        for (size_t byte = 0; byte < len; byte++) {
            for (int bit = 0; bit < 8; bit++) {
                b[byte] ^= (uint8_t)(1u << bit);
                int st = as_tree_load(target, b, len);
                int ist = as_shard_inspect(b, len, NULL, NULL, NULL, NULL, NULL);
                as_tree *u = as_tree_from_bytes(b, len, NULL);
                int kind_flip = byte == SF_OFF_KIND && bit == 0;
                int depth_flip = byte >= SF_OFF_DEPTH && byte < SF_OFF_DEPTH + 4;
                if (kind_flip && kind == 0 && st == AS_OK) {
                    /* without a header checksum this is a valid delta: it adds
                     * the sequences to the empty tree */
                    CHECK_STATUS(ist, AS_OK);
                    as_tree_free(target);
                    target = as_tree_create(6, NULL);
                    REQUIRE(target != NULL);
                } else if (kind_flip || depth_flip) {
                    /* a snapshot with removals, a snapshot onto a non-empty tree,
                     * or (without a header checksum) a shard of another depth:
                     * never loadable into this tree */
                    CHECK(st != AS_OK);
                    if (depth_flip && st != AS_ERR_CHECKSUM) {
                        uint32_t d = (uint32_t)b[SF_OFF_DEPTH] | (uint32_t)b[SF_OFF_DEPTH + 1] << 8 |
                                     (uint32_t)b[SF_OFF_DEPTH + 2] << 16 |
                                     (uint32_t)b[SF_OFF_DEPTH + 3] << 24;
                        int valid = d >= 2 && d <= AS_MAX_DEPTH_LIMIT;
                        CHECK_STATUS(st, valid ? AS_ERR_DEPTH_MISMATCH : AS_ERR_FORMAT);
                    }
                    CHECK(unchanged(target, &before));
                } else {
                    if (st == AS_OK || ist == AS_OK)
                        fprintf(stderr, "  flip kind=%d byte=%zu bit=%d: load %d inspect %d\n",
                                kind, byte, bit, st, ist);
                    CHECK(st != AS_OK);
                    CHECK(ist != AS_OK);
                    CHECK(u == NULL);
                    CHECK(unchanged(target, &before));
                    if (st == AS_OK) { /* start the next flip from the same state */
                        as_tree_free(target);
                        target = as_tree_create(6, NULL);
                        REQUIRE(target != NULL);
                        if (kind == 1) {
                            const int32_t x[] = {1, 2, 3};
                            REQUIRE_OK(as_tree_add(target, ids[0], x, 3));
                        }
                    }
                }
                as_tree_free(u);
                b[byte] ^= (uint8_t)(1u << bit);
                flips++;
            }
        }
        CHECK_STATUS(as_tree_load(target, b, len), AS_OK); /* the original still loads */
        free(before.bytes);
        free(b);
        as_tree_free(target);
    }
    CHECK(flips > 1000);
    as_tree_free(t);
}

/* Each header field is validated: magic, version, kind, reserved, depth. */
static void test_header_fields(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2, 3};
    REQUIRE_OK(as_tree_add(t, 1, a, 3));
    size_t len = 0;
    uint8_t *b = save(t, &len);
    REQUIRE(b != NULL);
    CHECK(memcmp(b, "ASHD", 4) == 0);
    struct { size_t off; uint64_t value; int width; int want; } cases[] = {
        {0, 'B', 1, AS_ERR_FORMAT},
        {SF_OFF_VERSION, 0, 2, AS_ERR_VERSION},
        {SF_OFF_VERSION, 2, 2, AS_ERR_VERSION},
        {SF_OFF_VERSION, 0xFFFF, 2, AS_ERR_VERSION},
        {SF_OFF_KIND, 2, 2, AS_ERR_FORMAT},
        {SF_OFF_KIND, 0xFFFF, 2, AS_ERR_FORMAT},
        {SF_OFF_RESERVED, 1, 4, AS_ERR_FORMAT},
        {SF_OFF_DEPTH, 0, 4, AS_ERR_FORMAT},
        {SF_OFF_DEPTH, 1, 4, AS_ERR_FORMAT},
        {SF_OFF_DEPTH, AS_MAX_DEPTH_LIMIT + 1, 4, AS_ERR_FORMAT},
        {SF_OFF_DEPTH, UINT32_MAX, 4, AS_ERR_FORMAT},
        {SF_OFF_NREM, 1, 8, AS_ERR_FORMAT}, /* a snapshot has no removals */
    };
    uint8_t *c = malloc(len);
    REQUIRE(c != NULL);
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        memcpy(c, b, len);
        for (int k = 0; k < cases[i].width; k++) c[cases[i].off + (size_t)k] = (uint8_t)(cases[i].value >> (8 * k));
        sf_reseal(c, len); /* the checksum covers the header: reach the field check */
        int st = as_shard_inspect(c, len, NULL, NULL, NULL, NULL, NULL);
        if (st != cases[i].want) fprintf(stderr, "  header case %zu\n", i);
        CHECK_STATUS(st, cases[i].want);
        int fst = AS_OK;
        CHECK(as_tree_from_bytes(c, len, &fst) == NULL);
        CHECK_EQ_INT(fst, cases[i].want);
    }
    /* checksum mismatch */
    memcpy(c, b, len);
    c[SF_OFF_SUM] ^= 1;
    CHECK_STATUS(as_shard_inspect(c, len, NULL, NULL, NULL, NULL, NULL), AS_ERR_CHECKSUM);
    /* depth 2 and the limit are fine (an empty snapshot of each) */
    as_tree *e = as_tree_create(AS_MAX_DEPTH_LIMIT, NULL);
    REQUIRE(e != NULL);
    size_t elen = 0;
    uint8_t *eb = save(e, &elen);
    REQUIRE(eb != NULL);
    as_tree *f = as_tree_from_bytes(eb, elen, NULL);
    CHECK(f != NULL);
    as_tree_free(f);
    free(eb);
    as_tree_free(e);
    free(c);
    free(b);
    as_tree_free(t);
}

/* Headers and records that claim huge lengths are refused without allocating them. */
static void test_huge_lengths(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2, 3, 4};
    REQUIRE_OK(as_tree_add(t, 1, a, 4));
    REQUIRE_OK(as_tree_add(t, 2, a, 2));
    size_t len = 0;
    uint8_t *b = save(t, &len);
    REQUIRE(b != NULL);
    uint8_t *c = malloc(len);
    REQUIRE(c != NULL);
    as_tree *target = as_tree_create(8, NULL);
    REQUIRE(target != NULL);
    snap before = take(target);
    const uint64_t huge[] = {UINT64_MAX, UINT64_MAX / 2, (uint64_t)1 << 62, (uint64_t)1 << 40,
                             (uint64_t)1 << 32, 0xFFFFFFFFull, 1000};
    const size_t fields[] = {SF_OFF_NSEQ, SF_OFF_NREM, SF_OFF_PAYLOAD};
    uint64_t bytes0 = as_allocated_bytes();
    for (size_t f = 0; f < ARRAY_LEN(fields); f++) {
        for (size_t h = 0; h < ARRAY_LEN(huge); h++) {
            for (int kind = 0; kind < 2; kind++) {
                memcpy(c, b, len);
                c[SF_OFF_KIND] = (uint8_t)kind;
                sf_wr64(c + fields[f], huge[h]);
                largest_request = 0;
                CHECK(as_shard_inspect(c, len, NULL, NULL, NULL, NULL, NULL) != AS_OK);
                CHECK(as_tree_load(target, c, len) != AS_OK);
                CHECK(as_tree_from_bytes(c, len, NULL) == NULL);
                CHECK(largest_request < 4096);
            }
        }
    }
    /* a record whose token count is huge, with a valid checksum */
    const uint32_t counts[] = {UINT32_MAX, 0x80000000u, 0x40000000u, 6, 100};
    for (size_t i = 0; i < ARRAY_LEN(counts); i++) {
        memcpy(c, b, len);
        sf_wr32(c + 48 + 8, counts[i]);
        sf_reseal(c, len);
        largest_request = 0;
        CHECK_STATUS(as_shard_inspect(c, len, NULL, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
        CHECK_STATUS(as_tree_load(target, c, len), AS_ERR_FORMAT);
        CHECK(largest_request < 4096);
    }
    CHECK_EQ_U64(as_allocated_bytes(), bytes0);
    CHECK(unchanged(target, &before));
    free(before.bytes);
    free(c);
    free(b);
    as_tree_free(t);
    as_tree_free(target);
}

/* A negative token inside a correctly sealed payload is a format error. */
static void test_negative_token_in_payload(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2, 3, 4};
    REQUIRE_OK(as_tree_add(t, 1, a, 4));
    size_t len = 0;
    uint8_t *b = save(t, &len);
    REQUIRE(b != NULL);
    const uint32_t bad[] = {0x80000000u, 0xFFFFFFFFu};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        sf_wr32(b + 48 + 12 + 4 * 3, bad[i]);
        sf_reseal(b, len);
        int st = AS_OK;
        CHECK(as_tree_from_bytes(b, len, &st) == NULL);
        CHECK_EQ_INT(st, AS_ERR_FORMAT);
    }
    sf_wr32(b + 48 + 12 + 4 * 3, (uint32_t)INT32_MAX); /* the largest valid token */
    sf_reseal(b, len);
    as_tree *u = as_tree_from_bytes(b, len, NULL);
    CHECK(u != NULL);
    as_tree_free(u);
    free(b);
    as_tree_free(t);
}

/* as_shard_peek reads the header alone; as_shard_max_token validates and
 * returns the largest token id (-1 for none). */
static void test_peek_and_max_token(void) {
    as_tree *t = as_tree_create(16, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {5, 70000, 3}, b[] = {INT32_MAX - 1, 0};
    REQUIRE_OK(as_tree_add(t, 1, a, 3));
    REQUIRE_OK(as_tree_add(t, 2, b, 2));
    REQUIRE_OK(as_tree_add(t, 3, NULL, 0));
    size_t len = 0;
    uint8_t *s = save(t, &len);
    REQUIRE(s != NULL);
    uint32_t kind = 9, depth = 0;
    uint64_t ns = 0, nr = 9;
    CHECK_STATUS(as_shard_peek(s, len, &kind, &depth, &ns, &nr), AS_OK);
    CHECK_EQ_INT(kind, AS_SHARD_SNAPSHOT);
    CHECK_EQ_INT(depth, 16);
    CHECK_EQ_U64(ns, 3);
    CHECK_EQ_U64(nr, 0);
    CHECK_STATUS(as_shard_peek(s, len, NULL, NULL, NULL, NULL), AS_OK);
    int32_t top = 0;
    CHECK_STATUS(as_shard_max_token(s, len, &top), AS_OK);
    CHECK_EQ_INT(top, INT32_MAX - 1);
    CHECK_STATUS(as_shard_max_token(s, len, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_shard_max_token(NULL, len, &top), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_shard_peek(NULL, len, NULL, NULL, NULL, NULL), AS_ERR_INVALID_ARG);

    /* a delta of sequence 1 and one removal; a removal-only delta holds no token */
    const int64_t ids[] = {1}, rm[] = {77};
    size_t dlen = 0;
    uint8_t *d = save_delta(t, ids, 1, rm, 1, &dlen);
    REQUIRE(d != NULL);
    CHECK_STATUS(as_shard_peek(d, dlen, &kind, &depth, &ns, &nr), AS_OK);
    CHECK_EQ_INT(kind, AS_SHARD_DELTA);
    CHECK_EQ_U64(ns, 1);
    CHECK_EQ_U64(nr, 1);
    CHECK_STATUS(as_shard_max_token(d, dlen, &top), AS_OK);
    CHECK_EQ_INT(top, 70000);
    free(d);
    d = save_delta(t, NULL, 0, rm, 1, &dlen);
    REQUIRE(d != NULL);
    top = 0;
    CHECK_STATUS(as_shard_max_token(d, dlen, &top), AS_OK);
    CHECK_EQ_INT(top, -1);
    free(d);
    as_tree *e = as_tree_create(16, NULL); /* an empty snapshot */
    REQUIRE(e != NULL);
    size_t elen = 0;
    uint8_t *es = save(e, &elen);
    REQUIRE(es != NULL);
    top = 0;
    CHECK_STATUS(as_shard_max_token(es, elen, &top), AS_OK);
    CHECK_EQ_INT(top, -1);
    free(es);
    as_tree_free(e);

    /* header errors: the same codes as as_shard_inspect */
    CHECK_STATUS(as_shard_peek(s, AS_SHARD_HEADER_BYTES - 1, NULL, NULL, NULL, NULL),
                 AS_ERR_TRUNCATED);
    CHECK_STATUS(as_shard_peek(s, len - 1, NULL, NULL, NULL, NULL), AS_ERR_TRUNCATED);
    uint8_t *c = malloc(len + 1);
    REQUIRE(c != NULL);
    memcpy(c, s, len);
    c[len] = 0;
    CHECK_STATUS(as_shard_peek(c, len + 1, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
    c[0] = 'X';
    CHECK_STATUS(as_shard_peek(c, len, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
    memcpy(c, s, len);
    sf_wr32(c + SF_OFF_VERSION, 2); /* also overwrites kind: version is checked first */
    CHECK_STATUS(as_shard_peek(c, len, NULL, NULL, NULL, NULL), AS_ERR_VERSION);
    memcpy(c, s, len);
    sf_wr32(c + SF_OFF_DEPTH, AS_MAX_DEPTH_LIMIT + 1);
    CHECK_STATUS(as_shard_peek(c, len, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
    memcpy(c, s, len);
    sf_wr64(c + SF_OFF_NSEQ, UINT64_MAX); /* more sequences than the payload holds */
    CHECK_STATUS(as_shard_peek(c, len, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
    memcpy(c, s, len);
    sf_wr64(c + SF_OFF_NREM, 1); /* a snapshot with removals */
    CHECK_STATUS(as_shard_peek(c, len, NULL, NULL, NULL, NULL), AS_ERR_FORMAT);
    /* peek does not read the payload: a corrupt one passes peek, not max_token */
    memcpy(c, s, len);
    c[len - 1] ^= 0x40;
    CHECK_STATUS(as_shard_peek(c, len, &kind, &depth, NULL, NULL), AS_OK);
    CHECK_EQ_INT(depth, 16);
    CHECK_STATUS(as_shard_max_token(c, len, &top), AS_ERR_CHECKSUM);
    /* a depth of another tree is reported by peek before any load */
    memcpy(c, s, len);
    sf_wr32(c + SF_OFF_DEPTH, 1024);
    sf_reseal(c, len);
    CHECK_STATUS(as_shard_peek(c, len, NULL, &depth, NULL, NULL), AS_OK);
    CHECK_EQ_INT(depth, 1024);
    free(c);
    free(s);
    as_tree_free(t);
}

int main(void) {
    if (as_set_allocator(cnt_malloc, cnt_realloc, cnt_free, NULL) != AS_OK) {
        fprintf(stderr, "could not set the allocator\n");
        return 1;
    }
    TEST_RUN(test_checksum_agrees);
    TEST_RUN(test_round_trip);
    TEST_RUN(test_empty_round_trip);
    TEST_RUN(test_save_errors);
    TEST_RUN(test_snapshot_preconditions);
    TEST_RUN(test_delta);
    TEST_RUN(test_duplicate_ids_in_shard);
    TEST_RUN(test_truncations);
    TEST_RUN(test_bit_flips);
    TEST_RUN(test_header_fields);
    TEST_RUN(test_huge_lengths);
    TEST_RUN(test_negative_token_in_payload);
    TEST_RUN(test_peek_and_max_token);
    return TEST_REPORT("test_shard");
}
