/*
 * test_alloc.c -- the allocator hook and out-of-memory behaviour.
 *
 * A counting allocator that can fail the Nth allocation (once, or from the
 * Nth on) runs one scripted workload that touches every part of the API
 * (trees, appends, removes, shards, cursors, drafts, batches).  For every N
 * up to the number of allocations the workload makes, each call must
 * return AS_OK or AS_ERR_NOMEM (never crash), the handles must stay sound
 * (as_tree_check), a tree's content must match a model of the calls that
 * succeeded, and after everything is freed no block is live and
 * as_allocated_bytes() is back to its starting value.
 */
#include "agentspec.h"
#include "naive.h"
#include "testhelp.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- the failing allocator ------------------------------------------------ */

typedef struct fail_alloc {
    uint64_t calls;   /* malloc + realloc calls so far */
    uint64_t fail_at; /* 1-based call number to fail; 0 = never */
    int sticky;       /* fail every call from fail_at on */
    int64_t live;     /* blocks handed out and not yet freed */
    uint64_t failed;  /* calls that returned NULL */
    int paused;       /* while set: no failures, no counting (for checks) */
} fail_alloc;

static fail_alloc FA;

static int should_fail(fail_alloc *f) {
    if (f->paused) return 0;
    f->calls++;
    int fail = f->fail_at != 0 && (f->sticky ? f->calls >= f->fail_at : f->calls == f->fail_at);
    if (fail) f->failed++;
    return fail;
}

static void *fa_malloc(size_t n, void *ctx) {
    fail_alloc *f = (fail_alloc *)ctx;
    if (should_fail(f)) return NULL;
    void *p = malloc(n);
    if (p) f->live++;
    return p;
}

static void *fa_realloc(void *p, size_t n, void *ctx) {
    fail_alloc *f = (fail_alloc *)ctx;
    if (should_fail(f)) return NULL;
    void *q = realloc(p, n);
    if (q && p == NULL) f->live++;
    return q;
}

static void fa_free(void *p, void *ctx) {
    fail_alloc *f = (fail_alloc *)ctx;
    if (p) f->live--;
    free(p);
}

/* ---- checks used inside the workload ---------------------------------------- */

static int ok_or_nomem(int st) { return st == AS_OK || st == AS_ERR_NOMEM; }

/* as_tree_check needs scratch memory: run it with failures paused, so that
 * it verifies the tree instead of reporting NOMEM. */
static int check_sound(const as_tree *t) {
    FA.paused++;
    int st = as_tree_check(t);
    FA.paused--;
    return st == AS_OK;
}

/* The tree holds exactly the model's sequences (ids, order, tokens) and counts. */
static int tree_matches_now(const as_tree *t, const nv_tree *m) {
    if (!check_sound(t)) return 0;
    int64_t ids[64];
    size_t n = 0;
    if (as_tree_seq_ids(t, ids, 64, &n) != AS_OK || n != m->n) return 0;
    for (size_t i = 0; i < n; i++) {
        const nv_seq *s = &m->seqs[i];
        if (ids[i] != s->id) return 0;
        int32_t buf[256];
        uint64_t len = 0;
        if (as_tree_seq_len(t, s->id, &len) != AS_OK || len != s->n || len > 256) return 0;
        if (as_tree_seq_tokens(t, s->id, buf, 256) != AS_OK) return 0;
        if (len && memcmp(buf, s->tok, (size_t)len * 4) != 0) return 0;
    }
    int32_t x[3];
    for (int32_t a = 0; a < 4; a++) {
        for (int32_t b = 0; b < 4; b++) {
            x[0] = a;
            x[1] = b;
            x[2] = (a + b) % 4;
            for (size_t len = 1; len <= 3; len++) {
                uint64_t c = 0;
                if (as_tree_count(t, x, len, &c) != AS_OK || c != nv_count(m, x, len)) return 0;
            }
        }
    }
    as_tree_stats st;
    if (as_tree_stats_get(t, &st) != AS_OK) return 0;
    return st.sequences == m->n && st.tokens == nv_total_tokens(m) &&
           st.open_sequences == nv_open_count(m);
}

