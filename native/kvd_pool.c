/*
 * pool_read_many: gets through the pool's directory in one call
 * (kvd/client/pool_reads.py, PoolMap.read_direct_many).
 *
 * A client that maps the daemon's L1 pool read-only finds each value's slot
 * in the directory after the pool's bytes (kvd/l1/directory.py writes it,
 * kvd/wire/shm.py has the layout), checks the owner tag of its first page,
 * copies it into the caller's buffer, checks the copy's xxh3-64 against the
 * slot's checksum and the tag again. In Python that is ~10 us of interpreter
 * work per 64 KiB get beside ~3 us of copying; here a whole batch is one
 * call, the buffers held with the GIL, the reads done without it.
 *
 * What makes a copy the value's: the daemon writes a slot under an odd
 * sequence number, a value's tag before its slot, zeroes the tags of pages
 * before they are freed and never reuses an id. The loads of a slot come
 * after its sequence number and before it is read again, the copy's loads
 * after the tag and before it is read again (acquire loads and fences), so
 * a slot rewritten or pages reused while read are seen as such on any CPU.
 * With verify the copy is also hashed where it landed (on by default:
 * kvd.client's verify_pool_reads).
 *
 * pool: the mapping (a buffer); layout: (tags, slots, mask, ways, pool_bytes)
 * as kvd.client.pool_reads.DirectoryMap has them; digests: a sequence of
 * 16-byte directory_digest()s; buffers: a sequence of as many writable
 * buffers. Returns a list: each value's size, or -1 where it was not read so
 * (not there, being rewritten, reused, too large for its buffer, or its copy
 * does not match its checksum). ValueError (and nothing read) when the
 * layout does not fit the mapping or the sequences differ in length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "kvd_record.h"

#define KVD_POOL_PAGE_BYTES (64u * 1024u)
#define KVD_SLOT_BYTES 64u
#define KVD_DIGEST_BYTES 16
#define KVD_WAYS_MAX 64
/* Gets in one call: a batch of up to 1,024 keys (kvd.client's batch cap) and then some. */
#define KVD_POOL_READS_MAX 65536

typedef struct {
    uint64_t tags, slots, mask, ways, pool_bytes;
} pool_layout;

/* A slot's fields after its sequence number (kvd.wire.shm.DIRECTORY_FIELDS). */
typedef struct {
    uint64_t uid;
    uint8_t digest[KVD_DIGEST_BYTES];
    uint64_t size, checksum, offset;
} slot_fields;

static uint64_t
le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t
load_acquire(const uint8_t *p)
{
    return __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_ACQUIRE);
}

static uint64_t
load_relaxed(const uint8_t *p)
{
    return __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_RELAXED);
}

/* The slot naming `digest`, read whole under its sequence number; 0 when
 * none does, or the one that does was being rewritten. */
static int
find_slot(const uint8_t *pool, const pool_layout *l, const uint8_t *digest, slot_fields *out)
{
    const uint8_t *at = pool + l->slots + (le64(digest) & l->mask) * l->ways * KVD_SLOT_BYTES;
    for (uint64_t way = 0; way < l->ways; way++, at += KVD_SLOT_BYTES) {
        uint64_t seq = load_acquire(at);
        if (seq & 1)
            continue;
        out->uid = le64(at + 8);
        memcpy(out->digest, at + 16, KVD_DIGEST_BYTES);
        out->size = le64(at + 32);
        out->checksum = le64(at + 40);
        out->offset = le64(at + 48);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (out->uid == 0 || memcmp(out->digest, digest, KVD_DIGEST_BYTES) != 0)
            continue;
        return load_relaxed(at) == seq; /* rewritten while read: not a value */
    }
    return 0;
}

