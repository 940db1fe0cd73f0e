/*
 * standalone_main.c -- a driver for LLVMFuzzerTestOneInput when clang's
 * libFuzzer is not available (gcc builds).  No coverage feedback: it runs
 * every input file given, then random mutations of them (bit flips, byte
 * edits, interesting integers, inserts, erases, chunk copies, crossover)
 * for a bounded number of runs and/or seconds.
 *
 * It takes the libFuzzer flags the Makefile uses, so both builds run with
 * the same command line:
 *
 *   fuzz_x [-runs=N] [-max_total_time=S] [-seed=N] [-max_len=N]
 *          [-artifact_prefix=DIR/] FILE_OR_DIR...
 *
 * Stops at whichever bound comes first (default: 10000 runs).  A crash,
 * a sanitizer report or a failed property aborts the process; the input that
 * caused it is first written to ARTIFACT_PREFIX + "crash-<hash>" by the
 * sanitizer death callback or a signal handler, so it can be replayed by
 * passing the file.
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include(<sanitizer/common_interface_defs.h>)
#include <sanitizer/common_interface_defs.h>
#define HAVE_SANITIZER_CALLBACK 1
#endif
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct blob {
    uint8_t *p;
    size_t n;
} blob;

static blob *corpus = NULL;
static size_t corpus_n = 0, corpus_cap = 0;

/* The input being run, for the crash handlers. */
static const uint8_t *current = NULL;
static size_t current_n = 0;
static char artifact_path[4096] = "";

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint64_t rnd(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t rnd_below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

/* Write the current input; async-signal-safe (open/write/close only). */
static void dump_current(void) {
    if (current == NULL || artifact_path[0] == '\0') return;
    int fd = open(artifact_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    size_t off = 0;
    while (off < current_n) {
        ssize_t w = write(fd, current + off, current_n - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    close(fd);
    static const char msg[] = "standalone: the failing input was written to the artifact path\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
}

static void on_signal(int sig) {
    dump_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void add_blob(const uint8_t *p, size_t n) {
    if (corpus_n == corpus_cap) {
        corpus_cap = corpus_cap ? corpus_cap * 2 : 64;
        corpus = realloc(corpus, corpus_cap * sizeof(blob));
        if (corpus == NULL) abort();
    }
    blob *b = &corpus[corpus_n++];
    b->p = malloc(n ? n : 1);
    if (b->p == NULL) abort();
    if (n) memcpy(b->p, p, n);
    b->n = n;
}

static int read_file(const char *path, size_t max_len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return -1;
    uint8_t *buf = malloc(max_len ? max_len : 1);
    if (buf == NULL) abort();
    size_t n = fread(buf, 1, max_len, f);
    fclose(f);
    add_blob(buf, n);
    free(buf);
    return 0;
}

static void read_path(const char *path, size_t max_len) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "standalone: cannot read %s\n", path);
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        read_file(path, max_len);
        return;
    }
    DIR *d = opendir(path);
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (stat(full, &st) == 0 && S_ISREG(st.st_mode)) read_file(full, max_len);
    }
    closedir(d);
}

/* Little-endian values that often sit on boundaries of length checks. */
static const uint64_t interesting[] = {
    0, 1, 2, 3, 4, 7, 8, 12, 16, 31, 32, 47, 48, 63, 64, 127, 128, 255, 256, 1023, 1024, 1025,
    0x7fff, 0x8000, 0xffff, 0x10000, 0x7fffffff, 0x80000000u, 0xffffffffu, 0x100000000ull,
    0x7fffffffffffffffull, 0x8000000000000000ull, 0xffffffffffffffffull};

/* Apply 1..5 random mutations to buf (length *n, capacity cap). */
static void mutate(uint8_t *buf, size_t *n, size_t cap) {
    int rounds = 1 + (int)rnd_below(5);
    for (int k = 0; k < rounds; k++) {
        size_t len = *n;
        switch (rnd_below(10)) {
        case 0: /* flip a bit */
            if (len) buf[rnd_below(len)] ^= (uint8_t)(1u << rnd_below(8));
            break;
        case 1: /* set a random byte */
            if (len) buf[rnd_below(len)] = (uint8_t)rnd();
            break;
        case 2: /* add or subtract a little */
            if (len) buf[rnd_below(len)] += (uint8_t)(rnd_below(9) - 4);
            break;
        case 3: { /* an interesting integer of width 1, 2, 4 or 8 */
            size_t w = (size_t)1 << rnd_below(4);
            if (len < w) break;
            uint64_t v = interesting[rnd_below(sizeof interesting / sizeof interesting[0])];
            size_t at = rnd_below(len - w + 1);
            for (size_t i = 0; i < w; i++) buf[at + i] = (uint8_t)(v >> (8 * i));
            break;
        }
        case 4: { /* insert random bytes */
            size_t m = 1 + rnd_below(8);
            if (len + m > cap) break;
            size_t at = rnd_below(len + 1);
            memmove(buf + at + m, buf + at, len - at);
            for (size_t i = 0; i < m; i++) buf[at + i] = (uint8_t)rnd();
            *n = len + m;
            break;
        }
        case 5: { /* erase bytes */
            if (!len) break;
            size_t at = rnd_below(len), m = 1 + rnd_below(len - at < 16 ? len - at : 16);
            memmove(buf + at, buf + at + m, len - at - m);
            *n = len - m;
            break;
        }
        case 6: { /* duplicate a chunk in place */
            if (!len) break;
            size_t from = rnd_below(len), m = 1 + rnd_below(len - from);
            if (len + m > cap) break;
            size_t at = rnd_below(len + 1);
            uint8_t tmp[256];
            if (m > sizeof tmp) m = sizeof tmp;
            memcpy(tmp, buf + from, m);
            memmove(buf + at + m, buf + at, len - at);
            memcpy(buf + at, tmp, m);
            *n = len + m;
            break;
        }
        case 7: { /* overwrite with a chunk of another corpus entry */
            const blob *o = &corpus[rnd_below(corpus_n)];
            if (!o->n || !len) break;
            size_t from = rnd_below(o->n), m = 1 + rnd_below(o->n - from);
            size_t at = rnd_below(len);
            if (m > len - at) m = len - at;
            memcpy(buf + at, o->p + from, m);
            break;
        }
        case 8: /* truncate */
            if (len) *n = rnd_below(len);
            break;
        default: { /* append random bytes */
            size_t m = 1 + rnd_below(16);
            if (len + m > cap) break;
            for (size_t i = 0; i < m; i++) buf[len + i] = (uint8_t)rnd();
            *n = len + m;
            break;
        }
        }
    }
}

static void run_one(const uint8_t *p, size_t n) {
    /* an exact-size heap copy so that ASan catches reads past the end */
    uint8_t *copy = malloc(n ? n : 1);
    if (copy == NULL) abort();
    if (n) memcpy(copy, p, n);
    current = copy;
    current_n = n;
    LLVMFuzzerTestOneInput(copy, n);
    current = NULL;
    free(copy);
}

int main(int argc, char **argv) {
    long long runs = -1, max_time = -1;
    uint64_t seed = 0;
    size_t max_len = 4096;
    char prefix[2048] = "";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "-runs=", 6) == 0) runs = atoll(a + 6);
        else if (strncmp(a, "-max_total_time=", 16) == 0) max_time = atoll(a + 16);
        else if (strncmp(a, "-seed=", 6) == 0) seed = strtoull(a + 6, NULL, 10);
        else if (strncmp(a, "-max_len=", 9) == 0) max_len = (size_t)atoll(a + 9);
        else if (strncmp(a, "-artifact_prefix=", 17) == 0) snprintf(prefix, sizeof prefix, "%s", a + 17);
        else if (strncmp(a, "-verbosity=", 11) == 0 || strncmp(a, "-print_final_stats=", 19) == 0)
            continue; /* libFuzzer output options: nothing to do here */
        else if (a[0] == '-') fprintf(stderr, "standalone: ignoring flag %s\n", a);
        else read_path(a, max_len);
    }
    if (max_len < 16) max_len = 16;
    if (runs < 0 && max_time < 0) runs = 10000;
    if (seed == 0) seed = (uint64_t)time(NULL);
    rng_state ^= seed * 0x9E3779B97F4A7C15ull;
    if (rng_state == 0) rng_state = 1;
    snprintf(artifact_path, sizeof artifact_path, "%scrash-standalone-%llu", prefix,
             (unsigned long long)seed);
