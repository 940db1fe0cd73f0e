/*
 * test_tree.c -- tree building: create/free, add, append, close, remove,
 * counts against hand-computed values and against the brute-force model in
 * naive.h, depth bound, token and id edge cases, stats and accessors.
 */
#include "agentspec.h"
#include "naive.h"
#include "testhelp.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Count of a literal token string, e.g. COUNT(t, 1, 2). */
#define COUNT(t, ...) count_of((t), (const int32_t[]){__VA_ARGS__}, \
                               sizeof((int32_t[]){__VA_ARGS__}) / sizeof(int32_t))

static uint64_t count_of(const as_tree *t, const int32_t *x, size_t n) {
    uint64_t c = UINT64_MAX;
    if (as_tree_count(t, x, n, &c) != AS_OK) return UINT64_MAX;
    return c;
}

static as_tree_stats stats_of(const as_tree *t) {
    as_tree_stats s;
    memset(&s, 0xAB, sizeof s);
    if (as_tree_stats_get(t, &s) != AS_OK) memset(&s, 0xFF, sizeof s);
    return s;
}

static int stats_same(const as_tree_stats *a, const as_tree_stats *b) {
    return a->sequences == b->sequences && a->open_sequences == b->open_sequences &&
           a->tokens == b->tokens && a->nodes == b->nodes && a->bytes == b->bytes &&
           a->retained_tokens == b->retained_tokens && a->max_depth == b->max_depth;
}

/* Every string over alphabet [0, k) of length 1..maxlen: engine count == model count.
 * Returns the number of mismatches (printing the first few). */
static int compare_all_strings(const as_tree *t, const nv_tree *m, int32_t k, size_t maxlen) {
    int32_t x[16];
    int bad = 0;
    for (size_t len = 1; len <= maxlen && len <= 16; len++) {
        size_t combos = 1;
        for (size_t i = 0; i < len; i++) combos *= (size_t)k;
        for (size_t c = 0; c < combos; c++) {
            size_t v = c;
            for (size_t i = 0; i < len; i++) {
                x[i] = (int32_t)(v % (size_t)k);
                v /= (size_t)k;
            }
            uint64_t want = nv_count(m, x, len), got = count_of(t, x, len);
            if (want != got) {
                if (bad < 5)
                    fprintf(stderr, "  count mismatch len=%zu first=%d: engine %" PRIu64
                                    " model %" PRIu64 "\n", len, x[0], got, want);
                bad++;
            }
        }
    }
    return bad;
}

/* Create and free a tree; freeing NULL handles is a no-op. */
static void test_create_free(void) {
    int st = -1;
    as_tree *t = as_tree_create(AS_DEFAULT_MAX_DEPTH, &st);
    REQUIRE(t != NULL);
    CHECK_EQ_INT(st, AS_OK);
    CHECK_EQ_INT(as_tree_max_depth(t), AS_DEFAULT_MAX_DEPTH);
    as_tree_stats s = stats_of(t);
    CHECK_EQ_U64(s.sequences, 0);
    CHECK_EQ_U64(s.open_sequences, 0);
    CHECK_EQ_U64(s.tokens, 0);
    CHECK_EQ_U64(s.nodes, 1);
    CHECK(s.bytes > 0);
    CHECK_EQ_U64(s.retained_tokens, 0);
    CHECK_EQ_INT(s.max_depth, AS_DEFAULT_MAX_DEPTH);
    CHECK_STATUS(as_tree_check(t), AS_OK);
    as_tree_free(t);
    as_tree_free(NULL);
    t = as_tree_create(8, NULL); /* status pointer is optional */
    CHECK(t != NULL);
    as_tree_free(t);
}

