/*
 * kvd.io._uring: a bounded io_uring ring for kvd's L2 SSD tier.
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
#include "kvd_ring.h"

#include <errno.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

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
    self->done_rec = PyMem_Calloc((size_t)depth, sizeof(int));
    self->recs = PyMem_Calloc((size_t)depth, sizeof(kvd_rec));
    if (self->slots == NULL || self->done_idx == NULL || self->done_res == NULL ||
        self->done_rec == NULL || self->recs == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < depth; i++)
        self->slots[i].next_free = (i + 1 < depth) ? i + 1 : -1;
    self->free_head = 0;
    recs_init(self);
    /* CQ is 2x SQ by default; with at most `depth` ops in flight it can
     * never overflow.
     *
     * COOP_TASKRUN: a completion's task work runs when this thread next
     * enters or leaves the kernel (or wakes it when it sleeps) instead of
     * interrupting it with an IPI. Each op completes on the device's CPU
     * (a loop device's worker, an NVMe interrupt); without it every
     * completion sent an IPI to the loop thread. On this 2-vCPU VM with a
     * RAM-backed loop device, 64 KiB reads at QD32 through the bare ring
     * went from 3.2-3.9 to 6.2-8.2 GB/s (fio: 5.5-7.8 GB/s). TASKRUN_FLAG
     * tells liburing when task work is waiting, so a peek for completions
     * enters the kernel to run it. Kernels before 5.19 refuse the flags
     * (EINVAL): the ring then runs without them. */
    unsigned flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    int ret = io_uring_queue_init((unsigned)depth, &self->ring, flags);
    if (ret == -EINVAL) {
        flags = 0;
        ret = io_uring_queue_init((unsigned)depth, &self->ring, flags);
    }
    if (ret < 0) {
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->ring_ready = 1;
    self->setup_flags = flags;
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

    if (ring_submit_queued(self) < 0)
        return NULL;
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
    /* A record whose last op just completed is checked here, still
     * without the GIL: ~2 us for a 64 KiB payload at ~40 GB/s. */
    recs_account(self, count, 1);
    Py_END_ALLOW_THREADS
    self->busy = 0;

    /* Slots go back first: their completions are consumed from the CQ and
     * must not be lost even if building the result fails. */
    PyObject *result = recs_results(self, count);
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
            recs_account(self, count, 0);
            Py_END_ALLOW_THREADS
            self->busy = 0;
            PyObject *done = recs_results(self, count);
            if (done == NULL)
                PyErr_Clear();  /* only MemoryError: the slots are released anyway */
            else
                Py_DECREF(done);
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
        if (self->recs != NULL)
            recs_free(self);
        PyMem_Free(self->slots);
        PyMem_Free(self->done_idx);
        PyMem_Free(self->done_res);
        PyMem_Free(self->done_rec);
        PyMem_Free(self->recs);
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
Ring_get_cooperative(RingObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong((self->setup_flags & IORING_SETUP_COOP_TASKRUN) != 0);
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
    {"submit_records", (PyCFunction)Ring_submit_records, METH_VARARGS,
     "submit_records(layout, records, start, user_data) -> int: queue the L2 record reads "
     "records[start:] and return how many were accepted (a prefix whose ops fit in "
     "depth - inflight); records[start + i] gets user_data + i. layout is (fds, "
     "segment_bytes, stripe_bytes); each record is (segment, offset, header_bytes, "
     "payload, payload_bytes, checksum, seq, generation, namespace, key): its header "
     "lands in a buffer of the ring's, its payload in the payload buffers. "
     "reap() yields (user_data, status) once its last op completed and it was checked: "
     "0, READ_SHORT, READ_BAD_HEADER, READ_BAD_CHECKSUM or -errno."},
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
    {"cooperative", (getter)Ring_get_cooperative, NULL,
     "whether completions run as cooperative task work (IORING_SETUP_COOP_TASKRUN)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd.io._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth): a bounded io_uring instance (at most depth ops in flight).",
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_new = Ring_new,
};

static PyMethodDef module_methods[] = {
    {"check_record", (PyCFunction)kvd_check_record_py, METH_VARARGS,
     "check_record(header, payload, payload_bytes, checksum, seq, generation, namespace, "
     "key) -> int: the checks a record read gets, on buffers in memory (0 when good)."},
    {"xxh3_64", (PyCFunction)kvd_xxh3_64_py, METH_O,
     "xxh3_64(buffer) -> int: xxHash's xxh3-64 (seed 0), as the record checks compute it."},
    {"copy_many", (PyCFunction)kvd_copy_many_py, METH_VARARGS,
     "copy_many(jobs, to_pages) -> list[int]: copy each (span, pages) job one way or the "
     "other with the GIL released; the xxh3-64 of each job's bytes where they landed."},
    {"pool_read_many", (PyCFunction)kvd_pool_read_many_py, METH_VARARGS,
     "pool_read_many(pool, layout, digests, buffers, verify) -> list[int]: gets through "
     "the pool's directory with the GIL released; each value's size, or -1 where it was "
     "not read so."},
    {"recv_hashed", (PyCFunction)kvd_recv_hashed_py, METH_VARARGS,
     "recv_hashed(fd, views, timeout_ms) -> (status, received, digest): fill views in "
     "order from a stream socket with the GIL released, hashing each piece as it lands; "
     "status 0, RECV_EOF, RECV_TIMEOUT or -errno."},
    {"density_learn", (PyCFunction)(void (*)(void))kvd_density_learn_py, METH_FASTCALL,
     "density_learn(keys, mine, nodes, node_type, fields, ghost_pop, pending, shares, "
     "children, leaf_heap, inner_heap, heappush, rebuild, ring, ring_tick, reused, age_bin, "
     "gap_part, count_bucket, retention, entered, edge_ticks, consts, state) -> (seq, "
     "accesses): what the density eviction policy learns from one chain lookup, key by key, "
     "and its ring row closed (kvd/store/eviction/density_learn.py)."},
    {"density_hazards", (PyCFunction)kvd_density_hazards_py, METH_VARARGS,
     "density_hazards(entered, reused, features, classes, bins, prior, rounds, hazard) -> "
     "None: the density eviction policy's reuse hazards into hazard, numpy's arithmetic "
     "to the bit (native/kvd_plan.c)."},
    {"density_choose", (PyCFunction)kvd_density_choose_py, METH_VARARGS,
     "density_choose(hazard, entered, widths, retentions, lookups, target, low, high, steps, "
     "residence_cap, exp, survival) -> list[int]: the rest of the density eviction policy's "
     "plan after its hazards, numpy's arithmetic to the bit (native/kvd_plan.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvd.io._uring",
    .m_doc = "Bounded io_uring batches for kvd's L2 tier (GIL released while waiting).",
    .m_size = -1,
    .m_methods = module_methods,
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
        PyModule_AddIntConstant(m, "BUFS_PER_OP_MAX", KVD_BUFS_PER_OP_MAX) < 0 ||
        PyModule_AddIntConstant(m, "READ_OK", KVD_READ_OK) < 0 ||
        PyModule_AddIntConstant(m, "READ_SHORT", KVD_READ_SHORT) < 0 ||
        PyModule_AddIntConstant(m, "READ_BAD_HEADER", KVD_READ_BAD_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "READ_BAD_CHECKSUM", KVD_READ_BAD_CHECKSUM) < 0 ||
        PyModule_AddIntConstant(m, "RECV_EOF", KVD_RECV_EOF) < 0 ||
        PyModule_AddIntConstant(m, "RECV_TIMEOUT", KVD_RECV_TIMEOUT) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
