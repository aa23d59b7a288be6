/*
 * The `density` eviction policy's plan (kvd/store/eviction/density_plan.py
 * holds the same steps in numpy, used where this is not built; tests run
 * both on the same counts and compare the plans to the bit).
 *
 * density_hazards: the reuse hazard per class and age bin
 * (proportional_hazards, ~40 small numpy calls): column sums row after row
 * (numpy's reduction over the first axis), row sums pairwise, bincount's
 * sums in index order.
 *
 * density_choose: the plan from the hazards (choose). Survival, gain and
 * cost per class and retention, then each class picks the retention j that
 * maximises gain[c][j] - lambda * cost[c][j]; lambda is bisected on its log
 * until the planned occupancy (the sum over classes of occupancy[c][pick])
 * fills the blocks tracked, and the picks are capped. In numpy each of the
 * bisection's 30 steps is seven array calls (~7 us); here it is one pass
 * over the 73 x 44 table.
 *
 * The arithmetic is numpy's, step for step, so the plan is the same to the
 * bit: exp is numpy's own (passed in), a product is rounded before the
 * subtraction (the build contracts no multiply-add), the argmax takes the
 * first maximum (a NaN first of all, as numpy's does), sums go in numpy's
 * order (pairwise over a contiguous row, cumulative ones in order), and
 * the cap takes Python's min and max.
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

/* numpy's exp of x (the function passed in); -1 with an exception set. */
static int
exp_of(PyObject *exp, double x, double *out)
{
    PyObject *x_obj = PyFloat_FromDouble(x);
    if (x_obj == NULL)
        return -1;
    PyObject *y_obj = PyObject_CallOneArg(exp, x_obj);
    Py_DECREF(x_obj);
    if (y_obj == NULL)
        return -1;
    *out = PyFloat_AsDouble(y_obj);
    Py_DECREF(y_obj);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* The bisection: *high after `steps` halvings of [low, high]; `picked`
 * holds `classes` doubles. -1 with an exception set (from exp). */
static int
bisect_lambda(const double *g, const double *c, const double *o, Py_ssize_t classes,
              Py_ssize_t columns, double target, double low, double *high, int steps,
              PyObject *exp, double *picked)
{
    for (int step = 0; step < steps; step++) {
        double middle = (low + *high) / 2.0, lambda;
        if (exp_of(exp, middle, &lambda) < 0)
            return -1;
        for (Py_ssize_t k = 0; k < classes; k++) {
            Py_ssize_t row = k * columns;
            picked[k] = o[row + pick(g + row, c + row, columns, lambda)];
        }
        if (pairwise_sum(picked, classes) > target)
            low = middle;
        else
            *high = middle;
    }
    return 0;
}

static int
table_of(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != sizeof(double) || view->format == NULL ||
        strcmp(view->format, "d") != 0) {
        PyErr_Format(PyExc_TypeError, "density plan: %s must be float64", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
feature_of(PyObject *obj, Py_buffer *view, Py_ssize_t classes, Py_ssize_t *values)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != sizeof(int64_t) || view->format == NULL ||
        (strcmp(view->format, "l") != 0 && strcmp(view->format, "q") != 0) ||
        view->len != classes * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_TypeError,
                        "density_hazards: a feature must be int64, one value per class");
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *f = view->buf;
    int64_t top = 0;
    for (Py_ssize_t k = 0; k < classes; k++) {
        if (f[k] < 0 || f[k] >= classes) {
            PyErr_SetString(PyExc_ValueError, "density_hazards: a feature value out of range");
            PyBuffer_Release(view);
            return -1;
        }
        if (f[k] > top)
            top = f[k];
    }
    *values = (Py_ssize_t)top + 1;
    return 0;
}

#define FEATURES_MAX 8

PyObject *
kvd_density_hazards_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *entered_obj, *reused_obj, *features, *hazard_obj;
    Py_ssize_t classes, bins;
    double prior;
    int rounds;
    if (!PyArg_ParseTuple(args, "OOOnndiO:density_hazards", &entered_obj, &reused_obj,
                          &features, &classes, &bins, &prior, &rounds, &hazard_obj))
        return NULL;
    if (classes <= 0 || bins <= 0 || classes > PY_SSIZE_T_MAX / bins / 8 ||
        !PyTuple_Check(features) || PyTuple_GET_SIZE(features) > FEATURES_MAX) {
        PyErr_SetString(PyExc_ValueError, "density_hazards: bad shape or features");
        return NULL;
    }
    Py_ssize_t nf = PyTuple_GET_SIZE(features);
    Py_buffer entered, reused, hazard, feature[FEATURES_MAX];
    Py_ssize_t values[FEATURES_MAX];
    int held = 0, nheld = 0;
    PyObject *result = NULL;
    double *work = NULL;
    if (table_of(entered_obj, &entered, "entered") < 0)
        return NULL;
    held = 1;
    if (table_of(reused_obj, &reused, "reused") < 0)
        goto done;
    held = 2;
    if (table_of(hazard_obj, &hazard, "hazard") < 0)
        goto done;
    held = 3;
    if (hazard.readonly) {
        PyErr_SetString(PyExc_TypeError, "density_hazards: hazard must be writable");
        goto done;
    }
    Py_ssize_t cells = classes * bins, total = 0;
    if (entered.len != cells * (Py_ssize_t)sizeof(double) || reused.len != entered.len ||
        hazard.len != entered.len) {
        PyErr_SetString(PyExc_ValueError, "density_hazards: tables of another size");
        goto done;
    }
    for (; nheld < nf; nheld++) {
        if (feature_of(PyTuple_GET_ITEM(features, nheld), &feature[nheld], classes,
                       &values[nheld]) < 0)
            goto done;
        total += values[nheld];
    }
    /* pooled, reused by column, a row's products, expected, observed,
     * factor, then each feature's two bincounts. */
    Py_ssize_t size = 3 * bins + 3 * classes + 2 * total;
    work = PyMem_Calloc((size_t)size, sizeof(double));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *pooled = work, *column = pooled + bins, *row = column + bins;
    double *expected = row + bins, *observed = expected + classes;
    double *factor = observed + classes, *seen = factor + classes;
    const double *e = entered.buf, *r = reused.buf;
    for (Py_ssize_t j = 0; j < bins; j++) {
        pooled[j] = e[j];
        column[j] = r[j];
    }
    for (Py_ssize_t k = 1; k < classes; k++)
        for (Py_ssize_t j = 0; j < bins; j++) {
            pooled[j] += e[k * bins + j];
            column[j] += r[k * bins + j];
        }
    for (Py_ssize_t j = 0; j < bins; j++)
        pooled[j] = pooled[j] > 0.0 ? column[j] / pooled[j] : 0.0;
    for (Py_ssize_t k = 0; k < classes; k++) {
        for (Py_ssize_t j = 0; j < bins; j++)
            row[j] = e[k * bins + j] * pooled[j];
        expected[k] = pairwise_sum(row, bins);
        observed[k] = pairwise_sum(r + k * bins, bins);
        factor[k] = 1.0;
    }
    double *bin_sums[FEATURES_MAX], *observed_by[FEATURES_MAX];
    double *next = seen;
    for (Py_ssize_t f = 0; f < nf; f++) {
        observed_by[f] = next;
        bin_sums[f] = next + values[f];
        next += 2 * values[f];
        const int64_t *v = feature[f].buf;
        for (Py_ssize_t k = 0; k < classes; k++)
            observed_by[f][v[k]] += observed[k];
    }
    for (int round = 0; round < rounds; round++)
        for (Py_ssize_t f = 0; f < nf; f++) {
            const int64_t *v = feature[f].buf;
            double *sums = bin_sums[f];
            for (Py_ssize_t i = 0; i < values[f]; i++)
                sums[i] = 0.0;
            for (Py_ssize_t k = 0; k < classes; k++)
                sums[v[k]] += expected[k] * factor[k];
            for (Py_ssize_t i = 0; i < values[f]; i++)
                sums[i] = (observed_by[f][i] + prior) / (sums[i] + prior);
            for (Py_ssize_t k = 0; k < classes; k++)
                factor[k] *= sums[v[k]];
        }
    double *h = hazard.buf;
    for (Py_ssize_t k = 0; k < classes; k++) {
        factor[k] *= (observed[k] + prior) / (factor[k] * expected[k] + prior);
        for (Py_ssize_t j = 0; j < bins; j++) {
            double x = factor[k] * pooled[j];
            h[k * bins + j] = x < 0.0 ? 0.0 : (x > 1.0 ? 1.0 : x);
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(work);
    for (int i = 0; i < nheld; i++)
        PyBuffer_Release(&feature[i]);
    if (held >= 3)
        PyBuffer_Release(&hazard);
    if (held >= 2)
        PyBuffer_Release(&reused);
    PyBuffer_Release(&entered);
    return result;
}

/* density_choose(hazard, entered, widths, retentions, lookups, target, low,
 * high, steps, residence_cap, exp, survival) -> the plan, a retention per
 * class: the rest of DensityPolicy._plan after the hazards (survival into
 * `survival`, gain and cost, occupancy, the bisection, each class's
 * choice, the cap), numpy's and Python's arithmetic as there. */
PyObject *
kvd_density_choose_py(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *hazard_obj, *entered_obj, *widths_obj, *retentions_obj, *exp, *survival_obj;
    double lookups, target, low, high, residence_cap;
    int steps;
    if (!PyArg_ParseTuple(args, "OOOOddddidOO:density_choose", &hazard_obj, &entered_obj,
                          &widths_obj, &retentions_obj, &lookups, &target, &low, &high,
                          &steps, &residence_cap, &exp, &survival_obj))
        return NULL;
    Py_buffer hazard, entered, widths, retentions, survival;
    Py_buffer *views[5] = {&hazard, &entered, &widths, &retentions, &survival};
    PyObject *objs[5] = {hazard_obj, entered_obj, widths_obj, retentions_obj, survival_obj};
    const char *names[5] = {"hazard", "entered", "widths", "retentions", "survival"};
    int held = 0;
    PyObject *result = NULL;
    double *work = NULL;
    for (; held < 5; held++)
        if (table_of(objs[held], views[held], names[held]) < 0)
            goto done;
    Py_ssize_t bins = widths.len / (Py_ssize_t)sizeof(double), columns = bins + 1;
    Py_ssize_t classes = bins ? hazard.len / (Py_ssize_t)sizeof(double) / bins : 0;
    if (bins <= 0 || classes <= 0 || hazard.len != classes * bins * (Py_ssize_t)sizeof(double) ||
        entered.len != hazard.len || survival.len != hazard.len ||
        retentions.len != columns * (Py_ssize_t)sizeof(double) || survival.readonly) {
        PyErr_SetString(PyExc_ValueError, "density_choose: tables of another size");
        goto done;
    }
    work = PyMem_Malloc((size_t)(3 * classes * columns + 2 * classes) * sizeof(double));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *gain = work, *cost = gain + classes * columns, *occupancy = cost + classes * columns;
    double *scale = occupancy + classes * columns, *picked = scale + classes;
    const double *h = hazard.buf, *e = entered.buf, *w = widths.buf;
    double *s = survival.buf;
    for (Py_ssize_t k = 0; k < classes; k++) {
        const double *hk = h + k * bins;
        double *sk = s + k * bins, *gk = gain + k * columns, *ck = cost + k * columns;
        scale[k] = e[k * bins] / lookups;
        gk[0] = 0.0;
        ck[0] = 0.0;
        double total = 0.0;
        for (Py_ssize_t j = 0; j < bins; j++) {
            /* cumprod and cumsum: the first element as it is, then in order. */
            double before = j == 0 ? 1.0 : sk[j - 1];
            sk[j] = j == 0 ? 1.0 - hk[0] : sk[j - 1] * (1.0 - hk[j]);
            total = j == 0 ? before * w[0] : total + before * w[j];
            gk[j + 1] = 1.0 - sk[j];
            ck[j + 1] = total;
        }
        for (Py_ssize_t j = 0; j < columns; j++)
            occupancy[k * columns + j] = scale[k] * ck[j];
    }
    if (bisect_lambda(gain, cost, occupancy, classes, columns, target, low, &high, steps, exp,
                      picked) < 0)
        goto done;
    double lambda, rate = pairwise_sum(scale, classes);
    if (exp_of(exp, high, &lambda) < 0)
        goto done;
    /* Python's max(rate, 1e-9) and min(r, cap): the first unless the second
     * is strictly past it. */
    double cap = residence_cap * (target / (1e-9 > rate ? 1e-9 : rate));
    result = PyList_New(classes);
    if (result == NULL)
        goto done;
    const double *r = retentions.buf;
    for (Py_ssize_t k = 0; k < classes; k++) {
        double kept = r[pick(gain + k * columns, cost + k * columns, columns, lambda)];
        kept = cap < kept ? cap : kept;
        if (!(kept >= 0.0 && kept < 9.0e15)) {
            Py_CLEAR(result);
            PyErr_SetString(PyExc_ValueError, "density_choose: a retention out of range");
            goto done;
        }
        PyObject *item = PyLong_FromLongLong((long long)kept);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, item);
    }
done:
    PyMem_Free(work);
    for (int i = 0; i < held; i++)
        PyBuffer_Release(views[i]);
    return result;
}
