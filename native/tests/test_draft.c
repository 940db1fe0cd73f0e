/*
 * test_draft.c -- drafting: hand-computed examples (probabilities, budgets,
 * depth bound, self-occurrence, merge, min_score), parameter validation, and
 * random cross-checks of as_draft_context and cursor drafting against the
 * brute-force model in naive.h.
 */
#include "agentspec.h"
#include "naive.h"
#include "testhelp.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Output buffers for one draft. */
typedef struct outbuf {
    int32_t tokens[AS_MAX_SPEC_LIMIT];
    int32_t parents[AS_MAX_SPEC_LIMIT];
    float probs[AS_MAX_SPEC_LIMIT];
    as_draft_out out;
} outbuf;

static as_draft_out *outbuf_init(outbuf *b, uint32_t cap) {
    memset(b, 0, sizeof *b);
    b->out.tokens = b->tokens;
    b->out.parents = b->parents;
    b->out.probs = b->probs;
    b->out.cap = cap;
    b->out.n = 12345;
    b->out.match_len = 12345;
    b->out.source = 12345;
    b->out.score = -1.0;
    return &b->out;
}

static as_draft_params params_default(void) {
    as_draft_params p;
    memset(&p, 0xCD, sizeof p);
    as_draft_params_default(&p);
    return p;
}

/* Structural sanity of any draft: sizes, parents, probabilities, score. */
static int draft_sane(const as_draft_out *o, const as_draft_params *p, size_t ctx_len) {
    if (o->n > p->max_spec_tokens || o->n > o->cap) return 0;
    if (o->n == 0) return o->score == 0.0 && o->source == 0 && o->match_len == 0;
    if (o->source < 1 || o->source > 3 || o->match_len < 1 || o->match_len > ctx_len) return 0;
    double sum = 0.0;
    for (uint32_t i = 0; i < o->n; i++) {
        if (o->tokens[i] < 0) return 0;
        if (o->parents[i] < -1 || o->parents[i] >= (int32_t)i) return 0;
        if (!(o->probs[i] > 0.0f) || o->probs[i] > 1.0f) return 0;
        if (o->probs[i] < (float)p->min_token_prob) return 0;
        if (o->parents[i] >= 0 && o->probs[i] > o->probs[o->parents[i]]) return 0;
        if (!(p->flags & AS_DRAFT_TREE) && o->parents[i] != (int32_t)i - 1) return 0;
        sum += o->probs[i];
    }
    return fabs(sum - o->score) <= 1e-5 * (1.0 + o->n);
}

static as_tree *tree_with(uint32_t depth, const int32_t *const *seqs, const size_t *lens, size_t n) {
    as_tree *t = as_tree_create(depth, NULL);
    if (t == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (as_tree_add(t, (int64_t)i, seqs[i], lens[i]) != AS_OK) {
            as_tree_free(t);
            return NULL;
        }
    }
    return t;
}

/* The brief's global example: [1,2,3,4] once and [1,2,3,5] twice. */
static as_tree *example_tree(void) {
    static const int32_t a[] = {1, 2, 3, 4}, b[] = {1, 2, 3, 5};
    const int32_t *seqs[] = {a, b, b};
    const size_t lens[] = {4, 4, 4};
    return tree_with(64, seqs, lens, 3);
}

/* Default parameters are the documented ones. */
static void test_params_default(void) {
    as_draft_params p = params_default();
    CHECK_EQ_INT(p.max_spec_tokens, 32);
    CHECK_EQ_INT(p.max_pattern, 0);
    CHECK_EQ_INT(p.min_pattern, 0);
    CHECK_EQ_INT(p.flags, 0);
    CHECK_EQ_DBL(p.alpha, 1.0);
    CHECK_EQ_DBL(p.offset, 0.0);
    CHECK_EQ_DBL(p.min_token_prob, 0.1);
    CHECK_EQ_DBL(p.min_score, 0.0);
    CHECK_EQ_INT(p.vocab_size, 0);
}

/* vocab_size: a token >= vocab_size ends its branch (chain: stop before it;
 * tree: skip it and its subtree), D of the others is unchanged. */
static void test_vocab_bound(void) {
    /* [1,2,3,50,6] twice, [1,2,3,4,7] once: after 1,2 the chain is 3, 50, 6 */
    static const int32_t a[] = {1, 2, 3, 50, 6}, b[] = {1, 2, 3, 4, 7};
    const int32_t *seqs[] = {a, a, b};
    const size_t lens[] = {5, 5, 5};
    as_tree *g = tree_with(64, seqs, lens, 3);
    REQUIRE(g != NULL);
    const int32_t ctx[] = {9, 1, 2};
    as_draft_params p = params_default();
    p.alpha = 4.0;
    outbuf bf;
    as_draft_out *o = outbuf_init(&bf, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    REQUIRE(o->n == 3);
    CHECK_EQ_INT(o->tokens[1], 50);
    uint32_t vocabs[] = {51, 1000, 0};
    for (size_t i = 0; i < ARRAY_LEN(vocabs); i++) { /* a bound above every token: no change */
        p.vocab_size = vocabs[i];
        REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
        CHECK_EQ_INT(o->n, 3);
    }
    p.vocab_size = 50; /* 50 is out: the chain stops before it (4 is not taken instead) */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    REQUIRE(o->n == 1);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_DBL(o->score, 1.0);
    CHECK(draft_sane(o, &p, 3));
    p.vocab_size = 3; /* the first token is out: no draft */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 0);
    /* tree drafts: 50 and its child 6 are skipped, 4 (1/3) and 7 stay */
    p.flags = AS_DRAFT_TREE;
    p.min_token_prob = 0.0;
    p.vocab_size = 0;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 5);
    p.vocab_size = 50;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    REQUIRE(o->n == 3);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_INT(o->tokens[1], 4);
    CHECK_EQ_INT(o->tokens[2], 7);
    CHECK_EQ_INT(o->parents[1], 0);
    CHECK_EQ_INT(o->parents[2], 1);
    CHECK_EQ_DBL(o->probs[1], (float)(1.0 / 3.0));
    CHECK(draft_sane(o, &p, 3));
    /* merged mode (a per-request tree from a cursor) honours it too */
    int st = -1;
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, &st);
    REQUIRE(c != NULL);
    REQUIRE_OK(as_cursor_extend(c, ctx, 3));
    for (uint32_t flags = 0; flags < 4; flags++) {
        p.flags = flags;
        p.vocab_size = 50;
        REQUIRE_OK(as_draft(c, g, &p, o));
        CHECK(o->n >= 1);
        for (uint32_t k = 0; k < o->n; k++) CHECK(o->tokens[k] < 50);
        CHECK(draft_sane(o, &p, 3));
    }
    as_cursor_free(c);
    as_tree_free(g);
}

