/*
 * test_batch.c -- as_draft_batch: rows equal one as_draft per item, per-item
 * statuses (one bad item does not stop the others), threads give the same
 * bytes as the serial run, and argument checks; as_draft_batch_multi: rows
 * equal one as_draft_multi per item (several global trees, per-item caps).
 */
#include "agentspec.h"
#include "testhelp.h"

#define MAXN 96
#define STRIDE 16

/* Everything one batch call writes. */
typedef struct rows {
    int32_t tokens[MAXN * STRIDE];
    int32_t parents[MAXN * STRIDE];
    float probs[MAXN * STRIDE];
    uint32_t n_out[MAXN], match_len[MAXN], source[MAXN];
    double score[MAXN];
    int32_t statuses[MAXN];
} rows;

static void rows_poison(rows *r) {
    memset(r, 0x5A, sizeof *r);
}

static int run_batch(as_cursor *const *cur, const as_tree *const *glob, size_t n,
                     const int32_t *toks, const uint64_t *offs, const as_draft_params *p, rows *r,
                     uint32_t threads) {
    return as_draft_batch(cur, glob, n, toks, offs, p, r->tokens, r->parents, r->probs, STRIDE,
                          r->n_out, r->match_len, r->source, r->score, r->statuses, threads);
}

/* A few global trees over a small alphabet so that drafts are non-trivial. */
static as_tree *make_global(th_rng *r, uint32_t depth) {
    as_tree *g = as_tree_create(depth, NULL);
    if (g == NULL) return NULL;
    for (int64_t id = 0; id < 12; id++) {
        int32_t seq[80];
        size_t n = 20 + th_rng_below(r, 60);
        for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(r, 5);
        if (as_tree_add(g, id, seq, n) != AS_OK) {
            as_tree_free(g);
            return NULL;
        }
    }
    return g;
}

/* Random appends for n items (6 tokens each on the first step, else 0..3). */
static void random_appends(th_rng *r, size_t n, int first, int32_t *toks, uint64_t *offs) {
    offs[0] = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = first ? 6 : th_rng_below(r, 4);
        for (size_t j = 0; j < k; j++) toks[offs[i] + j] = (int32_t)th_rng_below(r, 5);
        offs[i + 1] = offs[i] + k;
    }
}

/* Row i of a batch equals the single draft o (whose arrays o->tokens etc. hold it). */
static void check_row(const rows *out, size_t i, const as_draft_out *o) {
    CHECK_EQ_INT(out->n_out[i], o->n);
    CHECK_EQ_INT(out->match_len[i], o->match_len);
    CHECK_EQ_INT(out->source[i], o->source);
    CHECK_EQ_DBL(out->score[i], o->score);
    for (uint32_t k = 0; k < o->n && k < out->n_out[i]; k++) {
        CHECK_EQ_INT(out->tokens[i * STRIDE + k], o->tokens[k]);
        CHECK_EQ_INT(out->parents[i * STRIDE + k], o->parents[k]);
        CHECK_EQ_DBL(out->probs[i * STRIDE + k], o->probs[k]);
    }
}

