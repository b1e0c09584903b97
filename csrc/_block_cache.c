/*
 * _block_cache.c -- a cache of large blocks for gdn_ext's own arrays and kernel workspace.
 *
 * Why: a block malloc hands back to the kernel comes back as fresh pages, and the first write to
 * each page is a page fault. A training step allocates tens of MB (outputs, the chunk states it
 * keeps for its backward, gradients, workspace), so without a cache it faults on every page of
 * them on every step. Here a freed large block is kept for the next call that asks for one of its
 * size, up to a limit, and given back by gdn_ext.empty_cache().
 *
 * Every block carries a header with its capacity, so that reuse never trusts a size passed to
 * free. Blocks below GDN_CACHE_MIN_BYTES go straight to malloc / free (malloc keeps those).
 * The lock is a pthread mutex held for a few list operations only; fork() takes it first, so a
 * child never inherits it held. tracemalloc: NumPy traces its arrays itself; workspace blocks are
 * traced here while they are in use (cached blocks are not in use and are not traced).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#define NPY_NO_DEPRECATED_API NPY_1_25_API_VERSION
#include <numpy/ndarraytypes.h>                   /* PyDataMem_Handler only: no NumPy calls here */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "_block_cache.h"
#if defined(_WIN32)
#include <windows.h>
#else
#include <pthread.h>
#include <sys/mman.h>
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define __SANITIZE_ADDRESS__ 1                    /* clang's spelling of GCC's macro */
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
/* AddressSanitizer: every block exact and freed at once, so that it sees overflows and reuse */
#define GDN_CACHE_MIN_BYTES SIZE_MAX
#else
#define GDN_CACHE_MIN_BYTES ((size_t)1 << 20)
#endif
#define GDN_CACHE_HEADER 64                       /* keeps the block's alignment to 64 bytes */
#define GDN_CACHE_SLOTS 256
#define GDN_TRACE_DOMAIN 0x67646e                 /* tracemalloc domain of the workspace ("gdn") */

typedef struct {
    size_t capacity;                              /* bytes usable after the header */
} block_header;

typedef struct {
    char *base;                                   /* the header's address; NULL: slot empty */
    size_t capacity;
    unsigned long long age;                       /* when it was cached: the oldest goes first */
} cache_slot;

static cache_slot slots[GDN_CACHE_SLOTS];
static size_t cached_bytes = 0;
/* the default: a float64 training step of one layer at H = 32, T = 4096, D = 128 frees 1.04 GiB */
static size_t cache_limit = (size_t)2 << 30;
static unsigned long long clock_now = 0;

#if defined(_WIN32)
static SRWLOCK cache_lock = SRWLOCK_INIT;
static void lock(void) { AcquireSRWLockExclusive(&cache_lock); }
static void unlock(void) { ReleaseSRWLockExclusive(&cache_lock); }
#else
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static void lock(void) { pthread_mutex_lock(&cache_lock); }
static void unlock(void) { pthread_mutex_unlock(&cache_lock); }
#endif

static size_t round_up(size_t bytes)
{
    const size_t page = 4096;
    return bytes > SIZE_MAX - 2 * page ? 0 : (bytes + page - 1) / page * page;
}

/* A new block of `capacity` bytes (NULL when malloc fails); huge pages asked for where NumPy's own
 * allocator asks for them (Linux, 4 MiB and up), since these blocks are read as NumPy's are. */
static char *new_block(size_t capacity, int zero)
{
    if (capacity > SIZE_MAX - GDN_CACHE_HEADER) return NULL;
    char *base = zero ? calloc(1, capacity + GDN_CACHE_HEADER) : malloc(capacity + GDN_CACHE_HEADER);
    if (base == NULL) return NULL;
    ((block_header *)base)->capacity = capacity;
#if defined(MADV_HUGEPAGE)
    if (capacity >= ((size_t)4 << 20)) {
        const uintptr_t huge = (uintptr_t)1 << 21;
        uintptr_t lo = ((uintptr_t)base + huge - 1) & ~(huge - 1);
        uintptr_t hi = ((uintptr_t)base + capacity + GDN_CACHE_HEADER) & ~(huge - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);   /* advice: failure is harmless */
    }
#endif
    return base;
}

/* The cached block that fits `need` bytes best (within a quarter more), taken out; NULL: none. */
static char *take_cached(size_t need)
{
    int best = -1;
    lock();
    for (int i = 0; i < GDN_CACHE_SLOTS; i++) {
        const size_t c = slots[i].capacity;
        if (slots[i].base == NULL || c < need || c - need > need / 4) continue;
        if (best < 0 || c < slots[best].capacity) best = i;
    }
    char *base = NULL;
    if (best >= 0) {
        base = slots[best].base;
        cached_bytes -= slots[best].capacity;
        slots[best].base = NULL;
        slots[best].capacity = 0;
    }
    unlock();
    return base;
}

