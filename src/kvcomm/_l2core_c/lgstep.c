/* ------------------------------------------------------------------ a LangGraph step
 *
 * What KVCOMM's LangGraph saver (integrations/langgraph/) does in Python at every step of
 * a graph, the same done in C: a graph step's saver cost is what a step costs beyond
 * InMemorySaver's, and in Python it was mostly the interpreter's. Each function is the
 * Python it stands for, named in its comment, with the same results and the same errors;
 * where an input is not of the plain shape a running graph passes (a subclass, another
 * mapping, a malformed write), it hands the whole call to that Python (a fallback passed
 * in, or None returned) rather than judging it in C. Tests hold each equal to the Python.
 *
 * NoPickle: the base of _serde.NoPickleSerializer; its dumps_typed.
 * step_metadata(excluded, fallback, config, metadata): saver._metadata.
 * checkpoint_record(dumps, checkpoint, metadata, parent, values): put's record.
 * task_records(dumps, writes, task_id, task_path, idx_map): put_writes' records.
 * step_keys(...), write_keys(...): _keys.Keys.step and .step_writes (plain_component:
 * their check of an id, which _keys._esc_id also asks).
 *
 * Where one of them calls Python code (a serializer, a fallback) or allocates (which may
 * collect, and run a finalizer), it holds its own reference to what it still uses.
 */

static PyObject *InnerName, *DumpsTypedName, *JudgeName, *NulStr, *EmptyStr, *DunderStr,
    *RunIdName, *MapsName, *MetadataName, *ConfigurableName, *Zero;

/* the interned names and constants used here (at the module's init) */
static int
lgstep_names(void)
{
    InnerName = PyUnicode_InternFromString("inner");
    DumpsTypedName = PyUnicode_InternFromString("dumps_typed");
    JudgeName = PyUnicode_InternFromString("_judge");
    NulStr = PyUnicode_FromStringAndSize("\0", 1);
    EmptyStr = PyUnicode_FromStringAndSize("", 0);
    DunderStr = PyUnicode_InternFromString("__");
    RunIdName = PyUnicode_InternFromString("run_id");
    MapsName = PyUnicode_InternFromString("maps");
    MetadataName = PyUnicode_InternFromString("metadata");
    ConfigurableName = PyUnicode_InternFromString("configurable");
    Zero = PyLong_FromLong(0);
    return (InnerName && DumpsTypedName && JudgeName && NulStr && EmptyStr && DunderStr &&
            RunIdName && MapsName && MetadataName && ConfigurableName && Zero) ? 0 : -1;
}

/* ---------------------------------------------------------------- NoPickle.dumps_typed
 *
 * ``self.inner.dumps_typed(obj)`` (the inner serializer looked up at each call: one
 * swapped in is the one used), returned as is when it is exactly a (str, bytes) tuple
 * whose type is neither "pickle" nor "pickle5" (_serde._PICKLE_TYPES); anything else it
 * returns or raises goes to ``self._judge(obj, out, exc)`` (Python), which says what is
 * wrong or converts it. */

static int
refused_type(PyObject *t)
{
    return PyUnicode_CompareWithASCIIString(t, "pickle") == 0 ||
           PyUnicode_CompareWithASCIIString(t, "pickle5") == 0;
}

static PyObject *
nopickle_dumps_typed(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"obj"}; /* (dumps_typed(obj=...) too, as in Python) */
    PyObject *obj;
    if (nargs == 1 && !kwnames)
        obj = args[0];
    else if (batch_args("dumps_typed", names, 1, args, nargs, kwnames, &obj) < 0)
        return NULL;
    PyObject *inner = PyObject_GetAttr(self, InnerName), *out = NULL;
    if (inner) {
        PyObject *call[2] = {inner, obj};
        out = PyObject_VectorcallMethod(DumpsTypedName, call, 2, NULL);
        Py_DECREF(inner);
    }
    if (out && PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) == 2 &&
        PyUnicode_CheckExact(PyTuple_GET_ITEM(out, 0)) &&
        PyBytes_CheckExact(PyTuple_GET_ITEM(out, 1)) && !refused_type(PyTuple_GET_ITEM(out, 0)))
        return out;
    PyObject *exc = NULL;
    if (!out) {
        PyObject *type, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (tb && exc)
            PyException_SetTraceback(exc, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        if (!exc)
            return NULL;
    }
    PyObject *judged = PyObject_CallMethodObjArgs(self, JudgeName, obj, out ? out : Py_None,
                                                  exc ? exc : Py_None, NULL);
    Py_XDECREF(out);
    Py_XDECREF(exc);
    return judged;
}

