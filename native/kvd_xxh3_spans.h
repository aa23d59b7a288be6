/*
 * The bodies of kvd_xxh3_spans and kvd_xxh3_copy, for each build of xxh3
 * (kvd_record.c: SSE2; kvd_xxh3_avx2.c, kvd_xxh3_avx512.c): include right
 * after <xxhash.h> with XXH_INLINE_ALL, having defined KVD_XXH3_SPANS,
 * KVD_XXH3_COPY and KVD_XXH3_UPDATE as the functions' names.
 */
#include <string.h>

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

/*
 * KVD_XXH3_COPY: copy between `flat` and `pieces` (into the pieces when
 * to_pieces, out of them otherwise) and return the xxh3-64 of the bytes
 * where they landed. A large copy goes in chunks of KVD_COPY_CHUNK, each
 * hashed right after it is copied, while it is still in the cache: a 4 MiB
 * value copied whole and then hashed is read from memory twice.
 */
uint64_t
KVD_XXH3_COPY(const kvd_piece *pieces, int npieces, uint8_t *flat, int to_pieces)
{
    if (npieces == 1 && pieces[0].len <= KVD_COPY_CHUNK) {
        if (to_pieces)
            memcpy(pieces[0].buf, flat, pieces[0].len);
        else
            memcpy(flat, pieces[0].buf, pieces[0].len);
        return XXH3_64bits(to_pieces ? pieces[0].buf : flat, pieces[0].len);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (int i = 0; i < npieces; i++) {
        for (size_t done = 0; done < pieces[i].len;) {
            size_t take = pieces[i].len - done;
            if (take > KVD_COPY_CHUNK)
                take = KVD_COPY_CHUNK;
            uint8_t *piece = pieces[i].buf + done;
            if (to_pieces)
                memcpy(piece, flat, take);
            else
                memcpy(flat, piece, take);
            XXH3_64bits_update(&state, to_pieces ? piece : flat, take);
            flat += take;
            done += take;
        }
    }
    return XXH3_64bits_digest(&state);
}

/*
 * KVD_XXH3_UPDATE: feed `len` bytes to a streaming xxh3-64 state (an
 * XXH3_state_t, reset by the caller; kvd_xxh3_update picks the build).
 */
void
KVD_XXH3_UPDATE(void *state, const void *buf, size_t len)
{
    XXH3_64bits_update((XXH3_state_t *)state, buf, len);
}
