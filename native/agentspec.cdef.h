/*
 * agentspec.cdef.h -- the C API of native/include/agentspec.h in CFFI cdef
 * syntax, read by native/ffi_build.py.
 *
 * Keep in sync with agentspec.h: tests/test_cdef_sync.py checks that every
 * AS_* constant, as_* type and as_* prototype of the header appears here
 * (and nothing else).  Integer macros are declared as `#define X ...` so the
 * compiler supplies their values; enum values are spelled out and CFFI's API
 * mode checks them against the header when the extension is built.
 */

#define AS_VERSION_MAJOR ...
#define AS_VERSION_MINOR ...
#define AS_VERSION_PATCH ...

#define AS_MAX_DEPTH_LIMIT ...
#define AS_DEFAULT_MAX_DEPTH ...
#define AS_MAX_SPEC_LIMIT ...
#define AS_MAX_GLOBALS ...

/* --- Status codes ------------------------------------------------------ */

typedef enum as_status {
    AS_OK = 0,
    AS_ERR_NOMEM = 1,
    AS_ERR_INVALID_ARG = 2,
    AS_ERR_INVALID_TOKEN = 3,
    AS_ERR_SEQ_EXISTS = 4,
    AS_ERR_SEQ_NOT_FOUND = 5,
    AS_ERR_SEQ_CLOSED = 6,
    AS_ERR_CAPACITY = 7,
    AS_ERR_FORMAT = 8,
    AS_ERR_VERSION = 9,
    AS_ERR_TRUNCATED = 10,
    AS_ERR_CHECKSUM = 11,
    AS_ERR_DEPTH_MISMATCH = 12,
    AS_ERR_THREAD = 13
} as_status;

const char *as_strerror(int status);

/* --- Allocator hook ---------------------------------------------------- */

typedef void *(*as_malloc_fn)(size_t size, void *ctx);
typedef void *(*as_realloc_fn)(void *ptr, size_t size, void *ctx);
typedef void (*as_free_fn)(void *ptr, void *ctx);
int as_set_allocator(as_malloc_fn m, as_realloc_fn r, as_free_fn f, void *ctx);

uint64_t as_allocated_bytes(void);

/* --- Trees ------------------------------------------------------------- */

typedef struct as_tree as_tree;

as_tree *as_tree_create(uint32_t max_depth, int *status);
void as_tree_free(as_tree *tree);

uint32_t as_tree_max_depth(const as_tree *tree);

int as_tree_add(as_tree *tree, int64_t seq_id, const int32_t *tokens, size_t n);
int as_tree_append(as_tree *tree, int64_t seq_id, const int32_t *tokens, size_t n);
int as_tree_close(as_tree *tree, int64_t seq_id);
int as_tree_remove(as_tree *tree, int64_t seq_id);
int as_tree_contains(const as_tree *tree, int64_t seq_id);

int as_tree_seq_len(const as_tree *tree, int64_t seq_id, uint64_t *len);
int as_tree_seq_tokens(const as_tree *tree, int64_t seq_id, int32_t *out, size_t cap);
int as_tree_seq_ids(const as_tree *tree, int64_t *out, size_t cap, size_t *n);

typedef struct as_tree_stats {
    uint64_t sequences;
    uint64_t open_sequences;
    uint64_t tokens;
    uint64_t nodes;
    uint64_t bytes;
    uint64_t retained_tokens;
    uint64_t free_bytes;
    uint32_t max_depth;
} as_tree_stats;

int as_tree_stats_get(const as_tree *tree, as_tree_stats *out);
int as_tree_count(const as_tree *tree, const int32_t *tokens, size_t n, uint64_t *count);
int as_tree_check(const as_tree *tree);

/* --- Shard format ------------------------------------------------------ */

#define AS_SHARD_SNAPSHOT ...
#define AS_SHARD_DELTA ...
#define AS_SHARD_HEADER_BYTES ...

