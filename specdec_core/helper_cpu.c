/* A second thread for ops that run on one thread: int4_cpu.c's linears of several rows.
 *
 * Why: beside a busy process, OpenMP's threads wait for each other at the end of every op,
 * and the one that shares a core with the busy process is descheduled for whole time
 * slices, so threads.py moves to one thread. One thread leaves the other core's spare time
 * unused: the scheduler gives a busy process half of a shared core, not all of it. The
 * helper takes that half, and never makes the caller wait for it.
 *
 * How: an op is cut into chunks. The caller claims chunks from the bottom and the helper
 * from the top, both through one atomic word that holds the two ends and the op's number.
 * The helper computes its chunks into a staging buffer and marks each done with the op's
 * number. When the ends meet, the caller merges the chunks marked done and computes the
 * others itself: the one the helper is still at, or was descheduled in the middle of. Both
 * run the same code on the same inputs, so the results are bitwise those of one thread.
 *
 * As the caller never waits, the helper may still be at a chunk of an op that has ended:
 * it reads inputs that may have changed since and writes only into staging, and marks the
 * chunk with a number the caller no longer accepts. What it points to stays allocated: the
 * op's buffers are kept across ops and reallocated only once it has settled
 * (helper_settle), and weights are freed only after a settle (int4_cpu.py settles when a
 * linear is freed). Nothing on the way waits for it.
 *
 * The op's arguments are published as a seqlock: the caller closes the claim word (its
 * ends meet) before rewriting them and opens it after; the helper copies them and then
 * claims with a compare-and-swap, which succeeds only if the word did not change, so
 * a claimed chunk's arguments are that op's.
 */
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helper_cpu.h"

/* The helper goes to sleep as soon as it finds no op, after this many pauses: spinning for
 * the next op (for 200 us) ran it beside the caller through the work between ops (attention,
 * norms, Python), which took a third of the caller's core; beside a busy process ours-auto
 * then gained 1.04x from the helper against 1.20x with it asleep. */
#define SPIN_PAUSES 64
#define CLAIM(op, low, high) ((uint64_t)(op) << 32 | (uint64_t)(low) << 16 | (uint64_t)(high))
#define OP(claim) ((uint32_t)((claim) >> 32))
#define LOW(claim) ((int64_t)(((claim) >> 16) & 0xFFFF))
#define HIGH(claim) ((int64_t)((claim) & 0xFFFF))

