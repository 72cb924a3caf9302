/* mpicoll.collectives._shm: the on-node allreduce (and allgather, bcast) in C, over one shared-memory segment per node.
 *
 * Every rank of a communicator that spans one node owns a region of one MPI shared-memory window
 * (MPI.Win.Allocate_shared, so MPI unlinks it, also when a rank is killed): a control block, then two data
 * slots of ``slot_bytes``.  A call runs in steps of at most one slot (a large buffer is cut into chunks); the
 * k-th step of a communicator (counted over its calls) uses slot k % 2 of every rank and goes:
 *
 *   | phase        | this rank does                                                | then publishes  | and waits for every rank's |
 *   |--------------|---------------------------------------------------------------|-----------------|----------------------------|
 *   | arrive       | copies its chunk into its slot (first step of a call: writes  | step = 2k - 1   | step >= 2k - 1             |
 *   |              | the call's fingerprint first)                                 |                 |                            |
 *   | check        | first step of a call: compares every rank's fingerprint       |                 |                            |
 *   | small chunk  | reduces every rank's slot, in rank order, into its output     | (nothing)       | (nothing)                  |
 *   | large chunk  | reduces its slice of every rank's slot, in rank order, into   | step = 2k       | step >= 2k                 |
 *   |              | its own slot's slice and its output; then copies every other  |                 |                            |
 *   |              | rank's slice from that rank's slot into its output            |                 |                            |
 *
 * A reduce_scatter goes as the allreduce's small chunks, each rank reducing only its block's piece of every
 * slot; an allgather (bcast) goes the same way with the reduction left out: every rank (the root) copies its chunk
 * in and arrives, then every rank copies every given chunk out of its owner's slot; one synchronisation a step.
 *
 * Why two slots and no closing barrier: slot k % 2 is next written in step k + 2, which a rank begins only
 * after step k + 1's arrival wait, that is after every rank began step k + 1 and so finished reading step
 * k's slots.  The fingerprint (call number, count, type, op) sits in one of two places by the call's parity for
 * the same reason: call n + 2 starts after every rank is in call n + 1, past reading call n's.  Steps are
 * published with release stores and read with acquire loads; counters only grow, so a late reader never
 * mistakes an old step for a new one.
 *
 * A rank's writes into its slots take cached stores or streamed ones (past the caches, fenced before the step is
 * published), whichever its calls of that size measured faster (``Choice``): where two cores share a cache the other
 * ranks take the chunk from it, where they do not (two sockets) memory is the faster way between them.
 *
 * Every element is reduced in rank order (((x0 op x1) op x2) ...), each slice by one rank, so every rank gets
 * the same bits, and they are those of a sequential reduction in rank order.  Floating-point MIN and MAX keep a
 * NaN as numpy's minimum and maximum do; float16 and bfloat16 add in float32 and round once per addition, as
 * numpy and ml_dtypes do.
 *
 * Where a rank is given threads (``threads`` > 1, OpenMP built in), its large copies and reductions are cut into
 * pieces of at least PIECE_BYTES that its threads take at once, each piece fenced by the thread that streamed it;
 * the steps and waits stay the calling thread's.
 *
 * Waits spin a little (not at all when ranks share cores), then yield the core (sched_yield), and after
 * ``yield_seconds`` hand the wait to Python (``stalled(rank, step)``), which waits with the communicator's
 * deadline, its alarms and its roll call of who is still there, and raises when a peer is lost or hung.
 * The GIL is released for everything but that hand-over.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#define OPENMP_BUILT 1              /* a rank's large copies and reductions may take threads of its own */
#else
#define OPENMP_BUILT 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() do {} while (0)
#endif
#if defined(__SSE2__)
#define CAN_STREAM 1                /* stores that bypass the caches (movntdq), then a fence */
#define STREAM_FENCE() _mm_sfence()
#else
#define CAN_STREAM 0
#define STREAM_FENCE() do {} while (0)
#endif

/* element types (numbered as mpicoll/collectives/algorithms/node.py's TYPES) and ops (as its OPS) */
enum { TY_I8, TY_I16, TY_I32, TY_I64, TY_U8, TY_U16, TY_U32, TY_U64, TY_F32, TY_F64, TY_F16, TY_BF16, TY_C64, TY_C128, TY_BOOL,
       N_TYPES };
enum { O_SUM, O_PROD, O_MIN, O_MAX, O_LAND, O_LOR, O_LXOR, O_BAND, O_BOR, O_BXOR, N_OPS };

typedef void (*combine_fn)(void *out, const void *a, const void *b, size_t n);

/* ---- the combines: out[i] = a[i] op b[i] (out may be a or b) ---------------------------------------------- */

/* the floating-point loops, slower than the caches they read (a chunk's slices are in cache) with SSE2's vectors
   (16-bit floats 3x, float32 sums 2x, measured), are built for each x86 vector width, the widest the machine has
   taken when the module loads (GCC's target_clones; "arch=skylake-avx512" came out slower than AVX2) */
#if defined(__GNUC__) && __GNUC__ >= 11 && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WIDEST __attribute__((target_clones("default", "avx2", "arch=x86-64-v4")))
#else
#define WIDEST
#endif

#define BINARY(name, T, expr) BINARY_AS(, name, T, expr)
#define BINARY_AS(ATTRIBUTES, name, T, expr) \
    ATTRIBUTES static void name(void *out_, const void *a_, const void *b_, size_t n) { \
        T *out = (T *)out_; const T *a = (const T *)a_, *b = (const T *)b_; \
        for (size_t i = 0; i < n; i++) { T x = a[i], y = b[i]; out[i] = (expr); } }

