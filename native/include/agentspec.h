/*
 * agentspec.h -- the public C API of agentspec's suffix-tree engine.
 *
 * This is the only public header.  Everything else under native/src is
 * private.  The library is plain C11: no C++, no third-party dependency, no
 * global mutable state other than the allocator hook.
 *
 * Conventions
 *   - Functions and types are prefixed `as_`, macros and enum values `AS_`.
 *   - Every fallible function returns an `as_status` (0 = AS_OK) and writes
 *     results through out-parameters; as_strerror() names a status.
 *   - Handles are opaque, created by *_create and released by *_free; every
 *     *_free accepts NULL.  Output buffers are owned by the caller.
 *   - The library never prints, never exits, never calls abort() and never
 *     asserts on input: bad input of any kind is an error code.
 *   - Token ids are int32 values in [0, INT32_MAX]; every such value is a
 *     valid token.  Negative values are refused with AS_ERR_INVALID_TOKEN.
 *
 * Thread safety
 *   - A tree may be read (drafting, stats, save) by any number of threads at
 *     once, as long as no thread modifies it at the same time.  Modifying
 *     calls (add/append/close/remove/load) need exclusive access.
 *   - A cursor belongs to one thread at a time.
 *   - as_draft_batch may run its items on several threads; items must use
 *     distinct cursors.
 *
 * The method (SuffixDecoding)
 *   A tree indexes every window seq[i : i+max_depth] of its sequences, so a
 *   node's count is the number of occurrences of the token string spelled on
 *   its path.  A cursor holds the context of one request (prompt + generated
 *   tokens) and, optionally, a per-request tree over that context.  Drafting
 *   matches every suffix of the context of length p = 1..max_depth-1 and, for
 *   each match that has a continuation, grows a draft by the probability
 *   D(child) = D(parent) * count(child) / sum(count of the child's siblings
 *   and the child), with D = 1 at the match point.  The draft for pattern
 *   length p holds at most min(max_spec_tokens, floor(alpha*p + offset))
 *   tokens; tokens with D < min_token_prob are dropped; the score of a draft
 *   is the sum of its D values, and the highest score wins (ties: the longer
 *   match, then the per-request tree).
 */
#ifndef AGENTSPEC_H
#define AGENTSPEC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AS_VERSION_MAJOR 0
#define AS_VERSION_MINOR 1
#define AS_VERSION_PATCH 0

/* Largest max_depth a tree accepts, and the default. */
#define AS_MAX_DEPTH_LIMIT 1024
#define AS_DEFAULT_MAX_DEPTH 64
/* Largest number of draft tokens one draft may hold. */
#define AS_MAX_SPEC_LIMIT 1024
/* Most global trees one draft may use (e.g. a stage shard and a pipeline tree). */
#define AS_MAX_GLOBALS 4

/* --- Status codes ------------------------------------------------------ */

typedef enum as_status {
    AS_OK = 0,
    AS_ERR_NOMEM = 1,          /* an allocation failed; the handle stays sound (see each call) */
    AS_ERR_INVALID_ARG = 2,    /* NULL where a pointer is needed, bad parameter */
    AS_ERR_INVALID_TOKEN = 3,  /* a token id < 0 */
    AS_ERR_SEQ_EXISTS = 4,     /* the sequence id is already in the tree */
    AS_ERR_SEQ_NOT_FOUND = 5,  /* no sequence with that id */
    AS_ERR_SEQ_CLOSED = 6,     /* append to a sequence that is closed */
    AS_ERR_CAPACITY = 7,       /* a size limit: output buffer, count or length */
    AS_ERR_FORMAT = 8,         /* shard bytes: bad magic or structure */
    AS_ERR_VERSION = 9,        /* shard bytes: unsupported format version */
    AS_ERR_TRUNCATED = 10,     /* shard bytes: shorter than their lengths say */
    AS_ERR_CHECKSUM = 11,      /* shard bytes: checksum mismatch */
    AS_ERR_DEPTH_MISMATCH = 12,/* shard max_depth differs from the tree's */
    AS_ERR_THREAD = 13         /* a worker thread could not be started */
} as_status;

