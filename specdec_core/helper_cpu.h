/* A second thread that shares ops run on one thread (helper_cpu.c). */
#ifndef SPECDEC_HELPER_CPU_H
#define SPECDEC_HELPER_CPU_H
#include <stdint.h>

#define HELPER_WORDS 15    /* an op's arguments, as 64-bit words */
#define HELPER_CHUNKS 64   /* the most chunks an op is cut into */

/* What an op's chunks do: `run` computes chunk c into its place (staged = 0, the caller) or
 * into the helper's staging buffer (staged = 1); `merge` copies a staged chunk into place. */
typedef struct {
    void (*run)(const uint64_t *args, int64_t chunk, int staged);
    void (*merge)(const uint64_t *args, int64_t chunk);
} helper_work;

int helper_begin(void);
void helper_share(const helper_work *work, const uint64_t *args, int64_t chunks);
void helper_end(void);
void helper_settle(void);
void helper_enable(int on);
void helper_counts(uint64_t counts[2]);
#endif
