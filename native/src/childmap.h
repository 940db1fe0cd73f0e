/*
 * childmap.h -- open-addressing hash map from token id (int32 >= 0) to a
 * child node index (uint32), used for nodes with more than two children.
 *
 * Layout: one block = header + `cap` slots of {key, val}, cap a power of two
 * (>= CM_MIN_CAP).  Keys are token ids, so every int32 >= 0 is a valid key;
 * the sentinels CM_EMPTY (-1) and CM_TOMB (-2) are negative and internal.
 * Probing is triangular (idx += 1, 2, 3, ...), which visits every slot of a
 * power-of-two table.  Fill (live + tombstones) is kept <= 3/4; a table
 * whose live entries drop below 1/8 halves (hysteresis: growing lands at
 * <= 3/8 + ..., shrinking at <= 1/4, so the two never chase each other).
 * `sum` and `best` are carried for the tree (sum of child counts, index of
 * the most frequent child); the map only preserves them.
 */
#ifndef AS_CHILDMAP_H
#define AS_CHILDMAP_H

#include <stdint.h>

#define CM_EMPTY (-1)
#define CM_TOMB (-2)
#define CM_MIN_CAP 4u
#define CM_NONE UINT32_MAX

typedef struct cm_slot {
    int32_t key;
    uint32_t val;
} cm_slot;

typedef struct childmap {
    uint32_t cap;   /* power of two */
    uint32_t size;  /* live entries */
    uint32_t tombs; /* tombstones */
    uint32_t best;  /* tree's: most frequent child node */
    uint64_t sum;   /* tree's: sum of child counts */
    cm_slot slots[];
} childmap;

/* Bytes of a map block with cap slots. */
static inline uint64_t cm_bytes(uint32_t cap) {
    return (uint64_t)sizeof(childmap) + (uint64_t)cap * sizeof(cm_slot);
}

/* New map with room for at least n entries; NULL on allocation failure. */
childmap *cm_create(uint64_t *acct, uint32_t n);
void cm_free(uint64_t *acct, childmap *m);

/* Value for key, or CM_NONE. */
uint32_t cm_get(const childmap *m, int32_t key);
/* Pointer to the value slot of key, or NULL. */
uint32_t *cm_ref(childmap *m, int32_t key);
/* Insert a key that is not present.  May reallocate *m.  0 or AS_ERR_NOMEM. */
int cm_insert(uint64_t *acct, childmap **m, int32_t key, uint32_t val);
/* Erase a present key; may shrink *m (a failed shrink is harmless).
 * Returns 1 if erased, 0 if absent. */
int cm_erase(uint64_t *acct, childmap **m, int32_t key);

#endif
