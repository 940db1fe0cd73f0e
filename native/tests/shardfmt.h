/*
 * shardfmt.h -- the shard format's byte layout, for tests and fuzzers that
 * edit shard bytes: header offsets, little-endian helpers and the payload
 * checksum.  This is an independent implementation of the format described
 * in agentspec.h and src/shard.c; test_shard.c's test_checksum_agrees pins
 * it to the engine, so a format change shows up there first.
 */
#ifndef AGENTSPEC_SHARDFMT_H
#define AGENTSPEC_SHARDFMT_H

#include <stddef.h>
#include <stdint.h>

#include "agentspec.h"

/* Header offsets. */
enum {
    SF_OFF_MAGIC = 0,
    SF_OFF_VERSION = 4,
    SF_OFF_KIND = 6,
    SF_OFF_DEPTH = 8,
    SF_OFF_RESERVED = 12,
    SF_OFF_NSEQ = 16,
    SF_OFF_NREM = 24,
    SF_OFF_PAYLOAD = 32,
    SF_OFF_SUM = 40
};
#define SF_VERSION 1

static inline uint64_t sf_rd64(const uint8_t *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}
static inline uint32_t sf_rd32(const uint8_t *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static inline void sf_wr64(uint8_t *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
}
static inline void sf_wr32(uint8_t *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
}
static inline void sf_wr16(uint8_t *b, uint16_t v) {
    b[0] = (uint8_t)v;
    b[1] = (uint8_t)(v >> 8);
}

static inline uint64_t sf_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The payload checksum ("checksum64" in src/shard.c). */
static inline uint64_t sf_checksum(const uint8_t *p, size_t n) {
    const uint64_t k1 = 0x9E3779B185EBCA87ull, k2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t h = 0x27D4EB2F165667C5ull ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        h ^= sf_rotl(sf_rd64(p + i) * k2, 31) * k1;
        h = sf_rotl(h, 27) * k1 + 0x52DCE729u;
    }
    for (; i < n; i++) {
        h ^= (uint64_t)p[i] * k1;
        h = sf_rotl(h, 11) * k2;
    }
    h ^= h >> 33;
    h *= k2;
    h ^= h >> 29;
    h *= 0x165667B19E3779F9ull;
    h ^= h >> 32;
    return h;
}

/* The shard checksum: header bytes 0..39 combined with the payload's. */
static inline uint64_t sf_shard_checksum(const uint8_t *buf, size_t len) {
    uint64_t h = sf_checksum(buf, 40);
    return sf_checksum(buf + AS_SHARD_HEADER_BYTES, len - AS_SHARD_HEADER_BYTES) ^
           (h * 0x9E3779B97F4A7C15ull + (h >> 29));
}

/* Rewrite the checksum field for the current header and payload (len >= header). */
static inline void sf_reseal(uint8_t *buf, size_t len) {
    sf_wr64(buf + SF_OFF_SUM, sf_shard_checksum(buf, len));
}

#endif /* AGENTSPEC_SHARDFMT_H */
