/*
 * L2 record reads on kvd.io._uring's Ring. A record is a logical range of a
 * segment: its header then its payload, striped over the layout's paths.
 * submit_records() cuts each range into one read op per path it touches
 * (more only past IOV_MAX pieces), lands the header in a buffer the ring
 * owns and the payload in the caller's pool pages, and submits the whole
 * batch in one io_uring_enter. When a record's last op completes, the reap
 * checks, without the GIL, that every op moved all its bytes, that the
 * header is the one the index expects (kvd_record.c) and that the payload
 * matches its checksum, and hands back one status per record: a short read,
 * a torn record or a wrong header is a miss, never a hit. Python does the
 * index work once per batch instead of per op.
 */
#include "kvd_ring.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Fields of a record tuple, in order (see Ring_submit_records). */
#define REC_FIELDS 10
#define KVD_ALIGN_BYTES 4096

void
recs_init(RingObject *self)
{
    for (int i = 0; i < self->depth; i++)
        self->recs[i].next_free = (i + 1 < self->depth) ? i + 1 : -1;
    self->rec_free_head = 0;
}

/* Free the ring-owned header buffers (at dealloc; no record is in flight). */
void
recs_free(RingObject *self)
{
    for (int i = 0; i < self->depth; i++) {
        free(self->recs[i].header);
        self->recs[i].header = NULL;
    }
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
    for (int i = 0; i < rec->npayload; i++)
        PyBuffer_Release(&rec->payload[i]);
    if (rec->payload != &rec->inline_payload)
        PyMem_Free(rec->payload);
    if (rec->spans != &rec->inline_span)
        PyMem_Free(rec->spans);
    rec->payload = NULL;
    rec->spans = NULL;
    rec->npayload = 0;
    Py_CLEAR(rec->ns);
    Py_CLEAR(rec->key);
    rec->in_use = 0;
    rec->next_free = self->rec_free_head;
    self->rec_free_head = r;
}

/* The UTF-8 bytes of a namespace given as str (its cached UTF-8, no copy)
 * or bytes; valid while `obj` is referenced. */
static int
name_bytes(PyObject *obj, const uint8_t **buf, size_t *len)
{
    Py_ssize_t n;
    if (PyUnicode_Check(obj)) {
        const char *utf8 = PyUnicode_AsUTF8AndSize(obj, &n);
        if (utf8 == NULL)
            return -1;
        *buf = (const uint8_t *)utf8;
    } else if (PyBytes_Check(obj)) {
        *buf = (const uint8_t *)PyBytes_AS_STRING(obj);
        n = PyBytes_GET_SIZE(obj);
    } else {
        PyErr_SetString(PyExc_TypeError, "namespace must be str or bytes");
        return -1;
    }
    *len = (size_t)n;
    return 0;
}

/* Export `payload` (a list/tuple of writable buffers) into the record:
 * rec->payload, rec->spans, rec->npayload. Returns the total bytes, or -1
 * with an exception set (what was exported is released by rec_release). */
static long long
rec_export_payload(kvd_rec *rec, PyObject *payload, int writable)
{
    if (!PyList_Check(payload) && !PyTuple_Check(payload)) {
        PyErr_SetString(PyExc_TypeError, "payload must be a list/tuple of buffers");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(payload);
    if (n > KVD_PAYLOAD_BUFS_MAX) {
        PyErr_Format(PyExc_ValueError, "a record takes 0..%d payload buffers, got %zd",
                     KVD_PAYLOAD_BUFS_MAX, n);
        return -1;
    }
    if (n <= 1) {
        rec->payload = &rec->inline_payload;
        rec->spans = &rec->inline_span;
    } else {
        rec->payload = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
        rec->spans = PyMem_Calloc((size_t)n, sizeof(kvd_span));
        if (rec->payload == NULL || rec->spans == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    long long total = 0;
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(payload, i), &rec->payload[i],
                               flags) < 0)
            return -1;
        rec->npayload++;
        rec->spans[i].buf = rec->payload[i].buf;
        rec->spans[i].len = (size_t)rec->payload[i].len;
        total += rec->payload[i].len;
    }
    return total;
}