/* One get: the value's size once copied into `dst` (room `room`), or -1. */
static int64_t
read_one(const uint8_t *pool, const pool_layout *l, const uint8_t *digest, uint8_t *dst,
         uint64_t room, int verify)
{
    slot_fields s;
    if (!find_slot(pool, l, digest, &s))
        return -1;
    if (s.size > room || s.offset % KVD_POOL_PAGE_BYTES || s.offset > l->pool_bytes ||
        s.size > l->pool_bytes - s.offset)
        return -1;
    const uint8_t *tag = pool + l->tags + s.offset / KVD_POOL_PAGE_BYTES * 8;
    if (load_acquire(tag) != s.uid)
        return -1;
    kvd_piece from = {(uint8_t *)(uintptr_t)(pool + s.offset), (size_t)s.size};
    uint64_t got = 0;
    if (verify)
        got = kvd_xxh3_copy(&from, 1, dst, 0);
    else
        memcpy(dst, from.buf, from.len);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (load_relaxed(tag) != s.uid || (verify && got != s.checksum))
        return -1;
    return (int64_t)s.size;
}

static int
parse_layout(PyObject *obj, const Py_buffer *pool, pool_layout *l)
{
    unsigned long long f[5];
    if (!PyArg_ParseTuple(obj, "KKKKK", &f[0], &f[1], &f[2], &f[3], &f[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "pool_read_many: layout is (tags, slots, mask, ways, pool_bytes)");
        return -1;
    }
    *l = (pool_layout){f[0], f[1], f[2], f[3], f[4]};
    uint64_t len = (uint64_t)pool->len;
    uint64_t pages = l->pool_bytes / KVD_POOL_PAGE_BYTES;
    int fits = l->ways >= 1 && l->ways <= KVD_WAYS_MAX && l->mask < (1ull << 40) &&
               (l->mask & (l->mask + 1)) == 0 && l->tags % 8 == 0 &&
               l->slots % KVD_SLOT_BYTES == 0 && l->pool_bytes <= l->tags &&
               l->tags <= len && pages <= (len - l->tags) / 8 && l->slots <= len &&
               (l->mask + 1) * l->ways <= (len - l->slots) / KVD_SLOT_BYTES &&
               (uintptr_t)pool->buf % 8 == 0;
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "pool_read_many: the layout does not fit the pool");
        return -1;
    }
    return 0;
}

PyObject *
kvd_pool_read_many_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *pool_obj, *layout_obj, *digests_obj, *buffers_obj;
    int verify;
    if (!PyArg_ParseTuple(args, "OOOOp:pool_read_many", &pool_obj, &layout_obj, &digests_obj,
                          &buffers_obj, &verify))
        return NULL;
    Py_buffer pool;
    if (PyObject_GetBuffer(pool_obj, &pool, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *digests = NULL, *buffers = NULL, *result = NULL;
    Py_buffer *views = NULL;
    int64_t *sizes = NULL;
    const uint8_t **named = NULL;
    Py_ssize_t held = 0, n = 0;
    pool_layout layout;
    if (parse_layout(layout_obj, &pool, &layout) < 0)
        goto done;
    digests = PySequence_Fast(digests_obj, "pool_read_many: digests must be a sequence");
    buffers = PySequence_Fast(buffers_obj, "pool_read_many: buffers must be a sequence");
    if (digests == NULL || buffers == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(digests);
    if (n != PySequence_Fast_GET_SIZE(buffers) || n > KVD_POOL_READS_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "pool_read_many: as many buffers as digests, at most %d", KVD_POOL_READS_MAX);
        goto done;
    }
    size_t slots = n ? (size_t)n : 1;
    views = PyMem_Calloc(slots, sizeof(Py_buffer));
    sizes = PyMem_Calloc(slots, sizeof(int64_t));
    named = PyMem_Calloc(slots, sizeof(uint8_t *));
    if (views == NULL || sizes == NULL || named == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *digest = PySequence_Fast_GET_ITEM(digests, i);
        if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) != KVD_DIGEST_BYTES) {
            PyErr_SetString(PyExc_TypeError, "pool_read_many: each digest is 16 bytes");
            goto done;
        }
        named[i] = (const uint8_t *)PyBytes_AS_STRING(digest);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, i), &views[i],
                               PyBUF_WRITABLE) < 0)
            goto done;
        held++;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        sizes[i] = read_one(pool.buf, &layout, named[i], views[i].buf, (uint64_t)views[i].len,
                            verify);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *size = PyLong_FromLongLong(sizes[i]);
        if (size == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, size);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sizes);
    PyMem_Free(named);
    Py_XDECREF(digests);
    Py_XDECREF(buffers);
    PyBuffer_Release(&pool);
    return result;
}
