/*
 * Slots of kvd.io._uring's Ring: one per op in flight. A slot keeps its op's
 * buffers exported (PyObject_GetBuffer) from submit until its completion is
 * reaped, so their owner cannot be freed or closed while the kernel may
 * write into them. See kvd_ring.h.
 */
#include "kvd_ring.h"

#include <errno.h>
#include <string.h>

/* ---- slots ------------------------------------------------------------ */

int
slot_pop(RingObject *self)
{
    int idx = self->free_head;
    assert(idx >= 0);
    self->free_head = self->slots[idx].next_free;
    self->slots[idx].in_use = 1;
    self->slots[idx].record = -1;
    self->slots[idx].want_bytes = 0;
    self->inflight++;
    return idx;
}

/* Release the slot's buffers and put it back on the free list. GIL held. */
void
slot_release(RingObject *self, int idx)
{
    kvd_slot *slot = &self->slots[idx];
    assert(slot->in_use);
    for (int i = 0; i < slot->nviews; i++)
        PyBuffer_Release(&slot->views[i]);
    if (slot->views != &slot->inline_view)
        PyMem_Free(slot->views);
    if (slot->iovs != slot->inline_iovs)
        PyMem_Free(slot->iovs);
    slot->views = NULL;
    slot->iovs = NULL;
    slot->nviews = 0;
    slot->niovs = 0;
    slot->in_use = 0;
    slot->next_free = self->free_head;
    self->free_head = idx;
    self->inflight--;
}

/* Export each buffer of `bufobj` into the slot. On failure every buffer
 * exported so far is released and -1 is returned with an exception set. */
int
slot_export(kvd_slot *slot, PyObject *bufobj, int writable)
{
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    PyObject *seq = NULL;
    Py_ssize_t n = 1;

    if (!PyObject_CheckBuffer(bufobj)) {
        if (!PyList_Check(bufobj) && !PyTuple_Check(bufobj)) {
            PyErr_SetString(PyExc_TypeError,
                            "op buffer must be a buffer or a list/tuple of buffers");
            return -1;
        }
        seq = bufobj;
        n = PySequence_Fast_GET_SIZE(seq);
        if (n < 1 || n > KVD_BUFS_PER_OP_MAX) {
            PyErr_Format(PyExc_ValueError, "an op takes 1..%d buffers, got %zd",
                         KVD_BUFS_PER_OP_MAX, n);
            return -1;
        }
    }
    if (n == 1) {
        slot->views = &slot->inline_view;
        slot->iovs = slot->inline_iovs;
    } else {
        slot->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
        slot->iovs = PyMem_Calloc((size_t)n, sizeof(struct iovec));
        if (slot->views == NULL || slot->iovs == NULL) {
            PyMem_Free(slot->views);
            PyMem_Free(slot->iovs);
            slot->views = NULL;
            slot->iovs = NULL;
            PyErr_NoMemory();
            return -1;
        }
    }
    long long total_bytes = 0;
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *item = seq ? PySequence_Fast_GET_ITEM(seq, got) : bufobj;
        if (PyObject_GetBuffer(item, &slot->views[got], flags) < 0)
            goto fail;
        total_bytes += slot->views[got].len;
        slot->iovs[got].iov_base = slot->views[got].buf;
        slot->iovs[got].iov_len = (size_t)slot->views[got].len;
        if (total_bytes > KVD_OP_BYTES_MAX) {
            got++;
            PyErr_Format(PyExc_ValueError, "an op moves at most %lld bytes",
                         KVD_OP_BYTES_MAX);
            goto fail;
        }
    }
    slot->nviews = (int)n;
    slot->niovs = (int)n;
    slot->want_bytes = total_bytes;
    return 0;
fail:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&slot->views[i]);
    if (slot->views != &slot->inline_view)
        PyMem_Free(slot->views);
    if (slot->iovs != slot->inline_iovs)
        PyMem_Free(slot->iovs);
    slot->views = NULL;
    slot->iovs = NULL;
    return -1;
}