/* Context ending in 1,2: linear draft [3,5] with probs 1.0 and 2/3, match 2. */
static void test_linear_example(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    const int32_t ctx[] = {9, 1, 2};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_INT(o->tokens[1], 5);
    CHECK_EQ_INT(o->parents[0], -1);
    CHECK_EQ_INT(o->parents[1], 0);
    CHECK_EQ_DBL(o->probs[0], 1.0f);
    CHECK_EQ_DBL(o->probs[1], (float)(1.0 * (2.0 / 3.0)));
    CHECK_EQ_DBL(o->score, 1.0 + 1.0 * (2.0 / 3.0));
    CHECK_EQ_INT(o->match_len, 2);
    CHECK_EQ_INT(o->source, 1);
    /* with alpha 2 the chain stops at the end of the stored sequences */
    p.alpha = 2.0;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 2);
    /* with min_token_prob above 2/3 only the certain token remains */
    p.min_token_prob = 0.7;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 1);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_INT(o->match_len, 2);
    as_tree_free(g);
}

/* Tree draft: 4 joins with 1/3 when the budget and min_token_prob allow. */
static void test_tree_example(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    const int32_t ctx[] = {9, 1, 2};
    as_draft_params p = params_default();
    p.flags = AS_DRAFT_TREE;
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    /* budget B(2) = 2: same as the linear draft */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 2);
    /* budget B(2) = 4: 3 (1.0), 5 (2/3), 4 (1/3), both children of 3 */
    p.alpha = 2.0;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    REQUIRE(o->n == 3);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_INT(o->tokens[1], 5);
    CHECK_EQ_INT(o->tokens[2], 4);
    CHECK_EQ_INT(o->parents[0], -1);
    CHECK_EQ_INT(o->parents[1], 0);
    CHECK_EQ_INT(o->parents[2], 0);
    CHECK_EQ_DBL(o->probs[2], (float)(1.0 * (1.0 / 3.0)));
    CHECK_EQ_DBL(o->score, (1.0 + 1.0 * (2.0 / 3.0)) + 1.0 * (1.0 / 3.0));
    /* p=1 ([2], budget 2) scores only 1 + 2/3 */
    CHECK_EQ_INT(o->match_len, 2);
    /* min_token_prob above 1/3 drops 4 */
    p.min_token_prob = 0.4;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 2);
    as_tree_free(g);
}

/* The per-request tree never matches the context's own occurrence. */
static void test_self_occurrence(void) {
    int st = -1;
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, &st);
    REQUIRE(c != NULL);
    CHECK_EQ_INT(st, AS_OK);
    const int32_t ctx1[] = {1, 2, 3};
    REQUIRE_OK(as_cursor_extend(c, ctx1, 3));
    CHECK_EQ_U64(as_cursor_len(c), 3);
    REQUIRE(as_cursor_local_tree(c) != NULL);
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    REQUIRE_OK(as_draft(c, NULL, &p, o));
    CHECK_EQ_INT(o->n, 0);
    CHECK_EQ_INT(o->source, 0);
    CHECK_EQ_INT(o->match_len, 0);
    CHECK_EQ_DBL(o->score, 0.0);
    /* [1,2,3,1,2]: pattern [1,2] has one continuation (3), prob 1.0, not 0.5 */
    const int32_t ctx2[] = {1, 2};
    REQUIRE_OK(as_cursor_extend(c, ctx2, 2));
    REQUIRE_OK(as_draft(c, NULL, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->tokens[0], 3);
    CHECK_EQ_INT(o->tokens[1], 1);
    CHECK_EQ_DBL(o->probs[0], 1.0f);
    CHECK_EQ_DBL(o->probs[1], 1.0f);
    CHECK_EQ_DBL(o->score, 2.0);
    CHECK_EQ_INT(o->match_len, 2);
    CHECK_EQ_INT(o->source, 2);
    /* the same through as_draft_context with the cursor's tree */
    outbuf b2;
    as_draft_out *o2 = outbuf_init(&b2, 32);
    const int32_t full[] = {1, 2, 3, 1, 2};
    REQUIRE_OK(as_draft_context(NULL, as_cursor_local_tree(c), full, 5, &p, o2));
    CHECK_EQ_INT(o2->n, 2);
    CHECK_EQ_DBL(o2->score, 2.0);
    CHECK_EQ_INT(o2->source, 2);
    /* with the per-request tree ignored there is nothing */
    p.flags = AS_DRAFT_NO_LOCAL;
    REQUIRE_OK(as_draft(c, NULL, &p, o));
    CHECK_EQ_INT(o->n, 0);
    as_cursor_free(c);
}

/* A context of length 1 drafts from a pattern of length 1. */
static void test_context_len_one(void) {
    static const int32_t s[] = {5, 6, 7};
    const int32_t *seqs[] = {s};
    const size_t lens[] = {3};
    as_tree *g = tree_with(64, seqs, lens, 1);
    REQUIRE(g != NULL);
    const int32_t ctx[] = {5};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 1, &p, o));
    REQUIRE(o->n == 1);
    CHECK_EQ_INT(o->tokens[0], 6);
    CHECK_EQ_INT(o->match_len, 1);
    /* through a cursor too */
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    REQUIRE_OK(as_cursor_extend(c, ctx, 1));
    REQUIRE_OK(as_draft(c, g, &p, o));
    CHECK_EQ_INT(o->n, 1);
    CHECK_EQ_INT(o->source, 1);
    /* an empty context drafts nothing */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 0, &p, o));
    CHECK_EQ_INT(o->n, 0);
    as_cursor_free(c);
    as_tree_free(g);
}

