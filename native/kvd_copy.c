/*
 * copy_many: a batch of region copies in one call (kvd/paths/shm/jobs.py).
 *
 * A shared-memory get copies each value from its pool pages into the
 * client's region and takes the xxh3-64 of the bytes where they landed (the
 * daemon checks it against the stored checksum before it answers: never a
 * wrong block); a put copies the other way and hashes the pool pages. In
 * Python each 64 KiB item cost a hasher object, a numpy view per page run
 * and a copy and an update per piece, ~10 us of interpreter work beside
 * ~5 us of copying; here the whole batch is one call, the buffers held
 * with the GIL, the copies and hashes done without it.
 *
 * jobs: a sequence of (span, pages): span the value's bytes in the region
 * (a buffer), pages its pool page runs (a sequence of buffers). to_pages
 * true copies span -> pages (a put: the page runs must hold exactly the
 * span's bytes), false pages -> span (a get: the span must have room for
 * them). Returns each job's xxh3-64, of the bytes copied, as read where they
 * landed. ValueError (and nothing copied) when a job's sizes do not fit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "kvd_record.h"

/* Buffers one call may hold: a batch of max_batch_items (1,024) values of
 * up to a few hundred page runs each. */
#define KVD_COPY_BUFFERS_MAX 65536

typedef struct {
    Py_ssize_t first; /* its span's index in views; its pages follow it */
    Py_ssize_t npages;
    uint64_t bytes;   /* the sum of its pages' lengths */
} copy_job;

static void
release_all(Py_buffer *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

static int
hold(PyObject *obj, Py_buffer *view, int writable)
{
    return PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

PyObject *
kvd_copy_many_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *jobs_obj;
    int to_pages;
    if (!PyArg_ParseTuple(args, "Op:copy_many", &jobs_obj, &to_pages))
        return NULL;
    PyObject *jobs_seq = PySequence_Fast(jobs_obj, "copy_many: jobs must be a sequence");
    if (jobs_seq == NULL)
        return NULL;
    Py_ssize_t njobs = PySequence_Fast_GET_SIZE(jobs_seq);
    /* Buffers to hold: each job's span and pages, counted before any is held. */
    Py_ssize_t total = njobs;
    for (Py_ssize_t j = 0; j < njobs && total <= KVD_COPY_BUFFERS_MAX; j++) {
        PyObject *job = PySequence_Fast_GET_ITEM(jobs_seq, j);
        Py_ssize_t npages = PyTuple_Check(job) && PyTuple_GET_SIZE(job) == 2
                                ? PySequence_Size(PyTuple_GET_ITEM(job, 1))
                                : -1;
        if (npages < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "copy_many: each job is (span, pages)");
            Py_DECREF(jobs_seq);
            return NULL;
        }
        total += npages;
    }
    if (total > KVD_COPY_BUFFERS_MAX) {
        PyErr_Format(PyExc_ValueError, "copy_many: more than %d buffers in one call",
                     KVD_COPY_BUFFERS_MAX);
        Py_DECREF(jobs_seq);
        return NULL;
    }
    size_t slots = total ? (size_t)total : 1;
    copy_job *jobs = PyMem_Calloc(njobs ? (size_t)njobs : 1, sizeof(copy_job));
    Py_buffer *views = PyMem_Calloc(slots, sizeof(Py_buffer));
    kvd_piece *pieces = PyMem_Calloc(slots, sizeof(kvd_piece));
    uint64_t *digests = PyMem_Calloc(njobs ? (size_t)njobs : 1, sizeof(uint64_t));
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (jobs == NULL || views == NULL || pieces == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < njobs; j++) {
        PyObject *job = PySequence_Fast_GET_ITEM(jobs_seq, j);
        PyObject *span_obj, *pages_obj;
        if (!PyTuple_Check(job) || !PyArg_ParseTuple(job, "OO", &span_obj, &pages_obj)) {
            PyErr_SetString(PyExc_TypeError, "copy_many: each job is (span, pages)");
            goto done;
        }
        PyObject *pages = PySequence_Fast(pages_obj, "copy_many: pages must be a sequence");
        if (pages == NULL)
            goto done;
        Py_ssize_t npages = PySequence_Fast_GET_SIZE(pages);
        if (held + 1 + npages > total) { /* the sequence grew since it was counted */
            Py_DECREF(pages);
            PyErr_SetString(PyExc_ValueError, "copy_many: a job's pages changed while held");
            goto done;
        }
        jobs[j].first = held;
        if (hold(span_obj, &views[held], !to_pages) < 0) {
            Py_DECREF(pages);
            goto done;
        }
        held++;
        uint64_t bytes = 0;
        for (Py_ssize_t p = 0; p < npages; p++) {
            if (hold(PySequence_Fast_GET_ITEM(pages, p), &views[held], to_pages) < 0) {
                Py_DECREF(pages);
                goto done;
            }
            bytes += (uint64_t)views[held].len;
            held++;
        }
        Py_DECREF(pages);
        jobs[j].npages = npages;
        jobs[j].bytes = bytes;
        uint64_t room = (uint64_t)views[jobs[j].first].len;
        if (to_pages ? bytes != room : bytes > room) {
            PyErr_Format(PyExc_ValueError,
                         "copy_many: job %zd moves %llu bytes of pages with a span of %llu", j,
                         (unsigned long long)bytes, (unsigned long long)room);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < njobs; j++) {
        Py_buffer *span = &views[jobs[j].first];
        Py_buffer *pages = span + 1;
        kvd_piece *mine = &pieces[jobs[j].first];
        for (Py_ssize_t p = 0; p < jobs[j].npages; p++)
            mine[p] = (kvd_piece){pages[p].buf, (size_t)pages[p].len};
        /* Hashed where the bytes landed, chunk by chunk right after each is
         * copied (still in cache): the pool pages for a put, the span for a get. */
        digests[j] = kvd_xxh3_copy(mine, (int)jobs[j].npages, span->buf, to_pages);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(njobs);
    if (result == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < njobs; j++) {
        PyObject *digest = PyLong_FromUnsignedLongLong(digests[j]);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, j, digest);
    }
done:
    if (views != NULL)
        release_all(views, held);
    PyMem_Free(jobs);
    PyMem_Free(views);
    PyMem_Free(pieces);
    PyMem_Free(digests);
    Py_DECREF(jobs_seq);
    return result;
}
