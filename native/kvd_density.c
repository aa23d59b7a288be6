/*
 * density_learn: what the `density` eviction policy learns from one chain
 * lookup, key by key (kvd/store/eviction/density_learn.py holds the same
 * loop in Python, used where this is not built; a test runs both and
 * compares every field, heap entry and counter).
 *
 * For each key of the chain (of this member's share, `mine`): the wait of
 * its previous reference ends (out of its ring row, a reuse counted in its
 * age bin), the reference gets its class (gap since the last lookup of the
 * key, how often it was looked up, the chain's length; the chain's last
 * key a class of its own), the class is counted in this lookup's ring row,
 * and the key's deadline is set: now + the class's retention, a leaf never
 * past the block before it. Then the lookup's ring row is closed (entered
 * counts per class and age bin). A tracked block's node takes the new fields
 * and, where its deadline moved earlier, a fresh heap entry (priority, seq,
 * key); a later deadline leaves its entry for the victim search to push
 * again (ChainPolicy's lazy raise). A block not yet put is remembered in
 * `pending` (and, in a pool, its share's parent in `shares`).
 *
 * In Python the loop costs ~1 us a key, the policy's largest cost per
 * lookup; here the node's fields are read and written through their slot
 * offsets (the member descriptors of its __slots__), and the counters in
 * the policy's flat arrays directly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>

enum { F_KLASS, F_GAP, F_TICK, F_COUNT, F_DUE, F_PRIORITY, F_SEQ, F_COUNT_OF_FIELDS };

enum {
    C_CLASSES,
    C_BINS,
    C_RING_MASK,
    C_AGE_LAST,
    C_COUNT_MAX,
    C_COUNT_BUCKET_LEN,
    C_COUNT_TOP,
    C_GAP_PART_LAST,
    C_GAP_TOP,
    C_LENGTH_BUCKETS,
    C_LAST,
    C_HEAP_CHECK,
    C_COUNT_OF_CONSTS
};

enum { S_NOW, S_ROW_START, S_LENGTH_BUCKET, S_BOUND, S_SEQ, S_ACCESSES, S_HEAP_BOUND,
       S_SHARE_LAST, S_CROSSING, S_COUNT_OF_STATE };

enum {
    A_KEYS, A_MINE, A_NODES, A_NODE_TYPE, A_FIELDS, A_GHOST_POP, A_PENDING, A_SHARES,
    A_CHILDREN, A_LEAF_HEAP, A_INNER_HEAP, A_HEAPPUSH, A_REBUILD, A_RING, A_RING_TICK,
    A_REUSED, A_AGE_BIN, A_GAP_PART, A_COUNT_BUCKET, A_RETENTION, A_ENTERED, A_EDGE_TICKS,
    A_CONSTS, A_STATE, A_COUNT_OF_ARGS
};

#define RETENTION_CLASSES_MAX 4096

static int
ints_of(PyObject *tuple, int64_t *out, Py_ssize_t n, const char *what)
{
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
        PyErr_Format(PyExc_TypeError, "density_learn: %s must be a tuple of %zd ints", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* A slot's offset in the node, from its member descriptor. */
static int
slot_offsets(PyObject *fields, PyTypeObject *node_type, Py_ssize_t *out)
{
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != F_COUNT_OF_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "density_learn: fields must be 7 member descriptors");
        return -1;
    }
    for (Py_ssize_t i = 0; i < F_COUNT_OF_FIELDS; i++) {
        PyObject *descr = PyTuple_GET_ITEM(fields, i);
        if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_SetString(PyExc_TypeError, "density_learn: a field is not a slot");
            return -1;
        }
        PyMemberDescrObject *member = (PyMemberDescrObject *)descr;
        if (member->d_member->type != T_OBJECT_EX ||
            !PyType_IsSubtype(node_type, PyDescr_TYPE(descr)) ||
            member->d_member->offset < (Py_ssize_t)sizeof(PyObject) ||
            member->d_member->offset + (Py_ssize_t)sizeof(PyObject *) > node_type->tp_basicsize) {
            PyErr_SetString(PyExc_TypeError, "density_learn: a field is not a slot of the node");
            return -1;
        }
        out[i] = member->d_member->offset;
    }
    return 0;
}

static inline PyObject **
slot(PyObject *node, Py_ssize_t offset)
{
    return (PyObject **)((char *)node + offset);
}

