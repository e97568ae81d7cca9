"""cffi builder for the ring buffer's compiled side, built at install time.

What it holds (module ``onepiece.transport.ring._atomics``):

- the word operations: 64-bit atomic load, store and compare-and-swap on shared memory, as a NIC
  does for RDMA atomics (a Python-level lock would only order threads of one process);
- RH64, the entry checksum (``ring_hash_*``), which entry.py, the agent and rdma paths and the
  tests all compute through this module, so every path agrees on the value;
- the shared-memory fast path: ``ring_send`` is the sender's steps 1-8 of writer.py in one call
  (Python keeps only step 1's bounded waiting and lock take-over), ``ring_recv`` the receiver's
  steps 1-5 of reader.py, and ``ring_release`` the end of a borrowed receive. They mirror
  writer.py and reader.py step by step (the step numbers are in the comments); the Python code
  stays the reference and is what runs with a step hook or over a remote region.

Built by setup.py (``cffi_modules``); ``python transport/ring/_atomics_build.py`` builds it in
place by hand (replacing the module file atomically, so running processes keep the old one).
"""

from cffi import FFI

# RH64's base key: 24 words of splitmix64 from the seed "onepiece" (any fixed words would do;
# these are written down here rather than pasted, so anyone can regenerate them).
_M = (1 << 64) - 1


def _base_key() -> list[int]:
    x, out = int.from_bytes(b"onepiece", "big"), []
    for _ in range(24):
        x = (x + 0x9E3779B97F4A7C15) & _M
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        out.append(z ^ (z >> 31))
    return out


# Constants and structs that Python and C both see, written once for cdef and source.
SHARED = """
#define RING_MAX_ROUNDS 16
#define RING_MAX_FRAMES 1024

/* ring_send results */
#define RS_OK 0
#define RS_FULL 1
#define RS_LOCKED 2
#define RS_PEER_GONE 3
#define RS_LOST_LOCK_2 4
#define RS_LOST_LOCK_6 5
#define RS_UNCONFIRMED 6

/* ring_recv results and modes */
#define RR_NONE 0
#define RR_OK 1
#define RR_DROPPED 2
#define RR_NEED 3
#define RR_COPY 0
#define RR_IN_PLACE 1

/* why an entry was dropped */
#define RE_NONE 0
#define RE_SHORT 1
#define RE_MAGIC 2
#define RE_SEQ 3
#define RE_LENGTH 4
#define RE_CHECKSUM 5
#define RE_NFRAMES 6
#define RE_TABLE 7
#define RE_SLOT_LENGTH 8

typedef struct {
    char *base;
    uint64_t nslots;
    uint64_t buf_size;
    uint64_t buf_off;
    uint64_t generation;
} ring_geom;

typedef struct {
    uint64_t found;    /* RS_LOCKED: the lock word found by step 1's CAS */
    uint64_t repairs;  /* step-4 tail repairs done by this call */
} ring_send_info;

typedef struct {
    uint64_t length;    /* the slot's length: how far the heads move */
    uint64_t eseq;      /* the entry's own counter (RE_SEQ) */
    uint64_t elen;      /* the entry's payload length */
    uint64_t checksum;  /* the entry's checksum, as verified (ring_release compares) */
    uint32_t nframes;
    int32_t error;      /* RE_*: why it was dropped */
    uint32_t clean;     /* no lock take-over before step 1: no sender can write over it (release) */
} ring_recv_info;
"""

CDEF = SHARED + """
typedef struct { ...; } ring_hash;

uint64_t ring_load(char *base, size_t off);
void ring_store(char *base, size_t off, uint64_t value);
uint64_t ring_cas(char *base, size_t off, uint64_t expected, uint64_t desired);
void ring_load_n(char *base, size_t off, uint64_t *out, size_t n);

void ring_hash_init(ring_hash *h, uint64_t seed);
void ring_hash_update(ring_hash *h, const char *data, size_t n);
uint64_t ring_hash_final(const ring_hash *h);
void ring_copy_hash(ring_hash *h, char *dst, const char *src, size_t n);
int ring_hash_kernel(void);

typedef void (*ring_hook_fn)(int step);
void ring_set_hook(ring_hook_fn hook);
int ring_hash_use(int kernel);

int ring_send(const ring_geom *g, uint64_t token, int acquire, uint32_t nframes,
              char **frames, const uint64_t *lens, ring_send_info *info);
int ring_recv(const ring_geom *g, uint64_t *heads, char *dst, uint64_t cap, uint64_t *table,
              int mode, ring_recv_info *info);
int ring_release(const ring_geom *g, uint64_t *heads, const ring_recv_info *info);
"""

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RH_X86 1
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's words and RH64 are defined little-endian"
#endif

