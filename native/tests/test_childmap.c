/*
 * test_childmap.c -- the internal open-addressing child map (src/childmap.h),
 * tested directly: edge keys, many keys against a plain array model,
 * tombstone reuse, growing and shrinking, byte accounting and a failed
 * allocation during growth.
 */
#include "agentspec.h"
#include "alloc.h"
#include "childmap.h"
#include "testhelp.h"

/* Live slots and tombstones counted by scanning the table. */
static void scan(const childmap *m, uint32_t *live, uint32_t *tombs) {
    *live = 0;
    *tombs = 0;
    for (uint32_t i = 0; i < m->cap; i++) {
        if (m->slots[i].key >= 0) (*live)++;
        else if (m->slots[i].key == CM_TOMB) (*tombs)++;
        else if (m->slots[i].key != CM_EMPTY) (*tombs) += 1000000; /* garbage key */
    }
}

/* The header agrees with the slots, the fill limit holds and cap is a power of two. */
static int well_formed(const childmap *m) {
    uint32_t live, tombs;
    scan(m, &live, &tombs);
    return live == m->size && tombs == m->tombs && m->cap >= CM_MIN_CAP &&
           (m->cap & (m->cap - 1)) == 0 && (uint64_t)(m->size + m->tombs) * 4 <= (uint64_t)m->cap * 3;
}

/* Keys 0, 1 and INT32_MAX insert, look up and erase like any other. */
static void test_edge_keys(void) {
    uint64_t acct = 0;
    childmap *m = cm_create(&acct, 0);
    REQUIRE(m != NULL);
    CHECK_EQ_U64(acct, cm_bytes(m->cap));
    CHECK_EQ_INT(cm_get(m, 0), CM_NONE);
    CHECK(cm_ref(m, INT32_MAX) == NULL);
    REQUIRE_OK(cm_insert(&acct, &m, 0, 10));
    REQUIRE_OK(cm_insert(&acct, &m, 1, 11));
    REQUIRE_OK(cm_insert(&acct, &m, INT32_MAX, 12));
    CHECK_EQ_U64(cm_get(m, 0), 10);
    CHECK_EQ_U64(cm_get(m, 1), 11);
    CHECK_EQ_U64(cm_get(m, INT32_MAX), 12);
    CHECK_EQ_U64(cm_get(m, 2), CM_NONE);
    CHECK_EQ_U64(cm_get(m, INT32_MAX - 1), CM_NONE);
    CHECK_EQ_U64(m->size, 3);
    uint32_t *v = cm_ref(m, 1);
    REQUIRE(v != NULL);
    *v = 99;
    CHECK_EQ_U64(cm_get(m, 1), 99);
    CHECK_EQ_INT(cm_erase(&acct, &m, 0), 1);
    CHECK_EQ_INT(cm_erase(&acct, &m, 0), 0);
    CHECK_EQ_U64(cm_get(m, 0), CM_NONE);
    CHECK_EQ_U64(cm_get(m, INT32_MAX), 12);
    CHECK_EQ_INT(cm_erase(&acct, &m, INT32_MAX), 1);
    CHECK_EQ_INT(cm_erase(&acct, &m, 1), 1);
    CHECK_EQ_U64(m->size, 0);
    CHECK(well_formed(m));
    CHECK_EQ_U64(acct, cm_bytes(m->cap));
    cm_free(&acct, m);
    CHECK_EQ_U64(acct, 0);
    cm_free(&acct, NULL);
}

/* cm_create sizes the table for the requested entries without growing. */
static void test_create_sized(void) {
    const uint32_t sizes[] = {0, 1, 3, 4, 7, 100, 1000};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        uint64_t acct = 0;
        childmap *m = cm_create(&acct, sizes[i]);
        REQUIRE(m != NULL);
        uint32_t cap0 = m->cap;
        CHECK((uint64_t)sizes[i] * 4 <= (uint64_t)cap0 * 3);
        for (uint32_t k = 0; k < sizes[i]; k++) REQUIRE_OK(cm_insert(&acct, &m, (int32_t)(k * 7919), k));
        CHECK_EQ_U64(m->cap, cap0);
        CHECK(well_formed(m));
        cm_free(&acct, m);
        CHECK_EQ_U64(acct, 0);
    }
}