static struct {
    pthread_mutex_t owner; /* one caller shares at a time; another runs its ops alone */
    pthread_once_t once;
    int enabled, running;
    uint64_t claim;                     /* op << 32 | next chunk from the bottom << 16 | end of those left */
    uint64_t words[1 + HELPER_WORDS];   /* the work, then its arguments */
    uint32_t done[HELPER_CHUNKS];       /* the op whose chunk the helper staged */
    uint32_t wake;                      /* futex word, bumped for every op */
    int sleeping, holding;              /* holding: inside a claim, or about to claim */
    uint32_t op;                        /* the caller's count of ops */
    uint64_t merged, recomputed;        /* the helper's chunks: taken from staging, or done again */
} helper = {.owner = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

static long futex(uint32_t *word, int op, uint32_t value) {
    return syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

/* The wake count once it differs from `seen`: a few pauses, then asleep. */
static uint32_t wait_for_op(uint32_t seen) {
    for (int i = 0; i < SPIN_PAUSES; i++) {
        uint32_t current = __atomic_load_n(&helper.wake, __ATOMIC_ACQUIRE);
        if (current != seen) return current;
        _mm_pause();
    }
    __atomic_store_n(&helper.sleeping, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&helper.wake, __ATOMIC_SEQ_CST) == seen) futex(&helper.wake, FUTEX_WAIT_PRIVATE, seen);
    __atomic_store_n(&helper.sleeping, 0, __ATOMIC_RELAXED);
    return __atomic_load_n(&helper.wake, __ATOMIC_ACQUIRE);
}

/* Chunks from the top of the open op until the ends meet. */
static void help(void) {
    uint64_t words[1 + HELPER_WORDS];
    for (;;) {
        uint64_t claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        if (LOW(claim) >= HIGH(claim)) return;
        for (int i = 0; i < 1 + HELPER_WORDS; i++) words[i] = __atomic_load_n(&helper.words[i], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        __atomic_store_n(&helper.holding, 1, __ATOMIC_SEQ_CST);
        if (__atomic_compare_exchange_n(&helper.claim, &claim, claim - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
            const helper_work *work = (const helper_work *)(uintptr_t)words[0];
            int64_t chunk = HIGH(claim) - 1;
            work->run(words + 1, chunk, 1);
            __atomic_store_n(&helper.done[chunk], OP(claim), __ATOMIC_RELEASE);
        }
        __atomic_store_n(&helper.holding, 0, __ATOMIC_RELEASE);
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    for (uint32_t seen = 0;;) {
        seen = wait_for_op(seen);
        help();
    }
    return NULL;
}

/* A forked child has no helper (only the forking thread is copied). */
static void forget_helper(void) {
    helper.running = 0;
    helper.holding = 0;
    pthread_mutex_init(&helper.owner, NULL);
}

static void start_helper(void) {
    pthread_t thread;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);  /* signals are for the caller's threads (Python handles them there) */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    helper.running = pthread_create(&thread, &attr, helper_main, NULL) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    pthread_atfork(NULL, NULL, forget_helper);
}

/* Whether ops may be shared (off until threads.py turns it on, when it runs one thread). */
void helper_enable(int on) {
    __atomic_store_n(&helper.enabled, on, __ATOMIC_RELAXED);
}

/* 1: the caller shares its ops (helper_share) until helper_end; 0: it runs them alone
 * (sharing is off, there is no helper, or another caller has it). */
int helper_begin(void) {
    if (!__atomic_load_n(&helper.enabled, __ATOMIC_RELAXED)) return 0;
    pthread_once(&helper.once, start_helper);
    return helper.running && pthread_mutex_trylock(&helper.owner) == 0;
}

void helper_end(void) {
    pthread_mutex_unlock(&helper.owner);
}

/* All `chunks` (at most HELPER_CHUNKS) of an op in place when it returns, some perhaps
 * computed by the helper. */
void helper_share(const helper_work *work, const uint64_t *args, int64_t chunks) {
    uint32_t op = ++helper.op ? helper.op : ++helper.op; /* 0 never: done[] starts at 0 */
    /* The last op's ends met: its word is closed while these are rewritten. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&helper.words[0], (uint64_t)(uintptr_t)work, __ATOMIC_RELAXED);
    for (int i = 0; i < HELPER_WORDS; i++) __atomic_store_n(&helper.words[1 + i], args[i], __ATOMIC_RELAXED);
    for (int64_t c = 0; c < chunks; c++) __atomic_store_n(&helper.done[c], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&helper.claim, CLAIM(op, 0, chunks), __ATOMIC_RELEASE);
    __atomic_add_fetch(&helper.wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&helper.sleeping, __ATOMIC_SEQ_CST)) futex(&helper.wake, FUTEX_WAKE_PRIVATE, 1);
    uint64_t claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
    while (LOW(claim) < HIGH(claim)) {
        if (__atomic_compare_exchange_n(&helper.claim, &claim, claim + (1u << 16), 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_ACQUIRE)) {
            work->run(args, LOW(claim), 0);
            claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        }
    }
    for (int64_t c = LOW(claim); c < chunks; c++) {
        if (__atomic_load_n(&helper.done[c], __ATOMIC_ACQUIRE) == op) {
            work->merge(args, c);
            helper.merged++;
        } else {
            work->run(args, c, 0);
            helper.recomputed++;
        }
    }
}

/* Chunks the helper claimed since the library loaded: counts[0] merged from its staging,
 * counts[1] computed again by the caller (unfinished when the caller reached them). */
void helper_counts(uint64_t counts[2]) {
    pthread_mutex_lock(&helper.owner);
    counts[0] = helper.merged, counts[1] = helper.recomputed;
    pthread_mutex_unlock(&helper.owner);
}

/* Returns once the helper holds no chunk: what the ops before point to may be freed. It may
 * wait for a descheduled helper, so callers settle before freeing, not after every op. */
void helper_settle(void) {
    for (int i = 0; __atomic_load_n(&helper.holding, __ATOMIC_SEQ_CST); i++) {
        if (i < 4096)
            _mm_pause();
        else
            sched_yield();
    }
}