/* A static, NUL-terminated English description of a status; never NULL. */
const char *as_strerror(int status);

/* --- Allocator hook ---------------------------------------------------- */

/* One process-wide allocator for all of the library's memory.  Must be set
 * before any handle exists (returns AS_ERR_INVALID_ARG otherwise, or if any
 * function is NULL).  Passing all NULL restores malloc/realloc/free.
 * Accounting of bytes per tree is done by the library itself and is exact:
 * it is the sum of the sizes requested from the hook for live blocks. */
typedef void *(*as_malloc_fn)(size_t size, void *ctx);
typedef void *(*as_realloc_fn)(void *ptr, size_t size, void *ctx);
typedef void (*as_free_fn)(void *ptr, void *ctx);
int as_set_allocator(as_malloc_fn m, as_realloc_fn r, as_free_fn f, void *ctx);

/* Bytes currently allocated by the whole library (all handles). */
uint64_t as_allocated_bytes(void);

/* --- Trees ------------------------------------------------------------- */

typedef struct as_tree as_tree;

/* Create an empty tree.  max_depth in [2, AS_MAX_DEPTH_LIMIT].
 * On failure returns NULL and, if status != NULL, stores why. */
as_tree *as_tree_create(uint32_t max_depth, int *status);
void as_tree_free(as_tree *tree); /* accepts NULL */

uint32_t as_tree_max_depth(const as_tree *tree);

/* Add a whole, closed sequence.  seq_id must be new.  n may be 0. */
int as_tree_add(as_tree *tree, int64_t seq_id, const int32_t *tokens, size_t n);

/* Append tokens to an open sequence, creating it (open) if seq_id is new.
 * This is the decode-loop form: at most O(max_depth) hash-map steps per
 * token, far fewer where windows grow inside their own leaves.
 * Nothing is changed if any token is invalid (checked up front).  On
 * AS_ERR_NOMEM the tokens before the failing one stay appended and the tree
 * is consistent. */
int as_tree_append(as_tree *tree, int64_t seq_id, const int32_t *tokens, size_t n);

/* Close an open sequence: it keeps its tokens, stops accepting appends and
 * releases its per-sequence matching window.  Closing a closed one is OK. */
int as_tree_close(as_tree *tree, int64_t seq_id);

/* Remove a sequence: every count it contributed is restored and nodes that no
 * longer occur are freed. */
int as_tree_remove(as_tree *tree, int64_t seq_id);

int as_tree_contains(const as_tree *tree, int64_t seq_id); /* 1 or 0 */

/* Length of a sequence in tokens (*len), and copy of its tokens into out
 * (out may be NULL when cap == 0; AS_ERR_CAPACITY if cap < length). */
int as_tree_seq_len(const as_tree *tree, int64_t seq_id, uint64_t *len);
int as_tree_seq_tokens(const as_tree *tree, int64_t seq_id, int32_t *out, size_t cap);

/* Ids of all sequences, in insertion order (oldest first).  *n receives the
 * total; at most cap ids are written. */
int as_tree_seq_ids(const as_tree *tree, int64_t *out, size_t cap, size_t *n);

typedef struct as_tree_stats {
    uint64_t sequences;     /* live sequences */
    uint64_t open_sequences;
    uint64_t tokens;        /* tokens in live sequences */
    uint64_t nodes;         /* live nodes, root included */
    uint64_t bytes;         /* exact bytes held from the allocator */
    uint64_t retained_tokens; /* tokens of removed sequences still referenced */
    uint64_t free_bytes;    /* part of `bytes` in free node slots, reused first;
                               a tree compacts itself once half its slots are free */
    uint32_t max_depth;
} as_tree_stats;

int as_tree_stats_get(const as_tree *tree, as_tree_stats *out);

/* Occurrence count of a token string of n >= 1 tokens (0 if absent or longer
 * than max_depth; n == 0 is AS_ERR_INVALID_ARG).  For tests and diagnostics. */