/* The same items as one batch and as separate extend+draft calls give the same rows. */
static void test_batch_equals_single(void) {
    th_rng r;
    th_rng_seed(&r, 1);
    as_tree *g1 = make_global(&r, 16), *g2 = make_global(&r, 16);
    REQUIRE(g1 != NULL && g2 != NULL);
    enum { N = 20 };
    as_cursor *a[N], *b[N];
    const as_tree *glob[N];
    for (size_t i = 0; i < N; i++) {
        uint32_t flags = i % 3 ? AS_CURSOR_LOCAL_TREE : 0;
        a[i] = as_cursor_create(16, flags, NULL);
        b[i] = as_cursor_create(16, flags, NULL);
        REQUIRE(a[i] != NULL && b[i] != NULL);
        glob[i] = i % 4 == 0 ? NULL : i % 2 ? g1 : g2;
    }
    static rows out;
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = STRIDE;
    int nonempty = 0;
    for (int step = 0; step < 30; step++) {
        int32_t toks[N * 8];
        uint64_t offs[N + 1];
        random_appends(&r, N, step == 0, toks, offs);
        p.flags = step % 2 ? AS_DRAFT_TREE : 0;
        rows_poison(&out);
        CHECK_STATUS(run_batch(a, glob, N, toks, offs, &p, &out, 1), AS_OK);
        for (size_t i = 0; i < N; i++) {
            CHECK_EQ_INT(out.statuses[i], AS_OK);
            REQUIRE_OK(as_cursor_extend(b[i], toks + offs[i], (size_t)(offs[i + 1] - offs[i])));
            int32_t tk[STRIDE], pa[STRIDE];
            float pr[STRIDE];
            as_draft_out o = {tk, pa, pr, STRIDE, 0, 0, 0, 0.0, 0};
            REQUIRE_OK(as_draft(b[i], glob[i], &p, &o));
            CHECK_EQ_U64(as_cursor_len(a[i]), as_cursor_len(b[i]));
            check_row(&out, i, &o);
            nonempty += o.n > 0;
        }
    }
    CHECK(nonempty > 100);
    for (size_t i = 0; i < N; i++) {
        as_cursor_free(a[i]);
        as_cursor_free(b[i]);
    }
    as_tree_free(g1);
    as_tree_free(g2);
}

/* Two (and more) threads write exactly the bytes of the serial run. */
static void test_threads_equal_serial(void) {
    th_rng r;
    th_rng_seed(&r, 2);
    as_tree *g = make_global(&r, 24);
    REQUIRE(g != NULL);
    static rows serial, par;
    const uint32_t thread_counts[] = {2, 3, 8, 200};
    for (size_t tc = 0; tc < sizeof thread_counts / sizeof thread_counts[0]; tc++) {
        enum { N = MAXN };
        as_cursor *a[N], *b[N];
        const as_tree *glob[N];
        for (size_t i = 0; i < N; i++) {
            a[i] = as_cursor_create(24, AS_CURSOR_LOCAL_TREE, NULL);
            b[i] = as_cursor_create(24, AS_CURSOR_LOCAL_TREE, NULL);
            REQUIRE(a[i] != NULL && b[i] != NULL);
            glob[i] = i % 5 ? g : NULL;
        }
        as_draft_params p;
        as_draft_params_default(&p);
        p.max_spec_tokens = STRIDE;
        for (int step = 0; step < 10; step++) {
            static int32_t toks[N * 40];
            uint64_t offs[N + 1];
            offs[0] = 0;
            for (size_t i = 0; i < N; i++) {
                size_t k = step == 0 ? 30 + th_rng_below(&r, 10) : th_rng_below(&r, 5);
                for (size_t j = 0; j < k; j++) toks[offs[i] + j] = (int32_t)th_rng_below(&r, 5);
                offs[i + 1] = offs[i] + k;
            }
            p.flags = (uint32_t)step % 4; /* linear/tree x merge */
            rows_poison(&serial);
            rows_poison(&par);
            CHECK_STATUS(run_batch(a, glob, N, toks, offs, &p, &serial, 1), AS_OK);
            CHECK_STATUS(run_batch(b, glob, N, toks, offs, &p, &par, thread_counts[tc]), AS_OK);
            for (size_t i = 0; i < N; i++) {
                CHECK_EQ_INT(par.statuses[i], AS_OK);
                CHECK_EQ_INT(par.n_out[i], serial.n_out[i]);
                CHECK_EQ_INT(par.match_len[i], serial.match_len[i]);
                CHECK_EQ_INT(par.source[i], serial.source[i]);
                CHECK_EQ_DBL(par.score[i], serial.score[i]);
                size_t nb = serial.n_out[i] <= STRIDE ? serial.n_out[i] : STRIDE;
                CHECK(memcmp(par.tokens + i * STRIDE, serial.tokens + i * STRIDE, nb * 4) == 0);
                CHECK(memcmp(par.parents + i * STRIDE, serial.parents + i * STRIDE, nb * 4) == 0);
                CHECK(memcmp(par.probs + i * STRIDE, serial.probs + i * STRIDE, nb * 4) == 0);
            }
        }
        for (size_t i = 0; i < N; i++) {
            as_cursor_free(a[i]);
            as_cursor_free(b[i]);
        }
    }
    as_tree_free(g);
}

