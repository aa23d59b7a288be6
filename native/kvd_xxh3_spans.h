/*
 * The body of kvd_xxh3_spans, for each build of xxh3 (kvd_record.c: SSE2;
 * kvd_xxh3_avx2.c, kvd_xxh3_avx512.c): include right after <xxhash.h> with
 * XXH_INLINE_ALL, having defined KVD_XXH3_SPANS as the function's name.
 */
uint64_t
KVD_XXH3_SPANS(const kvd_span *spans, int nspans, uint64_t nbytes)
{
    if (nspans <= 1 || nbytes == 0) {
        /* One buffer, the common case (a 64 KiB value in one pool page run). */
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