int as_tree_count(const as_tree *tree, const int32_t *tokens, size_t n, uint64_t *count);

/* Verify internal invariants without changing anything.  AS_OK if sound,
 * AS_ERR_FORMAT otherwise.  O(size of tree). */
int as_tree_check(const as_tree *tree);

/* --- Shard format ------------------------------------------------------ */

/* Little-endian, versioned, a 48-byte header:
 *   magic "ASHD", u16 version, u16 kind (0 snapshot, 1 delta),
 *   u32 max_depth, u32 reserved (0), u64 n_sequences, u64 n_removals,
 *   u64 payload_bytes, u64 checksum (of header bytes 0..39 and the payload),
 *   then payload:
 *   n_removals x i64 seq_id, then per sequence: i64 seq_id, u32 n, n x i32.
 * A snapshot holds every sequence of the tree (open ones are written with
 * their current tokens and load closed).  A delta holds sequences to add and
 * ids to remove.  Loading untrusted bytes never reads out of bounds and
 * reports any malformation as an error, leaving the tree unchanged. */

#define AS_SHARD_SNAPSHOT 0
#define AS_SHARD_DELTA 1
#define AS_SHARD_HEADER_BYTES 48

/* Bytes needed to save the whole tree. */
int as_tree_save_bound(const as_tree *tree, uint64_t *size);
/* Write a snapshot into buf (cap bytes); *written receives its size. */
int as_tree_save(const as_tree *tree, uint8_t *buf, size_t cap, size_t *written);

/* Bytes needed for a delta of the given sequences (ids present in the tree)
 * plus n_remove removals; then write it. */
int as_tree_delta_bound(const as_tree *tree, const int64_t *seq_ids, size_t n_ids,
                        size_t n_remove, uint64_t *size);
int as_tree_save_delta(const as_tree *tree, const int64_t *seq_ids, size_t n_ids,
                       const int64_t *remove_ids, size_t n_remove,
                       uint8_t *buf, size_t cap, size_t *written);

/* Validate shard bytes without loading (header, lengths, tokens, checksum).
 * Optional outputs may be NULL. */
int as_shard_inspect(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                     uint64_t *n_sequences, uint64_t *n_removals, uint64_t *n_tokens);

/* Read the fixed header only, in O(1): magic, version, kind, reserved field,
 * max_depth range, payload_bytes against len (AS_ERR_TRUNCATED short,
 * AS_ERR_FORMAT trailing bytes) and counts that cannot fit the payload.  The
 * checksum and the payload are NOT read: AS_OK does not mean the bytes are
 * valid.  For refusing a shard cheaply (e.g. of another depth) before
 * validating or loading it.  Optional outputs may be NULL. */
int as_shard_peek(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                  uint64_t *n_sequences, uint64_t *n_removals);

/* Validate shard bytes as as_shard_inspect does and store the largest token
 * id of their sequences in *max_token (-1 when they hold no token), e.g. to
 * refuse shards holding ids outside a model's vocabulary.  O(len). */
int as_shard_max_token(const uint8_t *buf, size_t len, int32_t *max_token);

/* Apply shard bytes to a tree.  A snapshot requires an empty tree
 * (AS_ERR_INVALID_ARG otherwise) and is all-or-nothing; a delta
 * removes the listed ids (absent ids are skipped), then adds its sequences
 * (ids already present are skipped: applying a delta twice is a no-op).
 * The bytes are fully validated first; a validation error changes nothing.
 * Only AS_ERR_NOMEM can leave a delta partly applied (whole sequences). */
int as_tree_load(as_tree *tree, const uint8_t *buf, size_t len);

/* Create a tree from snapshot bytes (max_depth from the header). */
as_tree *as_tree_from_bytes(const uint8_t *buf, size_t len, int *status);

/* --- Cursors (per-request state) ---------------------------------------- */

typedef struct as_cursor as_cursor;

#define AS_CURSOR_LOCAL_TREE 1u /* keep a per-request tree over the context */

/* A cursor holds one request's context and its incremental match state.
 * max_depth bounds the pattern length (and the per-request tree). */
