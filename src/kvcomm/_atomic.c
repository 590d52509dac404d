/*
 * kvcomm._atomic: 64-bit atomic operations on a shared-memory buffer.
 *
 * Why this exists: Python offers no atomic read-modify-write on memory shared
 * between processes, and the L2 segment needs exactly three things that plain
 * memoryview stores cannot give: a compare-and-set (the writer lock), a
 * fetch-and-add with a full barrier (publishing a slot version so that a
 * concurrent pin is seen, Dekker style), and loads/stores with acquire/release
 * ordering. Everything else in L2 is Python.
 *
 * Atomics(buffer) keeps a writable buffer export of `buffer` (an mmap) until
 * release() or deallocation; offsets are in bytes, must be 8-aligned and in
 * range, or IndexError/ValueError is raised. Nothing here allocates or calls
 * back into Python, so these calls never release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
} Atomics;

static int
Atomics_init(Atomics *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj))
        return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (((uintptr_t)self->view.buf) % 8 != 0) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        return -1;
    }
    self->has_view = 1;
    return 0;
}

static void
Atomics_dealloc(Atomics *self)
{
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static uint64_t *
word_at(Atomics *self, PyObject *off_obj)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "atomics released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || off % 8 != 0 || off + 8 > self->view.len) {
        PyErr_Format(PyExc_IndexError, "bad atomic offset %zd", off);
        return NULL;
    }
    return (uint64_t *)((char *)self->view.buf + off);
}

static int
as_u64(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
Atomics_load(Atomics *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "load(off)"); return NULL; }
    uint64_t *p = word_at(self, args[0]);
    if (!p) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

static PyObject *
Atomics_store(Atomics *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "store(off, value)"); return NULL; }
    uint64_t *p = word_at(self, args[0]);
    if (!p || as_u64(args[1], &v) < 0) return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *
Atomics_cas(Atomics *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected, desired;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cas(off, expected, desired)"); return NULL; }
    uint64_t *p = word_at(self, args[0]);
    if (!p || as_u64(args[1], &expected) < 0 || as_u64(args[2], &desired) < 0) return NULL;
    if (__atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *
Atomics_add(Atomics *self, PyObject *const *args, Py_ssize_t nargs)
{
    /* fetch-and-add with a full barrier; delta may be negative. Returns the new value. */
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "add(off, delta)"); return NULL; }
    uint64_t *p = word_at(self, args[0]);
    if (!p) return NULL;
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    uint64_t r = __atomic_add_fetch(p, (uint64_t)delta, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(r);
}

static PyObject *
Atomics_release(Atomics *self, PyObject *Py_UNUSED(ignored))
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Atomics_methods[] = {
    {"load", (PyCFunction)(void (*)(void))Atomics_load, METH_FASTCALL, "load(off) -> int (acquire)"},
    {"store", (PyCFunction)(void (*)(void))Atomics_store, METH_FASTCALL, "store(off, v) (release)"},
    {"cas", (PyCFunction)(void (*)(void))Atomics_cas, METH_FASTCALL, "cas(off, expected, desired) -> bool"},
    {"add", (PyCFunction)(void (*)(void))Atomics_add, METH_FASTCALL, "add(off, delta) -> new value"},
    {"release", (PyCFunction)Atomics_release, METH_NOARGS, "drop the buffer export"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AtomicsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._atomic.Atomics",
    .tp_basicsize = sizeof(Atomics),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Atomics_init,
    .tp_dealloc = (destructor)Atomics_dealloc,
    .tp_methods = Atomics_methods,
    .tp_doc = "Atomics(buffer): 64-bit atomics on a writable, 8-aligned buffer",
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvcomm._atomic", "64-bit atomics on shared buffers", -1, NULL,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&AtomicsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&AtomicsType);
    if (PyModule_AddObject(m, "Atomics", (PyObject *)&AtomicsType) < 0) {
        Py_DECREF(&AtomicsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
