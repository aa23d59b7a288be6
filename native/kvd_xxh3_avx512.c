/*
 * xxh3-64 built for AVX-512, chosen at run time by kvd_record.c when the
 * CPU has AVX512F (see kvd_xxh3_avx2.c): the same 64 bits again, 64 bytes
 * per vector instruction.
 */
#include "kvd_record.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#include <xxhash.h>

#ifndef __AVX512F__
#error "the avx512f target pragma did not take"
#endif

#define KVD_XXH3_SPANS kvd_xxh3_spans_avx512
#define KVD_XXH3_COPY kvd_xxh3_copy_avx512
#define KVD_XXH3_UPDATE kvd_xxh3_update_avx512
#include "kvd_xxh3_spans.h"
#endif
