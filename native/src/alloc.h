/*
 * alloc.h -- the one allocator hook and exact byte accounting.
 *
 * Every block the library allocates goes through as_xmalloc/as_xrealloc/
 * as_xfree.  Callers pass the block's size on free and realloc (the library
 * always knows it), and an optional per-handle counter, so that
 * as_tree_stats.bytes is the exact sum of live block sizes, not an estimate.
 * A process-wide atomic counter backs as_allocated_bytes().
 */
#ifndef AS_ALLOC_H
#define AS_ALLOC_H

#include <stddef.h>
#include <stdint.h>

void *as_xmalloc(uint64_t *acct, size_t size);
void *as_xcalloc(uint64_t *acct, size_t n, size_t size);
/* Resize a block of old_size bytes; on failure the old block is intact. */
void *as_xrealloc(uint64_t *acct, void *ptr, size_t old_size, size_t new_size);
void as_xfree(uint64_t *acct, void *ptr, size_t size);

/* Live-handle bookkeeping: the allocator may only change with none alive. */
void as_handle_opened(void);
void as_handle_closed(void);

/* Overflow-checked size multiplication: 0 on overflow. */
static inline size_t as_mul_size(size_t a, size_t b) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    return a * b;
}

#endif