/* max_depth outside [2, AS_MAX_DEPTH_LIMIT] is refused with INVALID_ARG. */
static void test_bad_max_depth(void) {
    const uint32_t bad[] = {0, 1, AS_MAX_DEPTH_LIMIT + 1, UINT32_MAX};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        int st = AS_OK;
        as_tree *t = as_tree_create(bad[i], &st);
        CHECK(t == NULL);
        CHECK_EQ_INT(st, AS_ERR_INVALID_ARG);
        as_tree_free(t);
        CHECK(as_tree_create(bad[i], NULL) == NULL);
    }
    const uint32_t good[] = {2, AS_MAX_DEPTH_LIMIT};
    for (size_t i = 0; i < ARRAY_LEN(good); i++) {
        as_tree *t = as_tree_create(good[i], NULL);
        CHECK(t != NULL);
        CHECK_EQ_INT(as_tree_max_depth(t), good[i]);
        as_tree_free(t);
    }
}

/* Counts of a small sequence, computed by hand. */
static void test_add_counts_simple(void) {
    as_tree *t = as_tree_create(64, NULL);
    REQUIRE(t != NULL);
    const int32_t s1[] = {1, 2, 1, 2, 3};
    REQUIRE_OK(as_tree_add(t, 7, s1, ARRAY_LEN(s1)));
    CHECK_EQ_U64(COUNT(t, 1), 2);
    CHECK_EQ_U64(COUNT(t, 2), 2);
    CHECK_EQ_U64(COUNT(t, 3), 1);
    CHECK_EQ_U64(COUNT(t, 4), 0);
    CHECK_EQ_U64(COUNT(t, 1, 2), 2);
    CHECK_EQ_U64(COUNT(t, 2, 1), 1);
    CHECK_EQ_U64(COUNT(t, 2, 3), 1);
    CHECK_EQ_U64(COUNT(t, 3, 1), 0);
    CHECK_EQ_U64(COUNT(t, 1, 2, 3), 1);
    CHECK_EQ_U64(COUNT(t, 1, 2, 1, 2, 3), 1);
    CHECK_EQ_U64(COUNT(t, 1, 2, 1, 2, 3, 1), 0);
    /* a second sequence adds its occurrences */
    const int32_t s2[] = {2, 3, 2, 3};
    REQUIRE_OK(as_tree_add(t, 8, s2, ARRAY_LEN(s2)));
    CHECK_EQ_U64(COUNT(t, 2), 4);
    CHECK_EQ_U64(COUNT(t, 3), 3);
    CHECK_EQ_U64(COUNT(t, 2, 3), 3);
    CHECK_EQ_U64(COUNT(t, 3, 2), 1);
    CHECK_EQ_U64(COUNT(t, 1, 2), 2);
    as_tree_stats s = stats_of(t);
    CHECK_EQ_U64(s.sequences, 2);
    CHECK_EQ_U64(s.open_sequences, 0);
    CHECK_EQ_U64(s.tokens, 9);
    CHECK_STATUS(as_tree_check(t), AS_OK);
    CHECK(s.nodes > 1);
    as_tree_free(t);
}

/* A sequence of one repeated token: count(k copies) = n - k + 1; every
 * prefix length ends a window, so there is one node per length. */
static void test_repeated_token(void) {
    as_tree *t = as_tree_create(16, NULL);
    REQUIRE(t != NULL);
    int32_t s[10];
    for (size_t i = 0; i < 10; i++) s[i] = 5;
    REQUIRE_OK(as_tree_add(t, 1, s, 10));
    for (size_t k = 1; k <= 10; k++) CHECK_EQ_U64(count_of(t, s, k), 10 - k + 1);
    CHECK_EQ_U64(stats_of(t).nodes, 1 + 10);
    as_tree_free(t);
}

/* Random sequences: every short string's count equals the brute-force count. */
static void test_add_matches_model(void) {
    th_rng r;
    th_rng_seed(&r, 11);
    for (int round = 0; round < 6; round++) {
        uint32_t depth = 2 + (uint32_t)round;
        as_tree *t = as_tree_create(depth, NULL);
        REQUIRE(t != NULL);
        nv_tree m;
        nv_init(&m, depth);
        for (int64_t id = 0; id < 8; id++) {
            int32_t seq[40];
            size_t n = th_rng_below(&r, 40);
            for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 3);
            CHECK_STATUS(as_tree_add(t, id * 1000 - 3, seq, n), nv_add(&m, id * 1000 - 3, seq, n));
        }
        CHECK_EQ_INT(compare_all_strings(t, &m, 3, depth + 1), 0);
        CHECK_STATUS(as_tree_check(t), AS_OK);
        as_tree_stats s = stats_of(t);
        CHECK_EQ_U64(s.tokens, nv_total_tokens(&m));
        CHECK_EQ_U64(s.sequences, m.n);
        nv_free(&m);
        as_tree_free(t);
    }
}

