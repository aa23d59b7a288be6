/*
 * L2 record reads on kvd.io._uring's Ring. A record is one or more read ops
 * (one per device its bytes are striped over) that land its header in a
 * scratch buffer and its payload in pool pages. When its last op completes
 * the reap checks, without the GIL, that every op moved all its bytes, that
 * the header is the one the index expects (kvd_record.c) and that the
 * payload matches its checksum, and hands back one status per record: a
 * short read, a torn record or a wrong header is a miss, never a hit.
 * Python does the index work once per batch instead of per op.
 */
#include "kvd_ring.h"

#include <errno.h>
#include <string.h>

/* Fields of a record tuple, in order (see Ring_submit_reads). */
#define REC_FIELDS 10

void
recs_init(RingObject *self)
{
    for (int i = 0; i < self->depth; i++)
        self->recs[i].next_free = (i + 1 < self->depth) ? i + 1 : -1;
    self->rec_free_head = 0;
}

static int
rec_pop(RingObject *self)
{
    int r = self->rec_free_head;
    /* A record holds at least one slot and slots are checked first. */
    assert(r >= 0);
    kvd_rec *rec = &self->recs[r];
    self->rec_free_head = rec->next_free;
    rec->in_use = 1;
    rec->pending = 0;
    rec->status = KVD_READ_OK;
    rec->has_header = 0;
    rec->payload = NULL;
    rec->spans = NULL;
    rec->npayload = 0;
    rec->ns = NULL;
    rec->key = NULL;
    return r;
}

/* Release what the record holds and put it back on the free list. GIL held. */
static void
rec_release(RingObject *self, int r)
{
    kvd_rec *rec = &self->recs[r];
    assert(rec->in_use);
    if (rec->has_header)
        PyBuffer_Release(&rec->header);
    for (int i = 0; i < rec->npayload; i++)
        PyBuffer_Release(&rec->payload[i]);
    if (rec->payload != &rec->inline_payload)
        PyMem_Free(rec->payload);
    if (rec->spans != &rec->inline_span)
        PyMem_Free(rec->spans);
    rec->payload = NULL;
    rec->spans = NULL;
    rec->npayload = 0;
    rec->has_header = 0;
    Py_CLEAR(rec->ns);
    Py_CLEAR(rec->key);
    rec->in_use = 0;
    rec->next_free = self->rec_free_head;
    self->rec_free_head = r;
}

/* Fill a popped record from its tuple (all but the ops). */
static int
rec_parse(kvd_rec *rec, PyObject *item)
{
    PyObject *header, *payload, *ns, *key, *ops;
    long long payload_bytes;
    unsigned long long checksum, seq, generation;
    if (!PyArg_ParseTuple(item, "LOOOLKKKSS", &rec->user_data, &ops, &header, &payload,
                          &payload_bytes, &checksum, &seq, &generation, &ns, &key))
        return -1;
    if (payload_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "payload_bytes must be >= 0");
        return -1;
    }
    if (PyObject_GetBuffer(header, &rec->header, PyBUF_SIMPLE) < 0)
        return -1;
    rec->has_header = 1;
    PyObject *views = PySequence_Fast(payload, "payload must be a list/tuple of buffers");
    if (views == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
    if (n > KVD_BUFS_PER_OP_MAX) {
        Py_DECREF(views);
        PyErr_Format(PyExc_ValueError, "a record takes 0..%d payload buffers, got %zd",
                     KVD_BUFS_PER_OP_MAX, n);
        return -1;
    }
    if (n <= 1) {
        rec->payload = &rec->inline_payload;
        rec->spans = &rec->inline_span;
    } else {
        rec->payload = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
        rec->spans = PyMem_Calloc((size_t)n, sizeof(kvd_span));
        if (rec->payload == NULL || rec->spans == NULL) {
            Py_DECREF(views);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(views, i), &rec->payload[i],
                               PyBUF_SIMPLE) < 0) {
            Py_DECREF(views);
            return -1;
        }
        rec->spans[i].buf = rec->payload[i].buf;
        rec->spans[i].len = (size_t)rec->payload[i].len;
        rec->npayload++;
    }
    Py_DECREF(views);
    Py_INCREF(ns);
    rec->ns = ns;
    Py_INCREF(key);
    rec->key = key;
    rec->expect.payload_bytes = (uint64_t)payload_bytes;
    rec->expect.payload_checksum = checksum;
    rec->expect.seq = seq;
    rec->expect.generation = generation;
    rec->expect.ns = (const uint8_t *)PyBytes_AS_STRING(ns);
    rec->expect.ns_len = (size_t)PyBytes_GET_SIZE(ns);
    rec->expect.key = (const uint8_t *)PyBytes_AS_STRING(key);
    rec->expect.key_len = (size_t)PyBytes_GET_SIZE(key);
    return 0;
}

