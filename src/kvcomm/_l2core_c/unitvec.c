/* ------------------------------------------------------------------ a unit float32 row
 *
 * unit_f32(vector, dims) -> bytes | None: the list (or tuple) ``vector`` of ``dims``
 * Python floats as a unit float32 row, its little-endian bytes (what a KVCommStore record
 * and the host's vector matrix hold: integrations/langgraph/_semantic.py blobs); an
 * indexed put's embedding made a row in one pass, where struct, NumPy's dot and a division
 * took three (most of the index's own work in a put).
 *
 * None, nothing computed, for whatever the caller's general path decides instead: not a
 * list or tuple of ``dims`` floats, an element not a float32 number (nan, beyond
 * float32), a vector whose float32 sum of squares would overflow or fall below float32's
 * normal range (zero included: NumPy's float32 dot makes inf or 0 of it there, and the
 * caller's path says what such a vector becomes), or a big-endian machine.
 *
 * The rounding is NumPy's float32 path's: each element rounded to float32 first, then
 * divided (in float32) by the norm rounded to float32; the sum of squares is in double
 * (NumPy's float32 dot sums in float32: they differ in the last bits of the norm).
 */
#include <float.h>
#include <math.h>

static PyObject *
unit_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "unit_f32(vector, dims)");
        return NULL;
    }
    Py_ssize_t dims = PyLong_AsSsize_t(args[1]);
    if (dims == -1 && PyErr_Occurred())
        return NULL;
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    Py_RETURN_NONE;
#else
    PyObject *v = args[0];
    PyObject **items;
    if (PyList_CheckExact(v) && PyList_GET_SIZE(v) == dims)
        items = ((PyListObject *)v)->ob_item;
    else if (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == dims)
        items = ((PyTupleObject *)v)->ob_item;
    else
        Py_RETURN_NONE;
    if (dims <= 0)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, dims * (Py_ssize_t)sizeof(float));
    if (!out)
        return NULL;
    float *row = (float *)PyBytes_AS_STRING(out);
    double ss = 0.0;
    for (Py_ssize_t i = 0; i < dims; i++) {
        PyObject *x = items[i]; /* (a list's items read with the GIL held: none changes) */
        if (!PyFloat_Check(x))
            goto general;
        double d = PyFloat_AS_DOUBLE(x);
        if (!(fabs(d) <= FLT_MAX)) /* nan, or beyond float32 */
            goto general;
        float f = (float)d;
        row[i] = f;
        ss += (double)f * (double)f;
    }
    if (!(ss >= FLT_MIN && ss <= FLT_MAX))
        goto general;
    float n = (float)sqrt(ss);
    for (Py_ssize_t i = 0; i < dims; i++)
        row[i] = row[i] / n;
    return out;
general:
    Py_DECREF(out);
    Py_RETURN_NONE;
#endif
}