/* Many keys, inserted and erased at random, always agree with an array model. */
static void test_many_keys_model(void) {
    enum { UNIVERSE = 3000 };
    static int32_t keys[UNIVERSE];
    static uint32_t model[UNIVERSE]; /* CM_NONE = absent */
    th_rng r;
    th_rng_seed(&r, 7);
    for (int i = 0; i < UNIVERSE; i++) {
        /* spread over the whole key range, including both ends */
        keys[i] = i == 0 ? 0 : i == 1 ? INT32_MAX : (int32_t)(th_rng_next(&r) & 0x7fffffff);
        model[i] = CM_NONE;
        for (int j = 0; j < i; j++)
            if (keys[j] == keys[i]) keys[i] = i; /* keep keys distinct */
    }
    uint64_t acct = 0;
    childmap *m = cm_create(&acct, 0);
    REQUIRE(m != NULL);
    uint32_t size = 0, max_cap = 0;
    for (int step = 0; step < 60000; step++) {
        int i = (int)th_rng_below(&r, UNIVERSE);
        /* phases: grow, churn, shrink */
        uint32_t bias = step < 20000 ? 80 : step < 40000 ? 50 : 15;
        if (th_rng_below(&r, 100) < bias) {
            if (model[i] == CM_NONE) {
                uint32_t val = th_rng_below(&r, 1u << 30);
                REQUIRE_OK(cm_insert(&acct, &m, keys[i], val));
                model[i] = val;
                size++;
            }
        } else {
            int erased = cm_erase(&acct, &m, keys[i]);
            CHECK_EQ_INT(erased, model[i] != CM_NONE);
            if (model[i] != CM_NONE) size--;
            model[i] = CM_NONE;
        }
        if (m->cap > max_cap) max_cap = m->cap;
        if (step % 1000 == 0) {
            CHECK(well_formed(m));
            CHECK_EQ_U64(m->size, size);
            for (int k = 0; k < UNIVERSE; k++) CHECK_EQ_U64(cm_get(m, keys[k]), model[k]);
        }
    }
    CHECK(max_cap >= 2048); /* it grew */
    for (int k = 0; k < UNIVERSE; k++) {
        if (model[k] != CM_NONE) CHECK_EQ_INT(cm_erase(&acct, &m, keys[k]), 1);
    }
    CHECK_EQ_U64(m->size, 0);
    CHECK_EQ_U64(m->cap, CM_MIN_CAP); /* it shrank all the way back */
    CHECK(well_formed(m));
    CHECK_EQ_U64(acct, cm_bytes(m->cap));
    cm_free(&acct, m);
    CHECK_EQ_U64(acct, 0);
}

/* Insert/erase cycles over a small key set reuse tombstones: the table stays small. */
static void test_tombstone_reuse(void) {
    uint64_t acct = 0;
    childmap *m = cm_create(&acct, 2);
    REQUIRE(m != NULL);
    REQUIRE_OK(cm_insert(&acct, &m, 5, 5));
    REQUIRE_OK(cm_insert(&acct, &m, 6, 6));
    for (int32_t k = 100; k < 5100; k++) {
        REQUIRE_OK(cm_insert(&acct, &m, k, (uint32_t)k));
        CHECK_EQ_U64(cm_get(m, k), (uint32_t)k);
        CHECK_EQ_INT(cm_erase(&acct, &m, k), 1);
        CHECK(m->cap <= 8);
        CHECK(well_formed(m));
    }
    CHECK_EQ_U64(cm_get(m, 5), 5);
    CHECK_EQ_U64(cm_get(m, 6), 6);
    CHECK_EQ_U64(m->size, 2);
    /* a lookup of an absent key terminates even after heavy churn */
    CHECK_EQ_U64(cm_get(m, 77), CM_NONE);
    cm_free(&acct, m);
    CHECK_EQ_U64(acct, 0);
}

