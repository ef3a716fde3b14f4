/* Helper threads for ops that run on one thread: int4_cpu.c's linears of several rows.
 *
 * Why: beside a busy process, OpenMP's threads wait for each other at the end of every op,
 * and the one that shares a core with the busy process is descheduled for whole time
 * slices, so threads.py moves to one thread. One thread leaves the other core's spare time
 * unused: the scheduler gives a busy process its share of a shared core, not all of it. The
 * helpers take the rest (each runnable thread gets a share, so two take more than one), and
 * never make the caller wait for them.
 *
 * How: an op is cut into chunks. The caller claims chunks from the bottom and the helpers
 * from the top, all through one atomic word that holds the two ends and the op's number.
 * A helper computes its chunks into its own staging buffer and marks each done with the op's
 * number and its own. When the ends meet, the caller merges the chunks marked done and
 * computes the others itself: one a helper is still at, or was descheduled in the middle of.
 * All run the same code on the same inputs, so the results are bitwise those of one thread.
 *
 * As the caller never waits, a helper may still be at a chunk of an op that has ended: it
 * reads inputs that may have changed since and writes only into its own staging, and marks
 * the chunk with a number the caller no longer accepts. Staging is per helper, at the same
 * place for every op: a late helper would otherwise write over another's chunk of a later
 * op, marked done. What it points to stays allocated: the op's buffers are kept across ops
 * and reallocated only once no helper holds a chunk (helper_settle), and weights are freed
 * only after a settle (int4_cpu.py settles when a linear is freed). Nothing on the way
 * waits for it.
 *
 * The op's arguments are published as a seqlock: the caller closes the claim word (its
 * ends meet) before rewriting them and opens it after; the helper copies them and then
 * claims with a compare-and-swap, which succeeds only if the word did not change, so
 * a claimed chunk's arguments are that op's.
 */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "helper_cpu.h"

/* A spin loop's pause, where the CPU has one. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Waiting on the wake word: a futex on Linux; elsewhere (macOS) a mutex and condition
 * variable, the waker taking the mutex so that no waiter misses a bump. SPECDEC_NO_FUTEX
 * builds the second on Linux too, to test it. */
#if defined(__linux__) && !defined(SPECDEC_NO_FUTEX)
#include <linux/futex.h>
#include <sys/syscall.h>

static void wait_word(uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}
static void wake_word(uint32_t *word, int count) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}
static void reset_word_lock(void) {}
#else
static pthread_mutex_t word_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t word_changed = PTHREAD_COND_INITIALIZER;

static void wait_word(uint32_t *word, uint32_t seen) {
    pthread_mutex_lock(&word_lock);
    if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == seen) pthread_cond_wait(&word_changed, &word_lock);
    pthread_mutex_unlock(&word_lock);
}
static void wake_word(uint32_t *word, int count) {
    (void)word, (void)count;
    pthread_mutex_lock(&word_lock);
    pthread_cond_broadcast(&word_changed);
    pthread_mutex_unlock(&word_lock);
}
static void reset_word_lock(void) {
    pthread_mutex_init(&word_lock, NULL);
    pthread_cond_init(&word_changed, NULL);
}
#endif

/* The helper goes to sleep as soon as it finds no op, after this many pauses: a helper that
 * spins for the next op runs beside the caller through the work between ops (attention,
 * norms, Python) and takes part of the caller's core, which beside a busy process costs
 * more than the helper gives (docs/performance.md#what-does-not-help-measured-not-kept). */
#define SPIN_PAUSES 64
#define CLAIM(op, low, high) ((uint64_t)(op) << 32 | (uint64_t)(low) << 16 | (uint64_t)(high))
#define OP(claim) ((uint32_t)((claim) >> 32))
#define LOW(claim) ((int64_t)(((claim) >> 16) & 0xFFFF))
#define HIGH(claim) ((int64_t)((claim) & 0xFFFF))
#define DONE(op, index) ((uint64_t)(op) << 8 | (uint64_t)(index))
#define DONE_OP(done) ((uint32_t)((done) >> 8))
#define DONE_HELPER(done) ((int)((done) & 0xFF))

static struct {
    pthread_mutex_t owner; /* one caller shares at a time; another runs its ops alone */
    pthread_once_t once;
    int enabled, started;               /* helpers asked for; helper threads running */
    uint64_t claim;                     /* op << 32 | next chunk from the bottom << 16 | end of those left */
    uint64_t words[1 + HELPER_WORDS];   /* the work, then its arguments */
    uint64_t done[HELPER_CHUNKS];       /* DONE(op, helper): who staged the chunk, for which op */
    uint32_t wake;                      /* the wake word (wait_word), bumped for every op */
    int sleeping, holding;              /* helpers asleep; helpers inside a claim or about to claim */
    uint32_t op;                        /* the caller's count of ops */
    uint64_t merged, recomputed;        /* the helpers' chunks: taken from staging, or done again */
    int lag_every;                      /* tests: every this many claims, a helper is late (helper_lag) */
} helper = {.owner = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

/* The wake count once it differs from `seen`: a few pauses (helpers asked for only), then
 * asleep. Each op wakes as many sleepers as helpers are asked for; any woken one helps. */
static uint32_t wait_for_op(int index, uint32_t seen) {
    int spins = index < __atomic_load_n(&helper.enabled, __ATOMIC_RELAXED) ? SPIN_PAUSES : 0;
    for (int i = 0; i < spins; i++) {
        uint32_t current = __atomic_load_n(&helper.wake, __ATOMIC_ACQUIRE);
        if (current != seen) return current;
        CPU_RELAX();
    }
    __atomic_add_fetch(&helper.sleeping, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&helper.wake, __ATOMIC_SEQ_CST) == seen) wait_word(&helper.wake, seen);
    __atomic_sub_fetch(&helper.sleeping, 1, __ATOMIC_RELAXED);
    return __atomic_load_n(&helper.wake, __ATOMIC_ACQUIRE);
}

