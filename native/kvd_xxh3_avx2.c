/*
 * xxh3-64 built for AVX2, chosen at run time by kvd_record.c when the CPU
 * has it (xxHash's own xxh_x86dispatch.c does the same; Debian ships only
 * its header). xxh3 gives the same 64 bits on every vector width; this
 * build takes ~0.3 instructions per byte against ~1.2 for the SSE2 one
 * every x86-64 has (callgrind), and the payload hash is most of a 64 KiB
 * read's CPU work.
 */
#include "kvd_record.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#ifndef __AVX2__
#error "the avx2 target pragma did not take"
#endif

#define KVD_XXH3_SPANS kvd_xxh3_spans_avx2
#define KVD_XXH3_COPY kvd_xxh3_copy_avx2
#define KVD_XXH3_UPDATE kvd_xxh3_update_avx2
#include "kvd_xxh3_spans.h"
#endif