/* ============================== word operations ============================== */

static uint64_t ring_load(char *base, size_t off) {
    return __atomic_load_n((uint64_t *)(base + off), __ATOMIC_ACQUIRE);
}

static void ring_store(char *base, size_t off, uint64_t value) {
    __atomic_store_n((uint64_t *)(base + off), value, __ATOMIC_RELEASE);
}

/* n consecutive words, each loaded atomically, in order (one call for a header read). */
static void ring_load_n(char *base, size_t off, uint64_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = __atomic_load_n((uint64_t *)(base + off + 8 * i), __ATOMIC_ACQUIRE);
}

/* Returns the value found, as an RDMA ATOMIC_CMP_AND_SWP does: the swap happened iff it
   equals `expected`. */
static uint64_t ring_cas(char *base, size_t off, uint64_t expected, uint64_t desired) {
    __atomic_compare_exchange_n((uint64_t *)(base + off), &expected, desired, 0,
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

/* ============================== RH64, the entry checksum ==============================

   Why this function. A ring entry must be checked at memory speed, in the same pass that copies
   it (the sender copies each piece into the ring and hashes the bytes it copied; the receiver
   hashes in place, or while copying out), and must catch a torn or overwritten entry with
   overwhelming probability, wherever in the entry the damage is. RH64 is the long-input
   construction of XXH3 (Collet; passes SMHasher), re-derived here so that it needs no header
   file: the input is cut into 64-byte stripes of eight 64-bit lanes; for lane i of a stripe
   with data word d and key word k,

        acc[i]   += lo32(d ^ k) * hi32(d ^ k)     (32x32->64 multiply: one AVX2 vpmuludq
        acc[i^1] += d                              does four lanes)

   so every input bit reaches the accumulators linearly (the second line, which the multiply
   cannot cancel) and non-linearly (the first). The key word of a lane depends on the stripe's
   place in its block of 16 stripes (a window sliding over 24 key words), and after each block
   the accumulators are scrambled (xorshift, xor key, multiply by an odd constant: a bijection),
   so the same bytes at another position give another sum: the checksum is position-sensitive,
   and moving, duplicating or swapping data is caught like changing it. A partial last stripe is
   zero-padded and the total length is mixed in, so no two lengths collide by padding. The end
   folds the eight accumulators pairwise through 64x64->128 multiplies and runs xxh64's
   avalanche. The key is the base key (24 splitmix64 words) plus/minus the seed, as XXH3 seeds
   its secret: the seed is the region's generation, so an entry left from an earlier region is
   invalid in a new one. A Fletcher-style sum was the other candidate; its two 64-bit sums are
   linear, so pairs of changes cancel (two top-bit flips an even number of words apart in one
   lane pass it), which torn data can well produce. Not a MAC: nothing here resists an adversary.

   AVX2 and portable C compute the same value (lane arithmetic is exact mod 2**64); the kernel is
   picked once at run time. */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

#define RH_STRIPE 64
#define RH_BLOCK 16   /* stripes between scrambles */
#define RH_KEY 24     /* key words: a window of 8 sliding 16 times, then 8 for the scramble */

static const uint64_t RH_BASE[RH_KEY] = { @BASE_KEY@ };

typedef struct {
    uint64_t acc[8];
    uint64_t key[RH_KEY];
    uint64_t total;         /* bytes absorbed */
    uint32_t stripe;        /* stripes absorbed in the current block */
    uint32_t nbuf;          /* bytes waiting in buf for a whole stripe */
    unsigned char buf[RH_STRIPE];
} ring_hash;

static void ring_hash_init(ring_hash *h, uint64_t seed) {
    static const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(h->acc, init, sizeof init);
    for (int i = 0; i < RH_KEY; i++)
        h->key[i] = RH_BASE[i] + ((i & 1) ? (uint64_t)0 - seed : seed);
    h->total = 0;
    h->stripe = 0;
    h->nbuf = 0;
}

static inline void rh_scramble_c(uint64_t *acc, const uint64_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= key[i];
        acc[i] = a * P32_1;
    }
}

/* n whole stripes from src, each also stored to dst when dst is not NULL (from the same loaded
   words, so what is hashed is exactly what is copied even if src changes meanwhile). */
static void rh_stripes_c(uint64_t *acc, const uint64_t *key, uint32_t *stripe,
                         const unsigned char *src, unsigned char *dst, size_t n) {
    uint32_t s = *stripe;
    for (; n; n--, src += RH_STRIPE) {
        uint64_t d[8];
        memcpy(d, src, RH_STRIPE);
        if (dst) {
            memcpy(dst, d, RH_STRIPE);
            dst += RH_STRIPE;
        }
        for (int i = 0; i < 8; i++) {
            uint64_t x = d[i] ^ key[s + i];
            acc[i] += (x & 0xFFFFFFFFULL) * (x >> 32);
            acc[i ^ 1] += d[i];
        }
        if (++s == RH_BLOCK) {
            rh_scramble_c(acc, key + 16);
            s = 0;
        }
    }
    *stripe = s;
}

#ifdef RH_X86
#define RH_PREFETCH 1024  /* bytes ahead: the hash keeps up with memory only with it */
__attribute__((target("avx2")))
static inline __m256i rh_scramble_avx2(__m256i a, const uint64_t *key) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)key));
    __m256i lo = _mm256_mul_epu32(a, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2")))
static void rh_stripes_avx2(uint64_t *acc, const uint64_t *key, uint32_t *stripe,
                            const unsigned char *src, unsigned char *dst, size_t n) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    uint32_t s = *stripe;
    for (; n; n--, src += RH_STRIPE) {
        _mm_prefetch((const char *)src + RH_PREFETCH, _MM_HINT_T0);
        __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        if (dst) {
            _mm256_storeu_si256((__m256i *)dst, d0);
            _mm256_storeu_si256((__m256i *)(dst + 32), d1);
            dst += RH_STRIPE;
        }
        __m256i x0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)(key + s)));
        __m256i x1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + s + 4)));
        __m256i p0 = _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32));
        __m256i p1 = _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32));
        /* 0x4E swaps the two 64-bit lanes of each 128-bit half: acc[i] += d[i ^ 1] */
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, 0x4E)));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, 0x4E)));
        if (++s == RH_BLOCK) {
            a0 = rh_scramble_avx2(a0, key + 16);
            a1 = rh_scramble_avx2(a1, key + 20);
            s = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    *stripe = s;
}
#endif