/* Growth and shrinking keep the tree's `best` and `sum` fields. */
static void test_rehash_keeps_fields(void) {
    uint64_t acct = 0;
    childmap *m = cm_create(&acct, 0);
    REQUIRE(m != NULL);
    m->best = 1234;
    m->sum = 0x123456789ull;
    for (int32_t k = 0; k < 500; k++) REQUIRE_OK(cm_insert(&acct, &m, k * 3, (uint32_t)k));
    CHECK_EQ_U64(m->best, 1234);
    CHECK_EQ_U64(m->sum, 0x123456789ull);
    for (int32_t k = 0; k < 499; k++) CHECK_EQ_INT(cm_erase(&acct, &m, k * 3), 1);
    CHECK(m->cap < 64);
    CHECK_EQ_U64(m->best, 1234);
    CHECK_EQ_U64(m->sum, 0x123456789ull);
    CHECK_EQ_U64(cm_get(m, 499 * 3), 499);
    cm_free(&acct, m);
}

/* Accounting: the per-map counter matches the library-wide byte counter. */
static void test_accounting(void) {
    uint64_t base = as_allocated_bytes(), acct = 0;
    childmap *m = cm_create(&acct, 0);
    REQUIRE(m != NULL);
    for (int32_t k = 0; k < 300; k++) {
        REQUIRE_OK(cm_insert(&acct, &m, k, 0));
        CHECK_EQ_U64(acct, cm_bytes(m->cap));
        CHECK_EQ_U64(as_allocated_bytes() - base, acct);
    }
    for (int32_t k = 0; k < 300; k++) {
        cm_erase(&acct, &m, k);
        CHECK_EQ_U64(acct, cm_bytes(m->cap));
        CHECK_EQ_U64(as_allocated_bytes() - base, acct);
    }
    cm_free(&acct, m);
    CHECK_EQ_U64(as_allocated_bytes(), base);
}

/* An allocator that can be told to fail. */
static int fail_now = 0;
static void *fail_malloc(size_t n, void *ctx) { (void)ctx; return fail_now ? NULL : malloc(n); }
static void *fail_realloc(void *p, size_t n, void *ctx) { (void)ctx; return fail_now ? NULL : realloc(p, n); }
static void fail_free(void *p, void *ctx) { (void)ctx; free(p); }

/* A failed allocation during growth returns NOMEM and leaves the map intact;
 * a failed shrink is harmless. */
static void test_nomem(void) {
    REQUIRE_OK(as_set_allocator(fail_malloc, fail_realloc, fail_free, NULL));
    uint64_t acct = 0;
    childmap *m = cm_create(&acct, 0);
    REQUIRE(m != NULL);
    int32_t k = 0;
    uint32_t cap = m->cap;
    while (m->cap == cap) {
        REQUIRE_OK(cm_insert(&acct, &m, k, (uint32_t)k));
        k++;
    }
    /* fill to the edge of the next growth */
    cap = m->cap;
    int32_t more = k;
    while ((uint64_t)(m->size + m->tombs + 1) * 4 <= (uint64_t)m->cap * 3) {
        REQUIRE_OK(cm_insert(&acct, &m, more, (uint32_t)more));
        more++;
    }
    CHECK_EQ_U64(m->cap, cap);
    childmap *before = m;
    uint64_t acct_before = acct;
    fail_now = 1;
    CHECK_STATUS(cm_insert(&acct, &m, 1000000, 1), AS_ERR_NOMEM);
    CHECK(m == before);
    CHECK_EQ_U64(acct, acct_before);
    CHECK_EQ_U64(cm_get(m, 1000000), CM_NONE);
    for (int32_t j = 0; j < more; j++) CHECK_EQ_U64(cm_get(m, j), (uint32_t)j);
    /* erase almost everything while allocations fail: shrinking is skipped */
    for (int32_t j = 0; j < more - 1; j++) CHECK_EQ_INT(cm_erase(&acct, &m, j), 1);
    CHECK(well_formed(m));
    CHECK_EQ_U64(cm_get(m, more - 1), (uint32_t)(more - 1));
    fail_now = 0;
    CHECK_EQ_U64(acct, cm_bytes(m->cap));
    cm_free(&acct, m);
    CHECK_EQ_U64(acct, 0);
    REQUIRE_OK(as_set_allocator(NULL, NULL, NULL, NULL));
}

int main(void) {
    TEST_RUN(test_edge_keys);
    TEST_RUN(test_create_sized);
    TEST_RUN(test_many_keys_model);
    TEST_RUN(test_tombstone_reuse);
    TEST_RUN(test_rehash_keeps_fields);
    TEST_RUN(test_accounting);
    TEST_RUN(test_nomem);
    return TEST_REPORT("test_childmap");
}