/* Fill a popped record from its tuple: (segment, offset, header_bytes,
 * payload, payload_bytes, checksum, seq, generation, namespace, key)
 * (kvd/io/ops.py's RecordRead). Sets *segment, *offset and *length
 * (header + payload). */
static int
rec_parse(kvd_rec *rec, PyObject *item, long long *segment, long long *offset,
          long long *length)
{
    PyObject *payload, *ns, *key;
    int header_bytes;
    long long payload_bytes;
    unsigned long long checksum, seq, generation;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != REC_FIELDS) {
        PyErr_SetString(PyExc_TypeError,
                        "a record must be a tuple (segment, offset, header_bytes, payload, "
                        "payload_bytes, checksum, seq, generation, namespace, key)");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "LLiOLKKKOS", segment, offset, &header_bytes, &payload,
                          &payload_bytes, &checksum, &seq, &generation, &ns, &key))
        return -1;
    if (*segment < 0 || *offset < 0 || payload_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "segment, offset and payload_bytes must be >= 0");
        return -1;
    }
    if (header_bytes < KVD_ALIGN_BYTES || header_bytes > KVD_HEADER_BYTES_MAX ||
        header_bytes % KVD_ALIGN_BYTES) {
        PyErr_Format(PyExc_ValueError, "header_bytes must be 4096 or 8192, got %d",
                     header_bytes);
        return -1;
    }
    long long payload_len = rec_export_payload(rec, payload, 1);
    if (payload_len < 0)
        return -1;
    if (payload_len < payload_bytes) {
        PyErr_Format(PyExc_ValueError, "payload buffers hold %lld bytes, fewer than %lld",
                     payload_len, payload_bytes);
        return -1;
    }
    if (rec->header == NULL) {
        void *mem = NULL;
        if (posix_memalign(&mem, KVD_ALIGN_BYTES, KVD_HEADER_BYTES_MAX) != 0) {
            PyErr_NoMemory();
            return -1;
        }
        rec->header = mem;
    }
    rec->header_len = (size_t)header_bytes;
    if (name_bytes(ns, &rec->expect.ns, &rec->expect.ns_len) < 0)
        return -1;
    Py_INCREF(ns);
    rec->ns = ns;
    Py_INCREF(key);
    rec->key = key;
    rec->expect.payload_bytes = (uint64_t)payload_bytes;
    rec->expect.payload_checksum = checksum;
    rec->expect.seq = seq;
    rec->expect.generation = generation;
    rec->expect.key = (const uint8_t *)PyBytes_AS_STRING(key);
    rec->expect.key_len = (size_t)PyBytes_GET_SIZE(key);
    *length = header_bytes + payload_len;
    return 0;
}

static int
layout_parse(PyObject *obj, kvd_layout *layout)
{
    PyObject *fds;
    if (!PyArg_ParseTuple(obj, "OLL", &fds, &layout->segment_bytes, &layout->stripe_bytes))
        return -1;
    if (!PyTuple_Check(fds) || PyTuple_GET_SIZE(fds) < 1 ||
        PyTuple_GET_SIZE(fds) > KVD_LAYOUT_PATHS_MAX) {
        PyErr_Format(PyExc_ValueError, "a layout takes a tuple of 1..%d fds",
                     KVD_LAYOUT_PATHS_MAX);
        return -1;
    }
    layout->npaths = (int)PyTuple_GET_SIZE(fds);
    for (int i = 0; i < layout->npaths; i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(fds, i));
        if (fd == -1 && PyErr_Occurred())
            return -1;
        if (fd < INT_MIN || fd > INT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "fd out of range");
            return -1;
        }
        layout->fds[i] = (int)fd;
    }
    if (layout->stripe_bytes <= 0 || layout->segment_bytes <= 0 ||
        layout->segment_bytes % layout->stripe_bytes) {
        PyErr_SetString(PyExc_ValueError,
                        "segment_bytes must be a positive multiple of stripe_bytes");
        return -1;
    }
    return 0;
}

