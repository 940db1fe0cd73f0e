/*
 * idmap.h -- open-addressing map from a caller's int64 sequence id to the
 * tree's internal sequence index (uint32).  Same probing and fill rules as
 * childmap.h; the value IDM_EMPTY / IDM_TOMB marks free slots, so every
 * int64 is a valid key.
 */
#ifndef AS_IDMAP_H
#define AS_IDMAP_H

#include <stdint.h>

#define IDM_EMPTY UINT32_MAX
#define IDM_TOMB (UINT32_MAX - 1)

typedef struct idm_slot {
    int64_t key;
    uint32_t val;
} idm_slot;

typedef struct idmap {
    uint32_t cap, size, tombs;
    idm_slot *slots;
} idmap;

int idm_init(uint64_t *acct, idmap *m);
void idm_destroy(uint64_t *acct, idmap *m);
uint32_t idm_get(const idmap *m, int64_t key); /* IDM_EMPTY if absent */
int idm_put(uint64_t *acct, idmap *m, int64_t key, uint32_t val); /* key absent */
void idm_del(uint64_t *acct, idmap *m, int64_t key);
/* Make sure one more insert cannot fail. */
int idm_reserve(uint64_t *acct, idmap *m);

#endif