/* integers: sums and products wrap (computed unsigned: signed overflow is undefined in C) */
#define INTEGER_OPS(S, T, U) \
    BINARY(sum_##S, T, (T)((U)x + (U)y)) \
    BINARY(prod_##S, T, (T)((U)x * (U)y)) \
    BINARY(min_##S, T, x <= y ? x : y) \
    BINARY(max_##S, T, x >= y ? x : y) \
    BINARY(land_##S, T, (T)((x != 0) && (y != 0))) \
    BINARY(lor_##S, T, (T)((x != 0) || (y != 0))) \
    BINARY(lxor_##S, T, (T)((x != 0) != (y != 0))) \
    BINARY(band_##S, T, (T)(x & y)) \
    BINARY(bor_##S, T, (T)(x | y)) \
    BINARY(bxor_##S, T, (T)(x ^ y))

INTEGER_OPS(i8, int8_t, uint8_t)
INTEGER_OPS(i16, int16_t, uint16_t)
INTEGER_OPS(i32, int32_t, uint32_t)
INTEGER_OPS(i64, int64_t, uint64_t)
INTEGER_OPS(u8, uint8_t, uint8_t)
INTEGER_OPS(u16, uint16_t, uint16_t)
INTEGER_OPS(u32, uint32_t, uint32_t)
INTEGER_OPS(u64, uint64_t, uint64_t)

/* booleans (numpy's bool: one byte, 0 or 1) */
BINARY(land_b, uint8_t, (uint8_t)(x && y))
BINARY(lor_b, uint8_t, (uint8_t)(x || y))
BINARY(lxor_b, uint8_t, (uint8_t)((x != 0) != (y != 0)))
BINARY(band_b, uint8_t, (uint8_t)(x & y))
BINARY(bor_b, uint8_t, (uint8_t)(x | y))
BINARY(bxor_b, uint8_t, (uint8_t)(x ^ y))

/* floats: numpy's minimum and maximum, (x <= y || isnan(x)) ? x : y, keep a NaN from either side (written with
   | so that the compiler makes it a vector compare and blend: with || the loop stayed scalar, 4x slower) */
#define FLOAT_OPS(S, T) \
    BINARY_AS(WIDEST, sum_##S, T, x + y) \
    BINARY_AS(WIDEST, prod_##S, T, x * y) \
    BINARY_AS(WIDEST, min_##S, T, ((x <= y) | (x != x)) ? x : y) \
    BINARY_AS(WIDEST, max_##S, T, ((x >= y) | (x != x)) ? x : y)

FLOAT_OPS(f32, float)
FLOAT_OPS(f64, double)

/* 16-bit floats, as their bits: widened to float32, combined, rounded back to nearest even (numpy's float16
   arithmetic, ml_dtypes' bfloat16) */
static inline float bf16_wide(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);      /* a NaN stays a (quiet) NaN */
}
static inline float f16_wide(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f)
        u = sign | 0x7f800000u | (man << 13);             /* inf, NaN */
    else if (exp != 0)
        u = sign | ((exp + 112u) << 23) | (man << 13);    /* normal */
    else if (man == 0)
        u = sign;                                         /* zero */
    else {                                                /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400u)) { man <<= 1; shift++; }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f16_narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));     /* NaN, kept quiet */
    if (a >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);                            /* rounds past the largest: inf */
    if (a < 0x38800000u) {                                            /* below float16's smallest normal */
        if (a < 0x33000000u)
            return (uint16_t)sign;                                    /* under half the smallest subnormal */
        uint32_t man = (a & 0x7fffffu) | 0x800000u, shift = 126u - (a >> 23);   /* 14..24 */
        uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1), h = man >> shift;
        if (rest > half || (rest == half && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10)), rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

#define NARROW_OPS(S, WIDE, NARROW) \
    BINARY_AS(WIDEST, sum_##S, uint16_t, NARROW(WIDE(x) + WIDE(y))) \
    BINARY_AS(WIDEST, prod_##S, uint16_t, NARROW(WIDE(x) * WIDE(y))) \
    BINARY_AS(WIDEST, min_##S, uint16_t, ((WIDE(x) <= WIDE(y)) | (WIDE(x) != WIDE(x))) ? x : y) \
    BINARY_AS(WIDEST, max_##S, uint16_t, ((WIDE(x) >= WIDE(y)) | (WIDE(x) != WIDE(x))) ? x : y)

NARROW_OPS(f16, f16_wide, f16_narrow)
NARROW_OPS(bf16, bf16_wide, bf16_narrow)

/* complex: numpy's formulas (no C99 Annex G special cases) */
#define COMPLEX_OPS(S, T) \
    static void sum_##S(void *out_, const void *a_, const void *b_, size_t n) { \
        T *out = (T *)out_; const T *a = (const T *)a_, *b = (const T *)b_; \
        for (size_t i = 0; i < 2 * n; i++) out[i] = a[i] + b[i]; } \
    static void prod_##S(void *out_, const void *a_, const void *b_, size_t n) { \
        T *out = (T *)out_; const T *a = (const T *)a_, *b = (const T *)b_; \
        for (size_t i = 0; i < n; i++) { \
            T ar = a[2 * i], ai = a[2 * i + 1], br = b[2 * i], bi = b[2 * i + 1]; \
            out[2 * i] = ar * br - ai * bi; out[2 * i + 1] = ar * bi + ai * br; } }

COMPLEX_OPS(c64, float)
COMPLEX_OPS(c128, double)

#define INT_ROW(S) {sum_##S, prod_##S, min_##S, max_##S, land_##S, lor_##S, lxor_##S, band_##S, bor_##S, bxor_##S}
static const combine_fn COMBINES[N_TYPES][N_OPS] = {
    [TY_I8] = INT_ROW(i8), [TY_I16] = INT_ROW(i16), [TY_I32] = INT_ROW(i32), [TY_I64] = INT_ROW(i64),
    [TY_U8] = INT_ROW(u8), [TY_U16] = INT_ROW(u16), [TY_U32] = INT_ROW(u32), [TY_U64] = INT_ROW(u64),
    [TY_F32] = {sum_f32, prod_f32, min_f32, max_f32},
    [TY_F64] = {sum_f64, prod_f64, min_f64, max_f64},
    [TY_F16] = {sum_f16, prod_f16, min_f16, max_f16},
    [TY_BF16] = {sum_bf16, prod_bf16, min_bf16, max_bf16},
    [TY_C64] = {sum_c64, prod_c64},
    [TY_C128] = {sum_c128, prod_c128},
    [TY_BOOL] = {NULL, NULL, NULL, NULL, land_b, lor_b, lxor_b, band_b, bor_b, bxor_b},
};
static const int ITEMSIZE[N_TYPES] = {1, 2, 4, 8, 1, 2, 4, 8, 4, 8, 2, 2, 8, 16, 1};

/* ---- the segment ------------------------------------------------------------------------------------------ */

typedef struct {
    _Alignas(64) uint64_t step;     /* the last phase published (written by its rank only) */
    _Alignas(64) uint64_t fingerprint[2][4];    /* by the call's parity: call number, count, type, op */
} Control;

#define CONTROL_BYTES 256           /* a region's control block; the slots follow */
#define BLOCK_BYTES 4096            /* a reduction of several ranks goes block by block, its partial in L1 */
#define PIECE_BYTES (64 << 10)     /* the least a rank's thread takes of a copy or a reduction (the fork and join of
                                       a team cost a few microseconds, 64 KiB's copy about as much) */
#define CLASSES 16                  /* calls by size, for the choice of stores: 16-32 KiB, 32-64 KiB, ... */
#define WARM_UP 2                   /* calls of a size not counted */
#define FIRST_EVERY 8               /* the other stores are tried every 8th call of a size, */
#define LAST_EVERY 64               /* every 64th once they keep losing */

/* which stores a rank's writes into its slots take, by the call's size: those that keep the lines in this core's
   caches (0), whence the other ranks' cores take them, or streamed ones (1), which go to memory, whence they read
   them.  The first is 2x faster where the cores share a cache; the second 3-4x faster where taking a line from
   another core's cache is slow (cores on two sockets; this machine's two virtual cores in some runs): each
   rank measures its calls' time a byte, from every rank's arrival to the end, and keeps the faster, trying the
   other now and then.  Only the writer's side changes, so the ranks need not agree; as every rank makes the same
   calls and waits for the same steps, they measure the same and choose alike. */
typedef struct {
    double cost[2];                 /* seconds a byte, smoothed, by the stores taken; 0: not measured yet */
    uint32_t calls, every;          /* calls of this size so far; the stores not chosen are tried every ``every`` */
} Choice;

typedef struct {
    PyObject_HEAD
    int rank, size;
    Py_ssize_t slot_bytes, small_bytes;
    uint64_t step, calls;           /* this rank's steps and calls so far */
    unsigned spins;                 /* polls before a wait yields the core (0 where ranks share cores) */
    double yield_seconds;           /* yielding the core, before the wait goes to Python */
    Control **control;              /* every rank's */
    char **slots;                   /* every rank's two slots, slot s of rank q at slots[2q + s] */
    PyObject *regions;              /* the buffers, kept alive */
    PyObject *stalled;              /* stalled(rank, step): waits in Python (raises on a lost or hung peer) */
    PyObject *mismatched;           /* mismatched(((count, type, op), ...)): raises MismatchError */
    PyObject *refuse;               /* refuse(): raises, for a call after a failed one (the ranks' steps differ) */
    PyObject *ops;                  /* the MPI ops by number (OPS), for calls that pass mpi4py's arguments */
    PyObject *narrow;               /* ((op, type), ...): user ops that add 16-bit floats as their bits (uint16) */
    PyObject *in_place;             /* MPI.IN_PLACE */
    int broken;                     /* a call failed midway: the ranks' steps may differ, every later call refused */
    int threads;                    /* threads taking a call's large copies and reductions (1: this one) */
    char *partial;                  /* BLOCK_BYTES a thread, for reductions of more than two ranks */
    int stores;                     /* STORES_LEARN: as ``choices`` say; STORES_CACHED, STORES_STREAMED: always */
    Choice choices[CLASSES];        /* the allreduce's */
    Choice scatter_choices[CLASSES];    /* the reduce_scatter's */
} Node;

enum { STORES_LEARN, STORES_CACHED, STORES_STREAMED };
static const char *STORES[] = {"learn", "cached", "streamed"};

static inline uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* streamed (1) or cached (0) stores for a call of ``bytes`` */
static Choice *choice_for(Node *self, Choice *choices, size_t bytes) {
    if (self->stores != STORES_LEARN || !CAN_STREAM || bytes <= (size_t)self->small_bytes)
        return NULL;
    int c = 63 - __builtin_clzll((unsigned long long)bytes) - 14;
    return &choices[c < 0 ? 0 : c >= CLASSES ? CLASSES - 1 : c];
}

static int best_of(const Choice *c) { return c->cost[1] != 0 && c->cost[1] < c->cost[0]; }

static int choose(const Choice *c) {
    if (c->cost[0] == 0 || c->cost[1] == 0)
        return c->cost[0] != 0;           /* each kind once, first (after the warm-up) */
    return (c->calls + 1) % c->every == 0 ? !best_of(c) : best_of(c);
}

static void learn(Choice *c, int streamed, double cost) {
    if (c->calls++ < WARM_UP)
        return;                     /* a size's first calls are cold (pages touched first, caches empty, peers'
                                       first-call work): 10-20x the later ones' time, not counted */
    int tried = c->cost[0] != 0 && c->cost[1] != 0 && streamed != best_of(c);
    /* a trial's time replaces the old one (the machine may have changed since); the chosen one's is smoothed */
    c->cost[streamed] = c->cost[streamed] == 0 || tried ? cost : 0.75 * c->cost[streamed] + 0.25 * cost;
    if (c->every == 0)
        c->every = FIRST_EVERY;
    if (tried)
        c->every = c->cost[streamed] < c->cost[!streamed] ? FIRST_EVERY
                   : c->every * 2 > LAST_EVERY ? LAST_EVERY : c->every * 2;
}

/* dst[0:len] = src[0:len], streamed past the caches (the caller fences before publishing) or as memcpy */
static void to_slot(char *dst, const char *src, size_t len, int streamed) {
#if CAN_STREAM
    if (streamed && len >= 64) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15, i;
        memcpy(dst, src, head);
        for (i = head; i + 64 <= len; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, len - i);
        return;
    }
#endif
    (void)streamed;
    memcpy(dst, src, len);
}

/* how many of the rank's threads share ``bytes`` of work: one a PIECE_BYTES, at most ``threads`` */
static int sharing(const Node *self, size_t bytes) {
    size_t most = bytes / PIECE_BYTES;
    return most < 2 || self->threads < 2 ? 1 : most < (size_t)self->threads ? (int)most : self->threads;
}

static void slice_of(int q, int p, size_t count, size_t unit, size_t *start, size_t *stop);

/* to_slot by as many threads as the bytes warrant, each fencing its own streamed stores */
static void copy_by(const Node *self, char *dst, const char *src, size_t len, int streamed) {
    int threads = sharing(self, len);
    if (threads == 1) {
        to_slot(dst, src, len, streamed);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        size_t start, stop;
        slice_of(t, threads, len, 64, &start, &stop);
        to_slot(dst + start, src + start, stop - start, streamed);
        if (streamed)
            STREAM_FENCE();
    }
#endif
}

/* 0 once every rank has published ``target``; -1 with a Python error (the GIL is held only meanwhile) */
static int wait_all(Node *self, PyThreadState **save, uint64_t target) {
    for (int q = 0; q < self->size; q++) {
        const uint64_t *step = &self->control[q]->step;
        if (load_acquire(step) >= target)
            continue;
        for (unsigned i = 0; i < self->spins && load_acquire(step) < target; i++)
            CPU_RELAX();
        if (load_acquire(step) >= target)
            continue;
        /* then yield the core; past ``yield_seconds`` the wait goes to Python.  (Napping here 1-100 us between
           looks, from 20 us or 1 ms of yields to 5 ms, made 16 MiB at 2 ranks with gloo's threads in the job
           0.74-0.88x DeepSpeed's time where handing over at 1 ms gave 1.68-2.02x, and 16-64 MiB at 4 ranks on 2
           cores 2.6-3.2x slower: measured, bench-torch, December 2) */
        double start = seconds();
        while (load_acquire(step) < target && seconds() - start < self->yield_seconds)
            sched_yield();
        if (load_acquire(step) >= target)
            continue;
        PyEval_RestoreThread(*save);
        PyObject *done = PyObject_CallFunction(self->stalled, "iK", q, (unsigned long long)target);
        *save = PyEval_SaveThread();
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

/* out[from:to] = sources[0] op sources[1] op ... op sources[p-1] there (elements, ``offset`` bytes into each
   source), in that order, block by block (a partial of BLOCK_BYTES for more than two ranks) */
static void reduce_range(int p, combine_fn combine, int itemsize, char *out, char *also, char **sources,
                         Py_ssize_t offset, size_t from, size_t to, char *partial) {
    size_t block = BLOCK_BYTES / itemsize;
    for (size_t start = from; start < to; start += block) {
        size_t n = to - start < block ? to - start : block;
        size_t at = offset + start * itemsize;
        char *o = out + start * itemsize;
        if (p == 2) {
            combine(o, sources[0] + at, sources[1] + at, n);
        } else {
            combine(partial, sources[0] + at, sources[1] + at, n);
            for (int q = 2; q < p - 1; q++)
                combine(partial, partial, sources[q] + at, n);
            combine(o, partial, sources[p - 1] + at, n);
        }
        if (also) memcpy(also + start * itemsize, o, n * itemsize);
    }
}

/* out = sources[0] op sources[1] op ... op sources[p-1], in that order; out may be one of them; by as many
   threads as the bytes warrant, each its own range of whole cache lines */
static void reduce_into(Node *self, combine_fn combine, int itemsize, char *out, char *also, char **sources,
                        Py_ssize_t offset, size_t count) {
    int p = self->size;
    if (p == 1) {
        memmove(out, sources[0] + offset, count * itemsize);
        if (also) memcpy(also, out, count * itemsize);
        return;
    }
    int threads = sharing(self, count * itemsize);
    if (threads == 1) {
        reduce_range(p, combine, itemsize, out, also, sources, offset, 0, count, self->partial);
        return;
    }
#ifdef _OPENMP
    size_t unit = itemsize < 64 ? 64 / itemsize : 1;
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        size_t start, stop;
        slice_of(t, threads, count, unit, &start, &stop);
        reduce_range(p, combine, itemsize, out, also, sources, offset, start, stop, self->partial + t * BLOCK_BYTES);
    }
#endif
}

/* [start, stop) of rank q's slice of a chunk of ``count`` elements, cut at multiples of ``unit`` */
static void slice_of(int q, int p, size_t count, size_t unit, size_t *start, size_t *stop) {
    size_t units = (count + unit - 1) / unit, base = units / p, extra = units % p;
    size_t first = q * base + ((size_t)q < extra ? (size_t)q : extra), n = base + ((size_t)q < extra);
    *start = first * unit < count ? first * unit : count;
    *stop = (first + n) * unit < count ? (first + n) * unit : count;
}

/* a step's arrival: publishes step 2k - 1 (its streamed stores fenced first) and waits for every rank's; on a call's first step, compares every
 * rank's fingerprint of call ``call``.  0; -1 with a Python error (a lost or hung peer); -2 with the MismatchError
 * every rank raises (they all stop at this step, so the next call starts together).  The GIL is released. */
static int arrive(Node *self, PyThreadState **save, uint64_t k, uint64_t call, int first, int streamed,
                  double *began) {
    int p = self->size;
    const uint64_t *fingerprint = self->control[self->rank]->fingerprint[call & 1];
    if (streamed)
        STREAM_FENCE();                 /* the streamed stores land before the step is published */
    store_release(&self->control[self->rank]->step, 2 * k - 1);
    if (wait_all(self, save, 2 * k - 1) < 0)
        return -1;
    if (!first)
        return 0;
    *began = seconds();                 /* every rank is here: the call's time (for the stores' choice) from now */
    int agree = 1;
    for (int q = 0; q < p; q++)
        agree &= memcmp(self->control[q]->fingerprint[call & 1], fingerprint, 4 * sizeof(uint64_t)) == 0;
    if (agree)
        return 0;
    PyEval_RestoreThread(*save);
    PyObject *calls = PyTuple_New(p);
    for (int q = 0; calls != NULL && q < p; q++) {
        const uint64_t *f = self->control[q]->fingerprint[call & 1];
        PyTuple_SET_ITEM(calls, q, Py_BuildValue("(KKK)", (unsigned long long)f[1], (unsigned long long)f[2],
                                                 (unsigned long long)f[3]));
    }
    PyObject *raised = calls == NULL ? NULL : PyObject_CallOneArg(self->mismatched, calls);
    Py_XDECREF(calls);
    if (raised != NULL) {
        Py_DECREF(raised);
        PyErr_SetString(PyExc_RuntimeError, "mismatched() returned instead of raising");
    }
    *save = PyEval_SaveThread();
    return -2;
}

/* writes this rank's fingerprint of its next call, which it numbers */
static uint64_t begin_call(Node *self, uint64_t bytes_or_count, uint64_t kind, uint64_t detail) {
    uint64_t call = ++self->calls;
    uint64_t *fingerprint = self->control[self->rank]->fingerprint[call & 1];
    fingerprint[0] = call; fingerprint[1] = bytes_or_count; fingerprint[2] = kind; fingerprint[3] = detail;
    return call;
}

/* a call's end: its buffers released; one that failed midway (not a mismatch, where every rank stopped at the
   same step) leaves the ranks' steps apart, so the node refuses every later call */
static PyObject *finish(Node *self, PyObject *result, int mismatch, Py_buffer *send, Py_buffer *recv) {
    if (send != NULL)
        PyBuffer_Release(send);
    PyBuffer_Release(recv);
    if (result == NULL && !mismatch)
        self->broken = 1;
    Py_XINCREF(result);
    return result;
}

/* the allreduce of C-contiguous buffers of ``recv_obj``'s size; ``send_obj`` Py_None: in place */
static PyObject *run(Node *self, PyObject *send_obj, PyObject *recv_obj, int type, int op) {
    if (self->broken)
        return PyObject_CallNoArgs(self->refuse);
    if (type < 0 || type >= N_TYPES || op < 0 || op >= N_OPS || COMBINES[type][op] == NULL) {
        PyErr_Format(PyExc_ValueError, "the on-node allreduce has no op %d on type %d", op, type);
        return NULL;
    }
    Py_buffer recv, send;
    if (PyObject_GetBuffer(recv_obj, &recv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int in_place = send_obj == Py_None;
    if (!in_place) {
        if (PyObject_GetBuffer(send_obj, &send, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&recv);
            return NULL;
        }
        if (send.len != recv.len) {
            PyErr_Format(PyExc_ValueError, "send has %zd bytes, recv %zd", send.len, recv.len);
            PyBuffer_Release(&send);
            PyBuffer_Release(&recv);
            return NULL;
        }
    }
    int itemsize = ITEMSIZE[type], p = self->size, r = self->rank;
    size_t count = recv.len / itemsize;
    const char *source = in_place ? recv.buf : send.buf;
    char *target = recv.buf;
    combine_fn combine = COMBINES[type][op];
    size_t chunk = self->slot_bytes / itemsize, unit = itemsize < 64 ? 64 / itemsize : 1;
    uint64_t call = begin_call(self, count, type, op);
    Control *mine = self->control[r];
    Choice *choice = choice_for(self, self->choices, recv.len);
    int streamed = choice ? choose(choice) : self->stores == STORES_STREAMED && CAN_STREAM;
    double began = 0;                   /* when every rank had arrived */
    char *sources[p];
    PyObject *result = Py_None;
    int mismatch = 0;
    PyThreadState *save = PyEval_SaveThread();
    size_t done = 0;
    do {                                    /* one step a chunk; a call of no elements is one step too */
        size_t n = count - done < chunk ? count - done : chunk;
        uint64_t k = ++self->step;
        int s = (int)(k & 1);
        char *slot = self->slots[2 * r + s];
        for (int q = 0; q < p; q++)
            sources[q] = self->slots[2 * q + s];
        int small = (Py_ssize_t)(n * itemsize) <= self->small_bytes;
        size_t start = 0, stop = 0;         /* a large chunk: this rank's slice, reduced from where it lies */
        if (!small)
            slice_of(r, p, n, unit, &start, &stop);
        copy_by(self, slot, source + done * itemsize, start * itemsize, streamed);
        copy_by(self, slot + stop * itemsize, source + (done + stop) * itemsize, (n - stop) * itemsize, streamed);
        int arrived = arrive(self, &save, k, call, done == 0, streamed, &began);
        if (arrived < 0) {
            result = NULL;
            mismatch = arrived == -2;
            break;
        }
        char *out = target + done * itemsize;
        if (small) {
            reduce_into(self, combine, itemsize, out, NULL, sources, 0, n);
        } else {
            sources[r] = (char *)source + done * itemsize;
            if (streamed) {             /* into the output, then streamed into the slot */
                reduce_into(self, combine, itemsize, out + start * itemsize, NULL, sources, start * itemsize,
                            stop - start);
                copy_by(self, slot + start * itemsize, out + start * itemsize, (stop - start) * itemsize, 1);
                STREAM_FENCE();
            } else {
                reduce_into(self, combine, itemsize, slot + start * itemsize, out + start * itemsize, sources,
                            start * itemsize, stop - start);
            }
            store_release(&mine->step, 2 * k);
            if (wait_all(self, &save, 2 * k) < 0) {
                result = NULL;
                break;
            }
            for (int q = 0; q < p; q++) {
                if (q == r)
                    continue;
                slice_of(q, p, n, unit, &start, &stop);
                copy_by(self, out + start * itemsize, sources[q] + start * itemsize, (stop - start) * itemsize, 0);
            }
        }
        done += n;
    } while (done < count);
    if (choice && result != NULL)
        learn(choice, streamed, (seconds() - began) / (double)recv.len);
    PyEval_RestoreThread(save);
    return finish(self, result, mismatch, in_place ? NULL : &send, &recv);
}

/* the fingerprints' kinds of the calls that move bytes without reducing (past the allreduce's type codes) */
enum { KIND_ALLGATHER = 100, KIND_BCAST = 101, KIND_REDUCE_SCATTER = 200 /* + the type */ };

/* allgather (root < 0: every rank's ``block`` bytes of ``send``, or of its own block of ``recv`` when ``send`` is
 * None, into ``recv`` in rank order) or bcast (root's ``recv`` into every rank's), in steps of at most a slot:
 * the ranks that give copy their chunk into their slot, every rank arrives (step 2k - 1, as the allreduce's small
 * chunks), then copies the given chunks out of their owners' slots.  A slot is written again two steps later,
 * after every rank has arrived at the step between, so past reading it: one synchronisation a step. */
static PyObject *move(Node *self, PyObject *send_obj, PyObject *recv_obj, int root) {
    if (self->broken)
        return PyObject_CallNoArgs(self->refuse);
    int p = self->size, r = self->rank;
    if (root >= p) {
        PyErr_Format(PyExc_ValueError, "root %d of %d ranks", root, p);
        return NULL;
    }
    Py_buffer recv, send;
    if (PyObject_GetBuffer(recv_obj, &recv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int has_send = send_obj != Py_None;
    if (has_send && PyObject_GetBuffer(send_obj, &send, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&recv);
        return NULL;
    }
    size_t block = root >= 0 ? (size_t)recv.len : (size_t)recv.len / p;
    if ((root < 0 && recv.len % p) || (root >= 0 && has_send) || (has_send && (size_t)send.len != block)) {
        PyErr_Format(PyExc_ValueError, "%s: recv has %zd bytes, send %zd, for %d ranks", root < 0 ? "allgather" :
                     "bcast", recv.len, has_send ? send.len : (Py_ssize_t)-1, p);
        if (has_send)
            PyBuffer_Release(&send);
        PyBuffer_Release(&recv);
        return NULL;
    }
    char *target = recv.buf;
    const char *source = has_send ? send.buf : root >= 0 ? target : target + r * block;
    int gives = root < 0 || r == root;
    uint64_t call = begin_call(self, block, root < 0 ? KIND_ALLGATHER : KIND_BCAST, root < 0 ? 0 : (uint64_t)root);
    double began;                           /* (unused: the copies' stores are not chosen) */
    PyObject *result = Py_None;
    int mismatch = 0;
    PyThreadState *save = PyEval_SaveThread();
    size_t done = 0, chunk = (size_t)self->slot_bytes;
    do {                                    /* a call of no bytes is one step too */
        size_t n = block - done < chunk ? block - done : chunk;
        uint64_t k = ++self->step;
        int s = (int)(k & 1);
        if (gives)
            copy_by(self, self->slots[2 * r + s], source + done, n, 0);
        int arrived = arrive(self, &save, k, call, done == 0, 0, &began);
        if (arrived < 0) {
            result = NULL;
            mismatch = arrived == -2;
            break;
        }
        for (int q = root < 0 ? 0 : root; q < (root < 0 ? p : root + 1); q++) {
            char *out = root < 0 ? target + q * block + done : target + done;
            if (q == r)                     /* its own: from where it lies, if not there already */
                memmove(out, source + done, out == source + done ? 0 : n);
            else
                copy_by(self, out, self->slots[2 * q + s], n, 0);
        }
        done += n;
    } while (done < block);
    PyEval_RestoreThread(save);
    return finish(self, result, mismatch, has_send ? &send : NULL, &recv);
}

static PyObject *node_allgather(Node *self, PyObject *args) {
    PyObject *send_obj, *recv_obj;
    if (!PyArg_ParseTuple(args, "OO", &send_obj, &recv_obj))
        return NULL;
    return move(self, send_obj, recv_obj, -1);
}

static PyObject *node_bcast(Node *self, PyObject *args) {
    PyObject *buf;
    int root;
    if (!PyArg_ParseTuple(args, "Oi", &buf, &root))
        return NULL;
    if (root < 0) {
        PyErr_Format(PyExc_ValueError, "root %d", root);
        return NULL;
    }
    return move(self, Py_None, buf, root);
}

/* reduce_scatter_block: ``recv`` (count elements) <- the reduction over the ranks of their ``send`` blocks of this
 * rank, in rank order.  In steps of a slot's share per block: every rank copies its pieces of the other ranks'
 * blocks into its slot (piece q at q x the share), arrives, and reduces its own piece of every other rank's slot
 * and of its own send into ``recv``; one synchronisation a step, the slots reused as the allgather's. */
static PyObject *reduce_scatter(Node *self, PyObject *send_obj, PyObject *recv_obj, int type, int op) {
    if (self->broken)
        return PyObject_CallNoArgs(self->refuse);
    if (type < 0 || type >= N_TYPES || op < 0 || op >= N_OPS || COMBINES[type][op] == NULL) {
        PyErr_Format(PyExc_ValueError, "the on-node reduce_scatter has no op %d on type %d", op, type);
        return NULL;
    }
    int p = self->size, r = self->rank, itemsize = ITEMSIZE[type];
    Py_buffer recv, send;
    if (PyObject_GetBuffer(recv_obj, &recv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(send_obj, &send, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&recv);
        return NULL;
    }
    if (send.len != p * recv.len || recv.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "reduce_scatter: send has %zd bytes, recv %zd, for %d ranks", send.len,
                     recv.len, p);
        return finish(self, NULL, 1, &send, &recv);
    }
    size_t count = recv.len / itemsize, share = (self->slot_bytes / p) / 64 * 64 / itemsize;
    if (share == 0)
        share = 1;
    const char *source = send.buf;
    char *target = recv.buf;
    combine_fn combine = COMBINES[type][op];
    uint64_t call = begin_call(self, count, KIND_REDUCE_SCATTER + type, op);
    Choice *choice = choice_for(self, self->scatter_choices, send.len);
    int streamed = choice ? choose(choice) : self->stores == STORES_STREAMED && CAN_STREAM;
    double began = 0;
    char *sources[p];
    PyObject *result = Py_None;
    int mismatch = 0;
    PyThreadState *save = PyEval_SaveThread();
    size_t done = 0;
    do {                                    /* a call of no elements is one step too */
        size_t n = count - done < share ? count - done : share;
        uint64_t k = ++self->step;
        int s = (int)(k & 1);
        char *slot = self->slots[2 * r + s];
        for (int q = 0; q < p; q++)
            if (q != r)
                copy_by(self, slot + q * share * itemsize, source + (q * count + done) * itemsize, n * itemsize,
                        streamed);
        int arrived = arrive(self, &save, k, call, done == 0, streamed, &began);
        if (arrived < 0) {
            result = NULL;
            mismatch = arrived == -2;
            break;
        }
        for (int q = 0; q < p; q++)
            sources[q] = q == r ? (char *)source + (r * count + done) * itemsize
                                : self->slots[2 * q + s] + r * share * itemsize;
        reduce_into(self, combine, itemsize, target + done * itemsize, NULL, sources, 0, n);
        done += n;
    } while (done < count);
    if (choice && result != NULL)
        learn(choice, streamed, (seconds() - began) / (double)send.len);
    PyEval_RestoreThread(save);
    return finish(self, result, mismatch, &send, &recv);
}

static PyObject *node_reduce_scatter(Node *self, PyObject *args) {
    PyObject *send_obj, *recv_obj;
    int type, op;
    if (!PyArg_ParseTuple(args, "OOii", &send_obj, &recv_obj, &type, &op))
        return NULL;
    return reduce_scatter(self, send_obj, recv_obj, type, op);
}

static PyObject *node_allreduce(Node *self, PyObject *args) {
    PyObject *send_obj, *recv_obj;
    int type, op;
    if (!PyArg_ParseTuple(args, "OOii", &send_obj, &recv_obj, &type, &op))
        return NULL;
    return run(self, send_obj, recv_obj, type, op);
}

/* the type of a buffer numpy exports in native byte order (its format and item size); -1: none of ours */
static int type_of(const char *format, Py_ssize_t itemsize) {
    if (format == NULL)
        return itemsize == 1 ? TY_U8 : -1;
    if (format[0] == '@' || format[0] == '=')
        format++;
    if (format[0] == 'Z' && format[2] == 0)
        return format[1] == 'f' ? TY_C64 : format[1] == 'd' ? TY_C128 : -1;
    if (format[0] == 0 || format[1] != 0)
        return -1;
    int width = itemsize == 1 ? 0 : itemsize == 2 ? 1 : itemsize == 4 ? 2 : itemsize == 8 ? 3 : -1;
    if (strchr("bhilqn", format[0]) && width >= 0)
        return TY_I8 + width;
    if (strchr("BHILQN", format[0]) && width >= 0)
        return TY_U8 + width;
    switch (format[0]) {
    case 'f': return itemsize == 4 ? TY_F32 : -1;
    case 'd': return itemsize == 8 ? TY_F64 : -1;
    case 'e': return itemsize == 2 ? TY_F16 : -1;
    case '?': return itemsize == 1 ? TY_BOOL : -1;
    }
    return -1;
}

/* (type, op) of an mpi4py-style call this node carries, or 0 with *type = -1 where it does not (not C-contiguous,
   types that differ, an op or type it has not); -1 on a Python error */
static int codes(Node *self, PyObject *sendbuf, PyObject *recvbuf, PyObject *op, int *type, int *opcode) {
    *type = *opcode = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->ops); i++)
        if (PyTuple_GET_ITEM(self->ops, i) == op)
            *opcode = (int)i;
    Py_buffer recv, send;
    if (PyObject_GetBuffer(recvbuf, &recv, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();                      /* the checked path says what is wrong with it */
        return 0;
    }
    int kind = type_of(recv.format, recv.itemsize);
    if (sendbuf != self->in_place) {
        if (PyObject_GetBuffer(sendbuf, &send, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            kind = -1;
        } else {
            if (type_of(send.format, send.itemsize) != kind || send.len != recv.len)
                kind = -1;
            PyBuffer_Release(&send);
        }
    }
    PyBuffer_Release(&recv);
    if (*opcode < 0 && kind == TY_U16) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->narrow); i++) {
            PyObject *pair = PyTuple_GET_ITEM(self->narrow, i);
            if (PyTuple_GET_ITEM(pair, 0) == op) {
                kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(pair, 1));
                *opcode = O_SUM;
            }
        }
    }
    if (kind < 0 || *opcode < 0 || COMBINES[kind][*opcode] == NULL)
        kind = -1;
    *type = kind;
    return 0;
}

/* takes(sendbuf, recvbuf, op): whether this node carries an Allreduce with mpi4py's arguments */
static PyObject *node_takes(Node *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "takes(sendbuf, recvbuf, op)");
        return NULL;
    }
    int type, op;
    if (codes(self, args[0], args[1], args[2], &type, &op) < 0)
        return NULL;
    return PyBool_FromLong(type >= 0);
}

/* node(owner, sendbuf, recvbuf, op): an Allreduce with mpi4py's arguments (``takes`` said yes), as the fast
   path calls MPI's (mpicoll.collectives._fastcall) */
static PyObject *node_call(Node *self, PyObject *args, PyObject *kwds) {
    PyObject *owner, *sendbuf, *recvbuf, *op;
    if (kwds != NULL || !PyArg_ParseTuple(args, "OOOO", &owner, &sendbuf, &recvbuf, &op))
        return NULL;
    int type, opcode;
    if (codes(self, sendbuf, recvbuf, op, &type, &opcode) < 0)
        return NULL;
    if (type < 0) {
        PyErr_SetString(PyExc_TypeError, "the on-node allreduce was handed a call it does not take");
        return NULL;
    }
    return run(self, sendbuf == self->in_place ? Py_None : sendbuf, recvbuf, type, opcode);
}

static PyObject *node_arrived(Node *self, PyObject *args) {
    int q;
    unsigned long long target;
    if (!PyArg_ParseTuple(args, "iK", &q, &target))
        return NULL;
    if (q < 0 || q >= self->size) {
        PyErr_SetString(PyExc_IndexError, "no such rank");
        return NULL;
    }
    return PyBool_FromLong(load_acquire(&self->control[q]->step) >= target);
}

static int node_init(Node *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"regions", "rank", "slot_bytes", "small_bytes", "spins", "yield_seconds",
                            "stalled", "mismatched", "refuse", "ops", "narrow", "in_place", "stores", "threads", NULL};
    PyObject *regions, *stalled, *mismatched, *refuse, *ops, *narrow, *in_place;
    const char *stores;
    int rank, threads;
    Py_ssize_t slot_bytes, small_bytes;
    unsigned spins;
    double yield_seconds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OinnIdOOOO!O!Osi", names, &regions, &rank, &slot_bytes,
                                     &small_bytes, &spins, &yield_seconds, &stalled, &mismatched, &refuse,
                                     &PyTuple_Type, &ops, &PyTuple_Type, &narrow, &in_place, &stores, &threads))
        return -1;
    if (!OPENMP_BUILT)
        threads = 1;                    /* built without OpenMP: this thread alone */
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "threads=%d: 1 or more", threads);
        return -1;
    }
    int kind = -1;
    for (int k = 0; k < 3; k++)
        if (strcmp(stores, STORES[k]) == 0)
            kind = k;
    if (kind < 0) {
        PyErr_Format(PyExc_ValueError, "stores=%s: 'learn', 'cached' or 'streamed'", stores);
        return -1;
    }
    if (self->control != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Node is made once");
        return -1;
    }
    PyObject *list = PySequence_Fast(regions, "regions: a sequence of every rank's region");
    if (list == NULL)
        return -1;
    int p = (int)PySequence_Fast_GET_SIZE(list);
    if (p < 1 || rank < 0 || rank >= p || slot_bytes < 64 || slot_bytes % 64) {
        PyErr_SetString(PyExc_ValueError, "Node: a rank among the regions, and slots of a multiple of 64 bytes");
        Py_DECREF(list);
        return -1;
    }
    self->control = PyMem_Calloc(p, sizeof(Control *));
    self->slots = PyMem_Calloc(2 * p, sizeof(char *));
    self->partial = PyMem_Malloc((size_t)threads * BLOCK_BYTES);
    if (self->control == NULL || self->slots == NULL || self->partial == NULL) {
        Py_DECREF(list);
        PyErr_NoMemory();
        return -1;
    }
    for (int q = 0; q < p; q++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(list, q), &view, PyBUF_WRITABLE) < 0) {
            Py_DECREF(list);
            return -1;
        }
        char *base = view.buf;
        Py_ssize_t len = view.len;
        PyBuffer_Release(&view);        /* the regions stay alive: this object keeps them (and the window them) */
        if (len < CONTROL_BYTES + 2 * slot_bytes || ((uintptr_t)base) % 64) {
            PyErr_Format(PyExc_ValueError, "rank %d's region: %zd bytes at %p, needs %zd, 64-byte aligned", q, len,
                         base, CONTROL_BYTES + 2 * slot_bytes);
            Py_DECREF(list);
            return -1;
        }
        self->control[q] = (Control *)base;
        self->slots[2 * q] = base + CONTROL_BYTES;
        self->slots[2 * q + 1] = base + CONTROL_BYTES + slot_bytes;
    }
    self->regions = list;
    self->rank = rank;
    self->size = p;
    self->slot_bytes = slot_bytes;
    self->small_bytes = small_bytes;
    self->spins = spins;
    self->yield_seconds = yield_seconds;
    self->step = self->calls = 0;            /* a fresh window holds zeros */
    self->broken = 0;
    self->stores = kind;
    self->threads = threads;
    memset(self->choices, 0, sizeof self->choices);
    memset(self->scatter_choices, 0, sizeof self->scatter_choices);
    Py_INCREF(stalled); self->stalled = stalled;
    Py_INCREF(mismatched); self->mismatched = mismatched;
    Py_INCREF(refuse); self->refuse = refuse;
    Py_INCREF(ops); self->ops = ops;
    Py_INCREF(narrow); self->narrow = narrow;
    Py_INCREF(in_place); self->in_place = in_place;
    return 0;
}

static int node_traverse(Node *self, visitproc visit, void *arg) {
    Py_VISIT(self->regions); Py_VISIT(self->stalled); Py_VISIT(self->mismatched); Py_VISIT(self->refuse);
    Py_VISIT(self->ops); Py_VISIT(self->narrow); Py_VISIT(self->in_place);
    return 0;
}

static int node_clear(Node *self) {
    Py_CLEAR(self->regions); Py_CLEAR(self->stalled); Py_CLEAR(self->mismatched); Py_CLEAR(self->refuse);
    Py_CLEAR(self->ops); Py_CLEAR(self->narrow); Py_CLEAR(self->in_place);
    return 0;
}

static void node_dealloc(Node *self) {
    PyObject_GC_UnTrack(self);
    node_clear(self);
    PyMem_Free(self->control);
    PyMem_Free(self->slots);
    PyMem_Free(self->partial);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *node_chosen(Node *self, PyObject *unused) {
    PyObject *chosen = PyDict_New();
    for (int c = 0; chosen != NULL && c < CLASSES; c++) {
        const Choice *choice = &self->choices[c];
        if (choice->cost[0] == 0 || choice->cost[1] == 0)
            continue;
        PyObject *key = PyLong_FromLongLong(16384LL << c);
        PyObject *value = Py_BuildValue("(sdd)", STORES[best_of(choice) ? STORES_STREAMED : STORES_CACHED],
                                        choice->cost[0] * 1e9, choice->cost[1] * 1e9);
        if (key == NULL || value == NULL || PyDict_SetItem(chosen, key, value) < 0)
            Py_CLEAR(chosen);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return chosen;
}

static PyMethodDef node_methods[] = {
    {"chosen", (PyCFunction)node_chosen, METH_NOARGS,
     "chosen(): {calls from this many bytes: (the stores chosen, ns a byte cached, ns a byte streamed)}, where "
     "both were measured."},
    {"allreduce", (PyCFunction)node_allreduce, METH_VARARGS,
     "allreduce(send or None, recv, type, op): recv <- the reduction over the node's ranks (send None: of recv)."},
    {"allgather", (PyCFunction)node_allgather, METH_VARARGS,
     "allgather(send or None, recv): recv <- every rank's send (None: its block of recv) in rank order, as bytes."},
    {"reduce_scatter", (PyCFunction)node_reduce_scatter, METH_VARARGS,
     "reduce_scatter(send, recv, type, op): recv <- the reduction over the ranks of their send's block of this rank."},
    {"bcast", (PyCFunction)node_bcast, METH_VARARGS, "bcast(buf, root): buf <- root's buf, as bytes."},
    {"arrived", (PyCFunction)node_arrived, METH_VARARGS, "arrived(rank, step): whether rank published step."},
    {"takes", (PyCFunction)(void (*)(void))node_takes, METH_FASTCALL,
     "takes(sendbuf, recvbuf, op): whether this node carries an Allreduce with these mpi4py arguments."},
    {NULL},
};

static PyMemberDef node_members[] = {
    {"calls", T_ULONGLONG, offsetof(Node, calls), READONLY, "calls so far"},
    {"steps", T_ULONGLONG, offsetof(Node, step), READONLY, "steps so far"},
    {"threads", T_INT, offsetof(Node, threads), READONLY, "threads taking a call's large copies and reductions "
     "(1 where the extension was built without OpenMP)"},
    {"broken", T_INT, offsetof(Node, broken), READONLY, "a call failed midway: later calls are refused"},
    {NULL},
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicoll.collectives._shm.Node",
    .tp_doc = "One rank's part of the on-node allreduce over a shared-memory segment.",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)node_init,
    .tp_call = (ternaryfunc)node_call,
    .tp_traverse = (traverseproc)node_traverse,
    .tp_clear = (inquiry)node_clear,
    .tp_dealloc = (destructor)node_dealloc,
    .tp_methods = node_methods,
    .tp_members = node_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shm", "The on-node allreduce over shared memory, in C.",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__shm(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NodeType);
    if (PyModule_AddObject(m, "Node", (PyObject *)&NodeType) < 0 ||
            PyModule_AddIntConstant(m, "CONTROL_BYTES", CONTROL_BYTES) < 0 ||
            PyModule_AddIntConstant(m, "PIECE_BYTES", PIECE_BYTES) < 0 ||
            PyModule_AddIntConstant(m, "OPENMP", OPENMP_BUILT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