/* A bad item gets its own status and an empty row; the others are drafted. */
static void test_per_item_status(void) {
    th_rng r;
    th_rng_seed(&r, 3);
    as_tree *g = make_global(&r, 8);
    REQUIRE(g != NULL);
    for (uint32_t threads = 1; threads <= 2; threads++) {
        as_cursor *c[4];
        for (size_t i = 0; i < 4; i++) {
            c[i] = as_cursor_create(8, AS_CURSOR_LOCAL_TREE, NULL);
            REQUIRE(c[i] != NULL);
        }
        as_cursor *items[4] = {c[0], c[1], NULL, c[3]};
        const as_tree *glob[4] = {g, g, g, g};
        /* item 1 has a negative token; item 2 has no cursor */
        const int32_t toks[] = {0, 1, 2, 0, 1, 0, -7, 3, 1, 2, 0, 1};
        const uint64_t offs[] = {0, 5, 8, 9, 12};
        as_draft_params p;
        as_draft_params_default(&p);
        p.max_spec_tokens = STRIDE;
        static rows out;
        rows_poison(&out);
        int st = run_batch(items, glob, 4, toks, offs, &p, &out, threads);
        CHECK(st == AS_ERR_INVALID_TOKEN || st == AS_ERR_INVALID_ARG);
        if (threads == 1) CHECK_STATUS(st, AS_ERR_INVALID_TOKEN); /* the first bad item */
        CHECK_EQ_INT(out.statuses[0], AS_OK);
        CHECK_EQ_INT(out.statuses[1], AS_ERR_INVALID_TOKEN);
        CHECK_EQ_INT(out.statuses[2], AS_ERR_INVALID_ARG);
        CHECK_EQ_INT(out.statuses[3], AS_OK);
        for (size_t i = 1; i <= 2; i++) {
            CHECK_EQ_INT(out.n_out[i], 0);
            CHECK_EQ_INT(out.source[i], 0);
            CHECK_EQ_INT(out.match_len[i], 0);
            CHECK_EQ_DBL(out.score[i], 0.0);
        }
        CHECK_EQ_U64(as_cursor_len(c[0]), 5);
        CHECK_EQ_U64(as_cursor_len(c[1]), 0); /* the bad append changed nothing */
        CHECK_EQ_U64(as_cursor_len(c[3]), 3);
        CHECK(out.n_out[0] > 0); /* 0,1,2,0,1 is in the global tree's alphabet */
        for (size_t i = 0; i < 4; i++) as_cursor_free(c[i]);
    }
    as_tree_free(g);
}

/* No appends (NULL new_tokens), NULL globals array and optional outputs. */
static void test_optional_arguments(void) {
    th_rng r;
    th_rng_seed(&r, 4);
    as_tree *g = make_global(&r, 8);
    REQUIRE(g != NULL);
    as_cursor *c = as_cursor_create(8, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    const int32_t ctx[] = {0, 1, 2, 3, 0, 1, 2};
    REQUIRE_OK(as_cursor_extend(c, ctx, 7));
    as_cursor *items[1] = {c};
    const as_tree *glob[1] = {g};
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = 8;
    int32_t tk[8], pa[8];
    float pr[8];
    uint32_t n = 99;
    CHECK_STATUS(as_draft_batch(items, glob, 1, NULL, NULL, &p, tk, pa, pr, 8, &n, NULL, NULL,
                                NULL, NULL, 2), AS_OK);
    CHECK_EQ_U64(as_cursor_len(c), 7);
    int32_t tk2[8], pa2[8];
    float pr2[8];
    as_draft_out o = {tk2, pa2, pr2, 8, 0, 0, 0, 0.0, 0};
    REQUIRE_OK(as_draft(c, g, &p, &o));
    CHECK_EQ_INT(n, o.n);
    CHECK(memcmp(tk, tk2, sizeof(int32_t) * o.n) == 0);
    /* globals == NULL: the per-request tree only */
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, &p, tk, pa, pr, 8, &n, NULL, NULL,
                                NULL, NULL, 1), AS_OK);
    REQUIRE_OK(as_draft(c, NULL, &p, &o));
    CHECK_EQ_INT(n, o.n);
    /* zero items is fine */
    CHECK_STATUS(as_draft_batch(NULL, NULL, 0, NULL, NULL, &p, NULL, NULL, NULL, 8, NULL, NULL,
                                NULL, NULL, NULL, 4), AS_OK);
    as_cursor_free(c);
    as_tree_free(g);
}

