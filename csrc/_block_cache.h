/* _block_cache.h -- the block cache of _block_cache.c: large blocks reused across calls. */
#ifndef GDN_BLOCK_CACHE_H
#define GDN_BLOCK_CACHE_H
#include <Python.h>
#include <stddef.h>

/* bytes of memory (zeroed when zero != 0); NULL when out of memory. Free with gdn_cache_free. */
void *gdn_cache_alloc(size_t bytes, int zero);
void gdn_cache_free(void *p);
/* kernel workspace: the cache's blocks, traced by tracemalloc while in use */
void *gdn_workspace_alloc(size_t bytes);
void gdn_workspace_free(void *p);
/* frees every cached block; returns the bytes freed */
size_t gdn_cache_empty(void);
/* the most bytes the cache keeps (0: none); returns the previous limit */
size_t gdn_cache_set_limit(size_t limit);
void gdn_cache_stats(size_t *cached, size_t *limit);
/* a new reference to the NumPy allocator (a "mem_handler" capsule) that uses the cache */
PyObject *gdn_cache_handler(void);
#endif
