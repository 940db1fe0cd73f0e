/*
 * fuzz_shard.c -- untrusted shard bytes.
 *
 * Input: one mode byte, then the shard bytes.  Mode bit 0 "reseal": fix the
 * magic, version, payload length and checksum first, so that mutations
 * reach the structure checks behind the checksum instead of stopping at
 * it.  Mode bits 1-2 pick the tree the bytes are loaded onto (empty,
 * holding sequences the shard may name, or of another depth).
 *
 * Properties (any violation aborts):
 *   - as_shard_inspect, as_shard_peek, as_shard_max_token, as_tree_from_bytes
 *     and as_tree_load never crash,
 *     leak, or read out of bounds, whatever the bytes;
 *   - a failed load leaves the tree exactly as it was;
 *   - load succeeds only if inspect does, and a parse error is the same code;
 *   - peek accepts what inspect accepts (same header fields); max_token fails
 *     exactly when inspect does and is -1 only without tokens;
 *   - a tree made from bytes is sound (as_tree_check), has the inspected
 *     depth, sequence and token counts, and survives save -> from_bytes
 *     with identical stats and identical bytes.
 */
#include "agentspec.h"
#include "fuzz_common.h"
#include "shardfmt.h"

/* Save a tree into a fresh buffer (NULL on failure). */
static uint8_t *save_tree(const as_tree *t, size_t *len) {
    uint64_t bound = 0;
    if (as_tree_save_bound(t, &bound) != AS_OK) return NULL;
    uint8_t *buf = malloc((size_t)bound ? (size_t)bound : 1);
    if (buf == NULL) return NULL;
    if (as_tree_save(t, buf, (size_t)bound, len) != AS_OK) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* Stats and snapshot bytes of a tree, to show that it did not change. */
typedef struct state {
    as_tree_stats st;
    uint8_t *bytes;
    size_t len;
} state;

static state state_of(const as_tree *t) {
    state s;
    memset(&s, 0, sizeof s);
    FZ_ASSERT(as_tree_stats_get(t, &s.st) == AS_OK);
    s.bytes = save_tree(t, &s.len);
    FZ_ASSERT(s.bytes != NULL);
    return s;
}

static int same_state(const state *a, const state *b) {
    return memcmp(&a->st, &b->st, sizeof a->st) == 0 && a->len == b->len &&
           memcmp(a->bytes, b->bytes, a->len) == 0;
}

/* The target tree for a load, chosen by the mode. */
static as_tree *make_target(unsigned which, uint32_t depth) {
    if (depth < 2 || depth > AS_MAX_DEPTH_LIMIT) depth = 8;
    if (which == 2) depth = depth == 8 ? 9 : 8; /* another depth */
    as_tree *t = as_tree_create(depth, NULL);
    FZ_ASSERT(t != NULL);
    if (which == 1 || which == 3) { /* ids 0..3 and -1, which deltas may name */
        for (int64_t id = -1; id < 4; id++) {
            int32_t toks[6];
            for (int k = 0; k < 6; k++) toks[k] = (int32_t)((id + k) & 3);
            FZ_ASSERT(as_tree_add(t, id, toks, (size_t)(id + 2)) == AS_OK);
        }
        if (which == 3) FZ_ASSERT(as_tree_append(t, 7, NULL, 0) == AS_OK);
    }
    return t;
}

/* A tree made from bytes round-trips through save/from_bytes unchanged. */
static void check_round_trip(const as_tree *t) {
    FZ_ASSERT(as_tree_check(t) == AS_OK);
    size_t len = 0;
    uint8_t *b = save_tree(t, &len);
    FZ_ASSERT(b != NULL);
    int st = -1;
    as_tree *u = as_tree_from_bytes(b, len, &st);
    FZ_ASSERT(u != NULL && st == AS_OK);
    as_tree_stats a, c;
    FZ_ASSERT(as_tree_stats_get(t, &a) == AS_OK && as_tree_stats_get(u, &c) == AS_OK);
    FZ_ASSERT(a.sequences == c.sequences && a.tokens == c.tokens && a.nodes == c.nodes &&
              a.max_depth == c.max_depth && c.open_sequences == 0);
    size_t len2 = 0;
    uint8_t *b2 = save_tree(u, &len2);
    FZ_ASSERT(b2 != NULL && len2 == len && memcmp(b, b2, len) == 0);
    free(b);
    free(b2);
    as_tree_free(u);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    unsigned mode = data[0];
    size_t len = size - 1;
    /* an exact-size private copy: reads past the end are caught by ASan */
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) return 0;
    if (len) memcpy(buf, data + 1, len);
    if ((mode & 1) && len >= AS_SHARD_HEADER_BYTES) {
        memcpy(buf, "ASHD", 4);
        sf_wr16(buf + SF_OFF_VERSION, SF_VERSION);
        sf_wr64(buf + SF_OFF_PAYLOAD, (uint64_t)(len - AS_SHARD_HEADER_BYTES));
        sf_reseal(buf, len);
    }

    uint32_t kind = 0, depth = 0;
    uint64_t nseq = 0, nrem = 0, ntok = 0;
    int ist = as_shard_inspect(buf, len, &kind, &depth, &nseq, &nrem, &ntok);
    FZ_ASSERT(ist == AS_OK || ist == AS_ERR_FORMAT || ist == AS_ERR_VERSION ||
              ist == AS_ERR_TRUNCATED || ist == AS_ERR_CHECKSUM || ist == AS_ERR_INVALID_ARG);
    if (ist == AS_OK) {
        FZ_ASSERT(kind <= AS_SHARD_DELTA && depth >= 2 && depth <= AS_MAX_DEPTH_LIMIT);
        FZ_ASSERT(nrem * 8 + nseq * 12 + ntok * 4 == len - AS_SHARD_HEADER_BYTES);
        FZ_ASSERT(kind == AS_SHARD_DELTA || nrem == 0);
    }
    /* peek (header only) accepts whatever inspect accepts, with the same fields;
     * max_token agrees with inspect on validity */
    uint32_t pkind = 9, pdepth = 0;
    uint64_t pnseq = 0, pnrem = 0;
    int pst = as_shard_peek(buf, len, &pkind, &pdepth, &pnseq, &pnrem);
    int32_t top = -2;
    int mst = as_shard_max_token(buf, len, &top);
    FZ_ASSERT(mst == ist);
    if (ist == AS_OK) {
        FZ_ASSERT(pst == AS_OK && pkind == kind && pdepth == depth && pnseq == nseq && pnrem == nrem);
        FZ_ASSERT(ntok == 0 ? top == -1 : top >= 0);
    } else if (pst == AS_OK) {
        FZ_ASSERT(ist == AS_ERR_CHECKSUM || ist == AS_ERR_FORMAT);
    } else {
        /* the header checks give inspect's code; the count checks (FORMAT) run
         * before the checksum in peek, after it in inspect */
        FZ_ASSERT(pst == ist || (pst == AS_ERR_FORMAT && ist == AS_ERR_CHECKSUM));
    }

    /* from_bytes */
    int fst = -1;
    as_tree *t = as_tree_from_bytes(buf, len, &fst);
    FZ_ASSERT((t != NULL) == (fst == AS_OK));
    if (t != NULL) {
        FZ_ASSERT(ist == AS_OK && kind == AS_SHARD_SNAPSHOT);
        as_tree_stats s;
        FZ_ASSERT(as_tree_stats_get(t, &s) == AS_OK);
        FZ_ASSERT(s.max_depth == depth && s.sequences == nseq && s.tokens == ntok);
        check_round_trip(t);
        as_tree_free(t);
    } else if (ist != AS_OK) {
        FZ_ASSERT(fst == ist);
    } else {
        /* valid bytes that are not a loadable snapshot: a delta, or repeated ids */
        FZ_ASSERT(fst == AS_ERR_FORMAT || fst == AS_ERR_CAPACITY);
    }

    /* load onto a tree */
    as_tree *target = make_target((mode >> 1) & 3, ist == AS_OK ? depth : 8);
    state before = state_of(target);
    int lst = as_tree_load(target, buf, len);
    if (lst == AS_OK) {
        FZ_ASSERT(ist == AS_OK);
        FZ_ASSERT(before.st.max_depth == depth);
        check_round_trip(target);
        /* a delta applied a second time changes nothing */
        if (kind == AS_SHARD_DELTA) {
            state once = state_of(target);
            FZ_ASSERT(as_tree_load(target, buf, len) == AS_OK);
            state twice = state_of(target);
            /* removal-then-add of the same id re-creates it at the end: same
             * stats and the same sequences, possibly in another order */
            FZ_ASSERT(once.st.sequences == twice.st.sequences && once.st.tokens == twice.st.tokens &&
                      once.st.nodes == twice.st.nodes);
            free(once.bytes);
            free(twice.bytes);
        }
    } else {
        if (ist != AS_OK) FZ_ASSERT(lst == ist);
        state after = state_of(target);
        FZ_ASSERT(same_state(&before, &after));
        free(after.bytes);
    }
    free(before.bytes);
    as_tree_free(target);
    free(buf);
    return 0;
}