as_cursor *as_cursor_create(uint32_t max_depth, uint32_t flags, int *status);
void as_cursor_free(as_cursor *cur); /* accepts NULL */

/* Append tokens to the context (prompt first, then each decode step's
 * accepted tokens).  The context can ONLY BE APPENDED TO.  On AS_ERR_NOMEM
 * the tokens before the failing one stay appended (as_cursor_len tells). */
int as_cursor_extend(as_cursor *cur, const int32_t *tokens, size_t n);

/* Context length so far, and the per-request tree (NULL without
 * AS_CURSOR_LOCAL_TREE).  The tree is owned by the cursor. */
uint64_t as_cursor_len(const as_cursor *cur);
const as_tree *as_cursor_local_tree(const as_cursor *cur);

/* --- Drafting ---------------------------------------------------------- */

#define AS_DRAFT_TREE 1u    /* best-first tree draft instead of a chain */
#define AS_DRAFT_MERGE 2u   /* score global+local counts merged per pattern */
#define AS_DRAFT_NO_LOCAL 4u  /* ignore the per-request tree */
#define AS_DRAFT_NO_GLOBAL 8u /* ignore the global tree */
#define AS_DRAFT_CONF 16u     /* weigh every token by conf[] (see as_draft_params) */

/* Bins of the confidence table: bin(x) = bit length of min(x, 127), 0..7. */
#define AS_CONF_BINS 8

typedef struct as_draft_params {
    uint32_t max_spec_tokens; /* 1..AS_MAX_SPEC_LIMIT */
    uint32_t max_pattern;     /* longest pattern tried; 0 = max_depth-1 */
    uint32_t min_pattern;     /* shortest pattern tried; 0 = 1 */
    uint32_t flags;           /* AS_DRAFT_* */
    uint32_t vocab_size;      /* 0: no bound; else a token >= vocab_size ends its
                                 branch (a chain stops before it, a tree draft
                                 skips it and its subtree) */
    double alpha;             /* max_spec_factor (>= 0): draft <= alpha*p + offset */
    double offset;            /* max_spec_offset */
    double min_token_prob;    /* drop tokens with D below this */
    double min_score;         /* drafts scoring below this are returned empty */
    /* With AS_DRAFT_CONF: conf[bin(L) * AS_CONF_BINS + bin(T)] in [0, 1] is how
     * often a token is accepted when the text it continues matched L tokens
     * (pattern length plus the tokens drafted before it) and occurred T
     * times; D is multiplied by it at every token, so the budget follows the
     * path's confidence and short or rare matches stop sooner. */
    float conf[64]; /* AS_CONF_BINS * AS_CONF_BINS */
} as_draft_params;

/* Defaults: 32 tokens, alpha 1, offset 0, min_token_prob 0.1, linear, no vocab bound. */
void as_draft_params_default(as_draft_params *p);

/* One draft, written into caller buffers of capacity cap (>= the number of
 * tokens the draft may hold, i.e. params->max_spec_tokens).
 * parents[i] is the index of token i's parent in the draft, -1 for a child of
 * the match point; a linear draft has parents -1, 0, 1, ...
 * source: 0 none, 1 global, 2 per-request, 3 merged; global_index: which of
 * the global trees passed to as_draft_multi (0 otherwise). */
typedef struct as_draft_out {
    int32_t *tokens;
    int32_t *parents;
    float *probs;
    uint32_t cap;
    uint32_t n;            /* out */
    uint32_t match_len;    /* out */
    uint32_t source;       /* out */
    double score;          /* out */
    uint32_t global_index; /* out */
} as_draft_out;

/* Draft for one request from its cursor and an optional global tree.
 * The global tree is only read.  The cursor's match state is updated. */
int as_draft(as_cursor *cur, const as_tree *global, const as_draft_params *params,
             as_draft_out *out);