static PyMethodDef NoPickleMethods[] = {
    {"dumps_typed", (PyCFunction)(void (*)(void))nopickle_dumps_typed,
     METH_FASTCALL | METH_KEYWORDS,
     "dumps_typed($self, obj)\n--\n\n(str, bytes): self.inner's answer, judged (see "
     "_serde.NoPickleSerializer)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NoPickleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcomm._l2core.NoPickle",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The C half of a LangGraph serializer that refuses pickles: its dumps_typed.",
    .tp_methods = NoPickleMethods,
    .tp_new = PyType_GenericNew,
};

/* ``fallback(*args)``, the Python a function stands for, given the call's arguments;
 * NULL when an error is set already */
static PyObject *
call_fallback(PyObject *fallback, PyObject *const *args, Py_ssize_t n)
{
    if (PyErr_Occurred())
        return NULL;
    return PyObject_Vectorcall(fallback, args, n, NULL);
}

/* ---------------------------------------------------------------- step_metadata
 *
 * Runs no Python code between its checks and its answer: every key it compares or
 * stores is an exact str, every value it judges is of a type whose ``isinstance`` answer
 * nothing can fake; any other key or value sends the whole call to LangGraph's function,
 * which then judges (and raises) as it does. So nothing it iterates can change under it. */

/* ``v.replace("\0", "")`` of an exact str, a new reference (``v`` itself when it holds
 * no NUL) */
static PyObject *
without_nul(PyObject *v)
{
    Py_ssize_t at = PyUnicode_FindChar(v, 0, 0, PyUnicode_GET_LENGTH(v), 1);
    if (at == -2)
        return NULL;
    if (at == -1)
        return Py_NewRef(v);
    return PyUnicode_Replace(v, NulStr, EmptyStr, -1);
}

/* what ``isinstance(v, str)`` and ``isinstance(v, (int, bool, float))`` answer for ``v``:
 * 's' (an exact str), 'n' (an exact int or float, a bool), 'o' (neither: None, or an exact
 * dict, list or tuple, whose class nothing can fake), 0 (another type: a subclass, or an
 * object whose ``__class__`` may claim anything) */
static char
kind_of(PyObject *v)
{
    if (PyUnicode_CheckExact(v))
        return 's';
    if (PyLong_CheckExact(v) || PyBool_Check(v) || PyFloat_CheckExact(v))
        return 'n';
    if (v == Py_None || PyDict_CheckExact(v) || PyList_CheckExact(v) || PyTuple_CheckExact(v))
        return 'o';
    return 0;
}

/* whether every key of the exact dict ``d`` is an exact str */
static int
str_keys(PyObject *d)
{
    Py_ssize_t pos = 0;
    PyObject *key, *v;
    while (PyDict_Next(d, &pos, &key, &v))
        if (!PyUnicode_CheckExact(key))
            return 0;
    return 1;
}

/* 1: ``d``'s items added to ``md`` as get_checkpoint_metadata adds a config part's (a key
 * already there, excluded or starting with "__" skipped; a str without its NULs, an int,
 * bool or float as is; anything else left out); 0: a key or value it does not judge (the
 * caller falls back); -1: an error */
static int
add_part(PyObject *md, PyObject *d, PyObject *excluded)
{
    Py_ssize_t pos = 0; /* (``d``: config_part's, its keys exact str already) */
    PyObject *key, *v;
    while (PyDict_Next(d, &pos, &key, &v)) {
        int r = PyDict_Contains(md, key);
        if (r < 0)
            return -1;
        if (r)
            continue;
        r = PySet_Contains(excluded, key);
        if (r < 0)
            return -1;
        if (r || PyUnicode_Tailmatch(key, DunderStr, 0, 2, -1) == 1)
            continue;
        char kind = kind_of(v);
        if (!kind)
            return 0;
        if (kind == 'o')
            continue;
        PyObject *kept = kind == 's' ? without_nul(v) : Py_NewRef(v);
        r = !kept || PyDict_SetItem(md, key, kept) < 0;
        Py_XDECREF(kept);
        if (r)
            return -1;
    }
    return 1;
}

/* ``part`` of a config as a dict whose items iterate as ``part.items()`` would (a
 * ChainMap of exact dicts merged: the first map's value wins, keys in ChainMap's order), a
 * new reference; Py_None for None; NULL without an error set for another shape (or keys
 * not all exact str) */
static PyObject *ChainMapType; /* collections.ChainMap (module init) */

static PyObject *
config_part(PyObject *part)
{
    if (part == Py_None)
        return Py_NewRef(part);
    if (PyDict_CheckExact(part))
        return str_keys(part) ? Py_NewRef(part) : NULL;
    if ((PyObject *)Py_TYPE(part) != ChainMapType)
        return NULL;
    PyObject *maps = PyObject_GetAttr(part, MapsName);
    if (!maps || !PyList_CheckExact(maps)) {
        if (!maps)
            clear_exception(); /* (an Exception: the fallback's; anything else raised) */
        Py_XDECREF(maps);
        return NULL;
    }
    PyObject *merged = PyDict_New();
    for (Py_ssize_t i = PyList_GET_SIZE(maps) - 1; merged && i >= 0; i--) {
        PyObject *m = PyList_GET_ITEM(maps, i); /* (no code runs: maps stays as it is) */
        if (!PyDict_CheckExact(m) || !str_keys(m) || PyDict_Update(merged, m) < 0)
            Py_CLEAR(merged);
    }
    Py_DECREF(maps);
    if (!merged && PyErr_Occurred()) /* (only a dict's allocation may fail: the fallback */
        clear_exception(); /* raises as it does; anything but an Exception is raised) */
    return merged;
}

/* step_metadata(excluded, fallback, config, metadata) -> dict: LangGraph's
 * get_checkpoint_metadata(config, metadata) (saver._metadata: the same dict, keys in the
 * same order), or ``fallback(config, metadata)``'s answer for a config or metadata of
 * another shape than a running graph's (metadata a dict; config an exact dict whose
 * "metadata" is None, a dict or a ChainMap of dicts and whose "configurable" is None or a
 * dict; their keys exact str, their values of the types kind_of judges). */
static PyObject *
step_metadata(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "step_metadata(excluded, fallback, config, metadata)");
        return NULL;
    }
    PyObject *excluded = args[0], *fallback = args[1], *config = args[2], *metadata = args[3];
    if (!PyAnySet_Check(excluded)) {
        PyErr_SetString(PyExc_TypeError, "step_metadata: excluded is a set");
        return NULL;
    }
    PyObject *parts[2] = {NULL, NULL}, *md = NULL;
    int ok = PyDict_CheckExact(config) && PyDict_CheckExact(metadata) &&
             str_keys(config); /* (0: the fallback) */
    if (!ok || !(md = PyDict_New()))
        goto done;
    Py_ssize_t pos = 0;
    PyObject *key, *v;
    while (PyDict_Next(metadata, &pos, &key, &v)) { /* (as LangGraph: metadata first) */
        char kind = PyUnicode_CheckExact(key) ? kind_of(v) : 0; /* (before it is hashed) */
        if (!kind) {
            ok = 0;
            goto done;
        }
        PyObject *clean = kind == 's' ? without_nul(v) : Py_NewRef(v);
        int r = !clean || PyDict_SetItem(md, key, clean) < 0;
        Py_XDECREF(clean);
        if (r)
            goto done;
    }
    PyObject *names[2] = {MetadataName, ConfigurableName};
    for (int i = 0; i < 2; i++) {
        PyObject *part = PyDict_GetItemWithError(config, names[i]); /* (borrowed) */
        if (!part && PyErr_Occurred())
            goto done;
        parts[i] = config_part(part ? part : Py_None);
        if (!parts[i]) {
            ok = 0;
            goto done;
        }
    }
    for (int i = 0; i < 2; i++) {
        if (parts[i] == Py_None || PyDict_GET_SIZE(parts[i]) == 0)
            continue;
        int r = add_part(md, parts[i], excluded);
        if (r <= 0) {
            ok = r == 0 ? 0 : ok;
            goto done;
        }
    }
