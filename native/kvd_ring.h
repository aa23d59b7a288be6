/*
 * The Ring object shared by the files of kvd.io._uring: kvd_uring.c (the
 * type, submit/reap/close, the module), kvd_slots.c (one slot per op in
 * flight: its exported buffers and SQE) and kvd_reads.c (L2 record reads:
 * a batch of records, each one or more read ops, checked in C when its
 * last op completes).
 */
#ifndef KVD_RING_H
#define KVD_RING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <liburing.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvd_record.h"

/* Kernel rings go to 32768 entries; 4096 in flight is ~16 GiB of 4 MiB
 * reads, far past what one daemon thread should keep queued. */
#define KVD_DEPTH_MAX 4096
/* IOV_MAX on Linux: readv/writev refuse more segments than this. */
#define KVD_BUFS_PER_OP_MAX 1024
/* MAX_RW_COUNT: Linux moves at most 2 GiB - 4 KiB in one read/write, and a
 * CQE result is a signed 32-bit int. */
#define KVD_OP_BYTES_MAX 0x7ffff000LL
/* An NVMe command times out after 30 s by default and is retried; 60 s
 * covers one timeout plus the retry on a healthy kernel. */
#define KVD_CLOSE_WAIT_S 60
/* liburing reserves (__u64)-1 for its internal timeout SQEs. */
#define KVD_CANCEL_USER_DATA (UINT64_MAX - 1)

enum { OP_READ = 0, OP_WRITE = 1, OP_FSYNC = 2, OP_FDATASYNC = 3 };

/* iovecs a slot holds without an allocation: a record's header and payload
 * on one device, with the payload in up to three runs of pool pages. */
#define KVD_INLINE_IOVS 4
/* The most paths one stripe layout spans (the ssd_path setting's bound). */
#define KVD_LAYOUT_PATHS_MAX 64
/* A record header: 4 KiB, or 8 KiB with a large meta (kvd/l2/format.py). */
#define KVD_HEADER_BYTES_MAX 8192
/* A record's payload buffers: a 64 GiB value (max_value_bytes' bound) in
 * 64 KiB pool pages. */
#define KVD_PAYLOAD_BUFS_MAX (1 << 20)
/* One op of a record read moves at most this much (below MAX_RW_COUNT);
 * kvd/io/ops.py's OP_BYTES_MAX cuts the same way. */
#define KVD_RECORD_OP_BYTES_MAX (1LL << 30)

typedef struct {
    long long user_data;
    Py_buffer *views;     /* nviews exported buffers (views == &inline_view when nviews == 1);
                           * NULL for a record's op: the record holds its buffers */
    struct iovec *iovs;   /* niovs entries, read by the kernel until completion */
    int nviews;
    int niovs;
    int next_free;        /* free-list link, -1 at the end */
    int in_use;
    int record;           /* the record read this op belongs to, or -1 */
    long long want_bytes; /* bytes asked for (a record op moving fewer is short) */
    Py_buffer inline_view;
    struct iovec inline_iovs[KVD_INLINE_IOVS];
} kvd_slot;

/* One record read in flight: its ops' slots point at it. */
typedef struct {
    long long user_data;
    int pending;          /* its ops not yet completed */
    int status;           /* KVD_READ_* or -errno; the first failure wins */
    int next_free;
    int in_use;
    uint8_t *header;      /* KVD_HEADER_BYTES_MAX, 4 KiB-aligned, owned by the ring: the
                           * header lands here (allocated at first use, kept) */
    size_t header_len;
    Py_buffer *payload;   /* npayload buffers in logical order */
    kvd_span *spans;      /* the same, for the checks without the GIL */
    int npayload;
    Py_buffer inline_payload;
    kvd_span inline_span;
    PyObject *ns;         /* str or bytes, referenced until released */
    PyObject *key;
    kvd_expect expect;
} kvd_rec;

/* Where a logical segment's bytes live: stripes of stripe_bytes dealt
 * round-robin over the paths (kvd/io/layout.py's StripeLayout). */
typedef struct {
    int fds[KVD_LAYOUT_PATHS_MAX];
    int npaths;
    long long segment_bytes;  /* per path */
    long long stripe_bytes;
} kvd_layout;

typedef struct {
    PyObject_HEAD
    struct io_uring ring;
    int ring_ready;       /* queue_init done and queue_exit not yet called */
    int depth;
    unsigned setup_flags; /* the IORING_SETUP_* flags the kernel took */
    int inflight;         /* slots in use: accepted and not yet reaped */
    int busy;             /* a thread is inside the ring with the GIL released */
    int event_fd;         /* -1 until eventfd() */
    int free_head;
    kvd_slot *slots;
    int *done_idx;        /* depth entries: scratch for reap() */
    int *done_res;
    int *done_rec;        /* the record a completion finished, or -1 */
    kvd_rec *recs;        /* depth entries: a record has at least one op */
    int rec_free_head;
} RingObject;

/* kvd_slots.c */
typedef struct {
    int opcode;
    int fd;
    long long offset;
} kvd_op_head;

int slot_pop(RingObject *self);
void slot_release(RingObject *self, int idx);
void slot_unpop(RingObject *self, int idx);
int slot_export(kvd_slot *slot, PyObject *bufobj, int writable);
int op_parse(RingObject *self, PyObject *op, int idx, kvd_op_head *head);
void op_prep(RingObject *self, int idx, const kvd_op_head *head);
int ring_check_usable(RingObject *self);
int ring_submit_queued(RingObject *self);
int ring_harvest(RingObject *self, int max);

/* kvd_reads.c */
void recs_init(RingObject *self);
int recs_account(RingObject *self, int count, int check);
PyObject *recs_results(RingObject *self, int count);
PyObject *Ring_submit_records(RingObject *self, PyObject *args);
void recs_free(RingObject *self);
PyObject *kvd_check_record_py(PyObject *module, PyObject *args);
PyObject *kvd_xxh3_64_py(PyObject *module, PyObject *arg);
PyObject *kvd_copy_many_py(PyObject *module, PyObject *args);
PyObject *kvd_pool_read_many_py(PyObject *module, PyObject *args);
/* kvd_net.c */
PyObject *kvd_recv_hashed_py(PyObject *module, PyObject *args);
/* kvd_density.c, kvd_plan.c */
PyObject *kvd_density_learn_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvd_density_hazards_py(PyObject *module, PyObject *args);
PyObject *kvd_density_choose_py(PyObject *module, PyObject *args);

#endif