typedef void (*rh_stripes_fn)(uint64_t *, const uint64_t *, uint32_t *, const unsigned char *,
                              unsigned char *, size_t);
static rh_stripes_fn rh_stripes_impl = 0;
static int rh_kernel = 0;  /* 1 portable C, 2 AVX2 */

static rh_stripes_fn rh_pick(void) {
    rh_stripes_fn f = rh_stripes_c;
    int k = 1;
#ifdef RH_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        f = rh_stripes_avx2;
        k = 2;
    }
#endif
    rh_kernel = k;
    rh_stripes_impl = f;  /* a benign race: every thread picks the same */
    return f;
}

static inline void rh_stripes(uint64_t *acc, const uint64_t *key, uint32_t *stripe,
                              const unsigned char *src, unsigned char *dst, size_t n) {
    rh_stripes_fn f = rh_stripes_impl;
    if (!f)
        f = rh_pick();
    f(acc, key, stripe, src, dst, n);
}

static int ring_hash_kernel(void) {
    if (!rh_stripes_impl)
        rh_pick();
    return rh_kernel;
}

/* Tests only: use the portable kernel (1) or the best one (2); returns the one in use. */
static int ring_hash_use(int kernel) {
    rh_pick();
    if (kernel == 1) {
        rh_stripes_impl = rh_stripes_c;
        rh_kernel = 1;
    }
    return rh_kernel;
}