done:
    Py_XDECREF(parts[0]);
    Py_XDECREF(parts[1]);
    if (ok && md && !PyErr_Occurred())
        return md;
    Py_XDECREF(md); /* (an error: call_fallback returns it) */
    return call_fallback(fallback, args + 2, 2);
}

/* ---------------------------------------------------------------- records */

/* ``record += dumps(obj)`` (``*dumps(obj)``: its items, whatever iterable it gives);
 * -1 on an error */
static int
extend_dumped(PyObject *record, PyObject *dumps, PyObject *obj)
{
    PyObject *out = PyObject_CallOneArg(dumps, obj);
    PyObject *items =
        out ? PySequence_Fast(out, "a serializer's dumps_typed returns (str, bytes)") : NULL;
    int r = items ? 0 : -1;
    for (Py_ssize_t i = 0; items && !r && i < PySequence_Fast_GET_SIZE(items); i++)
        r = PyList_Append(record, PySequence_Fast_GET_ITEM(items, i));
    Py_XDECREF(items);
    Py_XDECREF(out);
    return r;
}

/* whether a channel value is small, kept in the record of every checkpoint that has it
 * (see put): None, a bool, an int or float, a str of at most 256 characters; exact types */
static int
inline_value(PyObject *v)
{
    return v == Py_None || kind_of(v) == 'n' ||
           (PyUnicode_CheckExact(v) && PyUnicode_GET_LENGTH(v) <= 256);
}

