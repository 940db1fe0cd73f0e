/*
 * fuzz_api.c -- the input is a program of API calls on two trees and a
 * cursor, checked against the brute-force model in tests/naive.h.
 *
 * The first bytes pick the two trees' depths and the cursor's depth and
 * flags; then each step reads an opcode and its parameters (ids, tokens,
 * draft parameters -- bad ones included: negative tokens, unknown or
 * repeated ids, invalid draft parameters).  After every call:
 *   - the status is the one the model predicts (OK, SEQ_EXISTS, ...);
 *   - after every mutation as_tree_check() passes and the stats agree
 *     with the model (sequences, open sequences, tokens);
 *   - drafts (as_draft_context, as_draft on the cursor, as_draft_batch)
 *     are exactly the model's drafts;
 *   - counts are the model's counts;
 *   - snapshots and deltas move sequences between the trees exactly.
 * Sizes are kept small (the model is brute force) so that one input runs
 * in well under a millisecond or so.
 */
#include <math.h>

#include "agentspec.h"
#include "fuzz_common.h"
#include "naive.h"
#include "shardfmt.h"

#define MAX_TOKENS_PER_TREE 600
#define MAX_CTX 200
#define MAX_STEPS 64

typedef struct world {
    as_tree *t[2];
    nv_tree m[2];
    as_cursor *cur;
    nv_tree mctx; /* the cursor's context as sequence 0 */
    uint32_t cdepth, cflags;
    int32_t ctx[MAX_CTX];
    size_t nctx;
} world;

static int64_t read_id(fz_reader *r) {
    uint8_t b = fz_u8(r);
    if (b == 255) return INT64_MAX;
    if (b == 254) return INT64_MIN;
    return (int64_t)(b % 8) - 2;
}

/* Tokens from a tiny alphabet (so that strings repeat), rarely INT32_MAX;
 * with `bad`, rarely a negative one. */
static size_t read_tokens(fz_reader *r, int32_t *out, size_t cap, int bad) {
    size_t n = fz_below(r, 17);
    if (n > cap) n = cap;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = fz_u8(r);
        if (b >= 250) out[i] = INT32_MAX;
        else if (bad && b >= 246) out[i] = b == 246 ? INT32_MIN : -1;
        else out[i] = (int32_t)(b % 4);
    }
    return n;
}

/* Draft parameters; *valid tells whether the engine must accept them. */
static void read_params(fz_reader *r, as_draft_params *p, int *valid) {
    as_draft_params_default(p);
    uint8_t b = fz_u8(r);
    p->max_spec_tokens = 1 + b % 8;
    p->flags = fz_u8(r) & 15u;
    p->alpha = (double)fz_below(r, 9) * 0.25;
    p->offset = (double)fz_below(r, 8) * 0.5 - 1.0;
    p->min_token_prob = (double)fz_below(r, 6) * 0.1;
    uint8_t pat = fz_u8(r);
    p->max_pattern = pat & 1 ? (uint32_t)(pat >> 1) % 6 : 0;
    p->min_pattern = pat & 2 ? (uint32_t)(pat >> 3) % 4 : 0;
    p->min_score = fz_below(r, 8) == 0 ? 1.0 : 0.0;
    if (fz_below(r, 4) == 0) { /* a confidence table: tenths, per cell */
        p->flags |= AS_DRAFT_CONF;
        for (int i = 0; i < AS_CONF_BINS * AS_CONF_BINS; i++) p->conf[i] = (float)fz_below(r, 11) / 10.0f;
    }
    *valid = 1;
    uint8_t bad = fz_u8(r);
    if (bad == 1) p->max_spec_tokens = 0;
    if (bad == 2) p->max_spec_tokens = AS_MAX_SPEC_LIMIT + 1;
    if (bad == 3) p->flags |= 64;
    if (bad == 4) p->min_token_prob = 1.5;
    if (bad == 5) p->alpha = -INFINITY;
    if (bad == 6) {
        p->flags |= AS_DRAFT_CONF;
        p->conf[bad] = NAN;
    }
    if (bad >= 1 && bad <= 6) *valid = 0;
    if (p->max_pattern != 0 && p->min_pattern > p->max_pattern) *valid = 0;
}