/* What a descheduled helper does, on purpose: tests make it happen often (helper_lag). */
static void lag(void) {
    static __thread uint64_t claims;
    int every = __atomic_load_n(&helper.lag_every, __ATOMIC_RELAXED);
    if (every && ++claims % (uint64_t)every == 0) nanosleep(&(struct timespec){.tv_nsec = 50000}, NULL);
}

/* Chunks from the top of the open op until the ends meet. */
static void help(int index) {
    uint64_t words[1 + HELPER_WORDS];
    for (;;) {
        uint64_t claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        if (LOW(claim) >= HIGH(claim)) return;
        for (int i = 0; i < 1 + HELPER_WORDS; i++) words[i] = __atomic_load_n(&helper.words[i], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        __atomic_add_fetch(&helper.holding, 1, __ATOMIC_SEQ_CST);
        if (__atomic_compare_exchange_n(&helper.claim, &claim, claim - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
            const helper_work *work = (const helper_work *)(uintptr_t)words[0];
            int64_t chunk = HIGH(claim) - 1;
            lag();
            work->run(words + 1, chunk, index);
            __atomic_store_n(&helper.done[chunk], DONE(OP(claim), index), __ATOMIC_RELEASE);
        }
        __atomic_sub_fetch(&helper.holding, 1, __ATOMIC_RELEASE);
    }
}

static void *helper_main(void *arg) {
    int index = (int)(intptr_t)arg;
    for (uint32_t seen = 0;;) {
        seen = wait_for_op(index, seen);
        help(index);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers (only the forking thread is copied): it
 * starts its own when it shares an op. */
static void forget_helpers(void) {
    helper.started = 0;
    helper.sleeping = 0;
    helper.holding = 0;
    pthread_mutex_init(&helper.owner, NULL);
    reset_word_lock();
}

static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, forget_helpers);
}

/* Threads up to `count`; called by the owner only (helper.owner held). */
static void start_helpers(int count) {
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_once(&helper.once, register_fork_handler);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);  /* signals are for the caller's threads (Python handles them there) */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (pthread_t thread; helper.started < count; helper.started++)
        if (pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)helper.started) != 0) break;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

/* How many helpers share ops (0, off, until threads.py turns it on when it runs one thread). */
void helper_enable(int count) {
    count = count < 0 ? 0 : count > HELPER_THREADS ? HELPER_THREADS : count;
    __atomic_store_n(&helper.enabled, count, __ATOMIC_RELAXED);
}

/* 1: the caller shares its ops (helper_share) until helper_end; 0: it runs them alone
 * (sharing is off, there is no helper, or another caller has it). */
int helper_begin(void) {
    int wanted = __atomic_load_n(&helper.enabled, __ATOMIC_RELAXED);
    if (!wanted || pthread_mutex_trylock(&helper.owner) != 0) return 0;
    if (helper.started < wanted) start_helpers(wanted);
    if (helper.started) return 1;
    pthread_mutex_unlock(&helper.owner);
    return 0;
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
    if (__atomic_load_n(&helper.sleeping, __ATOMIC_SEQ_CST))
        wake_word(&helper.wake, __atomic_load_n(&helper.enabled, __ATOMIC_RELAXED));
    uint64_t claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
    while (LOW(claim) < HIGH(claim)) {
        if (__atomic_compare_exchange_n(&helper.claim, &claim, claim + (1u << 16), 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_ACQUIRE)) {
            work->run(args, LOW(claim), -1);
            claim = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        }
    }
    for (int64_t c = LOW(claim); c < chunks; c++) {
        uint64_t done = __atomic_load_n(&helper.done[c], __ATOMIC_ACQUIRE);
        if (DONE_OP(done) == op) {
            work->merge(args, c, DONE_HELPER(done));
            helper.merged++;
        } else {
            work->run(args, c, -1);
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

/* Tests: from now on every `every`-th chunk a helper claims starts late (a short sleep in
 * `lag`), as if it had been descheduled (0: never). */
void helper_lag(int every) {
    __atomic_store_n(&helper.lag_every, every, __ATOMIC_RELAXED);
}

/* Returns once no helper holds a chunk: what the ops before point to may be freed. It may
 * wait for a descheduled helper, so callers settle before freeing, not after every op. */
void helper_settle(void) {
    for (int i = 0; __atomic_load_n(&helper.holding, __ATOMIC_SEQ_CST); i++) {
        if (i < 4096)
            CPU_RELAX();
        else
            sched_yield();
    }
}