/* checkpoint_record(dumps, checkpoint, metadata, parent, values) -> (record, inline): put's
 * checkpoint record, ``[*dumps(checkpoint), *dumps(metadata), parent, metadata.get("run_id")]``
 * then ``(channel, *dumps(value))`` for each small value (inline_value), and the set of
 * those channels; the Python it stands for is _checkpoint_record in
 * tests/integrations/test_langgraph_step.py, which holds the two equal (``metadata`` and
 * ``values`` exact dicts, as put makes them) */
static PyObject *
checkpoint_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyDict_CheckExact(args[2]) || !PyDict_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "checkpoint_record(dumps, checkpoint, metadata: dict, parent, "
                        "values: dict)");
        return NULL;
    }
    PyObject *dumps = args[0], *values = args[4];
    PyObject *record = PyList_New(0), *inline_set = PySet_New(NULL);
    if (!record || !inline_set || extend_dumped(record, dumps, args[1]) < 0 ||
        extend_dumped(record, dumps, args[2]) < 0 || PyList_Append(record, args[3]) < 0)
        goto fail;
    PyObject *run = PyDict_GetItemWithError(args[2], RunIdName);
    if ((!run && PyErr_Occurred()) || PyList_Append(record, run ? run : Py_None) < 0)
        goto fail;
    /* (as Python's loop over values.items(): a serializer that changes them meets the
     * RuntimeError it would meet there) */
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(values), left = size;
    PyObject *channel, *value;
    for (;;) {
        if (PyDict_GET_SIZE(values) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto fail;
        }
        if (!PyDict_Next(values, &pos, &channel, &value))
            break;
        if (left-- == 0) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary keys changed during iteration");
            goto fail;
        }
        if (!inline_value(value))
            continue;
        Py_INCREF(channel); /* (dumps runs Python code: the dict may change under it) */
        Py_INCREF(value);
        int r = PyList_Append(record, channel) < 0 || extend_dumped(record, dumps, value) < 0 ||
                PySet_Add(inline_set, channel) < 0;
        Py_DECREF(channel);
        Py_DECREF(value);
        if (r)
            goto fail;
    }
    PyObject *out = PyTuple_Pack(2, record, inline_set);
    Py_DECREF(record);
    Py_DECREF(inline_set);
    return out;