/* Parse one (fd, offset, buffer(s)) read op of a record into slot `idx`. */
static int
rec_op_parse(RingObject *self, PyObject *op, int idx, kvd_op_head *head)
{
    PyObject *bufobj;
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3) {
        PyErr_SetString(PyExc_TypeError, "a record op must be a tuple (fd, offset, buffer(s))");
        return -1;
    }
    if (!PyArg_ParseTuple(op, "iLO", &head->fd, &head->offset, &bufobj))
        return -1;
    if (head->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0");
        return -1;
    }
    head->opcode = OP_READ;
    self->slots[idx].user_data = 0;
    return slot_export(&self->slots[idx], bufobj, 1);
}

PyObject *
Ring_submit_reads(RingObject *self, PyObject *records)
{
    if (ring_check_usable(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int room = self->depth - self->inflight;
    int *slot_ids = PyMem_Calloc((size_t)room + 1, sizeof(int));
    int *rec_ids = PyMem_Calloc((size_t)room + 1, sizeof(int));
    kvd_op_head *heads = PyMem_Calloc((size_t)room + 1, sizeof(kvd_op_head));
    int nslots = 0, nrecs = 0;
    if (slot_ids == NULL || rec_ids == NULL || heads == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    /* Parse every accepted record before queueing any op: a bad record
     * leaves nothing of this call in the ring. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != REC_FIELDS) {
            PyErr_SetString(PyExc_TypeError,
                            "a record must be a tuple (user_data, ops, header, payload, "
                            "payload_bytes, checksum, seq, generation, namespace, key)");
            goto fail;
        }
        PyObject *ops = PySequence_Fast(PyTuple_GET_ITEM(item, 1),
                                        "a record's ops must be a list/tuple");
        if (ops == NULL)
            goto fail;
        Py_ssize_t nops = PySequence_Fast_GET_SIZE(ops);
        if (nops < 1 || nops > self->depth) {
            Py_DECREF(ops);
            PyErr_Format(PyExc_ValueError, "a record takes 1..%d ops, got %zd", self->depth,
                         nops);
            goto fail;
        }
        if (nops > room - nslots) {
            Py_DECREF(ops);
            break;  /* the ring is full: the caller keeps the rest */
        }
        int r = rec_pop(self);
        rec_ids[nrecs++] = r;
        if (rec_parse(&self->recs[r], item) < 0) {
            Py_DECREF(ops);
            goto fail;
        }
        for (Py_ssize_t j = 0; j < nops; j++) {
            int idx = slot_pop(self);
            slot_ids[nslots] = idx;
            heads[nslots] = (kvd_op_head){0};
            nslots++;
            if (rec_op_parse(self, PySequence_Fast_GET_ITEM(ops, j), idx,
                             &heads[nslots - 1]) < 0) {
                Py_DECREF(ops);
                goto fail;
            }
            self->slots[idx].record = r;
        }
        self->recs[r].pending = (int)nops;
        Py_DECREF(ops);
    }
    for (int i = 0; i < nslots; i++)
        op_prep(self, slot_ids[i], &heads[i]);
    PyMem_Free(slot_ids);
    PyMem_Free(rec_ids);
    PyMem_Free(heads);
    Py_DECREF(seq);

    int ret = 0;
    if (io_uring_sq_ready(&self->ring) > 0) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        ret = io_uring_submit(&self->ring);
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    /* As in submit(): EAGAIN/EBUSY/EINTR leave SQEs for the next call. */
    if (ret < 0 && ret != -EAGAIN && ret != -EBUSY && ret != -EINTR) {
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(nrecs);

fail:
    /* A popped slot that failed to parse exported nothing (views NULL). */
    for (int i = 0; i < nslots; i++)
        slot_release(self, slot_ids[i]);
    for (int i = 0; i < nrecs; i++)
        rec_release(self, rec_ids[i]);
    PyMem_Free(slot_ids);
    PyMem_Free(rec_ids);
    PyMem_Free(heads);
    Py_DECREF(seq);
    return NULL;
}

/* Account `count` harvested completions to their records; a record whose
 * last op is among them is checked when `check` (not at close). Runs
 * without the GIL: touches only C memory and buffers held exported. */
int
recs_account(RingObject *self, int count, int check)
{
    int finished = 0;
    for (int i = 0; i < count; i++) {
        kvd_slot *slot = &self->slots[self->done_idx[i]];
        self->done_rec[i] = -1;
        if (slot->record < 0)
            continue;
        kvd_rec *rec = &self->recs[slot->record];
        int res = self->done_res[i];
        if (rec->status == KVD_READ_OK) {
            if (res < 0)
                rec->status = res;
            else if (res != slot->want_bytes)
                rec->status = KVD_READ_SHORT;
        }
        if (--rec->pending > 0)
            continue;
        self->done_rec[i] = slot->record;
        finished++;
        if (check && rec->status == KVD_READ_OK)
            rec->status = kvd_check_record(rec->header.buf, (size_t)rec->header.len,
                                           rec->spans, rec->npayload, &rec->expect);
    }
    return finished;
}

/* Release the slots (and finished records) of `count` completions and
 * return [(user_data, result)]: bytes or -errno for plain ops, a status for
 * records. Everything is released even when building the list fails. */
PyObject *
recs_results(RingObject *self, int count)
{
    Py_ssize_t out = 0;
    for (int i = 0; i < count; i++)
        if (self->slots[self->done_idx[i]].record < 0 || self->done_rec[i] >= 0)
            out++;
    PyObject *result = PyList_New(out);
    Py_ssize_t pos = 0;
    for (int i = 0; i < count; i++) {
        int idx = self->done_idx[i];
        assert(idx >= 0 && idx < self->depth && self->slots[idx].in_use);
        long long ud;
        int value;
        int r = self->done_rec[i];
        if (self->slots[idx].record < 0) {
            ud = self->slots[idx].user_data;
            value = self->done_res[i];
        } else if (r >= 0) {
            ud = self->recs[r].user_data;
            value = self->recs[r].status;
        } else {
            slot_release(self, idx);
            continue;
        }
        slot_release(self, idx);
        if (r >= 0)
            rec_release(self, r);
        if (result != NULL) {
            PyObject *item = Py_BuildValue("(Li)", ud, value);
            if (item == NULL)
                Py_CLEAR(result);
            else
                PyList_SET_ITEM(result, pos++, item);
        }
    }
    return result;
}

/* ---- module functions: the same checks on buffers in memory ------------- */

PyObject *
kvd_check_record_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    kvd_rec rec;
    memset(&rec, 0, sizeof(rec));
    rec.in_use = 1;
    PyObject *full = NULL, *ops = PyTuple_New(0);
    if (ops == NULL)
        return NULL;
    /* Reuse the record parser: (0, (), *args). */
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs != REC_FIELDS - 2) {
        Py_DECREF(ops);
        PyErr_SetString(PyExc_TypeError,
                        "check_record(header, payload, payload_bytes, checksum, seq, "
                        "generation, namespace, key)");
        return NULL;
    }
    full = PyTuple_New(REC_FIELDS);
    if (full == NULL) {
        Py_DECREF(ops);
        return NULL;
    }
    PyTuple_SET_ITEM(full, 0, PyLong_FromLong(0));
    PyTuple_SET_ITEM(full, 1, ops);
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        Py_INCREF(arg);
        PyTuple_SET_ITEM(full, i + 2, arg);
    }
    int status = -1;
    if (rec_parse(&rec, full) == 0) {
        Py_BEGIN_ALLOW_THREADS
        status = kvd_check_record(rec.header.buf, (size_t)rec.header.len, rec.spans,
                                  rec.npayload, &rec.expect);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(full);
    /* Release what rec_parse took (rec_release's work, without a ring). */
    if (rec.has_header)
        PyBuffer_Release(&rec.header);
    for (int i = 0; i < rec.npayload; i++)
        PyBuffer_Release(&rec.payload[i]);
    if (rec.payload != &rec.inline_payload)
        PyMem_Free(rec.payload);
    if (rec.spans != &rec.inline_span)
        PyMem_Free(rec.spans);
    Py_XDECREF(rec.ns);
    Py_XDECREF(rec.key);
    if (status == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(status);
}

PyObject *
kvd_xxh3_64_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    kvd_span span = {view.buf, (size_t)view.len};
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = kvd_xxh3_spans(&span, 1, (uint64_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(digest);
}
