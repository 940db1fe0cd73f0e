/*
 * testhelp.h -- a tiny test harness for agentspec's C tests.
 *
 * One function per test case, plain checks that report file:line and carry
 * on, and a runner that prints one closing line "NAME: N passed, N failed"
 * and makes main() return non-zero if any check failed.  No framework.
 *
 *     static void test_something(void) {
 *         CHECK(1 + 1 == 2);
 *         CHECK_EQ_U64(count, 3);
 *         REQUIRE(tree != NULL);   // returns from the test on failure
 *     }
 *     int main(void) {
 *         TEST_RUN(test_something);
 *         return TEST_REPORT("test_tree");
 *     }
 *
 * Everything is static, so each test program includes this header once.
 */
#ifndef AGENTSPEC_TESTHELP_H
#define AGENTSPEC_TESTHELP_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int th_tests_passed = 0;
static int th_tests_failed = 0;
static int th_current_failures = 0;
static const char *th_current_name = "";

/* Record one failed check (used by the macros below). */
static inline void th_fail(const char *file, int line, const char *what) {
    if (th_current_failures < 20)
        fprintf(stderr, "%s:%d: [%s] check failed: %s\n", file, line, th_current_name, what);
    else if (th_current_failures == 20)
        fprintf(stderr, "[%s] more failed checks not shown\n", th_current_name);
    th_current_failures++;
}

/* Check a condition; report and continue on failure. */
#define CHECK(cond)                                                   \
    do {                                                              \
        if (!(cond)) th_fail(__FILE__, __LINE__, #cond);              \
    } while (0)

/* Check a condition; report and return from the test on failure. */
#define REQUIRE(cond)                                                 \
    do {                                                              \
        if (!(cond)) {                                                \
            th_fail(__FILE__, __LINE__, #cond);                       \
            return;                                                   \
        }                                                             \
    } while (0)

/* Compare two integers (as signed 64-bit) and print both on failure. */
#define CHECK_EQ_INT(a, b)                                                        \
    do {                                                                          \
        int64_t th_a_ = (int64_t)(a), th_b_ = (int64_t)(b);                       \
        if (th_a_ != th_b_) {                                                     \
            char th_msg_[256];                                                    \
            snprintf(th_msg_, sizeof th_msg_, "%s == %s (%" PRId64 " != %" PRId64 ")", \
                     #a, #b, th_a_, th_b_);                                       \
            th_fail(__FILE__, __LINE__, th_msg_);                                 \
        }                                                                         \
    } while (0)

/* Compare two unsigned 64-bit integers and print both on failure. */
#define CHECK_EQ_U64(a, b)                                                        \
    do {                                                                          \
        uint64_t th_a_ = (uint64_t)(a), th_b_ = (uint64_t)(b);                    \
        if (th_a_ != th_b_) {                                                     \
            char th_msg_[256];                                                    \
            snprintf(th_msg_, sizeof th_msg_, "%s == %s (%" PRIu64 " != %" PRIu64 ")", \
                     #a, #b, th_a_, th_b_);                                       \
            th_fail(__FILE__, __LINE__, th_msg_);                                 \
        }                                                                         \
    } while (0)

/* Compare a status with the expected one and name both on failure. */
#define CHECK_STATUS(call, expected)                                              \
    do {                                                                          \
        int th_s_ = (int)(call), th_e_ = (int)(expected);                         \
        if (th_s_ != th_e_) {                                                     \
            char th_msg_[512];                                                    \
            snprintf(th_msg_, sizeof th_msg_, "%s -> %d (%s), expected %d (%s)",  \
                     #call, th_s_, as_strerror(th_s_), th_e_, as_strerror(th_e_)); \
            th_fail(__FILE__, __LINE__, th_msg_);                                 \
        }                                                                         \
    } while (0)

/* Compare a status with AS_OK and return from the test on failure. */
#define REQUIRE_OK(call)                                                          \
    do {                                                                          \
        int th_s_ = (int)(call);                                                  \
        if (th_s_ != AS_OK) {                                                     \
            char th_msg_[512];                                                    \
            snprintf(th_msg_, sizeof th_msg_, "%s -> %d (%s)", #call, th_s_,      \
                     as_strerror(th_s_));                                         \
            th_fail(__FILE__, __LINE__, th_msg_);                                 \
            return;                                                               \
        }                                                                         \
    } while (0)

/* Compare two doubles for exact equality (the engine's arithmetic is specified). */
#define CHECK_EQ_DBL(a, b)                                                        \
    do {                                                                          \
        double th_a_ = (double)(a), th_b_ = (double)(b);                          \
        if (!(th_a_ == th_b_)) {                                                  \
            char th_msg_[256];                                                    \
            snprintf(th_msg_, sizeof th_msg_, "%s == %s (%.17g != %.17g)", #a, #b, \
                     th_a_, th_b_);                                               \
            th_fail(__FILE__, __LINE__, th_msg_);                                 \
        }                                                                         \
    } while (0)

/* Run one test function and count it as passed or failed. */
#define TEST_RUN(fn)                                                  \
    do {                                                              \
        th_current_name = #fn;                                        \
        th_current_failures = 0;                                      \
        fn();                                                         \
        if (th_current_failures == 0) {                               \
            th_tests_passed++;                                        \
        } else {                                                      \
            th_tests_failed++;                                        \
            fprintf(stderr, "FAILED %s\n", #fn);                      \
        }                                                             \
    } while (0)

/* Print the closing line and give main()'s exit status. */
static inline int th_report(const char *program) {
    printf("%s: %d passed, %d failed\n", program, th_tests_passed, th_tests_failed);
    fflush(stdout);
    return th_tests_failed == 0 ? 0 : 1;
}
#define TEST_REPORT(program) th_report(program)

/* A small deterministic PRNG (xorshift64*) so failures reproduce exactly. */
typedef struct th_rng {
    uint64_t s;
} th_rng;

static inline void th_rng_seed(th_rng *r, uint64_t seed) {
    r->s = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (r->s == 0) r->s = 1;
}

static inline uint64_t th_rng_next(th_rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1Dull;
}

/* A uniform-ish integer in [0, n) (n > 0). */
static inline uint32_t th_rng_below(th_rng *r, uint32_t n) {
    return (uint32_t)(th_rng_next(r) % n);
}

#endif /* AGENTSPEC_TESTHELP_H */
