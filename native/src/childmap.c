/*
 * childmap.c -- the open-addressing child map (design in childmap.h).
 */
#include "childmap.h"

#include <assert.h>

#include "agentspec.h"
#include "alloc.h"

/* Fill limits as fractions of capacity (numerator over 8). */
#define CM_MAX_FILL_8 6 /* live + tombstones <= 6/8 */
#define CM_MIN_FILL_8 1 /* shrink when live < 1/8 */
static_assert(2 * CM_MIN_FILL_8 < CM_MAX_FILL_8, "hysteresis: shrink target must stay below grow limit");
static_assert((CM_MIN_CAP & (CM_MIN_CAP - 1)) == 0, "capacity must be a power of two");

static inline uint32_t hash_key(int32_t key) {
    uint32_t h = (uint32_t)key * 0x9E3779B1u;
    return h ^ (h >> 15);
}

static uint32_t cap_for(uint32_t n) {
    uint32_t cap = CM_MIN_CAP;
    /* smallest power of two with n <= cap * 6/8 */
    while ((uint64_t)n * 8 > (uint64_t)cap * CM_MAX_FILL_8) cap <<= 1;
    return cap;
}

childmap *cm_create(uint64_t *acct, uint32_t n) {
    uint32_t cap = cap_for(n);
    childmap *m = as_xmalloc(acct, (size_t)cm_bytes(cap));
    if (m == NULL) return NULL;
    m->cap = cap;
    m->size = 0;
    m->tombs = 0;
    m->best = CM_NONE;
    m->sum = 0;
    for (uint32_t i = 0; i < cap; i++) m->slots[i].key = CM_EMPTY;
    return m;
}

void cm_free(uint64_t *acct, childmap *m) {
    if (m != NULL) as_xfree(acct, m, (size_t)cm_bytes(m->cap));
}

uint32_t *cm_ref(childmap *m, int32_t key) {
    uint32_t mask = m->cap - 1;
    uint32_t i = hash_key(key) & mask;
    for (uint32_t step = 1; step <= m->cap; step++) {
        int32_t k = m->slots[i].key;
        if (k == key) return &m->slots[i].val;
        if (k == CM_EMPTY) return NULL;
        i = (i + step) & mask;
    }
    return NULL;
}

uint32_t cm_get(const childmap *m, int32_t key) {
    uint32_t *v = cm_ref((childmap *)m, key);
    return v ? *v : CM_NONE;
}

/* Place key into a table known to have room and not to contain it. */
static void place(childmap *m, int32_t key, uint32_t val) {
    uint32_t mask = m->cap - 1;
    uint32_t i = hash_key(key) & mask;
    for (uint32_t step = 1;; step++) {
        int32_t k = m->slots[i].key;
        if (k == CM_EMPTY || k == CM_TOMB) {
            if (k == CM_TOMB) m->tombs--;
            m->slots[i].key = key;
            m->slots[i].val = val;
            m->size++;
            return;
        }
        i = (i + step) & mask;
    }
}

/* Rebuild into a fresh table of new_cap slots (drops tombstones). */
static int rehash(uint64_t *acct, childmap **mp, uint32_t new_cap) {
    childmap *old = *mp;
    childmap *m = as_xmalloc(acct, (size_t)cm_bytes(new_cap));
    if (m == NULL) return AS_ERR_NOMEM;
    m->cap = new_cap;
    m->size = 0;
    m->tombs = 0;
    m->best = old->best;
    m->sum = old->sum;
    for (uint32_t i = 0; i < new_cap; i++) m->slots[i].key = CM_EMPTY;
    for (uint32_t i = 0; i < old->cap; i++)
        if (old->slots[i].key >= 0) place(m, old->slots[i].key, old->slots[i].val);
    cm_free(acct, old);
    *mp = m;
    return AS_OK;
}

int cm_insert(uint64_t *acct, childmap **mp, int32_t key, uint32_t val) {
    childmap *m = *mp;
    if ((uint64_t)(m->size + m->tombs + 1) * 8 > (uint64_t)m->cap * CM_MAX_FILL_8) {
        uint32_t cap = cap_for(m->size + 1);
        if (cap < m->cap) cap = m->cap; /* tombstone clean-up at same size */
        int rc = rehash(acct, mp, cap);
        if (rc != AS_OK) return rc;
        m = *mp;
    }
    place(m, key, val);
    return AS_OK;
}

int cm_erase(uint64_t *acct, childmap **mp, int32_t key) {
    childmap *m = *mp;
    uint32_t mask = m->cap - 1;
    uint32_t i = hash_key(key) & mask;
    for (uint32_t step = 1; step <= m->cap; step++) {
        int32_t k = m->slots[i].key;
        if (k == CM_EMPTY) return 0;
        if (k == key) {
            m->slots[i].key = CM_TOMB;
            m->size--;
            m->tombs++;
            if (m->cap > CM_MIN_CAP && (uint64_t)m->size * 8 < (uint64_t)m->cap * CM_MIN_FILL_8)
                (void)rehash(acct, mp, cap_for(m->size)); /* keeps the old table on failure */
            return 1;
        }
        i = (i + step) & mask;
    }
    return 0;
}