/* tree_matches_now with allocation failures paused (it only observes). */
static int tree_matches(const as_tree *t, const nv_tree *m) {
    FA.paused++;
    int same = tree_matches_now(t, m);
    FA.paused--;
    return same;
}

/* A deterministic token sequence. */
static void fill(int32_t *out, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) out[i] = (int32_t)((seed * 7 + i * i * 3 + i / 3) % 4);
}

/* One pass of the workload.  Returns the number of calls that failed a check. */
static int workload(void) {
    int bad = 0;
#define EXPECT(cond)                                                              \
    do {                                                                          \
        if (!(cond)) {                                                            \
            if (bad++ < 3)                                                        \
                fprintf(stderr, "  workload line %d (fail_at %" PRIu64 "%s): %s\n", \
                        __LINE__, FA.fail_at, FA.sticky ? " sticky" : "", #cond);  \
        }                                                                         \
    } while (0)
    int st = -1;
    as_tree *t = as_tree_create(6, &st);
    EXPECT(ok_or_nomem(st) && (t != NULL) == (st == AS_OK));
    if (t == NULL) return bad;
    nv_tree m;
    nv_init(&m, 6);
    int32_t buf[200];
    /* closed sequences, big enough to grow child maps and node chunks */
    for (int64_t id = 0; id < 12; id++) {
        size_t n = 20 + (size_t)id * 13;
        fill(buf, n, (uint32_t)id);
        buf[n / 2] = (int32_t)(1000 + id); /* a rare token: wide child maps */
        st = as_tree_add(t, id, buf, n);
        EXPECT(ok_or_nomem(st));
        if (st == AS_OK) nv_add(&m, id, buf, n);
    }
    EXPECT(tree_matches(t, &m));
    /* an open sequence appended in chunks; a NOMEM leaves whole tokens appended */
    for (int chunk = 0; chunk < 8; chunk++) {
        fill(buf, 9, (uint32_t)(50 + chunk));
        st = as_tree_append(t, 100, buf, 9);
        EXPECT(ok_or_nomem(st));
        uint64_t len = 0;
        nv_seq *s = nv_find(&m, 100);
        size_t before = s ? s->n : 0;
        if (as_tree_seq_len(t, 100, &len) == AS_OK) {
            EXPECT(len >= before && len <= before + 9);
            if (st == AS_OK) EXPECT(len == before + 9);
            nv_append(&m, 100, buf, (size_t)(len - before));
        } else {
            EXPECT(st == AS_ERR_NOMEM && s == NULL); /* creating it failed */
        }
        EXPECT(check_sound(t));
    }
    if (nv_find(&m, 100)) {
        EXPECT(as_tree_close(t, 100) == AS_OK);
        nv_close(&m, 100);
    }
    EXPECT(tree_matches(t, &m));
    /* removes (these free memory; they must not fail) */
    for (int64_t id = 0; id < 12; id += 3) {
        st = as_tree_remove(t, id);
        EXPECT(st == (nv_find(&m, id) ? AS_OK : AS_ERR_SEQ_NOT_FOUND));
        nv_remove(&m, id);
    }
    EXPECT(tree_matches(t, &m));
    /* snapshot: from_bytes and load into an empty tree are all-or-nothing */
    uint64_t bound = 0;
    EXPECT(as_tree_save_bound(t, &bound) == AS_OK);
    uint8_t *shard = malloc((size_t)bound);
    size_t slen = 0;
    EXPECT(shard != NULL && as_tree_save(t, shard, (size_t)bound, &slen) == AS_OK);
    as_tree *u = as_tree_from_bytes(shard, slen, &st);
    EXPECT(ok_or_nomem(st) && (u != NULL) == (st == AS_OK));
    if (u) EXPECT(tree_matches(u, &m));
    as_tree_free(u);
    u = as_tree_create(6, &st);
    if (u) {
        st = as_tree_load(u, shard, slen);
        EXPECT(ok_or_nomem(st));
        if (st == AS_OK) {
            EXPECT(tree_matches(u, &m));
        } else {
            as_tree_stats s;
            EXPECT(as_tree_stats_get(u, &s) == AS_OK && s.sequences == 0 && s.nodes == 1);
            EXPECT(check_sound(u));
        }
        as_tree_free(u);
    }
    /* a delta onto the tree: a NOMEM may leave whole sequences applied */
    const int64_t add_ids[] = {1, 2, 100};
    const int64_t rm_ids[] = {4, 5};
    uint8_t dbuf[4096];
    size_t dlen = 0;
    int have_delta = nv_find(&m, 1) && nv_find(&m, 2) && nv_find(&m, 100) &&
                     as_tree_save_delta(t, add_ids, 3, rm_ids, 2, dbuf, sizeof dbuf, &dlen) == AS_OK;
    as_tree *d = as_tree_create(6, &st);
    if (d && have_delta) {
        fill(buf, 30, 77);
        int added = as_tree_add(d, 5, buf, 30) == AS_OK;
        st = as_tree_load(d, dbuf, dlen);
        EXPECT(ok_or_nomem(st));
        EXPECT(check_sound(d));
        if (st == AS_OK) EXPECT(!as_tree_contains(d, 5));
        for (size_t i = 0; i < ARRAY_LEN(add_ids); i++) {
            uint64_t len = 0;
            if (as_tree_seq_len(d, add_ids[i], &len) == AS_OK)
                EXPECT(len == nv_find(&m, add_ids[i])->n); /* whole sequences only */
            else
                EXPECT(st == AS_ERR_NOMEM);
        }
        (void)added;
    }
    as_tree_free(d);
    free(shard);
    /* cursors, drafts and batches */
    as_cursor *c[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        c[i] = as_cursor_create(6, i ? AS_CURSOR_LOCAL_TREE : 0, &st);
        EXPECT(ok_or_nomem(st) && (c[i] != NULL) == (st == AS_OK));
    }
    as_draft_params p;
    as_draft_params_default(&p);
    p.max_spec_tokens = 8;
    for (int i = 0; i < 3; i++) {
        if (!c[i]) continue;
        fill(buf, 40, (uint32_t)i);
        uint64_t before = as_cursor_len(c[i]);
        st = as_cursor_extend(c[i], buf, 40);
        EXPECT(ok_or_nomem(st));
        EXPECT(as_cursor_len(c[i]) <= before + 40);
        if (st == AS_OK) EXPECT(as_cursor_len(c[i]) == before + 40);
        if (as_cursor_local_tree(c[i])) EXPECT(check_sound(as_cursor_local_tree(c[i])));
        int32_t tk[8], pa[8];
        float pr[8];
        for (uint32_t flags = 0; flags < 4; flags++) {
            p.flags = flags;
            as_draft_out o = {tk, pa, pr, 8, 0, 0, 0, 0.0, 0};
            st = as_draft(c[i], t, &p, &o);
            EXPECT(ok_or_nomem(st));
            EXPECT(o.n <= 8);
            st = as_draft_context(t, as_cursor_local_tree(c[i]), buf, 40, &p, &o);
            EXPECT(ok_or_nomem(st));
        }
    }
    if (c[0] && c[1] && c[2]) {
        int32_t toks[6] = {0, 1, 2, 3, 0, 1};
        uint64_t offs[4] = {0, 2, 4, 6};
        const as_tree *globs[3] = {t, t, NULL};
        int32_t T[24], P[24], S[3];
        float F[24];
        uint32_t N[3];
        p.flags = AS_DRAFT_TREE;
        st = as_draft_batch(c, globs, 3, toks, offs, &p, T, P, F, 8, N, NULL, NULL, NULL, S, 2);
        EXPECT(ok_or_nomem(st));
        for (int i = 0; i < 3; i++) EXPECT(ok_or_nomem(S[i]));
    }
    for (int i = 0; i < 3; i++) as_cursor_free(c[i]);
    EXPECT(tree_matches(t, &m));
    nv_free(&m);
    as_tree_free(t);
    return bad;
#undef EXPECT
}

/* The allocator can only change while no handle exists; half a hook is refused. */
static void test_set_allocator_rules(void) {
    as_tree *t = as_tree_create(4, NULL);
    REQUIRE(t != NULL);
    CHECK_STATUS(as_set_allocator(fa_malloc, fa_realloc, fa_free, &FA), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_set_allocator(NULL, NULL, NULL, NULL), AS_ERR_INVALID_ARG);
    as_tree_free(t);
    as_cursor *c = as_cursor_create(4, 0, NULL);
    REQUIRE(c != NULL);
    CHECK_STATUS(as_set_allocator(fa_malloc, fa_realloc, fa_free, &FA), AS_ERR_INVALID_ARG);
    as_cursor_free(c);
    CHECK_STATUS(as_set_allocator(fa_malloc, NULL, fa_free, &FA), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_set_allocator(NULL, fa_realloc, NULL, &FA), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_set_allocator(fa_malloc, fa_realloc, fa_free, &FA), AS_OK);
    memset(&FA, 0, sizeof FA);
    t = as_tree_create(4, NULL);
    REQUIRE(t != NULL);
    CHECK(FA.calls > 0); /* the hook is used */
    CHECK(FA.live > 0);
    as_tree_free(t);
    CHECK_EQ_INT(FA.live, 0);
    CHECK_STATUS(as_set_allocator(NULL, NULL, NULL, NULL), AS_OK); /* back to malloc */
}

/* Byte accounting follows the hook exactly and returns to the start. */
static void test_accounting_returns_to_start(void) {
    uint64_t start = as_allocated_bytes();
    as_tree *t = as_tree_create(8, NULL);
    as_cursor *c = as_cursor_create(8, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(t != NULL && c != NULL);
    int32_t buf[300];
    fill(buf, 300, 1);
    REQUIRE_OK(as_tree_add(t, 1, buf, 300));
    REQUIRE_OK(as_cursor_extend(c, buf, 300));
    CHECK(as_allocated_bytes() > start);
    as_tree_stats s, l;
    REQUIRE_OK(as_tree_stats_get(t, &s));
    REQUIRE_OK(as_tree_stats_get(as_cursor_local_tree(c), &l));
    CHECK(as_allocated_bytes() - start >= s.bytes + l.bytes);
    as_cursor_free(c);
    CHECK_EQ_U64(as_allocated_bytes() - start, s.bytes);
    as_tree_free(t);
    CHECK_EQ_U64(as_allocated_bytes(), start);
}

/* Fail each allocation of the workload in turn (once, then from there on). */
static void test_fail_every_allocation(void) {
    REQUIRE_OK(as_set_allocator(fa_malloc, fa_realloc, fa_free, &FA));
    uint64_t start = as_allocated_bytes();
    memset(&FA, 0, sizeof FA);
    CHECK_EQ_INT(workload(), 0); /* a clean run */
    uint64_t total = FA.calls;
    CHECK(total > 50);
    CHECK_EQ_INT(FA.live, 0);
    CHECK_EQ_U64(as_allocated_bytes(), start);
    int bad_runs = 0;
    uint64_t runs = 0, failures = 0;
    for (int sticky = 0; sticky < 2; sticky++) {
        for (uint64_t k = 1; k <= total + 1; k++) {
            memset(&FA, 0, sizeof FA);
            FA.fail_at = k;
            FA.sticky = sticky;
            int bad = workload();
            failures += FA.failed;
            runs++;
            if (bad || FA.live != 0 || as_allocated_bytes() != start) {
                if (bad_runs++ < 5)
                    fprintf(stderr, "  fail_at %" PRIu64 "%s: %d bad checks, %" PRId64
                                    " live blocks, %" PRIu64 " bytes accounted\n",
                            k, sticky ? " sticky" : "", bad, FA.live,
                            as_allocated_bytes() - start);
            }
        }
    }
    CHECK_EQ_INT(bad_runs, 0);
    CHECK(failures >= total); /* the injected failures did happen */
    memset(&FA, 0, sizeof FA);
    REQUIRE_OK(as_set_allocator(NULL, NULL, NULL, NULL));
    (void)runs;
}

int main(void) {
    TEST_RUN(test_set_allocator_rules);
    TEST_RUN(test_accounting_returns_to_start);
    TEST_RUN(test_fail_every_allocation);
    return TEST_REPORT("test_alloc");
}
