/* Helper threads that share ops run on one thread (helper_cpu.c). */
#ifndef SPECDEC_HELPER_CPU_H
#define SPECDEC_HELPER_CPU_H
#include <stdint.h>

#define HELPER_WORDS 15    /* an op's arguments, as 64-bit words */
#define HELPER_CHUNKS 64   /* the most chunks an op is cut into */
/* The most helpers; each stages its chunks in its own buffer, reserved for all of them. Two
 * ship (native.HELPERS): on a 2-core machine a third gained no more. */
#define HELPER_THREADS 2

/* What an op's chunks do: `run` computes chunk c into its place (helper = -1, the caller) or
 * into that helper's own staging buffer (0 .. HELPER_THREADS - 1); `merge` copies a chunk
 * staged by `helper` into place. */
typedef struct {
    void (*run)(const uint64_t *args, int64_t chunk, int helper);
    void (*merge)(const uint64_t *args, int64_t chunk, int helper);
} helper_work;

int helper_begin(void);
void helper_share(const helper_work *work, const uint64_t *args, int64_t chunks);
void helper_end(void);
void helper_settle(void);
void helper_enable(int count);
void helper_counts(uint64_t counts[2]);
void helper_lag(int every);
#endif