/* Appending in chunks (including empty ones) gives the counts of one add. */
static void test_append_chunks_equals_add(void) {
    th_rng r;
    th_rng_seed(&r, 22);
    as_tree *a = as_tree_create(5, NULL), *b = as_tree_create(5, NULL);
    REQUIRE(a != NULL && b != NULL);
    nv_tree m;
    nv_init(&m, 5);
    for (int64_t id = 1; id <= 5; id++) {
        int32_t seq[60];
        size_t n = 10 + th_rng_below(&r, 50);
        for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 3);
        REQUIRE_OK(as_tree_add(a, id, seq, n));
        nv_add(&m, id, seq, n);
        size_t pos = 0;
        while (pos < n) {
            size_t k = th_rng_below(&r, 7); /* 0..6, zero-length appends too */
            if (k > n - pos) k = n - pos;
            REQUIRE_OK(as_tree_append(b, id, seq + pos, k));
            pos += k;
            CHECK_STATUS(as_tree_check(b), AS_OK);
        }
    }
    CHECK_EQ_INT(compare_all_strings(b, &m, 3, 6), 0);
    as_tree_stats sa = stats_of(a), sb = stats_of(b);
    CHECK_EQ_U64(sb.sequences, sa.sequences);
    CHECK_EQ_U64(sb.tokens, sa.tokens);
    CHECK_EQ_U64(sb.nodes, sa.nodes);
    CHECK_EQ_U64(sb.open_sequences, 5);
    CHECK_EQ_U64(sa.open_sequences, 0);
    for (int64_t id = 1; id <= 5; id++) {
        uint64_t la = 0, lb = 1;
        CHECK_STATUS(as_tree_seq_len(a, id, &la), AS_OK);
        CHECK_STATUS(as_tree_seq_len(b, id, &lb), AS_OK);
        CHECK_EQ_U64(la, lb);
    }
    nv_free(&m);
    as_tree_free(a);
    as_tree_free(b);
}

/* append creates an open sequence; close stops appends; close is idempotent. */
static void test_close(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t x[] = {4, 5, 6};
    REQUIRE_OK(as_tree_append(t, 3, x, 3));
    CHECK_EQ_U64(stats_of(t).open_sequences, 1);
    REQUIRE_OK(as_tree_append(t, 3, x, 2));
    CHECK_STATUS(as_tree_close(t, 3), AS_OK);
    CHECK_EQ_U64(stats_of(t).open_sequences, 0);
    CHECK_STATUS(as_tree_close(t, 3), AS_OK);
    as_tree_stats before = stats_of(t);
    CHECK_STATUS(as_tree_append(t, 3, x, 1), AS_ERR_SEQ_CLOSED);
    as_tree_stats after = stats_of(t);
    CHECK(stats_same(&before, &after));
    CHECK_EQ_U64(COUNT(t, 4, 5), 2);
    CHECK_EQ_U64(COUNT(t, 6, 4, 5), 1);
    CHECK_EQ_U64(after.tokens, 5);
    /* a sequence made by add is closed from the start */
    REQUIRE_OK(as_tree_add(t, 4, x, 3));
    CHECK_STATUS(as_tree_append(t, 4, x, 1), AS_ERR_SEQ_CLOSED);
    CHECK_STATUS(as_tree_close(t, 999), AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_check(t), AS_OK);
    as_tree_free(t);
}

