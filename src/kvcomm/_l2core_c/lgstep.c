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
 * step_metadata(excluded, chainmap, fallback, config, metadata): saver._metadata.
 * checkpoint_record(dumps, checkpoint, metadata, parent, values): put's record.
 * task_records(dumps, writes, task_id, task_path, idx_map): put_writes' records.
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
nopickle_dumps_typed(PyObject *self, PyObject *obj)
{
    PyObject *inner = PyObject_GetAttr(self, InnerName);
    if (!inner)
        return NULL;
    PyObject *args[2] = {inner, obj};
    PyObject *out = PyObject_VectorcallMethod(DumpsTypedName, args, 2, NULL);
    Py_DECREF(inner);
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
    {"dumps_typed", nopickle_dumps_typed, METH_O,
     "dumps_typed(obj) -> (str, bytes): self.inner's, judged (see _serde.NoPickleSerializer)"},
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

/* ---------------------------------------------------------------- step_metadata */

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

/* 1: ``d``'s items added to ``md`` as get_checkpoint_metadata adds a config part's (a key
 * already there, excluded or starting with "__" skipped; a str without its NULs, an int,
 * bool or float as is; anything else left out); 0: a key or value whose handling could
 * run Python code (not an exact str key, a str subclass value): the caller falls back;
 * -1: an error */
static int
add_part(PyObject *md, PyObject *d, PyObject *excluded)
{
    Py_ssize_t pos = 0;
    PyObject *key, *v;
    while (PyDict_Next(d, &pos, &key, &v)) {
        if (!PyUnicode_CheckExact(key))
            return 0;
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
        if (PyUnicode_Check(v)) {
            if (!PyUnicode_CheckExact(v))
                return 0;
            PyObject *clean = without_nul(v);
            if (!clean || PyDict_SetItem(md, key, clean) < 0) {
                Py_XDECREF(clean);
                return -1;
            }
            Py_DECREF(clean);
        } else if (PyLong_Check(v) || PyFloat_Check(v)) {
            if (PyDict_SetItem(md, key, v) < 0)
                return -1;
        }
    }
    return 1;
}

/* ``part`` of a config as a dict whose items iterate as ``part.items()`` would (a
 * ChainMap of exact dicts merged: the first map's value wins, keys in ChainMap's order), a
 * new reference; Py_None for None; NULL without an error set for another shape */
static PyObject *
config_part(PyObject *part, PyObject *chainmap)
{
    if (part == Py_None || PyDict_CheckExact(part))
        return Py_NewRef(part);
    if ((PyObject *)Py_TYPE(part) != chainmap)
        return NULL;
    PyObject *maps = PyObject_GetAttr(part, MapsName);
    if (!maps) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *merged = NULL;
    if (PyList_CheckExact(maps)) {
        merged = PyDict_New();
        for (Py_ssize_t i = PyList_GET_SIZE(maps) - 1; merged && i >= 0; i--) {
            PyObject *m = PyList_GET_ITEM(maps, i);
            if (!PyDict_CheckExact(m) || PyDict_Update(merged, m) < 0)
                Py_CLEAR(merged);
        }
    }
    Py_DECREF(maps);
    if (!merged)
        PyErr_Clear(); /* (only a dict's update may fail: the fallback raises as it does) */
    return merged;
}

/* step_metadata(excluded, chainmap, fallback, config, metadata) -> dict: LangGraph's
 * get_checkpoint_metadata(config, metadata) (saver._metadata: the same dict, keys in the
 * same order), or ``fallback(config, metadata)``'s answer for a config or metadata of
 * another shape than a running graph's (config an exact dict whose "metadata" is None, a
 * dict or a ChainMap of dicts and whose "configurable" is None or a dict; metadata a dict;
 * str keys and values of exact types). */
static PyObject *
step_metadata(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "step_metadata(excluded, chainmap, fallback, config, metadata)");
        return NULL;
    }
    PyObject *excluded = args[0], *chainmap = args[1], *fallback = args[2];
    PyObject *config = args[3], *metadata = args[4];
    if (!PyAnySet_Check(excluded)) {
        PyErr_SetString(PyExc_TypeError, "step_metadata: excluded is a set");
        return NULL;
    }
    PyObject *parts[2] = {NULL, NULL}, *md = NULL;
    int ok = PyDict_CheckExact(config) && PyDict_CheckExact(metadata); /* (0: fallback) */
    PyObject *names[2] = {MetadataName, ConfigurableName};
    for (int i = 0; ok && i < 2; i++) {
        PyObject *part = PyDict_GetItemWithError(config, names[i]); /* (borrowed) */
        if (!part && PyErr_Occurred())
            goto done;
        parts[i] = config_part(part ? part : Py_None, chainmap);
        ok = parts[i] != NULL;
    }
    if (!ok || !(md = PyDict_New()))
        goto done;
    Py_ssize_t pos = 0;
    PyObject *key, *v;
    while (PyDict_Next(metadata, &pos, &key, &v)) {
        if (PyUnicode_Check(v) && !PyUnicode_CheckExact(v)) {
            ok = 0;
            goto done;
        }
        PyObject *clean = PyUnicode_CheckExact(v) ? without_nul(v) : Py_NewRef(v);
        int r = !clean || PyDict_SetItem(md, key, clean) < 0;
        Py_XDECREF(clean);
        if (r)
            goto done;
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
    if (PyErr_Occurred()) {
        Py_XDECREF(md);
        return NULL;
    }
    if (ok)
        return md;
    Py_XDECREF(md);
    PyObject *fargs[2] = {config, metadata};
    return PyObject_Vectorcall(fallback, fargs, 2, NULL);
}