int as_tree_save_bound(const as_tree *tree, uint64_t *size);
int as_tree_save(const as_tree *tree, uint8_t *buf, size_t cap, size_t *written);
int as_tree_delta_bound(const as_tree *tree, const int64_t *seq_ids, size_t n_ids,
                        size_t n_remove, uint64_t *size);
int as_tree_save_delta(const as_tree *tree, const int64_t *seq_ids, size_t n_ids,
                       const int64_t *remove_ids, size_t n_remove,
                       uint8_t *buf, size_t cap, size_t *written);
int as_shard_inspect(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                     uint64_t *n_sequences, uint64_t *n_removals, uint64_t *n_tokens);
int as_shard_peek(const uint8_t *buf, size_t len, uint32_t *kind, uint32_t *max_depth,
                  uint64_t *n_sequences, uint64_t *n_removals);
int as_shard_max_token(const uint8_t *buf, size_t len, int32_t *max_token);
int as_tree_load(as_tree *tree, const uint8_t *buf, size_t len);
as_tree *as_tree_from_bytes(const uint8_t *buf, size_t len, int *status);

/* --- Cursors (per-request state) ---------------------------------------- */

typedef struct as_cursor as_cursor;

#define AS_CURSOR_LOCAL_TREE ...

as_cursor *as_cursor_create(uint32_t max_depth, uint32_t flags, int *status);
void as_cursor_free(as_cursor *cur);
int as_cursor_extend(as_cursor *cur, const int32_t *tokens, size_t n);
uint64_t as_cursor_len(const as_cursor *cur);
const as_tree *as_cursor_local_tree(const as_cursor *cur);

/* --- Drafting ---------------------------------------------------------- */

#define AS_DRAFT_TREE ...
#define AS_DRAFT_MERGE ...
#define AS_DRAFT_NO_LOCAL ...
#define AS_DRAFT_NO_GLOBAL ...
#define AS_DRAFT_CONF ...
#define AS_CONF_BINS ...

typedef struct as_draft_params {
    uint32_t max_spec_tokens;
    uint32_t max_pattern;
    uint32_t min_pattern;
    uint32_t flags;
    uint32_t vocab_size;
    double alpha;
    double offset;
    double min_token_prob;
    double min_score;
    float conf[64];
} as_draft_params;

void as_draft_params_default(as_draft_params *p);

typedef struct as_draft_out {
    int32_t *tokens;
    int32_t *parents;
    float *probs;
    uint32_t cap;
    uint32_t n;
    uint32_t match_len;
    uint32_t source;
    double score;
    uint32_t global_index;
} as_draft_out;

int as_draft(as_cursor *cur, const as_tree *global, const as_draft_params *params,
             as_draft_out *out);
int as_draft_multi(as_cursor *cur, const as_tree *const *globals, size_t n_globals,
                   const as_draft_params *params, as_draft_out *out);
int as_draft_context(const as_tree *global, const as_tree *local, const int32_t *context,
                     size_t n, const as_draft_params *params, as_draft_out *out);
int as_draft_tail(as_cursor *cur, const as_tree *global, const int32_t *ctx, size_t n,
                  const as_draft_params *params, as_draft_out *out);
int as_draft_batch(as_cursor *const *cursors, const as_tree *const *globals, size_t n_items,
                   const int32_t *new_tokens, const uint64_t *offsets,
                   const as_draft_params *params, int32_t *tokens, int32_t *parents,
                   float *probs, uint32_t stride, uint32_t *n_out, uint32_t *match_len,
                   uint32_t *source, double *score, int32_t *statuses, uint32_t n_threads);

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

int as_draft_batch_multi(as_cursor *const *cursors, const as_tree *const *globals,
                         uint32_t globals_stride, const uint32_t *n_globals, size_t n_items,
                         const int32_t *new_tokens, const uint64_t *offsets, const uint32_t *caps,
                         const as_draft_params *params, const as_batch_out *out,
                         uint32_t n_threads);
