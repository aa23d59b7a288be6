/*
 * recv_hashed: a value's bytes from a stream socket straight into the
 * caller's buffers, each piece hashed right after it lands, in one call
 * with the GIL released (kvd/client/bulk.py: the bulk client's gets of
 * large values).
 *
 * In Python each recv_into of a 4 MiB value (tens of them, as the sender's
 * segments arrive) cost a slice and a hasher update: ~60-80 us of the
 * client's ~570 us of CPU per 4 MiB get over loopback. Here the value is
 * one call that waits in poll() for the next bytes: it blocks its thread,
 * so an event loop must not call it.
 *
 * recv_hashed(fd, views, timeout_ms) -> (status, received, digest):
 * views a sequence of writable buffers filled in order; status 0 when all
 * of them were filled, RECV_EOF when the peer closed first, RECV_TIMEOUT
 * when no byte came for timeout_ms (0: only what the socket holds now), or
 * -errno of a failed recv or poll; received the bytes that landed, digest
 * their xxh3-64 (the value's, when status is 0). The socket may be
 * blocking or not: every recv is MSG_DONTWAIT, every wait a poll().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#include "kvd_record.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifndef KVD_RECV_LOWAT
#define KVD_RECV_LOWAT (256 * 1024)
#endif

/* Buffers one call may fill: a value's pool page runs. */
#define KVD_RECV_BUFFERS_MAX 65536

static int64_t
now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Fill `pieces` from `fd` (see above); without the GIL. While it waits the
 * socket's SO_RCVLOWAT is what it still needs, up to KVD_RECV_LOWAT (*lowat
 * says what it set), so the kernel wakes it once per that many bytes. */
static int
recv_waiting(int fd, const kvd_piece *pieces, Py_ssize_t npieces, int timeout_ms,
             XXH3_state_t *state, uint64_t *received, int *lowat)
{
    int64_t deadline = now_ms() + timeout_ms;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < npieces; i++)
        total += pieces[i].len;
    for (Py_ssize_t i = 0; i < npieces; i++) {
        size_t done = 0;
        while (done < pieces[i].len) {
            size_t want = pieces[i].len - done;
            if (want > KVD_COPY_CHUNK) /* hashed while still in the cache */
                want = KVD_COPY_CHUNK;
            ssize_t n = recv(fd, pieces[i].buf + done, want, MSG_DONTWAIT);
            if (n > 0) {
                kvd_xxh3_update(state, pieces[i].buf + done, (size_t)n);
                done += (size_t)n;
                *received += (uint64_t)n;
                deadline = now_ms() + timeout_ms; /* the wait is for the next bytes */
                continue;
            }
            if (n == 0)
                return KVD_RECV_EOF;
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -errno;
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return KVD_RECV_TIMEOUT;
            uint64_t left_bytes = total - *received;
            int want_lowat = left_bytes < KVD_RECV_LOWAT ? (int)left_bytes : KVD_RECV_LOWAT;
            if (want_lowat != *lowat &&
                setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want_lowat, sizeof want_lowat) == 0)
                *lowat = want_lowat;
            struct pollfd waiting = {.fd = fd, .events = POLLIN};
            int ready = poll(&waiting, 1, left > INT32_MAX ? INT32_MAX : (int)left);
            if (ready < 0 && errno != EINTR)
                return -errno;
            /* Ready, hung up or in error: the next recv says which. */
        }
    }
    return KVD_RECV_OK;
}

static int
recv_pieces(int fd, const kvd_piece *pieces, Py_ssize_t npieces, int timeout_ms,
            XXH3_state_t *state, uint64_t *received)
{
    int lowat = 1; /* the socket's default, put back for whoever reads it next */
    int status = recv_waiting(fd, pieces, npieces, timeout_ms, state, received, &lowat);
    if (lowat != 1) {
        lowat = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
    }
    return status;
}

PyObject *
kvd_recv_hashed_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd, timeout_ms;
    PyObject *views_obj;
    if (!PyArg_ParseTuple(args, "iOi:recv_hashed", &fd, &views_obj, &timeout_ms))
        return NULL;
    if (fd < 0 || timeout_ms < 0) {
        PyErr_SetString(PyExc_ValueError, "recv_hashed: fd and timeout_ms must be >= 0");
        return NULL;
    }
    PyObject *views_seq = PySequence_Fast(views_obj, "recv_hashed: views must be a sequence");
    if (views_seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(views_seq);
    if (count > KVD_RECV_BUFFERS_MAX) {
        PyErr_Format(PyExc_ValueError, "recv_hashed: more than %d buffers in one call",
                     KVD_RECV_BUFFERS_MAX);
        Py_DECREF(views_seq);
        return NULL;
    }
    size_t slots = count ? (size_t)count : 1;
    Py_buffer *views = PyMem_Calloc(slots, sizeof(Py_buffer));
    kvd_piece *pieces = PyMem_Calloc(slots, sizeof(kvd_piece));
    XXH3_state_t *state = XXH3_createState();
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (views == NULL || pieces == NULL || state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        PyObject *view = PySequence_Fast_GET_ITEM(views_seq, held);
        if (PyObject_GetBuffer(view, &views[held], PyBUF_WRITABLE) < 0)
            goto done;
        pieces[held] = (kvd_piece){views[held].buf, (size_t)views[held].len};
    }
    XXH3_64bits_reset(state);
    uint64_t received = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = recv_pieces(fd, pieces, count, timeout_ms, state, &received);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("iKK", status, (unsigned long long)received,
                           (unsigned long long)XXH3_64bits_digest(state));
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    XXH3_freeState(state);
    PyMem_Free(views);
    PyMem_Free(pieces);
    Py_DECREF(views_seq);
    return result;
}
