/*
 * fuzz_common.h -- shared bits of the fuzz harnesses: a hard assertion that
 * names the broken property (a fuzzer finding must abort), and a byte
 * reader that turns the fuzzer's input into parameters, yielding zeros once
 * the input is used up.
 */
#ifndef AGENTSPEC_FUZZ_COMMON_H
#define AGENTSPEC_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Abort with file:line and the failed condition. */
#define FZ_ASSERT(cond)                                                              \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: fuzz property failed: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                 \
        }                                                                            \
    } while (0)

typedef struct fz_reader {
    const uint8_t *p;
    size_t n, pos;
} fz_reader;

static inline int fz_more(const fz_reader *r) { return r->pos < r->n; }

static inline uint8_t fz_u8(fz_reader *r) { return r->pos < r->n ? r->p[r->pos++] : 0; }

static inline uint32_t fz_u32(fz_reader *r) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)fz_u8(r) << (8 * i);
    return v;
}

/* A value in [0, n) (n > 0) from one byte. */
static inline uint32_t fz_below(fz_reader *r, uint32_t n) { return fz_u8(r) % n; }

#endif /* AGENTSPEC_FUZZ_COMMON_H */