/* Budget B(p) = min(max_spec_tokens, floor(alpha*p + offset + 1e-6)). */
static void test_budget(void) {
    int32_t s[20];
    for (int i = 0; i < 20; i++) s[i] = i + 1;
    const int32_t *seqs[] = {s};
    const size_t lens[] = {20};
    as_tree *g = tree_with(64, seqs, lens, 1);
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2, 3};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    struct { double alpha, offset; uint32_t max_spec, want_n, want_match; } cases[] = {
        {1.0, 0.0, 32, 3, 3},  /* B(3) = 3 */
        {0.5, 1.0, 32, 2, 3},  /* B(3) = 2 = B(2): the longer match wins */
        {2.0, 0.5, 4, 4, 3},   /* capped by max_spec_tokens */
        {1.0, -2.0, 32, 1, 3}, /* B(3) = 1, B(2) = B(1) = 0 */
        {1.0, -3.0, 32, 0, 0}, /* every budget <= 0 */
        {0.0, 2.0, 32, 2, 3},  /* offset only */
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        p.alpha = cases[i].alpha;
        p.offset = cases[i].offset;
        p.max_spec_tokens = cases[i].max_spec;
        REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
        CHECK_EQ_INT(o->n, cases[i].want_n);
        CHECK_EQ_INT(o->match_len, cases[i].want_match);
        for (uint32_t k = 0; k < o->n; k++) CHECK_EQ_INT(o->tokens[k], 4 + (int32_t)k);
    }
    as_tree_free(g);
}

/* The 1e-6 in the budget: alpha*p just below an integer still counts as it. */
static void test_budget_epsilon(void) {
    int32_t s[200];
    for (int i = 0; i < 200; i++) s[i] = i;
    const int32_t *seqs[] = {s};
    const size_t lens[] = {200};
    as_tree *g = tree_with(256, seqs, lens, 1);
    REQUIRE(g != NULL);
    as_draft_params p = params_default();
    p.alpha = 0.29; /* 0.29 * 100 = 28.999999999999996 in double */
    p.max_spec_tokens = 64;
    REQUIRE(0.29 * 100.0 < 29.0);
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 64);
    REQUIRE_OK(as_draft_context(g, NULL, s, 100, &p, o));
    CHECK_EQ_INT(o->n, 29);
    CHECK_EQ_INT(o->match_len, 100);
    CHECK_EQ_INT(o->tokens[28], 128);
    as_tree_free(g);
}

/* Drafts never go deeper than max_depth: len(pattern) + path <= D. */
static void test_depth_bound(void) {
    int32_t s[10];
    for (int i = 0; i < 10; i++) s[i] = i + 1;
    const int32_t *seqs[] = {s};
    const size_t lens[] = {10};
    as_tree *g = tree_with(4, seqs, lens, 1);
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2, 3};
    as_draft_params p = params_default();
    p.alpha = 10.0;
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    /* p=3: [4] only (depth 4 reached); p=2: [4,5]; p=1: [4,5,6]: 3 wins */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 3);
    CHECK_EQ_INT(o->match_len, 1);
    p.alpha = 1.0; /* B(1)=1, B(2)=2, B(3)=3 but depth caps p=3 at one token */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 3, &p, o));
    CHECK_EQ_INT(o->n, 2);
    CHECK_EQ_INT(o->match_len, 2);
    CHECK_EQ_INT(o->tokens[1], 5);
    /* a 4-token context can only use patterns up to D-1 = 3 */
    const int32_t ctx4[] = {1, 2, 3, 4};
    REQUIRE_OK(as_draft_context(g, NULL, ctx4, 4, &p, o));
    CHECK(o->match_len <= 3);
    CHECK_EQ_INT(o->n, 2); /* p=3 [2,3,4] -> [5]; p=2 [3,4] -> [5,6] */
    CHECK_EQ_INT(o->match_len, 2);
    as_tree_free(g);
}

/* max_pattern and min_pattern restrict the candidate lengths. */
static void test_pattern_bounds(void) {
    int32_t s[20];
    for (int i = 0; i < 20; i++) s[i] = i + 1;
    const int32_t *seqs[] = {s};
    const size_t lens[] = {20};
    as_tree *g = tree_with(64, seqs, lens, 1);
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2, 3, 4, 5};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    p.max_pattern = 2;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 5, &p, o));
    CHECK_EQ_INT(o->match_len, 2);
    CHECK_EQ_INT(o->n, 2);
    p.max_pattern = 1;
    p.min_pattern = 2; /* an empty range is a caller error */
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 5, &p, o), AS_ERR_INVALID_ARG);
    p.max_pattern = 0;
    p.min_pattern = 6; /* longer than the context */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 5, &p, o));
    CHECK_EQ_INT(o->n, 0);
    p.min_pattern = 4;
    p.alpha = 0.0;
    p.offset = 3.0; /* every budget 3: p=4 and p=5 tie, the longer wins */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 5, &p, o));
    CHECK_EQ_INT(o->match_len, 5);
    as_tree_free(g);
}

/* min_score empties a draft whose score is below it. */
static void test_min_score(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    p.min_score = 1.6; /* score is 1 + 2/3 */
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &p, o));
    CHECK_EQ_INT(o->n, 2);
    p.min_score = 1.7;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &p, o));
    CHECK_EQ_INT(o->n, 0);
    CHECK_EQ_DBL(o->score, 0.0);
    CHECK_EQ_INT(o->source, 0);
    CHECK_EQ_INT(o->match_len, 0);
    as_tree_free(g);
}

