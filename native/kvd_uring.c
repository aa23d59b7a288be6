/*
 * kvd._uring: a bounded io_uring ring for kvd's L2 SSD tier.
 *
 * The L2 tier moves 64 KiB-aligned O_DIRECT reads and writes between
 * segment files and pool pages. This module owns one io_uring instance per
 * Ring object and never holds the GIL while the kernel works: Python hands
 * it batches of ops, the kernel moves the bytes, Python reaps completions
 * (usually woken by an eventfd the asyncio loop watches).
 *
 * Ownership rule (the reason this file exists instead of a thin wrapper):
 * every buffer of an accepted op stays exported (PyObject_GetBuffer) from
 * submit() until its completion is reaped. The exporter therefore cannot be
 * resized or closed (mmap.close() raises BufferError) while the kernel may
 * still write into it. close() waits for in-flight ops before letting go;
 * if the device does not finish within KVD_CLOSE_WAIT_S, the buffers are
 * kept exported forever rather than handed back while the kernel owns them.
 *
 * Concurrency: one thread at a time. A method called while another thread
 * is inside the ring with the GIL released raises RuntimeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <liburing.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

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

typedef struct {
    long long user_data;
    Py_buffer *views;     /* nviews exported buffers (views == &inline_view when nviews == 1) */
    struct iovec *iovs;   /* nviews entries, read by the kernel until completion */
    int nviews;
    int next_free;        /* free-list link, -1 at the end */
    int in_use;
    Py_buffer inline_view;
    struct iovec inline_iov;
} kvd_slot;

typedef struct {
    PyObject_HEAD
    struct io_uring ring;
    int ring_ready;       /* queue_init done and queue_exit not yet called */
    int depth;
    int inflight;         /* slots in use: accepted and not yet reaped */
    int busy;             /* a thread is inside the ring with the GIL released */
    int event_fd;         /* -1 until eventfd() */
    int free_head;
    kvd_slot *slots;
    int *done_idx;        /* depth entries: scratch for reap() */
    int *done_res;
} RingObject;

/* ---- slots ------------------------------------------------------------ */

static int
slot_pop(RingObject *self)
{
    int idx = self->free_head;
    assert(idx >= 0);
    self->free_head = self->slots[idx].next_free;
    self->slots[idx].in_use = 1;
    self->inflight++;
    return idx;
}

/* Release the slot's buffers and put it back on the free list. GIL held. */
static void
slot_release(RingObject *self, int idx)
{
    kvd_slot *slot = &self->slots[idx];
    assert(slot->in_use);
    for (int i = 0; i < slot->nviews; i++)
        PyBuffer_Release(&slot->views[i]);
    if (slot->views != &slot->inline_view)
        PyMem_Free(slot->views);
    if (slot->iovs != &slot->inline_iov)
        PyMem_Free(slot->iovs);
    slot->views = NULL;
    slot->iovs = NULL;
    slot->nviews = 0;
    slot->in_use = 0;
    slot->next_free = self->free_head;
    self->free_head = idx;
    self->inflight--;
}

/* Export each buffer of `bufobj` into the slot. On failure every buffer
 * exported so far is released and -1 is returned with an exception set. */
static int
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
        slot->iovs = &slot->inline_iov;
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
    return 0;
fail:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&slot->views[i]);
    if (slot->views != &slot->inline_view)
        PyMem_Free(slot->views);
    if (slot->iovs != &slot->inline_iov)
        PyMem_Free(slot->iovs);
    slot->views = NULL;
    slot->iovs = NULL;
    return -1;
}

typedef struct {
    int opcode;
    int fd;
    long long offset;
} kvd_op_head;

/* Parse one op tuple into slot `idx` (buffers exported). */
static int
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
        slot->iovs = &slot->inline_iov;
        return 0;
    default:
        PyErr_Format(PyExc_ValueError, "unknown opcode %d", head->opcode);
        return -1;
    }
}