fail:
    Py_XDECREF(record);
    Py_XDECREF(inline_set);
    return NULL;
}

static PyObject *DequeType; /* collections.deque (module init) */

/* whether ``writes`` is a list, a tuple or a deque (exact types: LangGraph passes a
 * deque), whose iteration runs no Python code and consumes nothing (not a generator) */
static int
plain_sequence(PyObject *writes)
{
    return PyList_CheckExact(writes) || PyTuple_CheckExact(writes) ||
           (PyObject *)Py_TYPE(writes) == DequeType;
}

/* whether ``w`` is a plain write: an exact tuple or list of two, the first an exact str */
static int
plain_write(PyObject *w)
{
    return ((PyTuple_CheckExact(w) && PyTuple_GET_SIZE(w) == 2) ||
            (PyList_CheckExact(w) && PyList_GET_SIZE(w) == 2)) &&
           PyUnicode_CheckExact(PySequence_Fast_GET_ITEM(w, 0));
}

/* 1: every write of ``writes`` (plain_sequence) is plain; 0: not; -1: an error */
static int
plain_writes(PyObject *writes)
{
    PyObject *it = PyObject_GetIter(writes), *w;
    if (!it)
        return -1;
    int ok = 1;
    while (ok && (w = PyIter_Next(it))) {
        ok = plain_write(w);
        Py_DECREF(w);
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : ok;
}

/* task_records(dumps, writes, task_id, task_path, idx_map) -> (records, indices, regular)
 * | None: put_writes' records of a task's writes (``[task_id, channel, *dumps(value),
 * task_path]`` each), their indices as keyed (``idx_map.get(channel, idx)``) and the places
 * of the regular ones (index >= 0); the Python it stands for is _task_records in
 * tests/integrations/test_langgraph_step.py, which holds the two equal. For a list, tuple or deque of plain writes, all judged before the first is serialized
 * (what LangGraph passes); None for anything else, or a write a serializer made not plain
 * meanwhile (put_writes then checks them in Python, and says what is wrong). The writes
 * are iterated as that loop iterates them: a serializer adding one to a list adds it, one
 * changing a deque raises RuntimeError. */
static PyObject *
task_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyDict_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "task_records(dumps, writes, task_id, task_path, idx_map: dict)");
        return NULL;
    }
    PyObject *dumps = args[0], *writes = args[1], *task_id = args[2], *task_path = args[3];
    PyObject *idx_map = args[4];
    if (!plain_sequence(writes))
        Py_RETURN_NONE;
    int plain = plain_writes(writes);
    if (plain <= 0)
        return plain < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *records = PyList_New(0), *indices = PyList_New(0), *regular = PyList_New(0);
    PyObject *it = PyObject_GetIter(writes), *out = NULL, *w;
    if (!records || !indices || !regular || !it)
        goto done;
    for (Py_ssize_t idx = 0; (w = PyIter_Next(it)); idx++) {
        if (!plain_write(w)) { /* (made so by a serializer: Python checks them all) */
            Py_DECREF(w);
            out = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *channel = Py_NewRef(PySequence_Fast_GET_ITEM(w, 0));
        PyObject *value = Py_NewRef(PySequence_Fast_GET_ITEM(w, 1));
        Py_DECREF(w);
        PyObject *i = PyDict_GetItemWithError(idx_map, channel), *rec = NULL;
        Py_XINCREF(i);
        if (!i && !PyErr_Occurred())
            i = PyLong_FromSsize_t(idx);
        int bad = !i;
        if (!bad) {
            int ge = PyObject_RichCompareBool(i, Zero, Py_GE);
            PyObject *at = ge > 0 ? PyLong_FromSsize_t(idx) : NULL;
            bad = ge < 0 || (ge > 0 && (!at || PyList_Append(regular, at) < 0)) ||
                  PyList_Append(indices, i) < 0;
            Py_XDECREF(at);
        }
        if (!bad) {
            rec = PyList_New(0);
            bad = !rec || PyList_Append(rec, task_id) < 0 || PyList_Append(rec, channel) < 0 ||
                  extend_dumped(rec, dumps, value) < 0 || PyList_Append(rec, task_path) < 0 ||
                  PyList_Append(records, rec) < 0;
        }
        Py_DECREF(channel);
        Py_DECREF(value);
        Py_XDECREF(i);
        Py_XDECREF(rec);
        if (bad)
            goto done;
    }
    if (!PyErr_Occurred())
        out = PyTuple_Pack(3, records, indices, regular);
done:
    Py_XDECREF(it);
    Py_XDECREF(records);
    Py_XDECREF(indices);
    Py_XDECREF(regular);
    return out;
}

