/*
 * gen_corpus.c -- writes the seed corpora at build time (no binaries are
 * committed):
 *
 *   gen_corpus DIR
 *     DIR/shard/  valid snapshots and deltas made by the engine (empty,
 *                 small, INT32_MAX tokens, open sequences, depths 2..1024),
 *                 each prefixed by fuzz_shard's mode byte
 *     DIR/api/    deterministic pseudo-random programs for fuzz_api
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "agentspec.h"

static void die(const char *what) {
    fprintf(stderr, "gen_corpus: %s\n", what);
    exit(1);
}

static void mkdir_p(const char *path) {
    if (mkdir(path, 0755) != 0 && errno != EEXIST) die("cannot create a directory");
}

static void write_file(const char *dir, const char *name, uint8_t mode, const uint8_t *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL) die("cannot write a seed file");
    if (fwrite(&mode, 1, 1, f) != 1 || (n && fwrite(p, 1, n, f) != n)) die("short write");
    fclose(f);
}

static uint8_t *snapshot(const as_tree *t, size_t *len) {
    uint64_t bound = 0;
    if (as_tree_save_bound(t, &bound) != AS_OK) die("save_bound");
    uint8_t *b = malloc((size_t)bound);
    if (b == NULL || as_tree_save(t, b, (size_t)bound, len) != AS_OK) die("save");
    return b;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

static void shard_seeds(const char *dir) {
    static const uint32_t depths[] = {2, 3, 8, 64, AS_MAX_DEPTH_LIMIT};
    char name[64];
    int k = 0;
    for (size_t d = 0; d < sizeof depths / sizeof depths[0]; d++) {
        as_tree *t = as_tree_create(depths[d], NULL);
        if (t == NULL) die("create");
        for (int64_t id = -1; id < 4 + (int64_t)d; id++) {
            int32_t toks[40];
            size_t n = next() % 40;
            for (size_t i = 0; i < n; i++) toks[i] = next() % 11 == 0 ? INT32_MAX : (int32_t)(next() % 4);
            int rc = id % 2 ? as_tree_append(t, id, toks, n) : as_tree_add(t, id, toks, n);
            if (rc != AS_OK) die("add");
        }
        size_t len = 0;
        uint8_t *b = snapshot(t, &len);
        for (uint8_t mode = 0; mode < 8; mode += 3) {
            snprintf(name, sizeof name, "snapshot-%02d", k++);
            write_file(dir, name, mode, b, len);
        }
        free(b);
        /* a delta: some sequences, some removals (present and absent ids) */
        const int64_t add[] = {0, 2}, rm[] = {1, 3, 99};
        uint64_t bound = 0;
        if (as_tree_delta_bound(t, add, 2, 3, &bound) != AS_OK) die("delta_bound");
        b = malloc((size_t)bound);
        if (b == NULL || as_tree_save_delta(t, add, 2, rm, 3, b, (size_t)bound, &len) != AS_OK)
            die("save_delta");
        snprintf(name, sizeof name, "delta-%02d", k++);
        write_file(dir, name, 2, b, len);
        snprintf(name, sizeof name, "delta-%02d", k++);
        write_file(dir, name, 1 | 6, b, len);
        free(b);
        as_tree_free(t);
    }
    /* an empty snapshot */
    as_tree *e = as_tree_create(8, NULL);
    if (e == NULL) die("create");
    size_t len = 0;
    uint8_t *b = snapshot(e, &len);
    write_file(dir, "snapshot-empty", 0, b, len);
    free(b);
    as_tree_free(e);
}

static void api_seeds(const char *dir) {
    char name[64];
    for (int k = 0; k < 24; k++) {
        uint8_t prog[600];
        size_t n = 40 + next() % (sizeof prog - 40);
        for (size_t i = 0; i < n; i++) prog[i] = (uint8_t)next();
        /* bias the first bytes towards small depths and a per-request tree */
        prog[0] = (uint8_t)(k % 7);
        prog[1] = (uint8_t)(k & 1);
        prog[3] = 1;
        snprintf(name, sizeof name, "program-%02d", k);
        write_file(dir, name, prog[0], prog + 1, n - 1);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) die("usage: gen_corpus DIR");
    char sub[4096];
    mkdir_p(argv[1]);
    snprintf(sub, sizeof sub, "%s/shard", argv[1]);
    mkdir_p(sub);
    shard_seeds(sub);
    snprintf(sub, sizeof sub, "%s/api", argv[1]);
    mkdir_p(sub);
    api_seeds(sub);
    return 0;
}