/* Global vs per-request: higher score wins, ties go to the per-request tree;
 * merge mode adds the counts of both. */
static void test_local_global_merge(void) {
    static const int32_t s[] = {7, 8, 9};
    const int32_t *seqs[] = {s};
    const size_t lens[] = {3};
    as_tree *g = tree_with(64, seqs, lens, 1);
    REQUIRE(g != NULL);
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    const int32_t ctx[] = {7, 8, 6, 7, 8};
    REQUIRE_OK(as_cursor_extend(c, ctx, 5));
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    /* global: [9] (score 1); local: [6,7] (score 2) */
    REQUIRE_OK(as_draft(c, g, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->source, 2);
    CHECK_EQ_INT(o->tokens[0], 6);
    CHECK_EQ_INT(o->tokens[1], 7);
    /* global only */
    p.flags = AS_DRAFT_NO_LOCAL;
    REQUIRE_OK(as_draft(c, g, &p, o));
    REQUIRE(o->n == 1);
    CHECK_EQ_INT(o->source, 1);
    CHECK_EQ_INT(o->tokens[0], 9);
    p.flags = AS_DRAFT_NO_LOCAL | AS_DRAFT_NO_GLOBAL;
    REQUIRE_OK(as_draft(c, g, &p, o));
    CHECK_EQ_INT(o->n, 0);
    /* merged: [7,8] -> 6 and 9 once each; 6 (smaller token) with 0.5, then 7 */
    p.flags = AS_DRAFT_MERGE;
    REQUIRE_OK(as_draft(c, g, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->source, 3);
    CHECK_EQ_INT(o->tokens[0], 6);
    CHECK_EQ_INT(o->tokens[1], 7);
    CHECK_EQ_DBL(o->probs[0], 0.5f);
    CHECK_EQ_DBL(o->probs[1], 0.5f);
    CHECK_EQ_DBL(o->score, 1.0);
    CHECK_EQ_INT(o->match_len, 2);
    /* merged tree draft: both children of [7,8] */
    p.flags = AS_DRAFT_MERGE | AS_DRAFT_TREE;
    REQUIRE_OK(as_draft(c, g, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->tokens[0], 6);
    CHECK_EQ_INT(o->tokens[1], 9);
    CHECK_EQ_INT(o->parents[1], -1);
    as_cursor_free(c);
    as_tree_free(g);
}

/* Equal scores: the per-request draft wins over the global one. */
static void test_tie_prefers_local(void) {
    static const int32_t s[] = {1, 2, 3};
    const int32_t *seqs[] = {s};
    const size_t lens[] = {3};
    as_tree *g = tree_with(64, seqs, lens, 1);
    REQUIRE(g != NULL);
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    const int32_t ctx[] = {1, 4, 1};
    REQUIRE_OK(as_cursor_extend(c, ctx, 3));
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    /* global: [1] -> 2 (score 1); local: [1] -> 4 (score 1) */
    REQUIRE_OK(as_draft(c, g, &p, o));
    REQUIRE(o->n == 1);
    CHECK_EQ_INT(o->source, 2);
    CHECK_EQ_INT(o->tokens[0], 4);
    as_cursor_free(c);
    as_tree_free(g);
}

/* Several global trees: the best score wins, ties go to the earlier tree,
 * global_index names the winner, and each tree keeps its own match state. */
static void test_multi_global(void) {
    static const int32_t a[] = {1, 2, 3, 9};        /* "stage shard" */
    static const int32_t b[] = {1, 2, 3, 7, 8, 1, 2, 3, 7, 8}; /* "pipeline tree" */
    const int32_t *sa[] = {a};
    const size_t la[] = {4};
    const int32_t *sb[] = {b};
    const size_t lb[] = {10};
    as_tree *stage = tree_with(64, sa, la, 1);
    as_tree *pipe = tree_with(64, sb, lb, 1);
    REQUIRE(stage != NULL && pipe != NULL);
    as_cursor *c = as_cursor_create(64, 0, NULL);
    REQUIRE(c != NULL);
    const int32_t ctx[] = {5, 1, 2};
    REQUIRE_OK(as_cursor_extend(c, ctx, 3));
    as_draft_params p = params_default();
    p.alpha = 4.0;
    outbuf bf;
    as_draft_out *o = outbuf_init(&bf, 32);
    const as_tree *both[] = {stage, pipe};
    /* stage: [1,2] -> 3 9 (score 2); pipeline: [1,2] -> 3 7 8 1 2 ... (more) */
    REQUIRE_OK(as_draft_multi(c, both, 2, &p, o));
    CHECK_EQ_INT(o->source, 1);
    CHECK_EQ_INT(o->global_index, 1);
    CHECK(o->n > 2);
    CHECK_EQ_INT(o->tokens[1], 7);
    /* budget 2: both score 2.0 -> the earlier tree (the stage shard) wins */
    p.alpha = 1.0;
    REQUIRE_OK(as_draft_multi(c, both, 2, &p, o));
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->global_index, 0);
    CHECK_EQ_INT(o->tokens[1], 9);
    /* the other order: the pipeline tree is now first and wins the tie */
    const as_tree *rev[] = {pipe, stage};
    REQUIRE_OK(as_draft_multi(c, rev, 2, &p, o));
    CHECK_EQ_INT(o->global_index, 0);
    CHECK_EQ_INT(o->tokens[1], 7);
    /* incremental state per tree survives alternating calls */
    const int32_t more[] = {3};
    REQUIRE_OK(as_cursor_extend(c, more, 1));
    REQUIRE_OK(as_draft_multi(c, both, 2, &p, o));
    CHECK_EQ_INT(o->match_len, 3);
    /* NULL entries are skipped; too many trees is a capacity error */
    const as_tree *holes[] = {NULL, stage};
    REQUIRE_OK(as_draft_multi(c, holes, 2, &p, o));
    CHECK_EQ_INT(o->global_index, 1);
    CHECK_EQ_INT(o->tokens[0], 9);
    const as_tree *five[] = {stage, pipe, stage, pipe, stage};
    CHECK_STATUS(as_draft_multi(c, five, 5, &p, o), AS_ERR_CAPACITY);
    /* merged: counts of all trees add up */
    p.flags = AS_DRAFT_MERGE;
    REQUIRE_OK(as_draft_multi(c, both, 2, &p, o));
    CHECK_EQ_INT(o->source, 3);
    as_cursor_free(c);
    as_tree_free(stage);
    as_tree_free(pipe);
}

/* A cursor without a per-request tree drafts from the global tree only. */
static void test_cursor_without_local(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    as_cursor *c = as_cursor_create(64, 0, NULL);
    REQUIRE(c != NULL);
    CHECK(as_cursor_local_tree(c) == NULL);
    const int32_t ctx[] = {1, 2, 1, 2};
    REQUIRE_OK(as_cursor_extend(c, ctx, 4));
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    REQUIRE_OK(as_draft(c, g, &p, o));
    CHECK_EQ_INT(o->n, 2);
    CHECK_EQ_INT(o->source, 1);
    REQUIRE_OK(as_draft(c, NULL, &p, o));
    CHECK_EQ_INT(o->n, 0);
    as_cursor_free(c);
    as_tree_free(g);
}

/* A cursor's max_depth bounds the pattern length even when the global tree is
 * deeper; the global tree's depth still bounds how far its drafts go. */
static void test_cursor_depth_bounds_pattern(void) {
    static const int32_t s1[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, s2[] = {4, 5, 6, 99};
    const int32_t *seqs[] = {s1, s2};
    const size_t lens[] = {10, 4};
    as_tree *g = tree_with(8, seqs, lens, 2);
    REQUIRE(g != NULL);
    as_cursor *c = as_cursor_create(3, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    REQUIRE_OK(as_cursor_extend(c, s1, 6));
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    /* p <= 2: [5,6] -> 7 (1/2, ties go to the smaller token) -> 8 (1/2) */
    REQUIRE_OK(as_draft(c, g, &p, o));
    CHECK_EQ_INT(o->match_len, 2);
    REQUIRE(o->n == 2);
    CHECK_EQ_INT(o->tokens[0], 7);
    CHECK_EQ_INT(o->tokens[1], 8);
    CHECK_EQ_DBL(o->score, 1.0);
    /* without a cursor the global tree's depth allows p = 4: [7,8,9,10] */
    REQUIRE_OK(as_draft_context(g, NULL, s1, 6, &p, o));
    CHECK_EQ_INT(o->match_len, 4);
    CHECK_EQ_INT(o->n, 4);
    CHECK_EQ_DBL(o->score, 4.0);
    as_cursor_free(c);
    as_tree_free(g);
}

/* Bad parameters and arguments are errors, never crashes. */
static void test_bad_params(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2};
    as_draft_params p = params_default();
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    p.max_spec_tokens = 0;
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    p.max_spec_tokens = AS_MAX_SPEC_LIMIT + 1;
    o->cap = AS_MAX_SPEC_LIMIT;
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    p = params_default();
    o->cap = 31; /* smaller than max_spec_tokens */
    int st = as_draft_context(g, NULL, ctx, 2, &p, o);
    CHECK(st == AS_ERR_CAPACITY || st == AS_ERR_INVALID_ARG);
    o->cap = 32;
    p.alpha = NAN;
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    p.alpha = -0.5; /* budgets would shrink as the pattern grows */
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    p = params_default();
    p.min_token_prob = NAN;
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    p = params_default();
    p.offset = INFINITY;
    st = as_draft_context(g, NULL, ctx, 2, &p, o);
    CHECK(st == AS_ERR_INVALID_ARG || (st == AS_OK && draft_sane(o, &p, 2)));
    p = params_default();
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, NULL, o), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, NULL), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft_context(g, NULL, NULL, 2, &p, o), AS_ERR_INVALID_ARG);
    const int32_t bad[] = {1, -2};
    CHECK_STATUS(as_draft_context(g, NULL, bad, 2, &p, o), AS_ERR_INVALID_TOKEN);
    o->tokens = NULL;
    CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &p, o), AS_ERR_INVALID_ARG);
    /* cursors */
    as_cursor *c = as_cursor_create(64, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(c != NULL);
    o = outbuf_init(&b, 32);
    CHECK_STATUS(as_cursor_extend(c, bad, 2), AS_ERR_INVALID_TOKEN);
    CHECK_EQ_U64(as_cursor_len(c), 0);
    CHECK_STATUS(as_cursor_extend(c, NULL, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_cursor_extend(NULL, ctx, 1), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft(NULL, g, &p, o), AS_ERR_INVALID_ARG);
    CHECK_STATUS(as_draft(c, g, NULL, o), AS_ERR_INVALID_ARG);
    REQUIRE_OK(as_cursor_extend(c, ctx, 2));
    p.max_spec_tokens = 0;
    CHECK_STATUS(as_draft(c, g, &p, o), AS_ERR_INVALID_ARG);
    CHECK_EQ_U64(as_cursor_len(NULL), 0);
    CHECK(as_cursor_local_tree(NULL) == NULL);
    int cst = AS_OK;
    CHECK(as_cursor_create(1, 0, &cst) == NULL);
    CHECK_EQ_INT(cst, AS_ERR_INVALID_ARG);
    CHECK(as_cursor_create(AS_MAX_DEPTH_LIMIT + 1, 0, NULL) == NULL);
    CHECK(as_cursor_create(8, 0x80u, NULL) == NULL); /* unknown flag */
    as_cursor_free(c);
    as_cursor_free(NULL);
    as_tree_free(g);
}

/* A confidence table scales D per token by (matched length, count) bins; an
 * all-ones table changes nothing; bad tables are refused. */
static void test_conf_table(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    const int32_t ctx[] = {1, 2};
    as_draft_params p = params_default(), q;
    outbuf b, c;
    as_draft_out *o = outbuf_init(&b, 32), *o2 = outbuf_init(&c, 32);
    p.alpha = 8.0;
    q = p;
    q.flags |= AS_DRAFT_CONF;
    for (int i = 0; i < AS_CONF_BINS * AS_CONF_BINS; i++) q.conf[i] = 1.0f;
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &p, o));
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &q, o2));
    CHECK_EQ_U64(o->n, o2->n);
    CHECK(o->score == o2->score && o->match_len == o2->match_len);
    for (uint32_t i = 0; i < o->n && i < o2->n; i++)
        CHECK(o->tokens[i] == o2->tokens[i] && o->probs[i] == o2->probs[i]);
    /* [1,2] -> 3 (L=2, T=3: bins 2, 2) -> 5 (2 of 3; L=3, T=3: bins 2, 2) */
    for (int i = 0; i < AS_CONF_BINS * AS_CONF_BINS; i++) q.conf[i] = 0.0f;
    q.conf[2 * AS_CONF_BINS + 2] = 0.5f;
    q.min_token_prob = 0.1;
    o2 = outbuf_init(&c, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &q, o2));
    CHECK_EQ_U64(o2->n, 2);
    CHECK_EQ_INT(o2->tokens[0], 3);
    CHECK_EQ_INT(o2->tokens[1], 5);
    CHECK(fabs(o2->probs[0] - 0.5) < 1e-6 && fabs(o2->probs[1] - 0.5 * 2.0 / 3.0 * 0.5) < 1e-6);
    CHECK_EQ_U64(o2->match_len, 2);
    q.min_token_prob = 0.2; /* the second token falls below the cut */
    o2 = outbuf_init(&c, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &q, o2));
    CHECK_EQ_U64(o2->n, 1);
    q.min_token_prob = 0.0; /* a factor of 0 ends the branch even without a cut */
    q.conf[2 * AS_CONF_BINS + 2] = 0.0f;
    o2 = outbuf_init(&c, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &q, o2));
    CHECK_EQ_U64(o2->n, 0);
    const float bad[] = {NAN, -0.1f, 1.5f, INFINITY};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        q.conf[5] = bad[i];
        CHECK_STATUS(as_draft_context(g, NULL, ctx, 2, &q, o2), AS_ERR_INVALID_ARG);
    }
    as_tree_free(g);
}