/* Whole-call argument errors change no cursor. */
static void test_bad_arguments(void) {
    as_cursor *c = as_cursor_create(8, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    as_cursor *items[2] = {c, c};
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = 8;
    static rows out;
    const int32_t toks[] = {1, 2, 3};
    const uint64_t bad_offs[] = {0, 3, 1};
    int32_t *T = out.tokens, *P = out.parents;
    float *F = out.probs;
    uint32_t *NO = out.n_out;
    CHECK_STATUS(as_draft_batch(items, NULL, 1, toks, NULL, &p, T, P, F, 8, NO, NULL, NULL, NULL,
                                NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch(items, NULL, 2, toks, bad_offs, &p, T, P, F, 8, NO, NULL, NULL,
                                NULL, NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, &p, T, P, F, 7, NO, NULL, NULL, NULL,
                                NULL, 1), AS_ERR_CAPACITY);
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, NULL, T, P, F, 8, NO, NULL, NULL, NULL,
                                NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch(NULL, NULL, 1, NULL, NULL, &p, T, P, F, 8, NO, NULL, NULL, NULL,
                                NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, &p, NULL, P, F, 8, NO, NULL, NULL,
                                NULL, NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, &p, T, P, F, 8, NULL, NULL, NULL,
                                NULL, NULL, 1), AS_ERR_INVALID_ARG);
    p.max_spec_tokens = 0;
    CHECK_STATUS(as_draft_batch(items, NULL, 1, NULL, NULL, &p, T, P, F, 8, NO, NULL, NULL, NULL,
                                NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_EQ_U64(as_cursor_len(c), 0);
    as_cursor_free(c);
}

/* Several global trees per item and per-item caps: each row equals one
 * as_draft_multi with max_spec_tokens = min(cap, params), serial or threaded. */
static void test_multi_equals_single(void) {
    th_rng r;
    th_rng_seed(&r, 5);
    as_tree *g[3] = {make_global(&r, 16), make_global(&r, 16), make_global(&r, 16)};
    REQUIRE(g[0] != NULL && g[1] != NULL && g[2] != NULL);
    enum { N = 24, GS = 3 };
    as_cursor *a[N], *b[N];
    const as_tree *glob[N * GS];
    uint32_t ng[N], caps[N];
    for (size_t i = 0; i < N; i++) {
        a[i] = as_cursor_create(16, i % 3 ? AS_CURSOR_LOCAL_TREE : 0, NULL);
        b[i] = as_cursor_create(16, i % 3 ? AS_CURSOR_LOCAL_TREE : 0, NULL);
        REQUIRE(a[i] != NULL && b[i] != NULL);
        ng[i] = (uint32_t)(i % (GS + 1));
        for (size_t k = 0; k < GS; k++) /* some NULL entries, some repeated trees */
            glob[i * GS + k] = (i + k) % 5 == 0 ? NULL : g[(i + k) % 3];
    }
    static rows out;
    uint32_t gidx[N];
    as_batch_out bo = {out.tokens, out.parents, out.probs, STRIDE, out.n_out, out.match_len,
                       out.source, gidx, out.score, out.statuses};
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = 12;
    int nonempty = 0, capped = 0;
    for (int step = 0; step < 24; step++) {
        int32_t toks[N * 8];
        uint64_t offs[N + 1];
        random_appends(&r, N, step == 0, toks, offs);
        for (size_t i = 0; i < N; i++)
            caps[i] = (uint32_t)th_rng_below(&r, 16); /* 0 .. 15: some above max_spec_tokens */
        p.flags = step % 2 ? AS_DRAFT_TREE : 0;
        rows_poison(&out);
        memset(gidx, 0x5A, sizeof gidx);
        CHECK_STATUS(as_draft_batch_multi(a, glob, GS, ng, N, toks, offs, caps, &p, &bo,
                                          step % 3 == 0 ? 2 : 1), AS_OK);
        for (size_t i = 0; i < N; i++) {
            CHECK_EQ_INT(out.statuses[i], AS_OK);
            REQUIRE_OK(as_cursor_extend(b[i], toks + offs[i], (size_t)(offs[i + 1] - offs[i])));
            CHECK_EQ_U64(as_cursor_len(a[i]), as_cursor_len(b[i]));
            if (caps[i] == 0) {
                CHECK_EQ_INT(out.n_out[i], 0);
                continue;
            }
            as_draft_params q = p;
            if (caps[i] < q.max_spec_tokens) q.max_spec_tokens = caps[i];
            int32_t tk[STRIDE], pa[STRIDE];
            float pr[STRIDE];
            as_draft_out o = {tk, pa, pr, STRIDE, 0, 0, 0, 0.0, 0};
            REQUIRE_OK(as_draft_multi(b[i], glob + i * GS, ng[i], &q, &o));
            check_row(&out, i, &o);
            CHECK(out.n_out[i] <= caps[i]);
            CHECK_EQ_INT(gidx[i], o.global_index);
            nonempty += o.n > 0;
            capped += caps[i] < p.max_spec_tokens && o.n == caps[i];
        }
    }
    CHECK(nonempty > 100);
    CHECK(capped > 10); /* the caps did bind */
    for (size_t i = 0; i < N; i++) {
        as_cursor_free(a[i]);
        as_cursor_free(b[i]);
    }
    for (size_t k = 0; k < 3; k++) as_tree_free(g[k]);
}

/* as_draft_batch_multi's own argument checks change no cursor. */
static void test_multi_bad_arguments(void) {
    as_cursor *c = as_cursor_create(8, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    as_tree *g = as_tree_create(8, NULL);
    REQUIRE(g != NULL);
    as_cursor *items[1] = {c};
    const as_tree *glob[AS_MAX_GLOBALS + 1] = {g, g, g, g, g};
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = 8;
    static rows out;
    as_batch_out bo = {out.tokens, out.parents, out.probs, 8, out.n_out, NULL, NULL, NULL, NULL,
                       NULL};
    const int32_t toks[] = {1, 2, 3};
    const uint64_t offs[] = {0, 3};
    uint32_t ng_over[1] = {3}, ng_max[1] = {AS_MAX_GLOBALS + 1};
    CHECK_STATUS(as_draft_batch_multi(items, glob, 2, ng_over, 1, toks, offs, NULL, &p, &bo, 1),
                 AS_ERR_INVALID_ARG); /* more trees than the stride */
    CHECK_STATUS(as_draft_batch_multi(items, glob, AS_MAX_GLOBALS + 1, ng_max, 1, toks, offs, NULL,
                                      &p, &bo, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch_multi(items, glob, 0, NULL, 1, toks, offs, NULL, &p, &bo, 1),
                 AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_batch_multi(items, NULL, 0, NULL, 1, toks, offs, NULL, &p, NULL, 1),
                 AS_ERR_INVALID_ARG);
    bo.stride = 7;
    CHECK_STATUS(as_draft_batch_multi(items, NULL, 0, NULL, 1, toks, offs, NULL, &p, &bo, 1),
                 AS_ERR_CAPACITY);
    CHECK_EQ_U64(as_cursor_len(c), 0);
    bo.stride = 8;
    CHECK_STATUS(as_draft_batch_multi(items, NULL, 0, NULL, 1, toks, offs, NULL, &p, &bo, 1),
                 AS_OK); /* no trees at all: the per-request tree only */
    CHECK_EQ_U64(as_cursor_len(c), 3);
    as_cursor_free(c);
    as_tree_free(g);
}

int main(void) {
    TEST_RUN(test_batch_equals_single);
    TEST_RUN(test_threads_equal_serial);
    TEST_RUN(test_per_item_status);
    TEST_RUN(test_optional_arguments);
    TEST_RUN(test_bad_arguments);
    TEST_RUN(test_multi_equals_single);
    TEST_RUN(test_multi_bad_arguments);
    return TEST_REPORT("test_batch");
}
