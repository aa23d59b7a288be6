/*
 * Checks of one L2 record as read back from disk: its header against what
 * the index expects, and its payload against the checksum the index holds.
 * Plain C (no Python): the ring runs them with the GIL released, and the
 * layout is kvd/l2/format.py's, field for field.
 */
#ifndef KVD_RECORD_H
#define KVD_RECORD_H

#include <stddef.h>
#include <stdint.h>

/* Result of a record read: 0, or one of these (a miss, never a hit), or -errno. */
enum {
    KVD_READ_OK = 0,
    KVD_READ_SHORT = 1,         /* fewer bytes than asked for (EOF, truncated file) */
    KVD_READ_BAD_HEADER = 2,    /* not this record's header: torn, misdirected, deleted */
    KVD_READ_BAD_CHECKSUM = 3,  /* the payload does not match its checksum */
};

/* Result of recv_hashed (kvd_net.c): 0, one of these, or -errno. */
enum {
    KVD_RECV_OK = 0,
    KVD_RECV_EOF = 1,     /* the peer closed before every byte arrived */
    KVD_RECV_TIMEOUT = 2, /* timeout_ms passed first */
};

typedef struct {
    const uint8_t *buf;
    size_t len;
} kvd_span;

typedef struct {
    uint64_t payload_bytes;
    uint64_t payload_checksum;
    uint64_t seq;
    uint64_t generation;
    const uint8_t *ns;
    size_t ns_len;
    const uint8_t *key;
    size_t key_len;
} kvd_expect;

/* Writable memory: a piece of a copy's far side (kvd_xxh3_copy). */
typedef struct {
    uint8_t *buf;
    size_t len;
} kvd_piece;

/* A large copy is hashed in chunks of this many bytes, each right after it
 * lands (it stays in the L2 cache meanwhile). */
#define KVD_COPY_CHUNK (256u * 1024u)

/* xxh3-64 (seed 0) of the concatenation of `spans`, cut at `nbytes`. */
uint64_t kvd_xxh3_spans(const kvd_span *spans, int nspans, uint64_t nbytes);
/* Copy the pieces' bytes, in order, to `flat` (to_pieces 0) or `flat`'s
 * bytes over the pieces (to_pieces 1), and return the xxh3-64 of the bytes
 * as read where they landed. */
uint64_t kvd_xxh3_copy(const kvd_piece *pieces, int npieces, uint8_t *flat, int to_pieces);
/* Feed `len` bytes to `state`, an XXH3_state_t the caller reset (and digests). */
void kvd_xxh3_update(void *state, const void *buf, size_t len);
#if defined(__x86_64__) && defined(__GNUC__)
/* The same, built for AVX2 and AVX-512F: call only where the CPU has them. */
uint64_t kvd_xxh3_spans_avx2(const kvd_span *spans, int nspans, uint64_t nbytes);
uint64_t kvd_xxh3_spans_avx512(const kvd_span *spans, int nspans, uint64_t nbytes);
uint64_t kvd_xxh3_copy_avx2(const kvd_piece *pieces, int npieces, uint8_t *flat, int to_pieces);
uint64_t kvd_xxh3_copy_avx512(const kvd_piece *pieces, int npieces, uint8_t *flat,
                              int to_pieces);
void kvd_xxh3_update_avx2(void *state, const void *buf, size_t len);
void kvd_xxh3_update_avx512(void *state, const void *buf, size_t len);
#endif

/* KVD_READ_OK when `header` (header_len bytes: 4096 or 8192) is the record
 * `expect` describes; KVD_READ_BAD_HEADER otherwise. */
int kvd_check_header(const uint8_t *header, size_t header_len, const kvd_expect *expect);

/* Header check, then the payload checksum over the first payload_bytes of
 * `payload` (which must hold at least that many; KVD_READ_SHORT if not). */
int kvd_check_record(const uint8_t *header, size_t header_len, const kvd_span *payload,
                     int npayload, const kvd_expect *expect);

#endif