#ifdef HAVE_SANITIZER_CALLBACK
    __sanitizer_set_death_callback(dump_current);
#endif
    signal(SIGABRT, on_signal);
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGFPE, on_signal);
    signal(SIGILL, on_signal);

    fprintf(stderr, "standalone: seed %llu, %zu inputs, runs %lld, max_total_time %lld\n",
            (unsigned long long)seed, corpus_n, runs, max_time);
    time_t start = time(NULL);
    long long done = 0;
    /* every given input as it is */
    for (size_t i = 0; i < corpus_n; i++, done++) run_one(corpus[i].p, corpus[i].n);
    if (corpus_n == 0) add_blob((const uint8_t *)"", 0);
    uint8_t *buf = malloc(max_len);
    if (buf == NULL) abort();
    while ((runs < 0 || done < runs) && (max_time < 0 || time(NULL) - start < max_time)) {
        const blob *b = &corpus[rnd_below(corpus_n)];
        size_t n = b->n < max_len ? b->n : max_len;
        memcpy(buf, b->p, n);
        mutate(buf, &n, max_len);
        run_one(buf, n);
        done++;
    }
    free(buf);
    fprintf(stderr, "standalone: %lld runs in %lld s, no failure\n", done,
            (long long)(time(NULL) - start));
    for (size_t i = 0; i < corpus_n; i++) free(corpus[i].p);
    free(corpus);
    return 0;
}