/* A tree draft whose rounded probabilities sum a few ulps above its depth room
 * (2 levels, score 2.0000000000000004) is not pruned by that bound: it beats
 * a chain scoring exactly 2, as in the model (found by the fuzzer). */
static void test_tree_bound_slack(void) {
    static nv_draft want;
    static const int32_t s0[] = {2, 2, 2, 2, 2, 2, 2, 2147483647, 1, 1};
    static const int32_t s1[] = {0, 1, 0, 2147483647, 1, 1, 2, 2, 2, 3, 2, 2, 2, 2, 2};
    static const int32_t s2[] = {3, 2, 2, 2, 2, 0, 1, 1, 3};
    static const int32_t s3[] = {0, 0};
    const int32_t *seqs[] = {s0, s1, s2, s3};
    const size_t lens[] = {ARRAY_LEN(s0), ARRAY_LEN(s1), ARRAY_LEN(s2), ARRAY_LEN(s3)};
    const int32_t ctx[] = {2, 2, 2, 2};
    as_tree *g = tree_with(6, seqs, lens, 4), *l = tree_with(6, (const int32_t *const[]){ctx}, (const size_t[]){4}, 1);
    REQUIRE(g != NULL && l != NULL);
    nv_tree mg, ml;
    nv_init(&mg, 6);
    nv_init(&ml, 6);
    for (int i = 0; i < 4; i++) nv_add(&mg, i, seqs[i], lens[i]);
    nv_add(&ml, 0, ctx, 4);
    as_draft_params p = params_default();
    p.flags = AS_DRAFT_TREE;
    p.alpha = 1.5;
    p.offset = 1.0;
    p.min_token_prob = 0.0;
    p.max_spec_tokens = 7;
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 7);
    REQUIRE_OK(as_draft_context(g, l, ctx, 4, &p, o));
    nv_draft_context(&mg, &ml, ctx, 4, &p, &want);
    CHECK(nv_draft_equal(&want, o));
    CHECK_EQ_U64(o->source, 1);
    CHECK(o->score > 2.0);
    nv_free(&mg);
    nv_free(&ml);
    as_tree_free(g);
    as_tree_free(l);
}