/* The ops of one record: per path, its pieces of [header, payload...] in
 * logical order, at most KVD_BUFS_PER_OP_MAX per op. */
typedef struct {
    int fd;
    long long offset;  /* on the path */
    int first;         /* index of its first iovec in the plan's iovs */
    int niovs;
    long long bytes;
} kvd_plan_op;

typedef struct {
    kvd_plan_op *ops;
    int nops, cap_ops;
    struct iovec *iovs;
    int niovs, cap_iovs;
} kvd_plan;

static int
plan_grow(kvd_plan *plan)
{
    if (plan->nops == plan->cap_ops) {
        int cap = plan->cap_ops ? 2 * plan->cap_ops : 8;
        kvd_plan_op *ops = PyMem_Realloc(plan->ops, (size_t)cap * sizeof(kvd_plan_op));
        if (ops == NULL)
            return -1;
        plan->ops = ops;
        plan->cap_ops = cap;
    }
    return 0;
}

static int
plan_iov(kvd_plan *plan, void *base, size_t len)
{
    if (plan->niovs == plan->cap_iovs) {
        int cap = plan->cap_iovs ? 2 * plan->cap_iovs : 16;
        struct iovec *iovs = PyMem_Realloc(plan->iovs, (size_t)cap * sizeof(struct iovec));
        if (iovs == NULL)
            return -1;
        plan->iovs = iovs;
        plan->cap_iovs = cap;
    }
    plan->iovs[plan->niovs].iov_base = base;
    plan->iovs[plan->niovs].iov_len = len;
    plan->niovs++;
    return 0;
}

/* A position in a record's spans (the header, then the payload buffers),
 * moving forward only: one path's pieces come in logical order. */
typedef struct {
    int span;         /* -1: the header */
    long long start;  /* logical offset of that span's first byte */
} kvd_cursor;

static uint8_t *
span_buf(const kvd_rec *rec, int i)
{
    return i < 0 ? rec->header : (uint8_t *)rec->spans[i].buf;
}

static long long
span_len(const kvd_rec *rec, int i)
{
    return i < 0 ? (long long)rec->header_len : (long long)rec->spans[i].len;
}

/* Append the memory behind logical bytes [pos, pos + len) of the record
 * (logical 0: the header's first byte) to the plan's last op. */
static int
plan_take(kvd_plan *plan, const kvd_rec *rec, kvd_cursor *at, long long pos, long long len)
{
    while (len > 0) {
        assert(at->span < rec->npayload);
        long long span = span_len(rec, at->span);
        if (pos >= at->start + span) {
            at->start += span;
            at->span++;
            continue;
        }
        long long skip = pos - at->start;
        long long take = span - skip < len ? span - skip : len;
        kvd_plan_op *op = &plan->ops[plan->nops - 1];
        if (op->niovs == KVD_BUFS_PER_OP_MAX || op->bytes == KVD_RECORD_OP_BYTES_MAX) {
            /* IOV_MAX, or the most one op moves: the rest of this path's
             * range goes in a next op. */
            if (plan_grow(plan) < 0)
                return -1;
            op = &plan->ops[plan->nops - 1];
            plan->ops[plan->nops] = (kvd_plan_op){op->fd, op->offset + op->bytes, plan->niovs,
                                                  0, 0};
            op = &plan->ops[plan->nops++];
        }
        if (take > KVD_RECORD_OP_BYTES_MAX - op->bytes)
            take = KVD_RECORD_OP_BYTES_MAX - op->bytes;
        if (plan_iov(plan, span_buf(rec, at->span) + skip, (size_t)take) < 0)
            return -1;
        op->niovs++;
        op->bytes += take;
        pos += take;
        len -= take;
    }
    return 0;
}