/* Keeps a block for reuse, making room by freeing the oldest; frees it when it cannot be kept. */
static void give_back(char *base)
{
    const size_t capacity = ((block_header *)base)->capacity;
    char *evicted[GDN_CACHE_SLOTS];
    int n_evicted = 0, kept = 0;
    lock();
    while (capacity <= cache_limit) {
        int empty = -1, oldest = -1;
        for (int i = 0; i < GDN_CACHE_SLOTS; i++) {
            if (slots[i].base == NULL) {
                if (empty < 0) empty = i;
            } else if (oldest < 0 || slots[i].age < slots[oldest].age) {
                oldest = i;
            }
        }
        if (empty >= 0 && cached_bytes + capacity <= cache_limit) {
            slots[empty] = (cache_slot){base, capacity, ++clock_now};
            cached_bytes += capacity;
            kept = 1;
            break;
        }
        if (oldest < 0) break;
        evicted[n_evicted++] = slots[oldest].base;
        cached_bytes -= slots[oldest].capacity;
        slots[oldest].base = NULL;
        slots[oldest].capacity = 0;
    }
    unlock();
    for (int i = 0; i < n_evicted; i++) free(evicted[i]);
    if (!kept) free(base);
}

void *gdn_cache_alloc(size_t bytes, int zero)
{
    if (bytes < GDN_CACHE_MIN_BYTES) {
        char *base = new_block(bytes, zero);
        return base ? base + GDN_CACHE_HEADER : NULL;
    }
    const size_t need = round_up(bytes);
    if (need == 0) return NULL;
    char *base = take_cached(need);
    if (base == NULL) return (base = new_block(need, zero)) ? base + GDN_CACHE_HEADER : NULL;
    if (zero) memset(base + GDN_CACHE_HEADER, 0, bytes);
    return base + GDN_CACHE_HEADER;
}

void gdn_cache_free(void *p)
{
    if (p == NULL) return;
    char *base = (char *)p - GDN_CACHE_HEADER;
    if (((block_header *)base)->capacity < GDN_CACHE_MIN_BYTES) free(base);
    else give_back(base);
}

static void *cache_realloc(void *p, size_t bytes)
{
    if (p == NULL) return gdn_cache_alloc(bytes, 0);
    char *base = (char *)p - GDN_CACHE_HEADER;
    const size_t old = ((block_header *)base)->capacity;
    if (bytes <= old) return p;
    void *q = gdn_cache_alloc(bytes, 0);
    if (q == NULL) return NULL;                   /* p stays valid, as realloc leaves it */
    memcpy(q, p, old);
    gdn_cache_free(p);
    return q;
}

void *gdn_workspace_alloc(size_t bytes)
{
    void *p = gdn_cache_alloc(bytes ? bytes : 1, 0);
    if (p != NULL) PyTraceMalloc_Track(GDN_TRACE_DOMAIN, (uintptr_t)p, bytes ? bytes : 1);
    return p;
}

void gdn_workspace_free(void *p)
{
    if (p == NULL) return;
    PyTraceMalloc_Untrack(GDN_TRACE_DOMAIN, (uintptr_t)p);
    gdn_cache_free(p);
}

size_t gdn_cache_empty(void)
{
    char *all[GDN_CACHE_SLOTS];
    int n = 0;
    lock();
    const size_t released = cached_bytes;
    for (int i = 0; i < GDN_CACHE_SLOTS; i++)
        if (slots[i].base != NULL) {
            all[n++] = slots[i].base;
            slots[i].base = NULL;
            slots[i].capacity = 0;
        }
    cached_bytes = 0;
    unlock();
    for (int i = 0; i < n; i++) free(all[i]);
    return released;
}

size_t gdn_cache_set_limit(size_t limit)
{
    lock();
    const size_t previous = cache_limit;
    cache_limit = limit;
    const int over = cached_bytes > limit;
    unlock();
    if (over) gdn_cache_empty();
    return previous;
}

void gdn_cache_stats(size_t *cached, size_t *limit)
{
    lock();
    *cached = cached_bytes;
    *limit = cache_limit;
    unlock();
}

/* ---- NumPy's allocator interface (NEP 49): arrays made under this handler use the cache ---- */

static void *np_malloc(void *ctx, size_t bytes) { (void)ctx; return gdn_cache_alloc(bytes, 0); }
static void *np_calloc(void *ctx, size_t n, size_t size)
{
    (void)ctx;
    if (size != 0 && n > SIZE_MAX / size) return NULL;
    return gdn_cache_alloc(n * size, 1);
}
static void *np_realloc(void *ctx, void *p, size_t bytes) { (void)ctx; return cache_realloc(p, bytes); }
static void np_free(void *ctx, void *p, size_t bytes) { (void)ctx; (void)bytes; gdn_cache_free(p); }

static PyDataMem_Handler handler = {
    "gdn_ext_block_cache", 1, {NULL, np_malloc, np_calloc, np_realloc, np_free}};

#if !defined(_WIN32)
static void before_fork(void) { lock(); }
static void after_fork(void) { unlock(); }
#endif

PyObject *gdn_cache_handler(void)
{
#if !defined(_WIN32)
    static int registered = 0;
    if (!registered && pthread_atfork(before_fork, after_fork, after_fork) == 0) registered = 1;
#endif
    /* arrays keep a reference to their handler: the capsule outlives them all (never freed) */
    return PyCapsule_New(&handler, "mem_handler", NULL);
}
