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
 * float32), a zero vector (the caller's path says what it becomes), or a big-endian
 * machine.
 *
 * Each element is rounded to float32 first; the sum of squares, the norm and the
 * division are in double (a float32 vector's norm may overflow float32, or its squares
 * fall below it: 1e19 or 1e-22 in every element), the quotient rounded to float32, as
 * the caller's general path (SemanticIndex.unit, norms in float64) makes it.
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
    if (!(ss > 0.0)) /* (zero: the caller's path says what a zero vector becomes) */
        goto general;
    double n = sqrt(ss); /* (in double: a float32 vector's norm may overflow float32) */
    for (Py_ssize_t i = 0; i < dims; i++)
        row[i] = (float)((double)row[i] / n);
    return out;
general:
    Py_DECREF(out);
    Py_RETURN_NONE;
#endif
}