/* After a mutation: the engine tree is sound and agrees with the model. */
static void check_tree(const as_tree *t, const nv_tree *m) {
    FZ_ASSERT(as_tree_check(t) == AS_OK);
    as_tree_stats s;
    FZ_ASSERT(as_tree_stats_get(t, &s) == AS_OK);
    FZ_ASSERT(s.sequences == m->n);
    FZ_ASSERT(s.open_sequences == nv_open_count(m));
    FZ_ASSERT(s.tokens == nv_total_tokens(m));
}

/* Sequence ids, order and tokens equal the model's. */
static void check_content(const as_tree *t, const nv_tree *m) {
    int64_t ids[64];
    size_t n = 0;
    FZ_ASSERT(as_tree_seq_ids(t, ids, 64, &n) == AS_OK && n == m->n);
    for (size_t i = 0; i < n && i < 64; i++) {
        FZ_ASSERT(ids[i] == m->seqs[i].id);
        uint64_t len = 0;
        FZ_ASSERT(as_tree_seq_len(t, ids[i], &len) == AS_OK && len == m->seqs[i].n);
        int32_t *tok = malloc((size_t)len * 4 + 4);
        FZ_ASSERT(tok != NULL);
        FZ_ASSERT(as_tree_seq_tokens(t, ids[i], tok, (size_t)len) == AS_OK);
        FZ_ASSERT(len == 0 || memcmp(tok, m->seqs[i].tok, (size_t)len * 4) == 0);
        free(tok);
    }
}

static void check_draft(const nv_draft *want, const as_draft_out *got) {
    if (!nv_draft_equal(want, got)) {
        fprintf(stderr, "draft mismatch: want n=%u match=%u src=%u score=%.17g, got n=%u match=%u "
                        "src=%u score=%.17g\n", want->n, want->match_len, want->source, want->score,
                got->n, got->match_len, got->source, got->score);
        for (uint32_t i = 0; i < want->n || i < got->n; i++)
            fprintf(stderr, "  [%u] want %d/%d/%.9g got %d/%d/%.9g\n", i,
                    i < want->n ? want->tokens[i] : -9, i < want->n ? want->parents[i] : -9,
                    i < want->n ? want->probs[i] : -9.0, i < got->n ? got->tokens[i] : -9,
                    i < got->n ? got->parents[i] : -9, i < got->n ? (double)got->probs[i] : -9.0);
        FZ_ASSERT(!"draft differs from the model");
    }
}

/* Apply a delta to the model: removals, then adds of ids not present. */
static void model_apply_delta(nv_tree *dst, const nv_tree *src, const int64_t *add, size_t nadd,
                              const int64_t *rm, size_t nrm) {
    for (size_t i = 0; i < nrm; i++) nv_remove(dst, rm[i]);
    for (size_t i = 0; i < nadd; i++) {
        const nv_seq *s = nv_find(src, add[i]);
        if (s && !nv_find(dst, add[i])) nv_add(dst, add[i], s->tok, s->n);
    }
}

/* Apply a shard the engine accepted to the model (removals, then new ids). */
static void model_apply_shard(nv_tree *m, const uint8_t *b) {
    uint64_t nseq = sf_rd64(b + SF_OFF_NSEQ), nrem = sf_rd64(b + SF_OFF_NREM);
    const uint8_t *p = b + AS_SHARD_HEADER_BYTES;
    for (uint64_t i = 0; i < nrem; i++, p += 8) nv_remove(m, (int64_t)sf_rd64(p));
    for (uint64_t i = 0; i < nseq; i++) {
        int64_t id = (int64_t)sf_rd64(p);
        uint32_t n = sf_rd32(p + 8);
        int32_t *tok = malloc((size_t)n * 4 + 4);
        FZ_ASSERT(tok != NULL);
        for (uint32_t k = 0; k < n; k++) tok[k] = (int32_t)sf_rd32(p + 12 + 4 * (size_t)k);
        if (!nv_find(m, id)) nv_add(m, id, tok, n);
        free(tok);
        p += 12 + 4 * (size_t)n;
    }
}

