/*
 * xxh3-64 built for AVX2, chosen at run time by kvd_record.c when the CPU
 * has it (xxHash's own xxh_x86dispatch.c does the same; Debian ships only
 * its header). xxh3 gives the same 64 bits on every vector width; AVX2
 * hashes twice the bytes per instruction of the SSE2 build every x86-64
 * has: ~0.6 against ~1.2 instructions per byte here (callgrind), and the
 * payload hash is most of a 64 KiB read's CPU work.
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

uint64_t
kvd_xxh3_spans_avx2(const kvd_span *spans, int nspans, uint64_t nbytes)
{
    if (nspans <= 1 || nbytes == 0) {
        size_t n = nspans ? spans[0].len : 0;
        return XXH3_64bits(nspans ? spans[0].buf : NULL, nbytes < n ? nbytes : n);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (int i = 0; i < nspans && nbytes > 0; i++) {
        size_t take = spans[i].len < nbytes ? spans[i].len : (size_t)nbytes;
        XXH3_64bits_update(&state, spans[i].buf, take);
        nbytes -= take;
    }
    return XXH3_64bits_digest(&state);
}
#endif