/* Absorb n bytes of src; with dst, also copy them there (fused: one read of src). */
static void rh_absorb(ring_hash *h, unsigned char *dst, const unsigned char *src, size_t n) {
    h->total += n;
    if (h->nbuf) {
        size_t take = RH_STRIPE - h->nbuf;
        if (take > n)
            take = n;
        memcpy(h->buf + h->nbuf, src, take);
        if (dst) {
            memcpy(dst, h->buf + h->nbuf, take);
            dst += take;
        }
        h->nbuf += (uint32_t)take;
        src += take;
        n -= take;
        if (h->nbuf < RH_STRIPE)
            return;
        rh_stripes(h->acc, h->key, &h->stripe, h->buf, 0, 1);
        h->nbuf = 0;
    }
    size_t whole = n / RH_STRIPE;
    if (whole) {
        rh_stripes(h->acc, h->key, &h->stripe, src, dst, whole);
        src += whole * RH_STRIPE;
        if (dst)
            dst += whole * RH_STRIPE;
        n -= whole * RH_STRIPE;
    }
    if (n) {
        memcpy(h->buf, src, n);
        if (dst)
            memcpy(dst, h->buf, n);
        h->nbuf = (uint32_t)n;
    }
}

/* The sender's copy into the ring, for large pieces: non-temporal stores (no read for
   ownership of the destination, no cache pollution; what the receiver then reads comes from
   memory, which it would for a piece this large anyway), in chunks that are hashed right after
   they are copied, from the source, still in L1. The source is the sender's own frame, which
   holds still while it is sent; were it changed meanwhile, the entry would fail its checksum
   and be dropped, never handed up. Small pieces use the fused copy (registers to both). The
   caller fences (sfence) before publishing. Measured here (2 vCPUs sharing an L3 with other
   tenants): up to 4 MB the receiver's verification finds the entry in cache after ordinary
   stores, which then win; at 16 MB the non-temporal copy is 1.7x faster and the receiver
   reads memory either way; 8 MB is about even. */
#define NT_MIN (8 * 1024 * 1024)
#define NT_CHUNK (8 * 1024)

#ifdef RH_X86
__attribute__((target("avx2")))
static void nt_copy_avx2(unsigned char *dst, const unsigned char *src, size_t n) {
    /* dst 32-byte aligned, n a multiple of 64 */
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
}
#endif

static int rh_absorb_put(ring_hash *h, unsigned char *dst, const unsigned char *src, size_t n) {
#ifdef RH_X86
    if (n >= NT_MIN && ring_hash_kernel() == 2) {
        size_t head = (size_t)(-(uintptr_t)dst & 63);
        rh_absorb(h, dst, src, head);
        dst += head;
        src += head;
        n -= head;
        while (n >= 64) {
            size_t run = n < NT_CHUNK ? (n & ~(size_t)63) : NT_CHUNK;
            nt_copy_avx2(dst, src, run);
            rh_absorb(h, 0, src, run);
            dst += run;
            src += run;
            n -= run;
        }
        rh_absorb(h, dst, src, n);
        return 1;
    }
#endif
    rh_absorb(h, dst, src, n);
    return 0;
}

static void ring_hash_update(ring_hash *h, const char *data, size_t n) {
    rh_absorb(h, 0, (const unsigned char *)data, n);
}

static void ring_copy_hash(ring_hash *h, char *dst, const char *src, size_t n) {
    rh_absorb(h, (unsigned char *)dst, (const unsigned char *)src, n);
}