/* Removing every sequence brings nodes, tokens and bytes back to the empty tree's. */
static void test_remove_restores(void) {
    as_tree *t = as_tree_create(6, NULL);
    REQUIRE(t != NULL);
    as_tree_stats empty = stats_of(t);
    th_rng r;
    th_rng_seed(&r, 33);
    for (int64_t id = 0; id < 20; id++) {
        int32_t seq[30];
        size_t n = th_rng_below(&r, 30);
        for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 50);
        if (id % 2)
            REQUIRE_OK(as_tree_add(t, id, seq, n));
        else
            REQUIRE_OK(as_tree_append(t, id, seq, n));
    }
    CHECK(stats_of(t).nodes > 1);
    for (int64_t id = 0; id < 20; id++) REQUIRE_OK(as_tree_remove(t, id));
    as_tree_stats s = stats_of(t);
    CHECK_EQ_U64(s.sequences, 0);
    CHECK_EQ_U64(s.open_sequences, 0);
    CHECK_EQ_U64(s.tokens, 0);
    CHECK_EQ_U64(s.nodes, 1);
    CHECK_EQ_U64(s.retained_tokens, 0);
    CHECK_EQ_U64(s.bytes, empty.bytes);
    CHECK_EQ_U64(COUNT(t, 1), 0);
    CHECK_STATUS(as_tree_check(t), AS_OK);
    as_tree_free(t);
}

/* Removing one of two sequences leaves exactly the other's counts and nodes. */
static void test_remove_one_of_two(void) {
    as_tree *both = as_tree_create(4, NULL), *only = as_tree_create(4, NULL);
    REQUIRE(both != NULL && only != NULL);
    const int32_t a[] = {1, 2, 3, 1, 2, 4}, b[] = {2, 3, 1, 2, 9, 9, 9};
    REQUIRE_OK(as_tree_add(both, 1, a, ARRAY_LEN(a)));
    REQUIRE_OK(as_tree_add(both, 2, b, ARRAY_LEN(b)));
    REQUIRE_OK(as_tree_add(only, 2, b, ARRAY_LEN(b)));
    REQUIRE_OK(as_tree_remove(both, 1));
    CHECK_STATUS(as_tree_remove(both, 1), AS_ERR_SEQ_NOT_FOUND);
    as_tree_stats sb = stats_of(both), so = stats_of(only);
    CHECK_EQ_U64(sb.nodes, so.nodes);
    CHECK_EQ_U64(sb.tokens, so.tokens);
    CHECK_EQ_U64(sb.sequences, 1);
    CHECK_EQ_U64(COUNT(both, 1, 2), 1);
    CHECK_EQ_U64(COUNT(both, 1, 2, 3), 0);
    CHECK_EQ_U64(COUNT(both, 9, 9), 2);
    CHECK_EQ_U64(COUNT(both, 4), 0);
    CHECK(!as_tree_contains(both, 1));
    CHECK(as_tree_contains(both, 2));
    as_tree_free(both);
    as_tree_free(only);
}

/* Remove in reverse and in random order; the model agrees after every step. */
static void test_remove_orders(void) {
    for (int order = 0; order < 2; order++) {
        th_rng r;
        th_rng_seed(&r, 44 + (uint64_t)order);
        as_tree *t = as_tree_create(4, NULL);
        REQUIRE(t != NULL);
        as_tree_stats empty = stats_of(t);
        nv_tree m;
        nv_init(&m, 4);
        int64_t ids[12];
        for (int i = 0; i < 12; i++) {
            int32_t seq[25];
            size_t n = th_rng_below(&r, 25);
            for (size_t j = 0; j < n; j++) seq[j] = (int32_t)th_rng_below(&r, 3);
            ids[i] = (int64_t)th_rng_next(&r);
            REQUIRE_OK(as_tree_add(t, ids[i], seq, n));
            nv_add(&m, ids[i], seq, n);
        }
        if (order == 1) { /* shuffle */
            for (int i = 11; i > 0; i--) {
                int j = (int)th_rng_below(&r, (uint32_t)i + 1);
                int64_t tmp = ids[i];
                ids[i] = ids[j];
                ids[j] = tmp;
            }
        }
        for (int k = 0; k < 12; k++) {
            int64_t id = order == 0 ? ids[11 - k] : ids[k];
            REQUIRE_OK(as_tree_remove(t, id));
            nv_remove(&m, id);
            CHECK_STATUS(as_tree_check(t), AS_OK);
            CHECK_EQ_INT(compare_all_strings(t, &m, 3, 4), 0);
            CHECK_EQ_U64(stats_of(t).tokens, nv_total_tokens(&m));
        }
        as_tree_stats s = stats_of(t);
        CHECK_EQ_U64(s.nodes, 1);
        CHECK_EQ_U64(s.bytes, empty.bytes);
        nv_free(&m);
        as_tree_free(t);
    }
}