/* ---- random cross-checks against naive.h -------------------------------- */

static void random_params(th_rng *r, as_draft_params *p, int allow_merge) {
    as_draft_params_default(p);
    p->max_spec_tokens = 1 + th_rng_below(r, 8);
    p->alpha = (double)th_rng_below(r, 9) * 0.25;
    p->offset = (double)th_rng_below(r, 7) * 0.5 - 1.0;
    p->min_token_prob = (double)th_rng_below(r, 5) * 0.1;
    p->flags = 0;
    if (th_rng_below(r, 2)) p->flags |= AS_DRAFT_TREE;
    if (allow_merge && th_rng_below(r, 3) == 0) p->flags |= AS_DRAFT_MERGE;
    if (th_rng_below(r, 8) == 0) p->flags |= AS_DRAFT_NO_LOCAL;
    if (th_rng_below(r, 8) == 0) p->flags |= AS_DRAFT_NO_GLOBAL;
    if (th_rng_below(r, 4) == 0) p->max_pattern = th_rng_below(r, 6);
    if (th_rng_below(r, 4) == 0) p->min_pattern = th_rng_below(r, 4);
    if (p->max_pattern != 0 && p->min_pattern > p->max_pattern) p->min_pattern = p->max_pattern;
    if (th_rng_below(r, 6) == 0) p->min_score = (double)th_rng_below(r, 4) * 0.5;
    if (th_rng_below(r, 3) == 0) { /* a confidence table, monotone or not */
        p->flags |= AS_DRAFT_CONF;
        int shape = (int)th_rng_below(r, 3);
        for (int i = 0; i < AS_CONF_BINS * AS_CONF_BINS; i++) {
            int lb = i / AS_CONF_BINS, tb = i % AS_CONF_BINS;
            p->conf[i] = shape == 0   ? 1.0f
                         : shape == 1 ? (float)(1.0 - 1.0 / (2.0 + lb + 0.5 * tb))
                                      : (float)th_rng_below(r, 11) / 10.0f;
        }
    }
}

