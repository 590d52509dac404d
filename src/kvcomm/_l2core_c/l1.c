/* ------------------------------------------------------------------ sizes */

/* approx_size(obj) -> bytes a decoded value holds in this process (the object and what it
 * contains: dicts, lists, tuples, str, bytes, numbers), counted once per object and bounded
 * in depth. L1 is bounded by it, per process. */
static Py_ssize_t
approx(PyObject *o, int depth)
{
    if (depth > 64)
        return 64;
    PyTypeObject *t = Py_TYPE(o);
    Py_ssize_t n = t->tp_basicsize;
    if (t->tp_itemsize) {
        Py_ssize_t items = Py_SIZE(o);
        if (items < 0)
            items = -items;
        n += items * t->tp_itemsize;
    }
    if (PyUnicode_CheckExact(o)) {
        n = (Py_ssize_t)sizeof(PyASCIIObject) + 16 +
            PyUnicode_GET_LENGTH(o) * (Py_ssize_t)PyUnicode_KIND(o) + 1;
    } else if (PyList_CheckExact(o)) {
        Py_ssize_t len = PyList_GET_SIZE(o);
        n = (Py_ssize_t)sizeof(PyListObject) + len * (Py_ssize_t)sizeof(PyObject *) + 16;
        for (Py_ssize_t i = 0; i < len; i++)
            n += approx(PyList_GET_ITEM(o, i), depth + 1);
    } else if (PyTuple_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
            n += approx(PyTuple_GET_ITEM(o, i), depth + 1);
    } else if (PyDict_CheckExact(o)) {
        Py_ssize_t pos = 0, len = PyDict_GET_SIZE(o);
        PyObject *k, *v;
        n = 64 + len * 48; /* the table: hashes, entries and the index, generously */
        while (PyDict_Next(o, &pos, &k, &v))
            n += approx(k, depth + 1) + approx(v, depth + 1);
    } else if (PyLong_CheckExact(o) || PyFloat_CheckExact(o) || o == Py_None || PyBool_Check(o)) {
        if (o == Py_None || PyBool_Check(o))
            n = 0; /* shared singletons */
    }
    return n + 16; /* the allocator's own overhead, roughly */
}

static PyObject *
approx_size(PyObject *mod, PyObject *obj)
{
    return PyLong_FromSsize_t(approx(obj, 0));
}

/* ------------------------------------------------------------------ the L1 hit path
 *
 * Getter(entries, core, slow, sampled, sample): ``kv.get`` itself. A hit is one dict
 * lookup in the process's L1 and one load of the entry's L2 slot seq word: equal means L2
 * still holds the value L1 decoded, which is returned. Anything else — a miss, a stale
 * entry, an unhashable key — goes to ``slow(key, default, False)`` (the client's L2 path,
 * which also raises the errors). Every ``sample``-th hit calls ``sampled(key)`` (hot keys;
 * it sets ``sample`` again). In C because a Python method call alone costs what the whole
 * hit does here.
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *entries; /* the L1 dict (key -> L1Entry tuple), or NULL once closed */
    Core *core;
    PyObject *slow;
    PyObject *sampled;
    long long sample;
    unsigned long long hits;
} Getter;

static PyObject *
Getter_vectorcall(Getter *g, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *dflt = Py_None;
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        if (PyTuple_GET_SIZE(kwnames) != 1 || nargs != 1 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "default") != 0) {
            PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
            return NULL;
        }
        dflt = args[1];
    } else if (nargs == 2) {
        dflt = args[1];
    } else if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *key = args[0];
    Core *c = g->core;
    if (g->entries && c && c->has_view) {
        PyObject *e = PyDict_GetItemWithError(g->entries, key);
        if (e && PyTuple_Check(e) && PyTuple_GET_SIZE(e) >= 3) {
            uint64_t word = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 1));
            uint64_t seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 2));
            if (PyErr_Occurred())
                return NULL;
            if (word < c->size / 8 && LD(W(c, word * 8)) == seq) {
                PyObject *value = PyTuple_GET_ITEM(e, 0);
                Py_INCREF(value);
                g->hits++;
                if (--g->sample <= 0) {
                    PyObject *r = PyObject_CallOneArg(g->sampled, key);
                    if (!r) {
                        Py_DECREF(value);
                        return NULL;
                    }
                    Py_DECREF(r);
                }
                return value;
            }
        } else if (!e && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear(); /* an unhashable key: the slow path says what is wrong */
        }
    }
    PyObject *call[3] = {key, dflt, Py_False};
    return PyObject_Vectorcall(g->slow, call, 3, NULL);
}

static int
Getter_init(Getter *g, PyObject *args, PyObject *kwds)
{
    PyObject *entries, *core, *slow, *sampled;
    long long sample;
    if (!PyArg_ParseTuple(args, "OO!OOL", &entries, &CoreType_ref, &core, &slow, &sampled, &sample))
        return -1;
    if (!PyDict_Check(entries) || !PyCallable_Check(slow) || !PyCallable_Check(sampled)) {
        PyErr_SetString(PyExc_TypeError, "Getter(entries: dict, core, slow, sampled, sample)");
        return -1;
    }
    Py_INCREF(entries);
    Py_XSETREF(g->entries, entries);
    Py_INCREF(core);
    Py_XSETREF(g->core, (Core *)core);
    Py_INCREF(slow);
    Py_XSETREF(g->slow, slow);
    Py_INCREF(sampled);
    Py_XSETREF(g->sampled, sampled);
    g->sample = sample;
    g->hits = 0;
    g->vectorcall = (vectorcallfunc)Getter_vectorcall;
    return 0;
}

static int
Getter_traverse(Getter *g, visitproc visit, void *arg)
{
    Py_VISIT(g->entries);
    Py_VISIT(g->core);
    Py_VISIT(g->slow);
    Py_VISIT(g->sampled);
    return 0;
}

static int
Getter_clear(Getter *g)
{
    Py_CLEAR(g->entries);
    Py_CLEAR(g->core);
    Py_CLEAR(g->slow);
    Py_CLEAR(g->sampled);
    return 0;
}

static void
Getter_dealloc(Getter *g)
{
    PyObject_GC_UnTrack(g);
    Getter_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* close(): no more hits (every call goes to slow, which says the client is closed) */
static PyObject *
Getter_close(Getter *g, PyObject *Py_UNUSED(ignored))
{
    Getter_clear(g);
    Py_RETURN_NONE;
}

static PyObject *
Getter_call(Getter *g, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call((PyObject *)g, args, kwargs);
}

static PyMemberDef Getter_members[] = {
    {"sample", T_LONGLONG, offsetof(Getter, sample), 0, "hits until the next sampled one"},
    {"hits", T_ULONGLONG, offsetof(Getter, hits), 0, "L1 hits served"},
    {NULL},
};

static PyMethodDef Getter_methods[] = {
    {"close", (PyCFunction)Getter_close, METH_NOARGS, "serve no more hits"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GetterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._l2core.Getter",
    .tp_basicsize = sizeof(Getter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Getter_init,
    .tp_dealloc = (destructor)Getter_dealloc,
    .tp_traverse = (traverseproc)Getter_traverse,
    .tp_clear = (inquiry)Getter_clear,
    .tp_call = (ternaryfunc)Getter_call,
    .tp_vectorcall_offset = offsetof(Getter, vectorcall),
    .tp_members = Getter_members,
    .tp_methods = Getter_methods,
    .tp_doc = "kv.get's hit path: Getter(entries, core, slow, sampled, sample)(key, default=None)",
};
