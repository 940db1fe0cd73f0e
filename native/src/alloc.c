/*
 * alloc.c -- allocator hook and byte accounting (see alloc.h).
 *
 * The hook is process-wide and may only be replaced while no handle exists,
 * so a block is always freed by the allocator that made it.  Counters are
 * C11 atomics because cursors on batch worker threads allocate concurrently.
 */
#include "alloc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "agentspec.h"

static void *default_malloc(size_t size, void *ctx) { (void)ctx; return malloc(size); }
static void *default_realloc(void *p, size_t size, void *ctx) { (void)ctx; return realloc(p, size); }
static void default_free(void *p, void *ctx) { (void)ctx; free(p); }

static as_malloc_fn hook_malloc = default_malloc;
static as_realloc_fn hook_realloc = default_realloc;
static as_free_fn hook_free = default_free;
static void *hook_ctx = NULL;

static _Atomic uint64_t total_bytes = 0;
static _Atomic int64_t live_handles = 0;

int as_set_allocator(as_malloc_fn m, as_realloc_fn r, as_free_fn f, void *ctx) {
    if (atomic_load(&live_handles) != 0) return AS_ERR_INVALID_ARG;
    if (m == NULL && r == NULL && f == NULL) {
        hook_malloc = default_malloc;
        hook_realloc = default_realloc;
        hook_free = default_free;
        hook_ctx = NULL;
        return AS_OK;
    }
    if (m == NULL || r == NULL || f == NULL) return AS_ERR_INVALID_ARG;
    hook_malloc = m;
    hook_realloc = r;
    hook_free = f;
    hook_ctx = ctx;
    return AS_OK;
}

uint64_t as_allocated_bytes(void) { return atomic_load(&total_bytes); }

void as_handle_opened(void) { atomic_fetch_add(&live_handles, 1); }
void as_handle_closed(void) { atomic_fetch_sub(&live_handles, 1); }

static void account(uint64_t *acct, size_t add, size_t sub) {
    if (add) atomic_fetch_add(&total_bytes, (uint64_t)add);
    if (sub) atomic_fetch_sub(&total_bytes, (uint64_t)sub);
    if (acct != NULL) *acct = *acct + add - sub;
}

void *as_xmalloc(uint64_t *acct, size_t size) {
    if (size == 0) size = 1;
    void *p = hook_malloc(size, hook_ctx);
    if (p != NULL) account(acct, size, 0);
    return p;
}

void *as_xcalloc(uint64_t *acct, size_t n, size_t size) {
    size_t total = as_mul_size(n, size);
    if (total == 0 && n != 0 && size != 0) return NULL;
    void *p = as_xmalloc(acct, total);
    if (p != NULL) memset(p, 0, total == 0 ? 1 : total);
    return p;
}

void *as_xrealloc(uint64_t *acct, void *ptr, size_t old_size, size_t new_size) {
    if (ptr == NULL) return as_xmalloc(acct, new_size);
    if (new_size == 0) new_size = 1;
    if (old_size == 0) old_size = 1;
    void *p = hook_realloc(ptr, new_size, hook_ctx);
    if (p != NULL) account(acct, new_size, old_size);
    return p;
}

void as_xfree(uint64_t *acct, void *ptr, size_t size) {
    if (ptr == NULL) return;
    if (size == 0) size = 1;
    hook_free(ptr, hook_ctx);
    account(acct, 0, size);
}