/* ---------------------------------------------------------------- records */

/* ``record += dumps(obj)`` (``*dumps(obj)``: its items, whatever sequence it gives);
 * -1 on an error */
static int
extend_dumped(PyObject *record, PyObject *dumps, PyObject *obj)
{
    PyObject *out = PyObject_CallOneArg(dumps, obj);
    if (!out)
        return -1;
    int r;
    if (PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) == 2)
        r = PyList_Append(record, PyTuple_GET_ITEM(out, 0)) < 0 ||
                    PyList_Append(record, PyTuple_GET_ITEM(out, 1)) < 0 ? -1 : 0;
    else {
        PyObject *ext = PyObject_CallMethod(record, "extend", "O", out);
        r = ext ? 0 : -1;
        Py_XDECREF(ext);
    }
    Py_DECREF(out);
    return r;
}

/* saver._inline(value): a value kept in the record of its checkpoint (an int, float,
 * bool, None, or a str of at most 256 characters; exact types) */
static int
inline_value(PyObject *v)
{
    return v == Py_None || PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyBool_Check(v) ||
           (PyUnicode_CheckExact(v) && PyUnicode_GET_LENGTH(v) <= 256);
}

/* checkpoint_record(dumps, checkpoint, metadata, parent, values) -> (record, inline): put's

       record = [*dumps(checkpoint), *dumps(metadata), parent, metadata.get("run_id")]
       inline = set()
       for channel, value in values.items():
           if _inline(value):
               record += (channel, *dumps(value))
               inline.add(channel)

 * (``metadata`` and ``values`` exact dicts, as put makes them) */
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
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(values);
    PyObject *channel, *value;
    while (PyDict_Next(values, &pos, &channel, &value)) {
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
        if (PyDict_GET_SIZE(values) != size) { /* (as Python's loop over its items) */
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto fail;
        }
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

/* whether ``writes`` is a list, a tuple or a deque (exact types: LangGraph passes a
 * deque), which task_records may copy first without consuming anything the Python loop
 * would then not see (a generator) */
static int
plain_sequence(PyObject *writes)
{
    return PyList_CheckExact(writes) || PyTuple_CheckExact(writes) ||
           strcmp(Py_TYPE(writes)->tp_name, "collections.deque") == 0;
}

/* whether ``w`` is a plain write: an exact tuple or list of two, the first an exact str */
static int
plain_write(PyObject *w)
{
    return ((PyTuple_CheckExact(w) && PyTuple_GET_SIZE(w) == 2) ||
            (PyList_CheckExact(w) && PyList_GET_SIZE(w) == 2)) &&
           PyUnicode_CheckExact(PySequence_Fast_GET_ITEM(w, 0));
}

/* task_records(dumps, writes, task_id, task_path, idx_map) -> (records, indices, regular)
 * | None: put_writes'

       for idx, (channel, value) in enumerate(writes):
           i = idx_map.get(channel, idx)
           if i >= 0:
               regular.append(len(indices))
           indices.append(i)
           records.append([task_id, channel, *dumps(value), task_path])

 * for a list, tuple or deque of exact tuples or lists of two, a str channel each (what
 * LangGraph passes); None for anything else (put_writes' Python loop then does it all
 * again, and says what is wrong) */
static PyObject *
task_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyDict_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "task_records(dumps, writes, task_id, task_path, idx_map: dict)");
        return NULL;
    }
    PyObject *dumps = args[0], *task_id = args[2], *task_path = args[3], *idx_map = args[4];
    if (!plain_sequence(args[1]))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_List(args[1]); /* (a snapshot) */
    if (!seq)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(seq);
    PyObject *records = NULL, *indices = NULL, *regular = NULL, *out = NULL;
    for (Py_ssize_t idx = 0; idx < n; idx++) { /* (each write judged before any is dumped) */
        if (!plain_write(PyList_GET_ITEM(seq, idx))) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    records = PyList_New(0), indices = PyList_New(0), regular = PyList_New(0);
    if (!records || !indices || !regular)
        goto done;
    for (Py_ssize_t idx = 0; idx < n; idx++) {
        PyObject *w = PyList_GET_ITEM(seq, idx);
        if (!plain_write(w)) { /* (a list changed by a dumps before: the Python loop) */
            Py_CLEAR(records);
            out = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *channel = Py_NewRef(PySequence_Fast_GET_ITEM(w, 0));
        PyObject *value = Py_NewRef(PySequence_Fast_GET_ITEM(w, 1)); /* (a list may change
                                                                         while dumps runs) */
        PyObject *i = PyDict_GetItemWithError(idx_map, channel), *rec = NULL;
        Py_XINCREF(i);
        if (!i && !PyErr_Occurred())
            i = PyLong_FromSsize_t(idx);
        int bad = !i;
        if (!bad) {
            int neg = PyObject_RichCompareBool(i, Zero, Py_LT);
            PyObject *at = neg == 0 ? PyLong_FromSsize_t(idx) : NULL;
            bad = neg < 0 || (neg == 0 && (!at || PyList_Append(regular, at) < 0)) ||
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
    out = PyTuple_Pack(3, records, indices, regular);
done:
    Py_DECREF(seq);
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

/* the memo's entry of (thread_id, ns) (borrowed), NULL when there is none or on an error */
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
    return of;
}

/* whether an id is its own key component (plain_component) and an exact str */
static int
plain_id(PyObject *s)
{
    if (!PyUnicode_CheckExact(s))
        return 0;
    PyObject *r = plain_component(NULL, s);
    int ok = r == Py_True;
    Py_XDECREF(r);
    return ok;
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

static PyObject *
call_fallback(PyObject *fallback, PyObject *const *args, Py_ssize_t n)
{
    if (PyErr_Occurred())
        return NULL;
    return PyObject_Vectorcall(fallback, args, n, NULL);
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
    if (!of || !plain_id(args[5]))
        return call_fallback(args[2], args + 3, 3);
    PyObject *ckey = PyUnicode_Concat(PyTuple_GET_ITEM(of, 2), args[5]);
    if (!ckey)
        return NULL;
    Py_ssize_t n = utf8_len(ckey);
    if (n < 0 || n > max) {
        Py_DECREF(ckey);
        return call_fallback(args[2], args + 3, 3);
    }
    PyObject *out = PyTuple_Pack(3, ckey, PyTuple_GET_ITEM(of, 4), PyTuple_GET_ITEM(of, 1));
    Py_DECREF(ckey);
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
    if (!of || !plain_id(args[5]) || !plain_id(args[6]) || !PyList_CheckExact(indices))
        return call_fallback(args[2], args + 3, 5);
    Py_ssize_t n = PyList_GET_SIZE(indices);
    for (Py_ssize_t j = 0; j < n; j++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(indices, j)))
            return call_fallback(args[2], args + 3, 5);
    PyObject *prefix = PyUnicode_FromFormat("%U%U/%U/", PyTuple_GET_ITEM(of, 3), args[5],
                                            args[6]);
    PyObject *keys = prefix ? PyList_New(n) : NULL;
    if (!keys) {
        Py_XDECREF(prefix);
        return NULL;
    }
    Py_ssize_t longest = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *idx = PyObject_Str(PyList_GET_ITEM(indices, j));
        PyObject *key = idx ? PyUnicode_Concat(prefix, idx) : NULL;
        Py_XDECREF(idx);
        if (!key) {
            Py_DECREF(prefix);
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
    if (over) {
        Py_DECREF(keys);
        return call_fallback(args[2], args + 3, 5);
    }
    return keys;
}