/* ---------------------------------------------------------------- keys
 *
 * _keys.Keys.step and .step_writes for ids a run has used before: the thread's part of
 * its keys is in the Keys' memo (``(thread_id, ns) -> (T/N/, head key, checkpoints'
 * prefix, writes' prefix, blobs' prefix)``), and the checkpoint and task ids, LangGraph's
 * uuids, need no escaping. Anything else (ids not memoised or not exact str, an id to
 * escape, a key over max_key_bytes, an index not an exact int) goes to ``fallback``,
 * the Python method, with the same arguments: it escapes, fills the memo, or raises. */

/* the memo's entry of (thread_id, ns), a new reference (an allocation may collect, and a
 * finalizer clear the memo), NULL when there is none or on an error */
static PyObject *
memo_of(PyObject *memo, PyObject *thread_id, PyObject *ns)
{
    if (!PyDict_CheckExact(memo) || !PyUnicode_CheckExact(thread_id) || !PyUnicode_CheckExact(ns))
        return NULL;
    PyObject *pair = PyTuple_Pack(2, thread_id, ns);
    if (!pair)
        return NULL;
    PyObject *of = PyDict_GetItemWithError(memo, pair);
    Py_DECREF(pair);
    if (!of || !PyTuple_CheckExact(of) || PyTuple_GET_SIZE(of) != 5)
        return NULL;
    for (int i = 0; i < 5; i++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(of, i)))
            return NULL;
    return Py_NewRef(of);
}

/* whether the str ``s`` holds none of ``%``, ``/``, ``=``, a C0 control character or DEL,
 * the characters a LangGraph id is percent-escaped for in a key (_keys.py): such an id is
 * its own key component. One pass over the characters. */
static int
plain_chars(PyObject *s)
{
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 ch = PyUnicode_READ(kind, data, i);
        if (ch < 0x20 || ch == 0x7f || ch == '%' || ch == '/' || ch == '=')
            return 0;
    }
    return 1;
}

/* whether an id is an exact str that is its own key component (step_keys, write_keys) */
static int
plain_id(PyObject *s)
{
    return PyUnicode_CheckExact(s) && plain_chars(s);
}

/* plain_component(s) -> bool: plain_id, for _keys._esc_id; not an exact str: False (the
 * caller's escape says what is wrong) */
static PyObject *
plain_component(PyObject *self, PyObject *s)
{
    (void)self;
    return PyBool_FromLong(plain_id(s));
}

/* the UTF-8 length of a str, -1 for a lone surrogate (error cleared) */
static Py_ssize_t
utf8_len(PyObject *s)
{
    if (PyUnicode_IS_ASCII(s))
        return PyUnicode_GET_LENGTH(s);
    Py_ssize_t n;
    if (!PyUnicode_AsUTF8AndSize(s, &n)) {
        PyErr_Clear();
        return -1;
    }
    return n;
}

/* step_keys(memo, max, fallback, thread_id, ns, checkpoint_id) -> (checkpoint key,
 * blobs' prefix of the thread, head key): Keys.step */