/* Parse one op tuple into slot `idx` (buffers exported). */
int
op_parse(RingObject *self, PyObject *op, int idx, kvd_op_head *head)
{
    kvd_slot *slot = &self->slots[idx];
    PyObject *bufobj;
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "op must be a tuple (opcode, fd, offset, buffer(s), user_data)");
        return -1;
    }
    if (!PyArg_ParseTuple(op, "iiLOL", &head->opcode, &head->fd, &head->offset,
                          &bufobj, &slot->user_data))
        return -1;
    if (head->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0");
        return -1;
    }
    slot->nviews = 0;
    switch (head->opcode) {
    case OP_READ:
    case OP_WRITE:
        return slot_export(slot, bufobj, head->opcode == OP_READ);
    case OP_FSYNC:
    case OP_FDATASYNC:
        if (bufobj != Py_None) {
            PyErr_SetString(PyExc_TypeError, "fsync ops take None as buffer");
            return -1;
        }
        slot->views = &slot->inline_view;
        slot->iovs = slot->inline_iovs;
        slot->niovs = 0;
        return 0;
    default:
        PyErr_Format(PyExc_ValueError, "unknown opcode %d", head->opcode);
        return -1;
    }
}

void
op_prep(RingObject *self, int idx, const kvd_op_head *head)
{
    kvd_slot *slot = &self->slots[idx];
    struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
    /* The SQ has >= depth entries and every queued SQE owns a slot, so a
     * free slot implies a free SQE. */
    assert(sqe != NULL);
    __u64 off = (__u64)head->offset;
    switch (head->opcode) {
    case OP_READ:
        if (slot->niovs == 1)
            io_uring_prep_read(sqe, head->fd, slot->iovs[0].iov_base,
                               (unsigned)slot->iovs[0].iov_len, off);
        else
            io_uring_prep_readv(sqe, head->fd, slot->iovs, (unsigned)slot->niovs, off);
        break;
    case OP_WRITE:
        if (slot->niovs == 1)
            io_uring_prep_write(sqe, head->fd, slot->iovs[0].iov_base,
                                (unsigned)slot->iovs[0].iov_len, off);
        else
            io_uring_prep_writev(sqe, head->fd, slot->iovs, (unsigned)slot->niovs, off);
        break;
    case OP_FSYNC:
        io_uring_prep_fsync(sqe, head->fd, 0);
        break;
    case OP_FDATASYNC:
        io_uring_prep_fsync(sqe, head->fd, IORING_FSYNC_DATASYNC);
        break;
    default:
        assert(0);
    }
    io_uring_sqe_set_data64(sqe, (__u64)idx);
}

/* ---- helpers ------------------------------------------------------------ */

int
ring_check_usable(RingObject *self)
{
    if (!self->ring_ready) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by another thread");
        return -1;
    }
    return 0;
}

/* Hand the kernel the SQEs queued so far, without the GIL: issuing an
 * O_DIRECT op pins its pages inline (microseconds for 4 MiB). EAGAIN,
 * EBUSY and EINTR leave SQEs queued: they go out with the next submit or
 * reap (see `unsubmitted`). Anything else means the ring itself is broken
 * (-1, OSError set); the accepted ops stay owned by their slots. */
int
ring_submit_queued(RingObject *self)
{
    int ret = 0;
    if (io_uring_sq_ready(&self->ring) > 0) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        ret = io_uring_submit(&self->ring);
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    if (ret < 0 && ret != -EAGAIN && ret != -EBUSY && ret != -EINTR) {
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Collect up to `max` completions into done_idx/done_res. GIL released. */
int
ring_harvest(RingObject *self, int max)
{
    struct io_uring_cqe *cqe;
    int count = 0;
    while (count < max && io_uring_peek_cqe(&self->ring, &cqe) == 0) {
        if (cqe->user_data != KVD_CANCEL_USER_DATA) {
            self->done_idx[count] = (int)cqe->user_data;
            self->done_res[count] = cqe->res;
            count++;
        }
        io_uring_cqe_seen(&self->ring, cqe);
    }
    return count;
}


/* Put back a slot popped for an op that failed to parse (it exported nothing). */
void
slot_unpop(RingObject *self, int idx)
{
    self->slots[idx].nviews = 0;
    self->slots[idx].niovs = 0;
    self->slots[idx].views = NULL;
    self->slots[idx].iovs = NULL;
    slot_release(self, idx);
}
