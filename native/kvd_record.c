/*
 * L2 record checks in C (see kvd_record.h). The header layout is the one
 * kvd/l2/format.py documents and writes; tests/l2/test_format.py feeds the
 * same headers, good and damaged field by field, to both and expects the
 * same verdicts. xxh3-64 comes from xxHash's own header-only build
 * (XXH_INLINE_ALL, Debian libxxhash-dev), the algorithm the Python
 * `xxhash` package exposes as xxh3_64: same input, same 64 bits. AVX-512
 * and AVX2 builds of it (kvd_xxh3_avx512.c, kvd_xxh3_avx2.c) run where
 * the CPU has them.
 */
#include "kvd_record.h"

#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define KVD_MAGIC "KVDL2REC"
#define KVD_VERSION 1
#define KVD_FIXED_BYTES 64
#define KVD_BLOCK_BYTES 4096u
#define KVD_RECORD_ALIGN_BYTES (64u * 1024u)

static uint16_t
le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t
le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t
le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

static uint64_t
align_up(uint64_t n, uint64_t unit)
{
    return (n + unit - 1) / unit * unit;
}

#define KVD_XXH3_SPANS xxh3_spans_sse2
#define KVD_XXH3_COPY xxh3_copy_sse2
#define KVD_XXH3_UPDATE xxh3_update_sse2
static uint64_t xxh3_spans_sse2(const kvd_span *spans, int nspans, uint64_t nbytes);
static uint64_t xxh3_copy_sse2(const kvd_piece *pieces, int npieces, uint8_t *flat,
                               int to_pieces);
static void xxh3_update_sse2(void *state, const void *buf, size_t len);
#include "kvd_xxh3_spans.h"

uint64_t
kvd_xxh3_spans(const kvd_span *spans, int nspans, uint64_t nbytes)
{
#if defined(__x86_64__) && defined(__GNUC__)
    /* Checked on every call: a cached cpuid bit test, and no state to race on. */
    if (__builtin_cpu_supports("avx512f"))
        return kvd_xxh3_spans_avx512(spans, nspans, nbytes);
    if (__builtin_cpu_supports("avx2"))
        return kvd_xxh3_spans_avx2(spans, nspans, nbytes);
#endif
    return xxh3_spans_sse2(spans, nspans, nbytes);
}

uint64_t
kvd_xxh3_copy(const kvd_piece *pieces, int npieces, uint8_t *flat, int to_pieces)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f"))
        return kvd_xxh3_copy_avx512(pieces, npieces, flat, to_pieces);
    if (__builtin_cpu_supports("avx2"))
        return kvd_xxh3_copy_avx2(pieces, npieces, flat, to_pieces);
#endif
    return xxh3_copy_sse2(pieces, npieces, flat, to_pieces);
}

void
kvd_xxh3_update(void *state, const void *buf, size_t len)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) {
        kvd_xxh3_update_avx512(state, buf, len);
        return;
    }
    if (__builtin_cpu_supports("avx2")) {
        kvd_xxh3_update_avx2(state, buf, len);
        return;
    }
#endif
    xxh3_update_sse2(state, buf, len);
}

static uint64_t
xxh3(const uint8_t *buf, size_t len)
{
    kvd_span span = {buf, len};
    return kvd_xxh3_spans(&span, 1, len);
}

int
kvd_check_header(const uint8_t *h, size_t header_len, const kvd_expect *e)
{
    if (header_len != KVD_BLOCK_BYTES && header_len != 2 * KVD_BLOCK_BYTES)
        return KVD_READ_BAD_HEADER;
    if (memcmp(h, KVD_MAGIC, 8) != 0 || le16(h + 8) != KVD_VERSION)
        return KVD_READ_BAD_HEADER;
    /* flags: a tombstone written over the record, or a segment marker, is
     * not the record. */
    if (le16(h + 10) != 0 || le32(h + 12) != header_len)
        return KVD_READ_BAD_HEADER;
    if (xxh3(h, header_len - 8) != le64(h + header_len - 8))
        return KVD_READ_BAD_HEADER;
    uint64_t generation = le64(h + 16), seq = le64(h + 24), record_bytes = le64(h + 32);
    uint64_t payload_bytes = le64(h + 40), payload_checksum = le64(h + 48);
    size_t ns_len = le16(h + 56), key_len = h[58], parent_len = h[59], meta_len = le16(h + 60);
    if (generation != e->generation || seq != e->seq || payload_bytes != e->payload_bytes ||
        payload_checksum != e->payload_checksum)
        return KVD_READ_BAD_HEADER;
    size_t body = KVD_FIXED_BYTES + ns_len + key_len + parent_len + meta_len;
    if (body + 8 > header_len || align_up(body + 8, KVD_BLOCK_BYTES) != header_len)
        return KVD_READ_BAD_HEADER;
    if (record_bytes != align_up(header_len + payload_bytes, KVD_RECORD_ALIGN_BYTES))
        return KVD_READ_BAD_HEADER;
    if (ns_len != e->ns_len || key_len != e->key_len ||
        memcmp(h + KVD_FIXED_BYTES, e->ns, ns_len) != 0 ||
        memcmp(h + KVD_FIXED_BYTES + ns_len, e->key, key_len) != 0)
        return KVD_READ_BAD_HEADER;
    return KVD_READ_OK;
}

int
kvd_check_record(const uint8_t *header, size_t header_len, const kvd_span *payload,
                 int npayload, const kvd_expect *e)
{
    int status = kvd_check_header(header, header_len, e);
    if (status != KVD_READ_OK)
        return status;
    uint64_t have = 0;
    for (int i = 0; i < npayload; i++)
        have += payload[i].len;
    if (have < e->payload_bytes)
        return KVD_READ_SHORT;
    if (kvd_xxh3_spans(payload, npayload, e->payload_bytes) != e->payload_checksum)
        return KVD_READ_BAD_CHECKSUM;
    return KVD_READ_OK;
}