/* Draft from a cursor and up to AS_MAX_GLOBALS global trees (NULL entries
 * are skipped), e.g. a stage shard and a pipeline-wide tree.  The cursor
 * keeps one incremental match state per global tree (the AS_MAX_GLOBALS
 * most recently used).  Without AS_DRAFT_MERGE each tree drafts on its own
 * and the best score wins; ties go to the per-request tree, then to the
 * earlier global tree in the array.  With AS_DRAFT_MERGE all trees' counts
 * are added. */
int as_draft_multi(as_cursor *cur, const as_tree *const *globals, size_t n_globals,
                   const as_draft_params *params, as_draft_out *out);

/* Draft directly from a context (no cursor): matches every pattern length
 * from scratch (O(p^2) for the longest match p) in `global` and in `local`
 * (a per-request tree; either may be NULL).  The context's own occurrence in
 * `local` never counts: it has no continuation. */
int as_draft_context(const as_tree *global, const as_tree *local, const int32_t *context,
                     size_t n, const as_draft_params *params, as_draft_out *out);

/* Draft for a context given by the caller, normally the tail of the
 * cursor's own context (what vLLM and arctic-style callers pass).  When ctx
 * ends with the cursor's last tokens and covers every pattern length the
 * cursor tracks (min(len, max_depth-1) tokens), this is as_draft, incremental;
 * otherwise ctx is matched from scratch against the cursor's per-request
 * tree and `global`, as as_draft_context does. */
int as_draft_tail(as_cursor *cur, const as_tree *global, const int32_t *ctx, size_t n,
                  const as_draft_params *params, as_draft_out *out);

/* Batched drafting: one decode step of a serving engine.  For item i:
 * append new_tokens[offsets[i] .. offsets[i+1]) to cursors[i], then draft
 * from cursors[i] and globals[i] (may be NULL) into row i of the outputs:
 * tokens/parents/probs are n_items x stride arrays (stride >=
 * params->max_spec_tokens), n_out/match_len/source/score have n_items
 * entries.  new_tokens/offsets may be NULL (no appends).  n_threads <= 1
 * runs on the calling thread.  Each item's status is written to statuses
 * (may be NULL); the call returns the first non-OK status, or AS_OK.  Items
 * are independent: one failing does not stop the others. */
int as_draft_batch(as_cursor *const *cursors, const as_tree *const *globals, size_t n_items,
                   const int32_t *new_tokens, const uint64_t *offsets,
                   const as_draft_params *params, int32_t *tokens, int32_t *parents,
                   float *probs, uint32_t stride, uint32_t *n_out, uint32_t *match_len,
                   uint32_t *source, double *score, int32_t *statuses, uint32_t n_threads);

/* Output rows of a batched draft (caller-owned): tokens/parents/probs are
 * n_items x stride arrays; n_out and the optional (may be NULL) match_len,
 * source, global_index, score and statuses have n_items entries. */
typedef struct as_batch_out {
    int32_t *tokens;
    int32_t *parents;
    float *probs;
    uint32_t stride;
    uint32_t *n_out;
    uint32_t *match_len;
    uint32_t *source;
    uint32_t *global_index;
    double *score;
    int32_t *statuses;
} as_batch_out;

/* Batched drafting from several global trees per item: as as_draft_batch,
 * but item i drafts as as_draft_multi does, from cursors[i] and the
 * n_globals[i] trees at globals[i * globals_stride ..] (NULL entries are
 * skipped; globals_stride <= AS_MAX_GLOBALS; n_globals NULL: one tree per
 * item; globals NULL: none), and with at most caps[i] tokens (caps NULL:
 * params->max_spec_tokens for every item; larger caps are clamped to it; 0:
 * no draft, the item's new tokens are still appended).  global_index[i]
 * names the tree among item i's that its draft came from. */
int as_draft_batch_multi(as_cursor *const *cursors, const as_tree *const *globals,
                         uint32_t globals_stride, const uint32_t *n_globals, size_t n_items,
                         const int32_t *new_tokens, const uint64_t *offsets, const uint32_t *caps,
                         const as_draft_params *params, const as_batch_out *out,
                         uint32_t n_threads);

#ifdef __cplusplus
}
#endif
#endif /* AGENTSPEC_H */