static PyObject *
step_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "step_keys(memo, max, fallback, thread_id, ns, checkpoint_id)");
        return NULL;
    }
    Py_ssize_t max = PyLong_AsSsize_t(args[1]);
    if (max == -1 && PyErr_Occurred())
        return NULL;
    PyObject *of = memo_of(args[0], args[3], args[4]);
    if (!of || !plain_id(args[5])) {
        Py_XDECREF(of);
        return call_fallback(args[2], args + 3, 3);
    }
    PyObject *ckey = PyUnicode_Concat(PyTuple_GET_ITEM(of, 2), args[5]), *out = NULL;
    Py_ssize_t n = ckey ? utf8_len(ckey) : 0;
    if (ckey && (n < 0 || n > max))
        out = call_fallback(args[2], args + 3, 3);
    else if (ckey)
        out = PyTuple_Pack(3, ckey, PyTuple_GET_ITEM(of, 4), PyTuple_GET_ITEM(of, 1));
    Py_XDECREF(ckey);
    Py_DECREF(of);
    return out;
}

/* write_keys(memo, max, fallback, thread_id, ns, checkpoint_id, task_id, indices) -> the
 * keys of a task's writes ``indices`` (a list of ints): Keys.step_writes */
static PyObject *
write_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "write_keys(memo, max, fallback, thread_id, ns, "
                                         "checkpoint_id, task_id, indices)");
        return NULL;
    }
    Py_ssize_t max = PyLong_AsSsize_t(args[1]);
    if (max == -1 && PyErr_Occurred())
        return NULL;
    PyObject *of = memo_of(args[0], args[3], args[4]), *indices = args[7];
    int plain = of && plain_id(args[5]) && plain_id(args[6]) && PyList_CheckExact(indices);
    Py_ssize_t n = plain ? PyList_GET_SIZE(indices) : 0;
    /* (its own copy of the indices, allocated first: an allocation may collect, and a
     * finalizer change the list; then judged and filled with nothing allocated between) */
    PyObject *own = plain ? PyTuple_New(n) : NULL;
    if (plain && !own) {
        Py_DECREF(of);
        return NULL;
    }
    plain = plain && PyList_GET_SIZE(indices) == n;
    for (Py_ssize_t j = 0; plain && j < n; j++) {
        PyObject *i = PyList_GET_ITEM(indices, j);
        plain = PyLong_CheckExact(i);
        if (plain)
            PyTuple_SET_ITEM(own, j, Py_NewRef(i));
    }
    PyObject *prefix = plain ? PyUnicode_FromFormat("%U%U/%U/", PyTuple_GET_ITEM(of, 3),
                                                    args[5], args[6]) : NULL;
    Py_XDECREF(of);
    if (!plain) {
        Py_XDECREF(own);
        return call_fallback(args[2], args + 3, 5);
    }
    indices = own;
    PyObject *keys = prefix ? PyList_New(n) : NULL;
    if (!keys) {
        Py_XDECREF(prefix);
        Py_DECREF(indices);
        return NULL;
    }
    Py_ssize_t longest = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *idx = PyObject_Str(PyTuple_GET_ITEM(indices, j));
        PyObject *key = idx ? PyUnicode_Concat(prefix, idx) : NULL;
        Py_XDECREF(idx);
        if (!key) {
            Py_DECREF(prefix);
            Py_DECREF(indices);
            Py_DECREF(keys);
            return NULL;
        }
        if (PyUnicode_GET_LENGTH(key) > longest)
            longest = PyUnicode_GET_LENGTH(key);
        PyList_SET_ITEM(keys, j, key);
    }
    /* (the longest key's UTF-8 bytes: the prefix's, then ASCII digits) */
    Py_ssize_t bytes = utf8_len(prefix);
    int over = bytes < 0 || (n && bytes - PyUnicode_GET_LENGTH(prefix) + longest > max);
    Py_DECREF(prefix);
    Py_DECREF(indices);
    if (over) {
        Py_DECREF(keys);
        return call_fallback(args[2], args + 3, 5);
    }
    return keys;
}