static int
get_field(PyObject *node, Py_ssize_t offset, int64_t *out)
{
    PyObject *value = *slot(node, offset);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "density_learn: a node field is unset");
        return -1;
    }
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Steals value. */
static int
set_field(PyObject *node, Py_ssize_t offset, PyObject *value)
{
    if (value == NULL)
        return -1;
    PyObject **where = slot(node, offset);
    PyObject *old = *where;
    *where = value;
    Py_XDECREF(old);
    return 0;
}

/* A heap priority, (due << 64) | accesses, as a new int: made from its 16
 * bytes in one allocation (the shift and the or made three, and were a
 * quarter of the learning's instructions); a negative due (a peer's plan
 * can say anything) takes Python's own arithmetic, as the Python loop does. */
static PyObject *
priority_of(int64_t due, uint64_t accesses, PyObject *due_obj, PyObject *sixty_four)
{
    if (due >= 0) {
        unsigned char bytes[16];
        for (int i = 0; i < 8; i++) {
            bytes[i] = (unsigned char)(accesses >> (8 * i));
            bytes[8 + i] = (unsigned char)((uint64_t)due >> (8 * i));
        }
        return _PyLong_FromByteArray(bytes, sizeof bytes, 1, 0);
    }
    PyObject *shifted = PyNumber_Lshift(due_obj, sixty_four);
    if (shifted == NULL)
        return NULL;
    PyObject *access_obj = PyLong_FromUnsignedLongLong(accesses);
    PyObject *priority = access_obj == NULL ? NULL : PyNumber_Or(shifted, access_obj);
    Py_DECREF(shifted);
    Py_XDECREF(access_obj);
    return priority;
}