/* Plan the ops that read `length` logical bytes at `offset` of `segment`:
 * logical byte L lies on path (L / S) % N at segment * segment_bytes +
 * ((L / S) / N) * S + L % S (kvd/io/layout.py). A path's stripes of one
 * range are contiguous there, so each path touched is one op. */
static int
plan_record(kvd_plan *plan, const kvd_layout *layout, const kvd_rec *rec, long long segment,
            long long offset, long long length)
{
    long long stripe = layout->stripe_bytes, n = layout->npaths;
    plan->nops = plan->niovs = 0;
    if (layout->npaths == 1) {
        if (plan_grow(plan) < 0)
            return -1;
        plan->ops[plan->nops++] = (kvd_plan_op){layout->fds[0],
                                                segment * layout->segment_bytes + offset,
                                                0, 0, 0};
        kvd_cursor at = {-1, 0};
        return plan_take(plan, rec, &at, 0, length);
    }
    for (long long path = 0; path < n; path++) {
        int started = 0;
        kvd_cursor at = {-1, 0};
        long long pos = offset, end = offset + length;
        /* The first stripe of this path at or after `offset`. */
        long long index = pos / stripe;
        long long first = index + ((path - index % n) % n + n) % n;
        for (index = first; index * stripe < end; index += n) {
            long long from = index * stripe > pos ? index * stripe : pos;
            long long to = (index + 1) * stripe < end ? (index + 1) * stripe : end;
            if (!started) {
                if (plan_grow(plan) < 0)
                    return -1;
                long long at = segment * layout->segment_bytes + (index / n) * stripe +
                               from % stripe;
                plan->ops[plan->nops++] = (kvd_plan_op){layout->fds[path], at,
                                                        plan->niovs, 0, 0};
                started = 1;
            }
            if (plan_take(plan, rec, &at, from - offset, to - from) < 0)
                return -1;
        }
    }
    return 0;
}