static inline uint64_t rh_fold(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static uint64_t ring_hash_final(const ring_hash *h) {
    uint64_t acc[8];
    memcpy(acc, h->acc, sizeof acc);
    if (h->nbuf) {
        unsigned char last[RH_STRIPE];
        uint32_t s = h->stripe;
        memset(last, 0, sizeof last);
        memcpy(last, h->buf, h->nbuf);
        rh_stripes_c(acc, h->key, &s, last, 0, 1);
    }
    uint64_t r = h->total * P64_1;
    for (int i = 0; i < 4; i++)
        r += rh_fold(acc[2 * i] ^ h->key[2 * i + 1], acc[2 * i + 1] ^ h->key[2 * i + 2]);
    r ^= r >> 33;
    r *= P64_2;
    r ^= r >> 29;
    r *= P64_3;
    r ^= r >> 32;
    return r;
}

/* ============================== the ring (layout.py, entry.py) ============================== */

#define W_GEN 8
#define W_STATE 16
#define W_LOCK 40
#define W_TAILS 48
#define W_HEADS 56
#define HEADER_BYTES 64
#define ST_OPEN 1
#define LOCK_TAINT (1ULL << 63)  /* layout.LOCK_TAINT: set by a take-over, never cleared */

#define BUF_BITS 40
#define BUF_MASK ((1ULL << 40) - 1)
#define SEQ_MASK ((1ULL << 24) - 1)
#define BUSY (1ULL << 63)
#define LAP_SHIFT 40
#define LAP_MASK ((1ULL << 23) - 1)
#define LEN_MASK ((1ULL << 40) - 1)

#define ENTRY_MAGIC 0x31544E45ULL  /* "ENT1" little-endian */
#define ENTRY_HEADER 32
@SHARED@

/* Tests only (tests/test_ring_fastpath.py): called before each sender step, as writer.py's
   step hook, so a test can interfere at a step exactly as with the reference. NULL otherwise. */
typedef void (*ring_hook_fn)(int step);
static ring_hook_fn ring_hook = 0;
static void ring_set_hook(ring_hook_fn hook) { ring_hook = hook; }
#define STEP(n) do { if (ring_hook) ring_hook(n); } while (0)

static inline uint64_t ld(const ring_geom *g, uint64_t off) { return ring_load(g->base, off); }
static inline void st(const ring_geom *g, uint64_t off, uint64_t v) { ring_store(g->base, off, v); }
static inline uint64_t cas(const ring_geom *g, uint64_t off, uint64_t e, uint64_t d) {
    return ring_cas(g->base, off, e, d);
}
static inline uint64_t pack_ptrs(uint64_t buf, uint64_t seq) {
    return ((seq & SEQ_MASK) << BUF_BITS) | (buf & BUF_MASK);
}
static inline uint64_t lap_of(uint64_t seq, uint64_t nslots) {
    return ((seq & SEQ_MASK) / nslots) & LAP_MASK;
}
static inline uint64_t slot_offset(const ring_geom *g, uint64_t seq) {
    return HEADER_BYTES + 8 * (seq & (g->nslots - 1));
}
static inline uint64_t padded(uint64_t n) { return (n + 7) & ~7ULL; }

/* Bytes [o, o+n) of the entry at buffer counter pos, in the ring (wrapping at the buffer's
   end): put copies src there, get copies them out to dst (if dst); either absorbs what it
   moves into h (if h). */
static int ent_put(const ring_geom *g, uint64_t pos, uint64_t o, const unsigned char *src,
                   uint64_t n, ring_hash *h) {
    int nt = 0;
    while (n) {
        uint64_t p = (pos + o) & (g->buf_size - 1);
        uint64_t run = g->buf_size - p;
        if (run > n)
            run = n;
        unsigned char *dst = (unsigned char *)g->base + g->buf_off + p;
        if (h)
            nt |= rh_absorb_put(h, dst, src, run);
        else
            memcpy(dst, src, run);
        src += run;
        o += run;
        n -= run;
    }
    return nt;
}

static void ent_get(const ring_geom *g, uint64_t pos, uint64_t o, unsigned char *dst,
                    uint64_t n, ring_hash *h) {
    while (n) {
        uint64_t p = (pos + o) & (g->buf_size - 1);
        uint64_t run = g->buf_size - p;
        if (run > n)
            run = n;
        const unsigned char *src = (const unsigned char *)g->base + g->buf_off + p;
        if (h)
            rh_absorb(h, dst, src, run);
        else
            memcpy(dst, src, run);
        if (dst)
            dst += run;
        o += run;
        n -= run;
    }
}

/* ============================== the sender: writer.py ============================== */

/* Step 5: the entry at buffer counter btail for entry counter stail. The payload (frame table,
   then the frames) is copied and hashed in one pass; the header, whose checksum word needs
   that hash, goes last. Same bytes as entry.Prepared.at() + writer.py's region.write (the
   padding after the payload is not written, as there). */
static void write_entry(const ring_geom *g, uint64_t btail, uint64_t stail, uint32_t nframes,
                        char **frames, const uint64_t *lens, uint64_t length) {
    ring_hash h;
    uint64_t head[4];
    uint64_t o = ENTRY_HEADER;
    int nt = 0;
    ring_hash_init(&h, g->generation);
    ent_put(g, btail, o, (const unsigned char *)lens, 8ULL * nframes, &h);
    o += 8ULL * nframes;
    for (uint32_t i = 0; i < nframes; i++) {
        nt |= ent_put(g, btail, o, (const unsigned char *)frames[i], lens[i], &h);
        o += lens[i];
    }
#ifdef RH_X86
    if (nt)
        _mm_sfence();  /* the non-temporal stores are visible before the header and the publish */
#endif
    head[0] = ENTRY_MAGIC | ((uint64_t)nframes << 32);
    head[1] = stail;
    head[2] = length;
    rh_absorb(&h, 0, (const unsigned char *)head, 24);
    head[3] = ring_hash_final(&h);
    ent_put(g, btail, 0, (const unsigned char *)head, ENTRY_HEADER, 0);
}

/* Steps 2 to 7 (writer.py RingWriter._publish). */
static int publish(const ring_geom *g, uint64_t token, uint32_t nframes, char **frames,
                   const uint64_t *lens, uint64_t length, uint64_t total, ring_send_info *info) {
    for (int round = 0; round < RING_MAX_ROUNDS; round++) {
        /* 2: the header words; our lock? (token: the whole word we hold, taint included) */
        STEP(2);
        uint64_t gen = ld(g, W_GEN), state = ld(g, W_STATE), lock = ld(g, W_LOCK);
        uint64_t tails = ld(g, W_TAILS), heads = ld(g, W_HEADS);
        if (state != ST_OPEN || gen != g->generation)
            return RS_PEER_GONE;
        if (lock != token)
            return RS_LOST_LOCK_2;  /* taken over while we stalled; nothing written */
        uint64_t btail = tails & BUF_MASK, stail = (tails >> BUF_BITS) & SEQ_MASK;
        uint64_t bhead = heads & BUF_MASK, shead = (heads >> BUF_BITS) & SEQ_MASK;

        /* 3: an entry counter free? */
        STEP(3);
        if (((stail - shead) & SEQ_MASK) >= g->nslots)
            return RS_FULL;
        uint64_t soff = slot_offset(g, stail), lap = lap_of(stail, g->nslots);

        /* 4: the size slot at the tail */
        STEP(4);
        uint64_t w = ld(g, soff);
        uint64_t slap = (w >> LAP_SHIFT) & LAP_MASK, slen = w & LEN_MASK;
        if (w & BUSY) {
            if (slap != lap)
                return RS_FULL;  /* the receiver has not cleared it yet */
            /* a sender died after publishing, before moving the tails: move them past it */
            cas(g, W_TAILS, tails, pack_ptrs(btail + slen, stail + 1));
            info->repairs++;
            continue;
        }
        if (slap != lap)
            continue;  /* consumed already: the tails we read are stale, look again */
        if (((btail - bhead) & BUF_MASK) + total > g->buf_size)
            return RS_FULL;

        /* 5: the entry */
        STEP(5);
        write_entry(g, btail, stail, nframes, frames, lens, length);

        /* 6: publish the size slot */
        STEP(6);
        uint64_t freew = lap << LAP_SHIFT;
        uint64_t found = cas(g, soff, freew, BUSY | (lap << LAP_SHIFT) | (total & LEN_MASK));
        if (found != freew) {
            if (ld(g, W_LOCK) != token)
                return RS_LOST_LOCK_6;
            /* a stalled sender with the same stale tail published here after step 4 */
            if ((found & BUSY) && ((found >> LAP_SHIFT) & LAP_MASK) == lap && (found & LEN_MASK) != total)
                continue;  /* the slot's length rules our bytes out as its entry: look again */
            return RS_UNCONFIRMED;
        }

        /* 7: move both tails; if this fails a later sender's step 4 already did */
        STEP(7);
        cas(g, W_TAILS, tails, pack_ptrs(btail + total, stail + 1));
        return RS_OK;
    }
    return RS_FULL;  /* MAX_ROUNDS re-reads: report full and let go */
}

/* Steps 1 to 8 (writer.py RingWriter.write). With `acquire`, step 1 is one CAS of the lock from
   free (0, or LOCK_TAINT after a take-over, which stays) to free | `token`; if the lock is held
   this returns RS_LOCKED (the word found in info->found) and the caller does the bounded wait
   and take-over, then calls again without `acquire`, `token` being the word it holds. */
static int ring_send(const ring_geom *g, uint64_t token, int acquire, uint32_t nframes,
                     char **frames, const uint64_t *lens, ring_send_info *info) {
    uint64_t length = 8ULL * nframes;
    for (uint32_t i = 0; i < nframes; i++)
        length += lens[i];
    uint64_t total = padded(ENTRY_HEADER + length);
    info->repairs = 0;
    if (acquire) {
        STEP(1);
        uint64_t free = 0, found = cas(g, W_LOCK, 0, token);  /* 1 */
        if (found == LOCK_TAINT) {
            free = LOCK_TAINT;
            found = cas(g, W_LOCK, free, free | token);
        }
        if (found != free) {
            info->found = found;
            return RS_LOCKED;
        }
        token |= free;
    }
    int rc = publish(g, token, nframes, frames, lens, length, total, info);
    STEP(8);
    cas(g, W_LOCK, token, token & LOCK_TAINT);  /* 8: does nothing if the lock was taken over */
    return rc;
}

/* ============================== the receiver: reader.py ============================== */

/* Steps 4 and 5: clear the slot to "free, next lap", then advance both heads past the entry. */
static void consume(const ring_geom *g, uint64_t *heads, uint64_t length) {
    uint64_t bhead = heads[0], shead = heads[1];
    st(g, slot_offset(g, shead), lap_of(shead + g->nslots, g->nslots) << LAP_SHIFT);  /* 4 */
    bhead = (bhead + length) & BUF_MASK;
    shead = (shead + 1) & SEQ_MASK;
    st(g, W_HEADS, pack_ptrs(bhead, shead));  /* 5 */
    heads[0] = bhead;
    heads[1] = shead;
}

/* Step 3 (entry.parse), on the entry of `length` bytes at the head. With dst the whole entry
   is copied there (hashing the payload as it is copied) and checked from the copy; without,
   it is checked in place, the header and frame table read once into private memory first.
   Either way the frame sizes end up in table[0..nframes). Checks in entry.parse's order. */
static int check_entry(const ring_geom *g, uint64_t bhead, uint64_t shead, uint64_t length,
                       unsigned char *dst, uint64_t *table, ring_recv_info *info) {
    uint64_t head[4];
    ring_hash h;
    if (length < ENTRY_HEADER)
        return RE_SHORT;
    ent_get(g, bhead, 0, (unsigned char *)head, ENTRY_HEADER, 0);
    if (dst)
        memcpy(dst, head, ENTRY_HEADER);
    uint32_t nframes = (uint32_t)(head[0] >> 32);
    uint64_t eseq = head[1], elen = head[2];
    info->nframes = nframes;
    info->eseq = eseq;
    info->elen = elen;
    if ((uint32_t)head[0] != ENTRY_MAGIC)
        return RE_MAGIC;
    if (eseq != shead)
        return RE_SEQ;
    if (elen > length || padded(ENTRY_HEADER + elen) != length)
        return RE_LENGTH;
    ring_hash_init(&h, g->generation);
    if (dst) {
        ent_get(g, bhead, ENTRY_HEADER, dst + ENTRY_HEADER, elen, &h);
        ent_get(g, bhead, ENTRY_HEADER + elen, dst + ENTRY_HEADER + elen, length - ENTRY_HEADER - elen, 0);
    } else {
        uint64_t t = nframes;
        if (t > RING_MAX_FRAMES)
            t = RING_MAX_FRAMES;
        if (t > elen / 8)
            t = elen / 8;
        ent_get(g, bhead, ENTRY_HEADER, (unsigned char *)table, 8 * t, &h);
        ent_get(g, bhead, ENTRY_HEADER + 8 * t, 0, elen - 8 * t, &h);
    }
    rh_absorb(&h, 0, (const unsigned char *)head, 24);
    if (ring_hash_final(&h) != head[3])
        return RE_CHECKSUM;
    info->checksum = head[3];
    /* the checksum passed, so the table is what the sender wrote; still check it fits */
    if (nframes > RING_MAX_FRAMES || 8ULL * nframes > elen)
        return RE_NFRAMES;
    if (dst)
        memcpy(table, dst + ENTRY_HEADER, 8ULL * nframes);
    uint64_t sum = 8ULL * nframes;
    for (uint32_t i = 0; i < nframes; i++) {
        if (table[i] > elen - sum)
            return RE_TABLE;
        sum += table[i];
    }
    if (sum != elen)
        return RE_TABLE;
    return RE_NONE;
}

/* Steps 1 to 5 (reader.py RingReader._step) for the entry at heads = {bhead, shead}.
   RR_COPY: copy the entry into dst (cap bytes); RR_NEED (nothing done) if cap is too small.
   RR_IN_PLACE: verify it where it is and do not consume it (ring_release does, later);
   RR_NEED if it wraps around the buffer's end (the caller copies it instead).
   RR_OK: valid, frame sizes in table; RR_DROPPED: invalid, consumed, why in info->error. */
static int ring_recv(const ring_geom *g, uint64_t *heads, char *dst, uint64_t cap, uint64_t *table,
                     int mode, ring_recv_info *info) {
    uint64_t bhead = heads[0], shead = heads[1];
    /* 1: busy for this lap, and the tails past it */
    uint64_t w = ld(g, slot_offset(g, shead));
    if (!(w & BUSY) || ((w >> LAP_SHIFT) & LAP_MASK) != lap_of(shead, g->nslots))
        return RR_NONE;
    if (((ld(g, W_TAILS) >> BUF_BITS) & SEQ_MASK) == shead)
        return RR_NONE;  /* published, but the tails have not passed it yet */
    if (mode == RR_IN_PLACE)  /* only ring_release asks (a copy is checked as it is made) */
        info->clean = !(ld(g, W_LOCK) & LOCK_TAINT);
    uint64_t length = w & LEN_MASK;
    int err;
    info->length = length;
    info->error = RE_NONE;
    if (length > g->buf_size) {
        err = RE_SLOT_LENGTH;
    } else if (length < ENTRY_HEADER) {
        err = RE_SHORT;
    } else {
        if (mode == RR_COPY && cap < length)
            return RR_NEED;
        if (mode == RR_IN_PLACE && (bhead & (g->buf_size - 1)) + length > g->buf_size)
            return RR_NEED;
        /* 2, 3 */
        err = check_entry(g, bhead, shead, length, mode == RR_COPY ? (unsigned char *)dst : 0, table, info);
        if (err == RE_NONE) {
            if (mode == RR_COPY)
                consume(g, heads, length);  /* 4, 5 */
            return RR_OK;
        }
    }
    info->error = err;
    consume(g, heads, length);  /* 4, 5: a dropped entry moves the heads as far as its slot says */
    return RR_DROPPED;
}

/* The end of an in-place receive, then steps 4 and 5. Only a sender whose lock was taken over
   can write into a published entry (layout.py, LOCK_TAINT): if the lock word carried no taint
   at step 1 (info->clean), no such sender can reach this entry and its header is compared only;
   otherwise the entry is hashed where it is once more and compared with the checksum verified
   at hand-up, so a stalled sender's late write over it meanwhile is noticed, even one that left
   another valid entry there. Returns 1 if the bytes were still those verified, 0 if not; it is
   consumed either way. */
static int ring_release(const ring_geom *g, uint64_t *heads, const ring_recv_info *info) {
    uint64_t head[4];
    ent_get(g, heads[0], 0, (unsigned char *)head, ENTRY_HEADER, 0);
    int intact = head[3] == info->checksum && head[2] == info->elen;
    if (!info->clean) {
        ring_hash h;
        ring_hash_init(&h, g->generation);
        ent_get(g, heads[0], ENTRY_HEADER, 0, info->elen, &h);
        rh_absorb(&h, 0, (const unsigned char *)head, 24);
        intact = intact && ring_hash_final(&h) == info->checksum;
    }
    consume(g, heads, info->length);
    return intact;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "onepiece.transport.ring._atomics",
    SOURCE.replace("@SHARED@", SHARED).replace("@BASE_KEY@", ", ".join(f"0x{w:016X}ULL" for w in _base_key())),
    extra_compile_args=["-O3"],
)

if __name__ == "__main__":
    import os
    import shutil
    from pathlib import Path

    here = Path(__file__).resolve().parent
    # The name `pip install -e .` gives it (cffi builds for the limited API), so there is one.
    name = "_atomics.abi3.so"
    built = Path(ffibuilder.compile(tmpdir=str(here / "build"), target=name))
    tmp = here / (name + ".tmp")
    shutil.copy(built, tmp)
    os.replace(tmp, here / name)  # a new file: processes that mapped the old one keep theirs
    shutil.rmtree(here / "build", ignore_errors=True)
    print(os.path.relpath(here / name))