static void print_mismatch(const char *what, const nv_draft *w, const as_draft_out *o) {
    fprintf(stderr, "  %s: want n=%u match=%u src=%u score=%.17g; got n=%u match=%u src=%u score=%.17g\n",
            what, w->n, w->match_len, w->source, w->score, o->n, o->match_len, o->source, o->score);
    for (uint32_t i = 0; i < w->n || i < o->n; i++)
        fprintf(stderr, "    [%u] want %d/%d/%.9g got %d/%d/%.9g\n", i,
                i < w->n ? w->tokens[i] : -9, i < w->n ? w->parents[i] : -9,
                i < w->n ? w->probs[i] : -9.0, i < o->n ? o->tokens[i] : -9,
                i < o->n ? o->parents[i] : -9, i < o->n ? (double)o->probs[i] : -9.0);
}

/* Random global trees and contexts: as_draft_context equals the model exactly. */
static void test_random_context_drafts(void) {
    static nv_draft want;
    th_rng r;
    th_rng_seed(&r, 101);
    int mismatches = 0, nonempty = 0, total = 0;
    for (int round = 0; round < 300; round++) {
        uint32_t depth = 2 + th_rng_below(&r, 7);
        int32_t alphabet = 2 + (int32_t)th_rng_below(&r, 3);
        as_tree *g = as_tree_create(depth, NULL), *l = as_tree_create(depth, NULL);
        REQUIRE(g != NULL && l != NULL);
        nv_tree mg, ml;
        nv_init(&mg, depth);
        nv_init(&ml, depth);
        int nseq = (int)th_rng_below(&r, 6);
        for (int s = 0; s < nseq; s++) {
            int32_t seq[30];
            size_t n = th_rng_below(&r, 30);
            for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, (uint32_t)alphabet);
            REQUIRE_OK(as_tree_add(g, s, seq, n));
            nv_add(&mg, s, seq, n);
        }
        int32_t ctx[24];
        size_t n = th_rng_below(&r, 24);
        for (size_t i = 0; i < n; i++) ctx[i] = (int32_t)th_rng_below(&r, (uint32_t)alphabet);
        REQUIRE_OK(as_tree_add(l, 0, ctx, n));
        nv_add(&ml, 0, ctx, n);
        for (int k = 0; k < 8; k++) {
            as_draft_params p;
            random_params(&r, &p, 1);
            int use_l = (int)th_rng_below(&r, 2), use_g = (int)th_rng_below(&r, 4) != 0;
            outbuf b;
            as_draft_out *o = outbuf_init(&b, p.max_spec_tokens);
            REQUIRE_OK(as_draft_context(use_g ? g : NULL, use_l ? l : NULL, ctx, n, &p, o));
            nv_draft_context(use_g ? &mg : NULL, use_l ? &ml : NULL, ctx, n, &p, &want);
            CHECK(draft_sane(o, &p, n));
            nonempty += o->n > 0;
            total++;
            if (!nv_draft_equal(&want, o)) {
                if (mismatches++ < 3) {
                    fprintf(stderr, "  round %d depth %u flags %u n=%zu use_g=%d use_l=%d\n", round,
                            depth, p.flags, n, use_g, use_l);
                    print_mismatch("context draft", &want, o);
                }
            }
        }
        nv_free(&mg);
        nv_free(&ml);
        as_tree_free(g);
        as_tree_free(l);
    }
    CHECK_EQ_INT(mismatches, 0);
    CHECK(nonempty * 4 > total); /* the comparison is not vacuous */
}

/* A cursor extended in random chunks drafts exactly like the model after every
 * step (its depth bounds the pattern length, the global tree's depth bounds
 * the global drafts), and as_draft_context on its tree agrees too. */
static void test_random_cursor_drafts(void) {
    static nv_draft want;
    th_rng r;
    th_rng_seed(&r, 202);
    int mismatches = 0, nonempty = 0, total = 0;
    for (int round = 0; round < 120; round++) {
        uint32_t depth = 2 + th_rng_below(&r, 6);
        uint32_t gdepth = th_rng_below(&r, 2) ? depth : 2 + th_rng_below(&r, 8);
        uint32_t flags = th_rng_below(&r, 4) ? AS_CURSOR_LOCAL_TREE : 0;
        as_tree *g = as_tree_create(gdepth, NULL);
        as_cursor *c = as_cursor_create(depth, flags, NULL);
        REQUIRE(g != NULL && c != NULL);
        nv_tree mg, ml;
        nv_init(&mg, gdepth);
        nv_init(&ml, depth);
        for (int s = 0; s < 4; s++) {
            int32_t seq[25];
            size_t n = th_rng_below(&r, 25);
            for (size_t i = 0; i < n; i++) seq[i] = (int32_t)th_rng_below(&r, 3);
            REQUIRE_OK(as_tree_add(g, s, seq, n));
            nv_add(&mg, s, seq, n);
        }
        int32_t ctx[64];
        size_t n = 0;
        nv_append(&ml, 0, ctx, 0);
        while (n < 50) {
            size_t k = th_rng_below(&r, 4);
            for (size_t i = 0; i < k; i++) ctx[n + i] = (int32_t)th_rng_below(&r, 3);
            REQUIRE_OK(as_cursor_extend(c, ctx + n, k));
            nv_append(&ml, 0, ctx + n, k);
            n += k;
            CHECK_EQ_U64(as_cursor_len(c), n);
            as_draft_params p;
            random_params(&r, &p, 1);
            outbuf b, b2;
            as_draft_out *o = outbuf_init(&b, p.max_spec_tokens);
            as_draft_out *o2 = outbuf_init(&b2, p.max_spec_tokens);
            const as_tree *gg = th_rng_below(&r, 4) ? g : NULL;
            REQUIRE_OK(as_draft(c, gg, &p, o));
            nv_draft_capped(gg ? &mg : NULL, flags ? &ml : NULL, ctx, n, &p, depth - 1, &want);
            CHECK(draft_sane(o, &p, n));
            nonempty += o->n > 0;
            total++;
            if (!nv_draft_equal(&want, o) && mismatches++ < 3) {
                fprintf(stderr, "  round %d depth %u flags %u n=%zu\n", round, depth, p.flags, n);
                print_mismatch("cursor draft", &want, o);
            }
            REQUIRE_OK(as_draft_context(gg, as_cursor_local_tree(c), ctx, n, &p, o2));
            nv_draft_context(gg ? &mg : NULL, flags ? &ml : NULL, ctx, n, &p, &want);
            if (!nv_draft_equal(&want, o2) && mismatches++ < 3) {
                fprintf(stderr, "  round %d depth %u flags %u n=%zu\n", round, depth, p.flags, n);
                print_mismatch("context draft (cursor's tree)", &want, o2);
            }
        }
        if (flags) CHECK_STATUS(as_tree_check(as_cursor_local_tree(c)), AS_OK);
        nv_free(&mg);
        nv_free(&ml);
        as_tree_free(g);
        as_cursor_free(c);
    }
    CHECK_EQ_INT(mismatches, 0);
    CHECK(nonempty * 4 > total); /* the comparison is not vacuous */
}