/* Give a planned op's iovecs to slot `idx` (copied: the plan is reused). */
static int
slot_take_plan(kvd_slot *slot, const kvd_plan *plan, const kvd_plan_op *op)
{
    slot->views = NULL;
    slot->nviews = 0;
    if (op->niovs <= KVD_INLINE_IOVS) {
        slot->iovs = slot->inline_iovs;
    } else {
        slot->iovs = PyMem_Malloc((size_t)op->niovs * sizeof(struct iovec));
        if (slot->iovs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    memcpy(slot->iovs, &plan->iovs[op->first], (size_t)op->niovs * sizeof(struct iovec));
    slot->niovs = op->niovs;
    slot->want_bytes = op->bytes;
    return 0;
}

PyObject *
Ring_submit_records(RingObject *self, PyObject *args)
{
    PyObject *layout_obj, *records;
    Py_ssize_t start;
    long long user_data;
    if (!PyArg_ParseTuple(args, "OOnL:submit_records", &layout_obj, &records, &start,
                          &user_data))
        return NULL;
    if (ring_check_usable(self) < 0)
        return NULL;
    kvd_layout layout;
    if (layout_parse(layout_obj, &layout) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (start < 0 || start > n) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "start must be in 0..len(records)");
        return NULL;
    }
    int room = self->depth - self->inflight;
    int *slot_ids = PyMem_Calloc((size_t)room + 1, sizeof(int));
    int *rec_ids = PyMem_Calloc((size_t)room + 1, sizeof(int));
    kvd_op_head *heads = PyMem_Calloc((size_t)room + 1, sizeof(kvd_op_head));
    kvd_plan plan = {0};
    int nslots = 0, nrecs = 0;
    if (slot_ids == NULL || rec_ids == NULL || heads == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    long long logical_bytes = layout.segment_bytes * layout.npaths;
    /* Parse every accepted record before queueing any op: a bad record
     * leaves nothing of this call in the ring. */
    for (Py_ssize_t i = start; i < n && nslots < room; i++) {
        long long segment, offset, length;
        int r = rec_pop(self);
        rec_ids[nrecs++] = r;
        kvd_rec *rec = &self->recs[r];
        rec->user_data = user_data + (i - start);
        if (rec_parse(rec, PySequence_Fast_GET_ITEM(seq, i), &segment, &offset, &length) < 0)
            goto fail;
        if (offset + length > logical_bytes) {
            PyErr_Format(PyExc_ValueError,
                         "a record of %lld bytes at %lld does not fit in a segment of %lld",
                         length, offset, logical_bytes);
            goto fail;
        }
        if (plan_record(&plan, &layout, rec, segment, offset, length) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        if (plan.nops > self->depth) {
            PyErr_Format(PyExc_ValueError, "a record takes 1..%d ops, got %d", self->depth,
                         plan.nops);
            goto fail;
        }
        if (plan.nops > room - nslots) {
            /* The ring is full: the caller keeps this record and the rest. */
            rec_release(self, r);
            nrecs--;
            break;
        }
        for (int j = 0; j < plan.nops; j++) {
            int idx = slot_pop(self);
            slot_ids[nslots] = idx;
            heads[nslots] = (kvd_op_head){OP_READ, plan.ops[j].fd, plan.ops[j].offset};
            nslots++;
            self->slots[idx].user_data = 0;
            self->slots[idx].record = r;
            if (slot_take_plan(&self->slots[idx], &plan, &plan.ops[j]) < 0)
                goto fail;
        }
        rec->pending = plan.nops;
    }
    for (int i = 0; i < nslots; i++)
        op_prep(self, slot_ids[i], &heads[i]);
    PyMem_Free(plan.ops);
    PyMem_Free(plan.iovs);
    PyMem_Free(slot_ids);
    PyMem_Free(rec_ids);
    PyMem_Free(heads);
    Py_DECREF(seq);

    if (ring_submit_queued(self) < 0)
        return NULL;
    return PyLong_FromLong(nrecs);

fail:
    /* A record op's slot exported nothing (the record holds the buffers). */
    for (int i = 0; i < nslots; i++)
        slot_release(self, slot_ids[i]);
    for (int i = 0; i < nrecs; i++)
        rec_release(self, rec_ids[i]);
    PyMem_Free(plan.ops);
    PyMem_Free(plan.iovs);
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
            rec->status = kvd_check_record(rec->header, rec->header_len, rec->spans,
                                           rec->npayload, &rec->expect);
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
    PyObject *header_obj, *payload, *ns, *key;
    long long payload_bytes;
    unsigned long long checksum, seq, generation;
    if (!PyArg_ParseTuple(args, "OOLKKKOS:check_record", &header_obj, &payload,
                          &payload_bytes, &checksum, &seq, &generation, &ns, &key))
        return NULL;
    if (payload_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "payload_bytes must be >= 0");
        return NULL;
    }
    kvd_rec rec;
    memset(&rec, 0, sizeof(rec));
    Py_buffer header;
    if (PyObject_GetBuffer(header_obj, &header, PyBUF_SIMPLE) < 0)
        return NULL;
    int status = -1;
    if (rec_export_payload(&rec, payload, 0) >= 0 &&
        name_bytes(ns, &rec.expect.ns, &rec.expect.ns_len) == 0) {
        rec.expect.payload_bytes = (uint64_t)payload_bytes;
        rec.expect.payload_checksum = checksum;
        rec.expect.seq = seq;
        rec.expect.generation = generation;
        rec.expect.key = (const uint8_t *)PyBytes_AS_STRING(key);
        rec.expect.key_len = (size_t)PyBytes_GET_SIZE(key);
        Py_BEGIN_ALLOW_THREADS
        status = kvd_check_record(header.buf, (size_t)header.len, rec.spans, rec.npayload,
                                  &rec.expect);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&header);
    for (int i = 0; i < rec.npayload; i++)
        PyBuffer_Release(&rec.payload[i]);
    if (rec.payload != &rec.inline_payload)
        PyMem_Free(rec.payload);
    if (rec.spans != &rec.inline_span)
        PyMem_Free(rec.spans);
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