/* Strings longer than max_depth are never counted. */
static void test_depth_bound(void) {
    as_tree *t = as_tree_create(3, NULL);
    REQUIRE(t != NULL);
    const int32_t s[] = {1, 1, 1, 1, 1, 2, 3, 4, 5};
    REQUIRE_OK(as_tree_add(t, 1, s, ARRAY_LEN(s)));
    CHECK_EQ_U64(COUNT(t, 1), 5);
    CHECK_EQ_U64(COUNT(t, 1, 1), 4);
    CHECK_EQ_U64(COUNT(t, 1, 1, 1), 3);
    CHECK_EQ_U64(COUNT(t, 1, 1, 1, 1), 0);
    CHECK_EQ_U64(COUNT(t, 2, 3, 4), 1);
    CHECK_EQ_U64(COUNT(t, 2, 3, 4, 5), 0);
    CHECK_EQ_U64(COUNT(t, 1, 1, 1, 1, 1, 2, 3, 4, 5), 0);
    as_tree_free(t);
    /* the smallest depth, 2 */
    t = as_tree_create(2, NULL);
    REQUIRE(t != NULL);
    REQUIRE_OK(as_tree_append(t, 1, s, ARRAY_LEN(s)));
    CHECK_EQ_U64(COUNT(t, 1, 1), 4);
    CHECK_EQ_U64(COUNT(t, 1, 1, 1), 0);
    CHECK_STATUS(as_tree_check(t), AS_OK);
    as_tree_free(t);
}

/* INT32_MAX and 0 are ordinary tokens. */
static void test_extreme_tokens(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t s[] = {0, INT32_MAX, 0, INT32_MAX, 0};
    REQUIRE_OK(as_tree_add(t, 0, s, ARRAY_LEN(s)));
    CHECK_EQ_U64(COUNT(t, 0), 3);
    CHECK_EQ_U64(COUNT(t, INT32_MAX), 2);
    CHECK_EQ_U64(COUNT(t, 0, INT32_MAX), 2);
    CHECK_EQ_U64(COUNT(t, INT32_MAX, 0), 2);
    CHECK_EQ_U64(COUNT(t, 0, INT32_MAX, 0, INT32_MAX, 0), 1);
    CHECK_EQ_U64(COUNT(t, 1), 0);
    CHECK_EQ_U64(COUNT(t, INT32_MAX - 1), 0);
    int32_t back[5] = {0};
    CHECK_STATUS(as_tree_seq_tokens(t, 0, back, 5), AS_OK);
    CHECK(memcmp(back, s, sizeof s) == 0);
    REQUIRE_OK(as_tree_remove(t, 0));
    CHECK_EQ_U64(stats_of(t).nodes, 1);
    as_tree_free(t);
}

/* A negative token is refused up front and nothing changes. */
static void test_negative_token(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t ok[] = {1, 2, 3};
    REQUIRE_OK(as_tree_append(t, 1, ok, 3));
    as_tree_stats before = stats_of(t);
    const int32_t bad1[] = {1, 2, -1}, bad2[] = {INT32_MIN}, bad3[] = {7, 7, 7, 7, -5, 7};
    CHECK_STATUS(as_tree_add(t, 2, bad1, 3), AS_ERR_INVALID_TOKEN);
    CHECK_STATUS(as_tree_add(t, 2, bad2, 1), AS_ERR_INVALID_TOKEN);
    CHECK_STATUS(as_tree_append(t, 2, bad3, 6), AS_ERR_INVALID_TOKEN);
    CHECK_STATUS(as_tree_append(t, 1, bad3, 6), AS_ERR_INVALID_TOKEN);
    CHECK(!as_tree_contains(t, 2));
    as_tree_stats after = stats_of(t);
    CHECK(stats_same(&before, &after));
    CHECK_EQ_U64(COUNT(t, 7), 0);
    uint64_t len = 0;
    CHECK_STATUS(as_tree_seq_len(t, 1, &len), AS_OK);
    CHECK_EQ_U64(len, 3);
    /* counting a negative token is not a crash; it occurs nowhere */
    uint64_t c = 99;
    int st = as_tree_count(t, bad2, 1, &c);
    CHECK(st == AS_ERR_INVALID_TOKEN || (st == AS_OK && c == 0));
    CHECK_STATUS(as_tree_check(t), AS_OK);
    as_tree_free(t);
}