static int
hold(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, Py_ssize_t min_items,
     const char *what)
{
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % itemsize || view->len / itemsize < min_items) {
        PyErr_Format(PyExc_ValueError, "density_learn: %s is too short", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyObject *
kvd_density_learn_py(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != A_COUNT_OF_ARGS) {
        PyErr_Format(PyExc_TypeError, "density_learn takes %d arguments", A_COUNT_OF_ARGS);
        return NULL;
    }
    int64_t c[C_COUNT_OF_CONSTS], s[S_COUNT_OF_STATE];
    Py_ssize_t off[F_COUNT_OF_FIELDS];
    PyObject *nodes = args[A_NODES], *pending = args[A_PENDING], *shares = args[A_SHARES];
    PyObject *children = args[A_CHILDREN], *mine = args[A_MINE];
    if (!PyDict_Check(nodes) || !PyDict_Check(pending) || !PyDict_Check(children) ||
        (shares != Py_None && !PyDict_Check(shares)) || !PyType_Check(args[A_NODE_TYPE])) {
        PyErr_SetString(PyExc_TypeError, "density_learn: nodes, pending, children (and "
                                         "shares) must be dicts, node_type a type");
        return NULL;
    }
    PyTypeObject *node_type = (PyTypeObject *)args[A_NODE_TYPE];
    if (ints_of(args[A_CONSTS], c, C_COUNT_OF_CONSTS, "consts") < 0 ||
        ints_of(args[A_STATE], s, S_COUNT_OF_STATE, "state") < 0 ||
        slot_offsets(args[A_FIELDS], node_type, off) < 0)
        return NULL;
    if (c[C_CLASSES] <= 0 || c[C_CLASSES] > RETENTION_CLASSES_MAX || c[C_BINS] <= 0 ||
        c[C_RING_MASK] < 0 || c[C_LAST] < 0 || c[C_LAST] >= c[C_CLASSES] ||
        c[C_HEAP_CHECK] <= 0 || c[C_AGE_LAST] < 0 || c[C_GAP_PART_LAST] < 0 ||
        c[C_COUNT_BUCKET_LEN] < 0 || c[C_COUNT_MAX] < 0 || s[S_ROW_START] < 0 ||
        s[S_ACCESSES] < 0) {
        PyErr_SetString(PyExc_ValueError, "density_learn: constants out of range");
        return NULL;
    }
    const int64_t classes = c[C_CLASSES];
    int64_t retention[RETENTION_CLASSES_MAX];
    PyObject *ret_seq = PySequence_Fast(args[A_RETENTION], "density_learn: retention");
    if (ret_seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(ret_seq) != classes) {
        Py_DECREF(ret_seq);
        PyErr_SetString(PyExc_ValueError, "density_learn: one retention per class");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < classes; i++) {
        retention[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ret_seq, i));
        if (retention[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(ret_seq);
            return NULL;
        }
    }
    Py_DECREF(ret_seq);

    PyObject *keys = PySequence_Fast(args[A_KEYS], "density_learn: keys must be a sequence");
    if (keys == NULL)
        return NULL;
    PyObject *mine_seq = NULL;
    if (mine != Py_None) {
        mine_seq = PySequence_Fast(mine, "density_learn: mine must be a sequence");
        if (mine_seq == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    Py_buffer ring = {0}, ring_tick = {0}, reused = {0}, age_bin = {0}, gap_part = {0};
    Py_buffer count_bucket = {0}, entered = {0}, edge_ticks = {0};
    PyObject *result = NULL, *now_obj = NULL, *sixty_four = NULL;
    PyObject *leaf_heap = Py_NewRef(args[A_LEAF_HEAP]);
    PyObject *inner_heap = Py_NewRef(args[A_INNER_HEAP]);
    int held = 0;
    if (hold(args[A_RING], &ring, 4, 1, (c[C_RING_MASK] + 1) * classes, "ring") < 0)
        goto done;
    held = 1;
    if (hold(args[A_RING_TICK], &ring_tick, 8, 0, c[C_RING_MASK] + 1, "ring_tick") < 0)
        goto done;
    held = 2;
    if (hold(args[A_REUSED], &reused, 8, 1, classes * c[C_BINS], "reused") < 0)
        goto done;
    held = 3;
    if (hold(args[A_AGE_BIN], &age_bin, 4, 0, c[C_AGE_LAST] + 1, "age_bin") < 0)
        goto done;
    held = 4;
    if (hold(args[A_GAP_PART], &gap_part, 4, 0, c[C_GAP_PART_LAST] + 1, "gap_part") < 0)
        goto done;
    held = 5;
    if (hold(args[A_COUNT_BUCKET], &count_bucket, 4, 0, c[C_COUNT_BUCKET_LEN], "count_bucket") < 0)
        goto done;
    held = 6;
    if (hold(args[A_ENTERED], &entered, 8, 1, classes * c[C_BINS], "entered") < 0)
        goto done;
    held = 7;
    if (s[S_CROSSING] < 0 || s[S_CROSSING] >= c[C_BINS]) {
        PyErr_SetString(PyExc_ValueError, "density_learn: crossing out of range");
        goto done;
    }
    if (hold(args[A_EDGE_TICKS], &edge_ticks, 8, 0, s[S_CROSSING], "edge_ticks") < 0)
        goto done;
    held = 8;
    if (s[S_ROW_START] + classes > (c[C_RING_MASK] + 1) * classes) {
        PyErr_SetString(PyExc_ValueError, "density_learn: the row is past the ring");
        goto done;
    }
    int32_t *ring_p = ring.buf;
    const int64_t *tick_p = ring_tick.buf;
    double *reused_p = reused.buf;
    const int32_t *age_bin_p = age_bin.buf, *gap_part_p = gap_part.buf;
    const int32_t *count_bucket_p = count_bucket.buf;
    const int64_t now = s[S_NOW], row_start = s[S_ROW_START];
    const int64_t length_bucket = s[S_LENGTH_BUCKET], heap_bound = s[S_HEAP_BOUND];
    int64_t bound = s[S_BOUND], seq = s[S_SEQ];
    uint64_t accesses = (uint64_t)s[S_ACCESSES];
    now_obj = PyLong_FromLongLong(now);
    sixty_four = PyLong_FromLong(64);
    if (now_obj == NULL || sixty_four == NULL)
        goto done;

    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (mine_seq != NULL && PySequence_Fast_GET_SIZE(mine_seq) < n)
        n = PySequence_Fast_GET_SIZE(mine_seq);
    const Py_ssize_t last = PySequence_Fast_GET_SIZE(keys) - 1;
    PyObject **key_items = PySequence_Fast_ITEMS(keys);
    PyObject *share_parent = Py_None;  /* borrowed: a key of the chain */
    for (Py_ssize_t position = 0; position < n; position++) {
        if (mine_seq != NULL) {
            int owned = PyObject_IsTrue(PySequence_Fast_GET_ITEM(mine_seq, position));
            if (owned < 0)
                goto done;
            if (!owned)
                continue;
        }
        PyObject *key = key_items[position];
        PyObject *node = PyDict_GetItemWithError(nodes, key);  /* borrowed */
        if (node == NULL && PyErr_Occurred())
            goto done;
        int is_node = node != NULL && PyObject_TypeCheck(node, node_type);
        int64_t before, gap, tick, count;
        if (is_node) {
            if (get_field(node, off[F_KLASS], &before) < 0 ||
                get_field(node, off[F_GAP], &gap) < 0 ||
                get_field(node, off[F_TICK], &tick) < 0 ||
                get_field(node, off[F_COUNT], &count) < 0)
                goto done;
        } else {
            PyObject *pop_args[2] = {key, Py_None};
            PyObject *remembered = PyObject_Vectorcall(args[A_GHOST_POP], pop_args, 2, NULL);
            if (remembered == NULL)
                goto done;
            int truthy = PyObject_IsTrue(remembered);
            if (truthy < 0) {
                Py_DECREF(remembered);
                goto done;
            }
            if (!truthy) {
                Py_DECREF(remembered);
                remembered = PyDict_GetItemWithError(pending, key);
                if (remembered == NULL && PyErr_Occurred())
                    goto done;
                Py_XINCREF(remembered);
            }
            if (remembered == NULL) {
                before = 0, gap = 0, tick = -1, count = 0;
            } else {
                int64_t fields[4];
                if (!PyTuple_Check(remembered) || PyTuple_GET_SIZE(remembered) < 4) {
                    Py_DECREF(remembered);
                    PyErr_SetString(PyExc_TypeError, "density_learn: a remembered reference "
                                                     "is not a tuple of 4 or more ints");
                    goto done;
                }
                for (int i = 0; i < 4; i++) {
                    fields[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(remembered, i));
                    if (fields[i] == -1 && PyErr_Occurred()) {
                        Py_DECREF(remembered);
                        goto done;
                    }
                }
                Py_DECREF(remembered);
                before = fields[0], gap = fields[1], tick = fields[2], count = fields[3];
            }
        }
        if (before < 0 || before >= classes) {
            PyErr_SetString(PyExc_ValueError, "density_learn: a class out of range");
            goto done;
        }
        /* The wait of the reference (before, tick) ends now. */
        if (tick < 0) {
            gap = 0;
        } else if (tick != now) {
            gap = now - tick;
            int64_t ring_slot = tick & c[C_RING_MASK];
            if (tick_p[ring_slot] == tick && gap <= c[C_AGE_LAST]) {
                int32_t bin = age_bin_p[gap];
                if (bin < 0 || bin >= c[C_BINS]) {
                    PyErr_SetString(PyExc_ValueError, "density_learn: an age bin out of range");
                    goto done;
                }
                ring_p[ring_slot * classes + before] -= 1;
                reused_p[before * c[C_BINS] + bin] += 1.0;
            }
        }
        count = count < c[C_COUNT_MAX] ? count + 1 : c[C_COUNT_MAX];
        int64_t klass;
        if (position == last) {
            klass = c[C_LAST];
        } else {
            int64_t bucket = count < c[C_COUNT_BUCKET_LEN] ? count_bucket_p[count] : c[C_COUNT_TOP];
            int64_t part = (gap >= 0 && gap <= c[C_GAP_PART_LAST]) ? gap_part_p[gap] : c[C_GAP_TOP];
            klass = (part + bucket) * c[C_LENGTH_BUCKETS] + length_bucket;
        }
        if (klass < 0 || klass >= classes) {
            PyErr_SetString(PyExc_ValueError, "density_learn: a class out of range");
            goto done;
        }
        ring_p[row_start + klass] += 1;
        int64_t due = now + retention[klass];
        if (klass == c[C_LAST] && due > bound)
            due = bound;  /* a leaf is worth nothing past the block before it */
        bound = due;
        if (is_node) {
            /* A node's priority is (due << 64) | its access number, and
             * access numbers only grow: the new one is later than the
             * node's unless its due is earlier. */
            int64_t due_before;
            if (get_field(node, off[F_DUE], &due_before) < 0)
                goto done;
            const int later = due >= due_before;
            PyObject *due_obj = PyLong_FromLongLong(due);
            if (set_field(node, off[F_KLASS], PyLong_FromLongLong(klass)) < 0 ||
                set_field(node, off[F_GAP], PyLong_FromLongLong(gap)) < 0 ||
                set_field(node, off[F_TICK], Py_NewRef(now_obj)) < 0 ||
                set_field(node, off[F_COUNT], PyLong_FromLongLong(count)) < 0 ||
                set_field(node, off[F_DUE], Py_XNewRef(due_obj)) < 0) {
                Py_XDECREF(due_obj);
                goto done;
            }
            accesses += 1;
            PyObject *priority = priority_of(due, accesses, due_obj, sixty_four);
            Py_DECREF(due_obj);
            if (later) {
                /* Raised: its heap entry stays, pushed again when a victim
                 * search meets it (ChainPolicy's lazy raise). */
                if (set_field(node, off[F_PRIORITY], priority) < 0)
                    goto done;
                goto next_key;
            }
            seq += 1;
            PyObject *seq_obj = PyLong_FromLongLong(seq);
            if (priority == NULL || seq_obj == NULL) {
                Py_XDECREF(priority);
                Py_XDECREF(seq_obj);
                goto done;
            }
            PyObject *entry = PyTuple_Pack(3, priority, seq_obj, key);
            if (entry == NULL) {
                Py_DECREF(priority);
                Py_DECREF(seq_obj);
                goto done;
            }
            set_field(node, off[F_PRIORITY], priority);
            set_field(node, off[F_SEQ], seq_obj);
            int inner = PyDict_Contains(children, key);
            if (inner < 0) {
                Py_DECREF(entry);
                goto done;
            }
            PyObject *push_args[2] = {inner ? inner_heap : leaf_heap, entry};
            PyObject *pushed = PyObject_Vectorcall(args[A_HEAPPUSH], push_args, 2, NULL);
            Py_DECREF(entry);
            if (pushed == NULL)
                goto done;
            Py_DECREF(pushed);
            if (seq % c[C_HEAP_CHECK] == 0 &&
                PyList_Check(leaf_heap) && PyList_Check(inner_heap) &&
                PyList_GET_SIZE(leaf_heap) + PyList_GET_SIZE(inner_heap) > heap_bound) {
                PyObject *seq_now = PyLong_FromLongLong(seq);
                if (seq_now == NULL)
                    goto done;
                PyObject *heaps = PyObject_CallOneArg(args[A_REBUILD], seq_now);
                Py_DECREF(seq_now);
                if (heaps == NULL)
                    goto done;
                if (!PyTuple_Check(heaps) || PyTuple_GET_SIZE(heaps) != 2) {
                    Py_DECREF(heaps);
                    PyErr_SetString(PyExc_TypeError, "density_learn: rebuild returns 2 heaps");
                    goto done;
                }
                Py_SETREF(leaf_heap, Py_NewRef(PyTuple_GET_ITEM(heaps, 0)));
                Py_SETREF(inner_heap, Py_NewRef(PyTuple_GET_ITEM(heaps, 1)));
                Py_DECREF(heaps);
            }
        } else {
            PyObject *reference = Py_BuildValue("(LLOLL)", (long long)klass, (long long)gap,
                                                now_obj, (long long)count, (long long)due);
            if (reference == NULL)
                goto done;
            int failed = PyDict_SetItem(pending, key, reference);
            Py_DECREF(reference);
            if (failed < 0)
                goto done;
            if (shares != Py_None) {
                PyObject *share = PyTuple_Pack(2, share_parent,
                                               position == s[S_SHARE_LAST] ? Py_True : Py_False);
                if (share == NULL)
                    goto done;
                failed = PyDict_SetItem(shares, key, share);
                Py_DECREF(share);
                if (failed < 0)
                    goto done;
            }
        }
    next_key:
        share_parent = key;
    }
    /* The row is closed: its references entered the first age bin, and the
     * rows born an age edge ago enter the next bin with the references
     * still waiting in them. */
    double *entered_p = entered.buf;
    const int64_t *edge_p = edge_ticks.buf;
    const int64_t bins = c[C_BINS];
    for (int64_t k = 0; k < classes; k++)
        entered_p[k * bins] += (double)ring_p[row_start + k];
    for (int64_t j = 0; j < s[S_CROSSING]; j++) {
        const int32_t *born = ring_p + ((now - edge_p[j]) & c[C_RING_MASK]) * classes;
        for (int64_t k = 0; k < classes; k++)
            entered_p[k * bins + j + 1] += (double)born[k];
    }
    result = Py_BuildValue("(LK)", (long long)seq, (unsigned long long)accesses);
done:
    switch (held) {
    case 8: PyBuffer_Release(&edge_ticks); /* fall through */
    case 7: PyBuffer_Release(&entered); /* fall through */
    case 6: PyBuffer_Release(&count_bucket); /* fall through */
    case 5: PyBuffer_Release(&gap_part); /* fall through */
    case 4: PyBuffer_Release(&age_bin); /* fall through */
    case 3: PyBuffer_Release(&reused); /* fall through */
    case 2: PyBuffer_Release(&ring_tick); /* fall through */
    case 1: PyBuffer_Release(&ring); /* fall through */
    default: break;
    }
    Py_XDECREF(now_obj);
    Py_XDECREF(sixty_four);
    Py_DECREF(leaf_heap);
    Py_DECREF(inner_heap);
    Py_XDECREF(mine_seq);
    Py_DECREF(keys);
    return result;
}