static void
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
        if (slot->nviews == 1)
            io_uring_prep_read(sqe, head->fd, slot->iovs[0].iov_base,
                               (unsigned)slot->iovs[0].iov_len, off);
        else
            io_uring_prep_readv(sqe, head->fd, slot->iovs, (unsigned)slot->nviews, off);
        break;
    case OP_WRITE:
        if (slot->nviews == 1)
            io_uring_prep_write(sqe, head->fd, slot->iovs[0].iov_base,
                                (unsigned)slot->iovs[0].iov_len, off);
        else
            io_uring_prep_writev(sqe, head->fd, slot->iovs, (unsigned)slot->nviews, off);
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

static int
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

/* Collect up to `max` completions into done_idx/done_res. GIL released. */
static int
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

/* ---- Ring methods ------------------------------------------------------- */

static PyObject *
Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", NULL};
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:Ring", kwlist, &depth))
        return NULL;
    if (depth < 1 || depth > KVD_DEPTH_MAX) {
        PyErr_Format(PyExc_ValueError, "depth must be in 1..%d, got %d",
                     KVD_DEPTH_MAX, depth);
        return NULL;
    }
    RingObject *self = (RingObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->event_fd = -1;
    self->depth = depth;
    self->slots = PyMem_Calloc((size_t)depth, sizeof(kvd_slot));
    self->done_idx = PyMem_Calloc((size_t)depth, sizeof(int));
    self->done_res = PyMem_Calloc((size_t)depth, sizeof(int));
    if (self->slots == NULL || self->done_idx == NULL || self->done_res == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < depth; i++)
        self->slots[i].next_free = (i + 1 < depth) ? i + 1 : -1;
    self->free_head = 0;
    /* CQ is 2x SQ by default; with at most `depth` ops in flight it can
     * never overflow. */
    int ret = io_uring_queue_init((unsigned)depth, &self->ring, 0);
    if (ret < 0) {
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->ring_ready = 1;
    return (PyObject *)self;
}

static PyObject *
Ring_submit(RingObject *self, PyObject *ops)
{
    if (ring_check_usable(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(ops, "ops must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int take = self->depth - self->inflight;
    if (n < take)
        take = (int)n;

    kvd_op_head *heads = NULL;
    int *idxs = NULL;
    if (take > 0) {
        heads = PyMem_Calloc((size_t)take, sizeof(kvd_op_head));
        idxs = PyMem_Calloc((size_t)take, sizeof(int));
        if (heads == NULL || idxs == NULL) {
            PyMem_Free(heads);
            PyMem_Free(idxs);
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    /* Parse every op before queueing any, so a bad op leaves nothing
     * half-submitted. */
    for (int i = 0; i < take; i++) {
        idxs[i] = slot_pop(self);
        if (op_parse(self, PySequence_Fast_GET_ITEM(seq, i), idxs[i], &heads[i]) < 0) {
            /* The failed slot exported nothing; put it back as empty. */
            self->slots[idxs[i]].nviews = 0;
            self->slots[idxs[i]].views = NULL;
            self->slots[idxs[i]].iovs = NULL;
            for (int j = i; j >= 0; j--)
                slot_release(self, idxs[j]);
            PyMem_Free(heads);
            PyMem_Free(idxs);
            Py_DECREF(seq);
            return NULL;
        }
    }
    for (int i = 0; i < take; i++)
        op_prep(self, idxs[i], &heads[i]);
    PyMem_Free(heads);
    PyMem_Free(idxs);
    Py_DECREF(seq);

    int ret = 0;
    if (io_uring_sq_ready(&self->ring) > 0) {
        /* Issuing an O_DIRECT op pins its pages inline (microseconds for
         * 4 MiB), so the GIL goes while the kernel takes the batch. */
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        ret = io_uring_submit(&self->ring);
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    /* EAGAIN/EBUSY/EINTR leave SQEs queued: they go out with the next
     * submit() or reap() (see `unsubmitted`). Anything else means the ring
     * itself is broken; the accepted ops stay owned by their slots. */
    if (ret < 0 && ret != -EAGAIN && ret != -EBUSY && ret != -EINTR) {
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(take);
}

static PyObject *
Ring_reap(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max", "wait_nr", "timeout_ms", NULL};
    int max, wait_nr = 0;
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|iL:reap", kwlist, &max,
                                     &wait_nr, &timeout_ms))
        return NULL;
    if (ring_check_usable(self) < 0)
        return NULL;
    if (max < 1) {
        PyErr_SetString(PyExc_ValueError, "max must be >= 1");
        return NULL;
    }
    if (wait_nr < 0) {
        PyErr_SetString(PyExc_ValueError, "wait_nr must be >= 0");
        return NULL;
    }
    if (max > self->depth)
        max = self->depth;
    /* Never wait for completions that cannot come. */
    if (wait_nr > self->inflight)
        wait_nr = self->inflight;
    if (wait_nr > max)
        wait_nr = max;

    struct __kernel_timespec ts;
    struct __kernel_timespec *tsp = NULL;
    if (timeout_ms >= 0) {
        ts.tv_sec = timeout_ms / 1000;
        ts.tv_nsec = (timeout_ms % 1000) * 1000000LL;
        tsp = &ts;
    }
    int ret = 0, count = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (io_uring_sq_ready(&self->ring) > 0)
        ret = io_uring_submit(&self->ring);
    if (wait_nr > 0) {
        struct io_uring_cqe *cqe;
        ret = io_uring_wait_cqes(&self->ring, &cqe, (unsigned)wait_nr, tsp, NULL);
    }
    count = ring_harvest(self, max);
    Py_END_ALLOW_THREADS
    self->busy = 0;

    /* Slots go back first: their completions are consumed from the CQ and
     * must not be lost even if building the result fails. */
    PyObject *result = PyList_New(count);
    for (int i = 0; i < count; i++) {
        int idx = self->done_idx[i];
        assert(idx >= 0 && idx < self->depth && self->slots[idx].in_use);
        long long ud = self->slots[idx].user_data;
        slot_release(self, idx);
        if (result != NULL) {
            PyObject *item = Py_BuildValue("(Li)", ud, self->done_res[i]);
            if (item == NULL)
                Py_CLEAR(result);
            else
                PyList_SET_ITEM(result, i, item);
        }
    }
    /* Completions in hand are always returned: dropping them would strand
     * the callers waiting for them. Errors surface on an empty reap. */
    if (result == NULL || count > 0)
        return result;
    if (ret == -EINTR && PyErr_CheckSignals() < 0) {
        Py_DECREF(result);
        return NULL;
    }
    if (ret < 0 && ret != -ETIME && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
        Py_DECREF(result);
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return result;
}

static PyObject *
Ring_eventfd(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ring_check_usable(self) < 0)
        return NULL;
    if (self->event_fd >= 0)
        return PyLong_FromLong(self->event_fd);
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int ret = io_uring_register_eventfd(&self->ring, efd);
    if (ret < 0) {
        close(efd);
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->event_fd = efd;
    return PyLong_FromLong(efd);
}

/* Wait for every in-flight op, then tear the ring down. Returns -1 with an
 * exception set when the device does not finish in time; the ring and the
 * exported buffers are then kept, never handed back. */
static int
ring_close(RingObject *self)
{
    if (!self->ring_ready)
        return 0;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by another thread");
        return -1;
    }
    if (self->inflight > 0) {
        /* Requests not yet issued to the device end with -ECANCELED; ones
         * the device already holds cannot be recalled and are waited for. */
        struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
        if (sqe != NULL) {
            io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
            io_uring_sqe_set_data64(sqe, KVD_CANCEL_USER_DATA);
        }
        struct timespec start, now;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (;;) {
            int count;
            self->busy = 1;
            Py_BEGIN_ALLOW_THREADS
            struct __kernel_timespec ts = {.tv_sec = 0, .tv_nsec = 100 * 1000000LL};
            struct io_uring_cqe *cqe;
            io_uring_submit(&self->ring);
            io_uring_wait_cqe_timeout(&self->ring, &cqe, &ts);
            count = ring_harvest(self, self->depth);
            Py_END_ALLOW_THREADS
            self->busy = 0;
            for (int i = 0; i < count; i++)
                slot_release(self, self->done_idx[i]);
            if (self->inflight == 0)
                break;
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (now.tv_sec - start.tv_sec >= KVD_CLOSE_WAIT_S) {
                errno = ETIMEDOUT;
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
        }
    }
    if (self->event_fd >= 0) {
        io_uring_unregister_eventfd(&self->ring);
        close(self->event_fd);
        self->event_fd = -1;
    }
    io_uring_queue_exit(&self->ring);
    self->ring_ready = 0;
    return 0;
}

static PyObject *
Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ring_close(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static void
Ring_dealloc(RingObject *self)
{
    int leak = 0;
    if (ring_close(self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
        /* The kernel may still write into the exported buffers: keep them
         * exported (and the ring open) for the life of the process. */
        leak = 1;
    }
    if (!leak) {
        PyMem_Free(self->slots);
        PyMem_Free(self->done_idx);
        PyMem_Free(self->done_res);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Ring_get_depth(RingObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->depth);
}

static PyObject *
Ring_get_inflight(RingObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->inflight);
}

static PyObject *
Ring_get_unsubmitted(RingObject *self, void *Py_UNUSED(closure))
{
    if (!self->ring_ready)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLong(io_uring_sq_ready(&self->ring));
}

static PyObject *
Ring_get_closed(RingObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(!self->ring_ready);
}

static PyMethodDef Ring_methods[] = {
    {"submit", (PyCFunction)Ring_submit, METH_O,
     "submit(ops) -> int: queue ops (opcode, fd, offset, buffer(s), user_data) and "
     "return how many were accepted (at most depth - inflight, a prefix of ops)."},
    {"reap", (PyCFunction)(void (*)(void))Ring_reap, METH_VARARGS | METH_KEYWORDS,
     "reap(max, wait_nr=0, timeout_ms=-1) -> list[(user_data, result)]: result is "
     "bytes moved or -errno. Waits (GIL released) for wait_nr completions, capped "
     "at the number in flight."},
    {"eventfd", (PyCFunction)Ring_eventfd, METH_NOARGS,
     "eventfd() -> int: a non-blocking eventfd the kernel signals on each completion."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS,
     "close(): wait for in-flight ops, release their buffers, tear the ring down."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"depth", (getter)Ring_get_depth, NULL, "most ops in flight", NULL},
    {"inflight", (getter)Ring_get_inflight, NULL, "ops accepted and not yet reaped", NULL},
    {"unsubmitted", (getter)Ring_get_unsubmitted, NULL,
     "SQEs queued but not yet taken by the kernel", NULL},
    {"closed", (getter)Ring_get_closed, NULL, "whether close() has finished", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth): a bounded io_uring instance (at most depth ops in flight).",
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_new = Ring_new,
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvd._uring",
    .m_doc = "Bounded io_uring batches for kvd's L2 tier (GIL released while waiting).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__uring(void)
{
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&uring_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddIntConstant(m, "OP_READ", OP_READ) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", OP_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "OP_FSYNC", OP_FSYNC) < 0 ||
        PyModule_AddIntConstant(m, "OP_FDATASYNC", OP_FDATASYNC) < 0 ||
        PyModule_AddIntConstant(m, "DEPTH_MAX", KVD_DEPTH_MAX) < 0 ||
        PyModule_AddIntConstant(m, "BUFS_PER_OP_MAX", KVD_BUFS_PER_OP_MAX) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