static void step(world *w, fz_reader *r) {
    static nv_draft want;
    int32_t toks[32];
    uint8_t op = fz_u8(r) % 14;
    int k = fz_u8(r) & 1;
    as_tree *t = w->t[k];
    nv_tree *m = &w->m[k];
    switch (op) {
    case 0: { /* add */
        int64_t id = read_id(r);
        size_t n = read_tokens(r, toks, 32, 1);
        if (nv_total_tokens(m) + n > MAX_TOKENS_PER_TREE) break;
        int expect = nv_add(m, id, toks, n);
        FZ_ASSERT(as_tree_add(t, id, toks, n) == expect);
        check_tree(t, m);
        break;
    }
    case 1: { /* append */
        int64_t id = read_id(r);
        size_t n = read_tokens(r, toks, 32, 1);
        if (nv_total_tokens(m) + n > MAX_TOKENS_PER_TREE) break;
        int expect = nv_append(m, id, toks, n);
        FZ_ASSERT(as_tree_append(t, id, toks, n) == expect);
        check_tree(t, m);
        break;
    }
    case 2: { /* close */
        int64_t id = read_id(r);
        FZ_ASSERT(as_tree_close(t, id) == nv_close(m, id));
        check_tree(t, m);
        break;
    }
    case 3: { /* remove */
        int64_t id = read_id(r);
        FZ_ASSERT(as_tree_remove(t, id) == nv_remove(m, id));
        check_tree(t, m);
        break;
    }
    case 4: { /* count */
        size_t n = read_tokens(r, toks, 32, 0);
        uint64_t c = 0;
        int st = as_tree_count(t, toks, n, &c);
        if (n > 0) FZ_ASSERT(st == AS_OK && c == nv_count(m, toks, n));
        break;
    }
    case 5: { /* draft_context: global, local, context each chosen by the input */
        as_draft_params p;
        int valid;
        read_params(r, &p, &valid);
        uint8_t sel = fz_u8(r);
        const as_tree *g = sel & 1 ? t : NULL;
        const nv_tree *mg = sel & 1 ? m : NULL;
        const as_tree *l = NULL;
        const nv_tree *ml = NULL;
        if (sel & 2) {
            l = w->t[!k];
            ml = &w->m[!k];
        } else if ((sel & 4) && as_cursor_local_tree(w->cur)) {
            l = as_cursor_local_tree(w->cur);
            ml = &w->mctx;
        }
        int32_t ctxbuf[32];
        const int32_t *ctx = w->ctx;
        size_t n = w->nctx;
        if (sel & 8) {
            n = read_tokens(r, ctxbuf, 32, 0);
            ctx = ctxbuf;
        }
        int32_t ot[16], op_[16];
        float opr[16];
        as_draft_out o = {ot, op_, opr, 16, 0, 0, 0, 0.0, 0};
        if (p.max_spec_tokens > 16) valid = 0;
        int st = as_draft_context(g, l, ctx, n, &p, &o);
        if (!valid) {
            FZ_ASSERT(st == AS_ERR_INVALID_ARG || st == AS_ERR_CAPACITY);
            break;
        }
        FZ_ASSERT(st == AS_OK);
        nv_draft_context(mg, ml, ctx, n, &p, &want);
        check_draft(&want, &o);
        break;
    }
    case 6: { /* extend the cursor, then draft from it */
        size_t n = read_tokens(r, toks, 32, 1);
        if (w->nctx + n > MAX_CTX) n = 0;
        int ok = nv_tokens_valid(toks, n);
        int st = as_cursor_extend(w->cur, toks, n);
        FZ_ASSERT(st == (ok ? AS_OK : AS_ERR_INVALID_TOKEN));
        if (ok) {
            memcpy(w->ctx + w->nctx, toks, n * sizeof(int32_t));
            w->nctx += n;
            nv_append(&w->mctx, 0, toks, n);
        }
        FZ_ASSERT(as_cursor_len(w->cur) == w->nctx);
        if (as_cursor_local_tree(w->cur)) check_tree(as_cursor_local_tree(w->cur), &w->mctx);
    }
    /* fall through */
    case 7: { /* draft from the cursor */
        as_draft_params p;
        int valid;
        read_params(r, &p, &valid);
        int use_g = fz_u8(r) & 1;
        int32_t ot[8], op_[8];
        float opr[8];
        as_draft_out o = {ot, op_, opr, 8, 0, 0, 0, 0.0, 0};
        if (p.max_spec_tokens > 8) valid = 0;
        int st = as_draft(w->cur, use_g ? t : NULL, &p, &o);
        if (!valid) {
            FZ_ASSERT(st == AS_ERR_INVALID_ARG || st == AS_ERR_CAPACITY);
            break;
        }
        FZ_ASSERT(st == AS_OK);
        nv_draft_capped(use_g ? m : NULL, as_cursor_local_tree(w->cur) ? &w->mctx : NULL, w->ctx,
                        w->nctx, &p, w->cdepth - 1, &want);
        check_draft(&want, &o);
        break;
    }
    case 8: { /* snapshot of tree k into tree !k (or a fresh tree) */
        uint64_t bound = 0;
        FZ_ASSERT(as_tree_save_bound(t, &bound) == AS_OK);
        uint8_t *buf = malloc((size_t)bound);
        size_t len = 0;
        FZ_ASSERT(buf != NULL && as_tree_save(t, buf, (size_t)bound, &len) == AS_OK && len == bound);
        int st = -1;
        as_tree *u = as_tree_from_bytes(buf, len, &st);
        FZ_ASSERT(u != NULL && st == AS_OK);
        nv_tree closed;
        nv_init(&closed, m->depth);
        for (size_t i = 0; i < m->n; i++) nv_add(&closed, m->seqs[i].id, m->seqs[i].tok, m->seqs[i].n);
        check_tree(u, &closed);
        check_content(u, &closed);
        as_tree_free(u);
        as_tree *o = w->t[!k];
        nv_tree *mo = &w->m[!k];
        st = as_tree_load(o, buf, len);
        if (mo->depth != m->depth) {
            FZ_ASSERT(st == AS_ERR_DEPTH_MISMATCH);
        } else if (mo->n != 0) {
            FZ_ASSERT(st != AS_OK);
        } else {
            FZ_ASSERT(st == AS_OK);
            nv_free(mo);
            *mo = closed;
            memset(&closed, 0, sizeof closed);
            closed.depth = m->depth;
        }
        check_tree(o, mo);
        check_content(o, mo);
        nv_free(&closed);
        free(buf);
        break;
    }
    case 9: { /* delta from tree k applied to tree !k, twice */
        int64_t add[4], rm[3];
        size_t nadd = 0, nrm = fz_below(r, 4);
        for (size_t i = 0; i < nrm; i++) rm[i] = read_id(r);
        size_t want_add = fz_below(r, 5);
        for (size_t i = 0; i < want_add; i++) {
            int64_t id = read_id(r);
            if (nv_find(m, id)) add[nadd++] = id;
        }
        uint64_t bound = 0;
        FZ_ASSERT(as_tree_delta_bound(t, add, nadd, nrm, &bound) == AS_OK);
        uint8_t *buf = malloc((size_t)bound);
        size_t len = 0;
        FZ_ASSERT(buf != NULL);
        FZ_ASSERT(as_tree_save_delta(t, add, nadd, rm, nrm, buf, (size_t)bound, &len) == AS_OK);
        as_tree *o = w->t[!k];
        nv_tree *mo = &w->m[!k];
        uint64_t added = 0;
        for (size_t i = 0; i < nadd; i++) added += nv_find(m, add[i])->n;
        if (nv_total_tokens(mo) + added > MAX_TOKENS_PER_TREE) {
            free(buf);
            break;
        }
        int st = as_tree_load(o, buf, len);
        if (mo->depth != m->depth) {
            FZ_ASSERT(st == AS_ERR_DEPTH_MISMATCH);
        } else {
            FZ_ASSERT(st == AS_OK);
            model_apply_delta(mo, m, add, nadd, rm, nrm);
            check_tree(o, mo);
            check_content(o, mo);
            FZ_ASSERT(as_tree_load(o, buf, len) == AS_OK);
            model_apply_delta(mo, m, add, nadd, rm, nrm);
            check_tree(o, mo);
        }
        free(buf);
        break;
    }
    case 10: { /* raw bytes from the input loaded as a shard */
        size_t n = fz_below(r, 96);
        uint8_t *raw = malloc(n ? n : 1); /* exact size: ASan sees overreads */
        FZ_ASSERT(raw != NULL);
        for (size_t i = 0; i < n; i++) raw[i] = fz_u8(r);
        int ist = as_shard_inspect(raw, n, NULL, NULL, NULL, NULL, NULL);
        int st = as_tree_load(t, raw, n);
        if (st == AS_OK) {
            FZ_ASSERT(ist == AS_OK);
            model_apply_shard(m, raw);
            if (nv_total_tokens(m) > MAX_TOKENS_PER_TREE) FZ_ASSERT(!"unreachable: 96 bytes");
        } else if (ist != AS_OK) {
            FZ_ASSERT(st == ist);
        }
        check_tree(t, m);
        check_content(t, m);
        free(raw);
        break;
    }
    case 11: { /* batch: the cursor as item 0, and a throwaway cursor as item 1 */
        as_draft_params p;
        int valid;
        read_params(r, &p, &valid);
        if (p.max_spec_tokens > 8) valid = 0;
        as_cursor *other = as_cursor_create(w->cdepth, AS_CURSOR_LOCAL_TREE, NULL);
        FZ_ASSERT(other != NULL);
        as_cursor *items[2] = {w->cur, other};
        const as_tree *globs[2] = {t, fz_u8(r) & 1 ? w->t[!k] : NULL};
        size_t n0 = read_tokens(r, toks, 4, 0);
        if (w->nctx + n0 > MAX_CTX) n0 = 0;
        uint64_t offs[3] = {0, n0, n0};
        int32_t T[16], P[16], S[2];
        float F[16];
        uint32_t N[2], ML[2], SRC[2];
        double SC[2];
        int st = as_draft_batch(items, globs, 2, toks, offs, &p, T, P, F, 8, N, ML, SRC, SC, S,
                                1 + (fz_u8(r) & 1));
        if (!valid) {
            FZ_ASSERT(st == AS_ERR_INVALID_ARG || st == AS_ERR_CAPACITY);
            as_cursor_free(other);
            break;
        }
        FZ_ASSERT(st == AS_OK && S[0] == AS_OK && S[1] == AS_OK);
        memcpy(w->ctx + w->nctx, toks, n0 * sizeof(int32_t));
        w->nctx += n0;
        nv_append(&w->mctx, 0, toks, n0);
        nv_draft_capped(m, as_cursor_local_tree(w->cur) ? &w->mctx : NULL, w->ctx, w->nctx, &p,
                        w->cdepth - 1, &want);
        as_draft_out o = {T, P, F, 8, N[0], ML[0], SRC[0], SC[0], 0};
        check_draft(&want, &o);
        FZ_ASSERT(N[1] == 0); /* an empty cursor drafts nothing */
        as_cursor_free(other);
        break;
    }
    case 12: { /* bad calls change nothing */
        const int32_t neg[] = {1, -1};
        int64_t id = read_id(r);
        FZ_ASSERT(as_tree_add(t, id, neg, 2) == AS_ERR_INVALID_TOKEN);
        FZ_ASSERT(as_tree_append(t, id, neg, 2) == AS_ERR_INVALID_TOKEN);
        FZ_ASSERT(as_tree_add(t, id, NULL, 3) == AS_ERR_INVALID_ARG);
        int32_t out[2];
        uint64_t len = 0;
        nv_seq *s = nv_find(m, id);
        FZ_ASSERT(as_tree_seq_len(t, id, &len) == (s ? AS_OK : AS_ERR_SEQ_NOT_FOUND));
        if (s && s->n > 2) FZ_ASSERT(as_tree_seq_tokens(t, id, out, 2) == AS_ERR_CAPACITY);
        FZ_ASSERT(as_cursor_extend(w->cur, neg, 2) == AS_ERR_INVALID_TOKEN);
        FZ_ASSERT(as_cursor_len(w->cur) == w->nctx);
        check_tree(t, m);
        break;
    }
    default: { /* full comparison of contents */
        check_content(t, m);
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_reader r = {data, size, 0};
    static world w;
    memset(&w, 0, sizeof w);
    uint32_t d0 = 2 + fz_below(&r, 7), d1 = fz_u8(&r) & 1 ? d0 : 2 + fz_below(&r, 7);
    w.cdepth = fz_u8(&r) & 1 ? d0 : 2 + fz_below(&r, 7);
    w.cflags = fz_u8(&r) & 3 ? AS_CURSOR_LOCAL_TREE : 0;
    w.t[0] = as_tree_create(d0, NULL);
    w.t[1] = as_tree_create(d1, NULL);
    w.cur = as_cursor_create(w.cdepth, w.cflags, NULL);
    FZ_ASSERT(w.t[0] && w.t[1] && w.cur);
    nv_init(&w.m[0], d0);
    nv_init(&w.m[1], d1);
    nv_init(&w.mctx, w.cdepth);
    nv_append(&w.mctx, 0, NULL, 0);
    for (int s = 0; s < MAX_STEPS && fz_more(&r); s++) step(&w, &r);
    check_content(w.t[0], &w.m[0]);
    check_content(w.t[1], &w.m[1]);
    as_cursor_free(w.cur);
    as_tree_free(w.t[0]);
    as_tree_free(w.t[1]);
    nv_free(&w.m[0]);
    nv_free(&w.m[1]);
    nv_free(&w.mctx);
    return 0;
}
