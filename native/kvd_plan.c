/*
 * density_lambda: the bisection of the `density` eviction policy's plan
 * (DensityPolicy._refresh in kvd/store/eviction/density.py holds the same
 * loop in numpy, used where this is not built; a test runs both on the same
 * counts and compares the plans).
 *
 * Each class c picks the retention j that maximises gain[c][j] - lambda *
 * cost[c][j]; lambda is bisected on its log until the planned occupancy
 * (the sum over classes of occupancy[c][pick]) fills the blocks tracked.
 * The arithmetic is numpy's, step for step, so the plan is the same to the
 * bit: exp is numpy's own (passed in), the product is rounded before the
 * subtraction (the build contracts no multiply-add), the argmax takes the
 * first maximum (a NaN first of all, as numpy's does), and the sum over
 * classes is numpy's pairwise sum.
 *
 * In numpy each of the 30 steps is seven array calls (~7 us); here it is
 * one pass over the 73 x 44 table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

/* numpy's pairwise summation of n doubles (its add.reduce of a contiguous
 * float64 array): eight partial sums in blocks of up to 128, halves above. */
static double
pairwise_sum(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double res = 0.0;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        Py_ssize_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

/* The column of row's largest gain - lambda * cost: numpy's argmax (the
 * first maximum; the first NaN, if any). */
static Py_ssize_t
pick(const double *gain, const double *cost, Py_ssize_t columns, double lambda)
{
    double best = gain[0] - cost[0] * lambda;
    Py_ssize_t at = 0;
    if (isnan(best))
        return 0;
    for (Py_ssize_t j = 1; j < columns; j++) {
        double value = gain[j] - cost[j] * lambda;
        if (!(value <= best)) {
            best = value;
            at = j;
            if (isnan(value))
                break;
        }
    }
    return at;
}

static int
table_of(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != sizeof(double) || view->format == NULL ||
        strcmp(view->format, "d") != 0) {
        PyErr_Format(PyExc_TypeError, "density_lambda: %s must be float64", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyObject *
kvd_density_lambda_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *gain_obj, *cost_obj, *occupancy_obj, *exp;
    Py_ssize_t classes, columns;
    double target, low, high;
    int steps;
    if (!PyArg_ParseTuple(args, "OOOnndddiO:density_lambda", &gain_obj, &cost_obj,
                          &occupancy_obj, &classes, &columns, &target, &low, &high, &steps,
                          &exp))
        return NULL;
    if (classes <= 0 || columns <= 0 || classes > PY_SSIZE_T_MAX / columns) {
        PyErr_SetString(PyExc_ValueError, "density_lambda: bad table shape");
        return NULL;
    }
    Py_buffer gain, cost, occupancy;
    if (table_of(gain_obj, &gain, "gain") < 0)
        return NULL;
    if (table_of(cost_obj, &cost, "cost") < 0) {
        PyBuffer_Release(&gain);
        return NULL;
    }
    if (table_of(occupancy_obj, &occupancy, "occupancy") < 0) {
        PyBuffer_Release(&gain);
        PyBuffer_Release(&cost);
        return NULL;
    }
    PyObject *result = NULL;
    double *picked = NULL;
    Py_ssize_t cells = classes * columns;
    if (gain.len != cells * (Py_ssize_t)sizeof(double) || cost.len != gain.len ||
        occupancy.len != gain.len) {
        PyErr_SetString(PyExc_ValueError, "density_lambda: tables of another size");
        goto done;
    }
    picked = PyMem_Malloc((size_t)classes * sizeof(double));
    if (picked == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const double *g = gain.buf, *c = cost.buf, *o = occupancy.buf;
    for (int step = 0; step < steps; step++) {
        double middle = (low + high) / 2.0;
        PyObject *middle_obj = PyFloat_FromDouble(middle);
        if (middle_obj == NULL)
            goto done;
        PyObject *lambda_obj = PyObject_CallOneArg(exp, middle_obj);
        Py_DECREF(middle_obj);
        if (lambda_obj == NULL)
            goto done;
        double lambda = PyFloat_AsDouble(lambda_obj);
        Py_DECREF(lambda_obj);
        if (lambda == -1.0 && PyErr_Occurred())
            goto done;
        for (Py_ssize_t k = 0; k < classes; k++) {
            Py_ssize_t row = k * columns;
            picked[k] = o[row + pick(g + row, c + row, columns, lambda)];
        }
        if (pairwise_sum(picked, classes) > target)
            low = middle;
        else
            high = middle;
    }
    result = PyFloat_FromDouble(high);
done:
    PyMem_Free(picked);
    PyBuffer_Release(&gain);
    PyBuffer_Release(&cost);
    PyBuffer_Release(&occupancy);
    return result;
}
