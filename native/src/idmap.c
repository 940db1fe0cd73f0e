/*
 * idmap.c -- int64 -> uint32 open-addressing map (design in idmap.h).
 */
#include "idmap.h"

#include "agentspec.h"
#include "alloc.h"

static inline uint32_t hash64(int64_t key) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32);
}

static int resize(uint64_t *acct, idmap *m, uint32_t cap) {
    idm_slot *slots = as_xmalloc(acct, sizeof(idm_slot) * (size_t)cap);
    if (slots == NULL) return AS_ERR_NOMEM;
    for (uint32_t i = 0; i < cap; i++) slots[i].val = IDM_EMPTY;
    uint32_t mask = cap - 1;
    for (uint32_t j = 0; j < m->cap; j++) {
        if (m->slots[j].val >= IDM_TOMB) continue;
        uint32_t i = hash64(m->slots[j].key) & mask;
        for (uint32_t step = 1; slots[i].val != IDM_EMPTY; step++) i = (i + step) & mask;
        slots[i] = m->slots[j];
    }
    as_xfree(acct, m->slots, sizeof(idm_slot) * (size_t)m->cap);
    m->slots = slots;
    m->cap = cap;
    m->tombs = 0;
    return AS_OK;
}

int idm_init(uint64_t *acct, idmap *m) {
    m->cap = 8;
    m->size = 0;
    m->tombs = 0;
    m->slots = as_xmalloc(acct, sizeof(idm_slot) * 8);
    if (m->slots == NULL) return AS_ERR_NOMEM;
    for (uint32_t i = 0; i < 8; i++) m->slots[i].val = IDM_EMPTY;
    return AS_OK;
}

void idm_destroy(uint64_t *acct, idmap *m) {
    if (m->slots != NULL) as_xfree(acct, m->slots, sizeof(idm_slot) * (size_t)m->cap);
    m->slots = NULL;
    m->cap = m->size = m->tombs = 0;
}

uint32_t idm_get(const idmap *m, int64_t key) {
    uint32_t mask = m->cap - 1;
    uint32_t i = hash64(key) & mask;
    for (uint32_t step = 1; step <= m->cap; step++) {
        uint32_t v = m->slots[i].val;
        if (v == IDM_EMPTY) return IDM_EMPTY;
        if (v != IDM_TOMB && m->slots[i].key == key) return v;
        i = (i + step) & mask;
    }
    return IDM_EMPTY;
}

int idm_reserve(uint64_t *acct, idmap *m) {
    if ((uint64_t)(m->size + m->tombs + 1) * 4 <= (uint64_t)m->cap * 3) return AS_OK;
    uint32_t cap = m->cap;
    while ((uint64_t)(m->size + 1) * 8 > (uint64_t)cap * 3) {
        if (cap >= (1u << 31)) return AS_ERR_CAPACITY;
        cap <<= 1;
    }
    return resize(acct, m, cap);
}

int idm_put(uint64_t *acct, idmap *m, int64_t key, uint32_t val) {
    int rc = idm_reserve(acct, m);
    if (rc != AS_OK) return rc;
    uint32_t mask = m->cap - 1;
    uint32_t i = hash64(key) & mask;
    for (uint32_t step = 1; m->slots[i].val < IDM_TOMB; step++) i = (i + step) & mask;
    if (m->slots[i].val == IDM_TOMB) m->tombs--;
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->size++;
    return AS_OK;
}

void idm_del(uint64_t *acct, idmap *m, int64_t key) {
    uint32_t mask = m->cap - 1;
    uint32_t i = hash64(key) & mask;
    for (uint32_t step = 1; step <= m->cap; step++) {
        uint32_t v = m->slots[i].val;
        if (v == IDM_EMPTY) return;
        if (v != IDM_TOMB && m->slots[i].key == key) {
            m->slots[i].val = IDM_TOMB;
            m->size--;
            m->tombs++;
            if (m->cap > 8 && (uint64_t)m->size * 8 < m->cap) (void)resize(acct, m, m->cap / 2);
            return;
        }
        i = (i + step) & mask;
    }
}