/* The global tree changes between drafts (adds and removes): the cursor's
 * cached match state must not go stale. */
static void test_cursor_after_global_changes(void) {
    static nv_draft want;
    th_rng r;
    th_rng_seed(&r, 303);
    int mismatches = 0;
    const uint32_t depth = 5;
    as_tree *g = as_tree_create(depth, NULL);
    as_cursor *c = as_cursor_create(depth, AS_CURSOR_LOCAL_TREE, NULL);
    REQUIRE(g != NULL && c != NULL);
    nv_tree mg, ml;
    nv_init(&mg, depth);
    nv_init(&ml, depth);
    nv_append(&ml, 0, NULL, 0);
    int32_t ctx[1100];
    size_t n = 0;
    int64_t next_id = 0;
    for (int step = 0; step < 1000; step++) {
        int op = (int)th_rng_below(&r, 4);
        if (op == 0 || mg.n == 0) {
            int32_t seq[20];
            size_t k = th_rng_below(&r, 20);
            for (size_t i = 0; i < k; i++) seq[i] = (int32_t)th_rng_below(&r, 3);
            REQUIRE_OK(as_tree_add(g, next_id, seq, k));
            nv_add(&mg, next_id++, seq, k);
        } else if (op == 1) {
            int64_t id = mg.seqs[th_rng_below(&r, (uint32_t)mg.n)].id;
            REQUIRE_OK(as_tree_remove(g, id));
            nv_remove(&mg, id);
        } else if (op == 2) {
            int32_t t = (int32_t)th_rng_below(&r, 3);
            ctx[n++] = t;
            REQUIRE_OK(as_cursor_extend(c, &t, 1));
            nv_append(&ml, 0, &t, 1);
        }
        as_draft_params p;
        random_params(&r, &p, 1);
        outbuf b;
        as_draft_out *o = outbuf_init(&b, p.max_spec_tokens);
        REQUIRE_OK(as_draft(c, g, &p, o));
        nv_draft_context(&mg, &ml, ctx, n, &p, &want);
        if (!nv_draft_equal(&want, o) && mismatches++ < 3) {
            fprintf(stderr, "  step %d flags %u n=%zu\n", step, p.flags, n);
            print_mismatch("cursor draft", &want, o);
        }
    }
    CHECK_EQ_INT(mismatches, 0);
    nv_free(&mg);
    nv_free(&ml);
    as_tree_free(g);
    as_cursor_free(c);
}

/* Drafting only reads the global tree. */
static void test_draft_is_read_only(void) {
    as_tree *g = example_tree();
    REQUIRE(g != NULL);
    as_tree_stats before, after;
    REQUIRE_OK(as_tree_stats_get(g, &before));
    const int32_t ctx[] = {1, 2};
    as_draft_params p = params_default();
    p.flags = AS_DRAFT_TREE;
    outbuf b;
    as_draft_out *o = outbuf_init(&b, 32);
    REQUIRE_OK(as_draft_context(g, NULL, ctx, 2, &p, o));
    REQUIRE_OK(as_tree_stats_get(g, &after));
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    CHECK_STATUS(as_tree_check(g), AS_OK);
    as_tree_free(g);
}

int main(void) {
    TEST_RUN(test_conf_table);
    TEST_RUN(test_tree_bound_slack);
    TEST_RUN(test_params_default);
    TEST_RUN(test_vocab_bound);
    TEST_RUN(test_linear_example);
    TEST_RUN(test_tree_example);
    TEST_RUN(test_self_occurrence);
    TEST_RUN(test_context_len_one);
    TEST_RUN(test_budget);
    TEST_RUN(test_budget_epsilon);
    TEST_RUN(test_depth_bound);
    TEST_RUN(test_pattern_bounds);
    TEST_RUN(test_min_score);
    TEST_RUN(test_local_global_merge);
    TEST_RUN(test_tie_prefers_local);
    TEST_RUN(test_multi_global);
    TEST_RUN(test_cursor_without_local);
    TEST_RUN(test_cursor_depth_bounds_pattern);
    TEST_RUN(test_bad_params);
    TEST_RUN(test_random_context_drafts);
    TEST_RUN(test_random_cursor_drafts);
    TEST_RUN(test_cursor_after_global_changes);
    TEST_RUN(test_draft_is_read_only);
    return TEST_REPORT("test_draft");
}