/* add with an id that exists fails; the first sequence is untouched. */
static void test_duplicate_id(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 2}, b[] = {3, 4, 5};
    REQUIRE_OK(as_tree_add(t, 5, a, 2));
    as_tree_stats before = stats_of(t);
    CHECK_STATUS(as_tree_add(t, 5, b, 3), AS_ERR_SEQ_EXISTS);
    REQUIRE_OK(as_tree_append(t, 6, a, 2));
    CHECK_STATUS(as_tree_add(t, 6, b, 3), AS_ERR_SEQ_EXISTS); /* open one too */
    CHECK_EQ_U64(COUNT(t, 3), 0);
    CHECK_EQ_U64(stats_of(t).sequences, before.sequences + 1);
    uint64_t len = 0;
    CHECK_STATUS(as_tree_seq_len(t, 5, &len), AS_OK);
    CHECK_EQ_U64(len, 2);
    as_tree_free(t);
}

/* Operations on an id that is not there return SEQ_NOT_FOUND. */
static void test_unknown_id(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1};
    REQUIRE_OK(as_tree_add(t, 1, a, 1));
    uint64_t len = 7;
    int32_t out[4];
    CHECK_STATUS(as_tree_remove(t, 2), AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_close(t, 2), AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_seq_len(t, 2, &len), AS_ERR_SEQ_NOT_FOUND);
    CHECK_STATUS(as_tree_seq_tokens(t, 2, out, 4), AS_ERR_SEQ_NOT_FOUND);
    CHECK(!as_tree_contains(t, 2));
    CHECK(!as_tree_contains(t, INT64_MIN));
    CHECK(as_tree_contains(t, 1));
    as_tree_free(t);
}

/* Ids anywhere in int64 range, including INT64_MIN and INT64_MAX. */
static void test_int64_ids(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int64_t ids[] = {INT64_MIN, INT64_MAX, -1, 0, 1};
    const int32_t a[] = {1, 2};
    for (size_t i = 0; i < ARRAY_LEN(ids); i++) REQUIRE_OK(as_tree_add(t, ids[i], a, 2));
    for (size_t i = 0; i < ARRAY_LEN(ids); i++) CHECK(as_tree_contains(t, ids[i]));
    int64_t out[5] = {0};
    size_t n = 0;
    CHECK_STATUS(as_tree_seq_ids(t, out, 5, &n), AS_OK);
    CHECK_EQ_U64(n, 5);
    for (size_t i = 0; i < ARRAY_LEN(ids); i++) CHECK_EQ_INT(out[i], ids[i]);
    CHECK_EQ_U64(COUNT(t, 1, 2), 5);
    REQUIRE_OK(as_tree_remove(t, INT64_MIN));
    REQUIRE_OK(as_tree_remove(t, INT64_MAX));
    CHECK_EQ_U64(COUNT(t, 1, 2), 3);
    as_tree_free(t);
}

/* seq_len, seq_tokens and seq_ids: values, order and capacity rules. */
static void test_accessors(void) {
    as_tree *t = as_tree_create(8, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {9, 8, 7, 6};
    REQUIRE_OK(as_tree_add(t, 30, a, 4));
    REQUIRE_OK(as_tree_add(t, 10, NULL, 0)); /* an empty sequence */
    REQUIRE_OK(as_tree_append(t, 20, a, 2));
    uint64_t len = 99;
    CHECK_STATUS(as_tree_seq_len(t, 10, &len), AS_OK);
    CHECK_EQ_U64(len, 0);
    CHECK_STATUS(as_tree_seq_tokens(t, 10, NULL, 0), AS_OK);
    int32_t out[4] = {0};
    CHECK_STATUS(as_tree_seq_tokens(t, 30, out, 3), AS_ERR_CAPACITY);
    CHECK_STATUS(as_tree_seq_tokens(t, 30, out, 4), AS_OK);
    CHECK(memcmp(out, a, sizeof a) == 0);
    int64_t ids[3] = {0};
    size_t n = 0;
    CHECK_STATUS(as_tree_seq_ids(t, ids, 3, &n), AS_OK);
    CHECK_EQ_U64(n, 3);
    CHECK_EQ_INT(ids[0], 30);
    CHECK_EQ_INT(ids[1], 10);
    CHECK_EQ_INT(ids[2], 20);
    int64_t one[1] = {0};
    n = 0;
    CHECK_STATUS(as_tree_seq_ids(t, one, 1, &n), AS_OK); /* total reported, one written */
    CHECK_EQ_U64(n, 3);
    CHECK_EQ_INT(one[0], 30);
    n = 99;
    CHECK_STATUS(as_tree_seq_ids(t, NULL, 0, &n), AS_OK);
    CHECK_EQ_U64(n, 3);
    REQUIRE_OK(as_tree_remove(t, 10));
    REQUIRE_OK(as_tree_add(t, 10, a, 1)); /* re-added id goes to the end */
    CHECK_STATUS(as_tree_seq_ids(t, ids, 3, &n), AS_OK);
    CHECK_EQ_INT(ids[0], 30);
    CHECK_EQ_INT(ids[1], 20);
    CHECK_EQ_INT(ids[2], 10);
    as_tree_stats s = stats_of(t);
    CHECK_EQ_U64(s.sequences, 3);
    CHECK_EQ_U64(s.open_sequences, 1);
    CHECK_EQ_U64(s.tokens, 7);
    as_tree_free(t);
}

/* NULL handles and NULL buffers with n > 0 are INVALID_ARG, never a crash. */
static void test_null_args(void) {
    const int32_t a[] = {1};
    uint64_t u = 0;
    size_t n = 0;
    as_tree_stats s;
    CHECK_STATUS(as_tree_add(NULL, 1, a, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_append(NULL, 1, a, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_close(NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_remove(NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_stats_get(NULL, &s), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_count(NULL, a, 1, &u), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_check(NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_seq_ids(NULL, NULL, 0, &n), AS_ERR_INVALID_ARG);
    CHECK_EQ_INT(as_tree_contains(NULL, 1), 0);
    as_tree *t = as_tree_create(4, NULL);
    REQUIRE(t != NULL);
    CHECK_STATUS(as_tree_add(t, 1, NULL, 3), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_append(t, 1, NULL, 3), AS_ERR_INVALID_ARG);
    CHECK(!as_tree_contains(t, 1));
    CHECK_STATUS(as_tree_stats_get(t, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_count(t, a, 1, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_count(t, NULL, 2, &u), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_seq_len(t, 1, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_seq_ids(t, NULL, 0, NULL), AS_ERR_INVALID_ARG);
    REQUIRE_OK(as_tree_add(t, 1, a, 1));
    CHECK_STATUS(as_tree_seq_tokens(t, 1, NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_tree_seq_ids(t, NULL, 1, &n), AS_ERR_INVALID_ARG);
    CHECK_EQ_U64(stats_of(t).sequences, 1);
    as_tree_free(t);
}

/* stats.bytes is exactly what the library holds for that tree. */
static void test_stats_bytes_exact(void) {
    uint64_t base = as_allocated_bytes();
    as_tree *t = as_tree_create(16, NULL);
    REQUIRE(t != NULL);
    CHECK_EQ_U64(stats_of(t).bytes, as_allocated_bytes() - base);
    th_rng r;
    th_rng_seed(&r, 55);
    for (int64_t id = 0; id < 50; id++) {
        int32_t seq[100];
        size_t n = th_rng_below(&r, 100);
        for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 1000);
        REQUIRE_OK(as_tree_append(t, id, seq, n));
        if (id % 3 == 0) REQUIRE_OK(as_tree_close(t, id));
        if (id % 5 == 0) REQUIRE_OK(as_tree_remove(t, id / 2));
        CHECK_EQ_U64(stats_of(t).bytes, as_allocated_bytes() - base);
    }
    as_tree_free(t);
    CHECK_EQ_U64(as_allocated_bytes(), base);
}

/* Counting longer than the depth, or the empty string, is not an error to crash on. */
static void test_count_edges(void) {
    as_tree *t = as_tree_create(2, NULL);
    REQUIRE(t != NULL);
    const int32_t a[] = {1, 1, 1};
    REQUIRE_OK(as_tree_add(t, 1, a, 3));
    CHECK_EQ_U64(COUNT(t, 1, 1, 1), 0);
    uint64_t c = 123;
    int st = as_tree_count(t, a, 0, &c);
    CHECK(st == AS_OK || st == AS_ERR_INVALID_ARG);
    as_tree_free(t);
}

/* A long mixed workload against the model, with check() after every step. */
static void test_mixed_workload(void) {
    th_rng r;
    th_rng_seed(&r, 66);
    as_tree *t = as_tree_create(4, NULL);
    REQUIRE(t != NULL);
    nv_tree m;
    nv_init(&m, 4);
    for (int step = 0; step < 600; step++) {
        int64_t id = (int64_t)th_rng_below(&r, 10);
        int32_t seq[12];
        size_t n = th_rng_below(&r, 12);
        for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 3);
        if (th_rng_below(&r, 20) == 0 && n) seq[th_rng_below(&r, (uint32_t)n)] = -2;
        switch (th_rng_below(&r, 4)) {
        case 0: CHECK_STATUS(as_tree_add(t, id, seq, n), nv_add(&m, id, seq, n)); break;
        case 1: CHECK_STATUS(as_tree_append(t, id, seq, n), nv_append(&m, id, seq, n)); break;
        case 2: CHECK_STATUS(as_tree_close(t, id), nv_close(&m, id)); break;
        default: CHECK_STATUS(as_tree_remove(t, id), nv_remove(&m, id)); break;
        }
        CHECK_STATUS(as_tree_check(t), AS_OK);
        as_tree_stats s = stats_of(t);
        CHECK_EQ_U64(s.sequences, m.n);
        CHECK_EQ_U64(s.open_sequences, nv_open_count(&m));
        CHECK_EQ_U64(s.tokens, nv_total_tokens(&m));
        if (step % 50 == 0) CHECK_EQ_INT(compare_all_strings(t, &m, 3, 5), 0);
    }
    CHECK_EQ_INT(compare_all_strings(t, &m, 3, 5), 0);
    nv_free(&m);
    as_tree_free(t);
}

/* as_strerror names every status and never returns NULL. */
static void test_strerror(void) {
    for (int s = -3; s <= AS_ERR_THREAD + 3; s++) {
        const char *msg = as_strerror(s);
        CHECK(msg != NULL && msg[0] != '\0');
    }
    CHECK(strcmp(as_strerror(AS_OK), as_strerror(AS_ERR_NOMEM)) != 0);
}

int main(void) {
    TEST_RUN(test_create_free);
    TEST_RUN(test_bad_max_depth);
    TEST_RUN(test_add_counts_simple);
    TEST_RUN(test_repeated_token);
    TEST_RUN(test_add_matches_model);
    TEST_RUN(test_append_chunks_equals_add);
    TEST_RUN(test_close);
    TEST_RUN(test_remove_restores);
    TEST_RUN(test_remove_one_of_two);
    TEST_RUN(test_remove_orders);
    TEST_RUN(test_depth_bound);
    TEST_RUN(test_extreme_tokens);
    TEST_RUN(test_negative_token);
    TEST_RUN(test_duplicate_id);
    TEST_RUN(test_unknown_id);
    TEST_RUN(test_int64_ids);
    TEST_RUN(test_accessors);
    TEST_RUN(test_null_args);
    TEST_RUN(test_stats_bytes_exact);
    TEST_RUN(test_count_edges);
    TEST_RUN(test_mixed_workload);
    TEST_RUN(test_strerror);
    return TEST_REPORT("test_tree");
}
