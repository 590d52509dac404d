/* ------------------------------------------------------------------ batches: collecting ops
 *
 * BatchOps(keys, key_hash, encode, max_value, getter, live[, ext]): the collecting half of
 * ``kv.batch()`` (kvcomm._client.Batch derives from it and applies the ops on exit).
 * put() and delete() are the per-operation cost of a batch, so they are here: a key already
 * validated is found in the client's memo ``keys`` (key -> (bytes, hash)), a bytes value
 * is taken as it is; anything else goes through ``key_hash(key)`` / ``encode(value)``,
 * which validate and raise. The ops are the tuples Core.apply takes; with ``ext`` (bytes)
 * every put op carries it as the record's extension field (the writer's agent id).
 *
 * A batch is used once. Its state: NEW (never initialised: made without kv.batch()), OPEN
 * (collecting), APPLYING (its with-block ended: validators run; an op added then would be
 * a write from a validator), DONE (applied or discarded). put()/delete() add ops only while
 * OPEN and while the client is usable: ``getter`` is the client's kv.get, closed (core
 * NULL) when the client is closed or forked away, and ``live()`` then raises the error
 * that says which.
 */
enum { BATCH_NEW = 0, BATCH_OPEN = 1, BATCH_APPLYING = 2, BATCH_DONE = 3 };

typedef struct {
    PyObject_HEAD
    PyObject *ops, *keys, *values;
    PyObject *memo, *key_hash, *encode;
    PyObject *ext; /* the extension field every put carries (NULL: none) */
    Getter *getter;
    PyObject *live;
    Py_ssize_t max_value;
    Py_ssize_t max_key; /* the client's key bound (bytes); 0: every new key goes to key_hash */
    Py_ssize_t deletes; /* how many of the ops are deletes */
    int state;
} BatchOps;

static PyObject *BytesTag, *EmptyBytes;

static int
BatchOps_init(BatchOps *b, PyObject *args, PyObject *kwds)
{
    PyObject *memo, *key_hash, *encode, *getter, *live, *ext = NULL;
    Py_ssize_t max_value, max_key = 0;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "BatchOps() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!OOnO!O|On", &PyDict_Type, &memo, &key_hash, &encode,
                          &max_value, &GetterType, &getter, &live, &ext, &max_key))
        return -1;
    if (ext == Py_None)
        ext = NULL;
    if (ext && !PyBytes_Check(ext)) {
        PyErr_SetString(PyExc_TypeError, "BatchOps: ext must be bytes or None");
        return -1;
    }
    b->max_key = max_key;
    Py_XINCREF(ext);
    Py_XSETREF(b->ext, ext);
    Py_INCREF(memo);
    Py_XSETREF(b->memo, memo);
    Py_INCREF(key_hash);
    Py_XSETREF(b->key_hash, key_hash);
    Py_INCREF(encode);
    Py_XSETREF(b->encode, encode);
    Py_INCREF(getter);
    Py_XSETREF(b->getter, (Getter *)getter);
    Py_INCREF(live);
    Py_XSETREF(b->live, live);
    Py_XSETREF(b->ops, PyList_New(0));
    Py_XSETREF(b->keys, PyList_New(0));
    Py_XSETREF(b->values, PyList_New(0));
    b->max_value = max_value;
    b->deletes = 0;
    if (!b->ops || !b->keys || !b->values)
        return -1;
    b->state = BATCH_OPEN;
    return 0;
}

static int
BatchOps_traverse(BatchOps *b, visitproc visit, void *arg)
{
    Py_VISIT(b->ops);
    Py_VISIT(b->keys);
    Py_VISIT(b->values);
    Py_VISIT(b->memo);
    Py_VISIT(b->key_hash);
    Py_VISIT(b->encode);
    Py_VISIT(b->ext);
    Py_VISIT(b->getter);
    Py_VISIT(b->live);
    return 0;
}

static int
BatchOps_clear(BatchOps *b)
{
    Py_CLEAR(b->ops);
    Py_CLEAR(b->keys);
    Py_CLEAR(b->values);
    Py_CLEAR(b->memo);
    Py_CLEAR(b->key_hash);
    Py_CLEAR(b->encode);
    Py_CLEAR(b->ext);
    Py_CLEAR(b->getter);
    Py_CLEAR(b->live);
    b->state = BATCH_NEW; /* (cleared by the GC: its fields are gone) */
    return 0;
}

static void
BatchOps_dealloc(BatchOps *b)
{
    PyObject_GC_UnTrack(b);
    BatchOps_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* 0 when an op may be added now; else -1 with the error that says why */
static int
batch_refuse(BatchOps *b)
{
    switch (b->state) {
    case BATCH_NEW:
        PyErr_SetString(InvalidArgument, "this Batch was not initialised (a subclass that skips "
                                         "Batch.__init__?); make batches with kv.batch()");
        return -1;
    case BATCH_APPLYING:
        PyErr_SetString(WriteUnderLock, "kvcomm was called to write from inside a validator "
                                        "(into the batch it vets); validators may read, not write");
        return -1;
    case BATCH_DONE:
        PyErr_SetString(InvalidArgument, "this batch was applied (or discarded) when its "
                                         "with-block ended; start a new one: with kv.batch() as b");
        return -1;
    }
    PyObject *r = PyObject_CallNoArgs(b->live); /* raises SegmentError: closed, or forked */
    if (!r)
        return -1;
    Py_DECREF(r);
    PyErr_SetString(SegmentError, "the client of this batch is closed; open a new one");
    return -1;
}

#define BATCH_USABLE(b) ((b)->state == BATCH_OPEN && (b)->getter->core)

/* (bytes, hash) of a key valid as _client/base.py _key says, computed here and memoised
 * in ``memo`` (NULL: not memoised)
 * as _key_hash does (the memo cleared when it holds KEY_MEMO keys); NULL without an error
 * set for a key that is not (the caller asks key_hash, which raises InvalidKey). */
static PyObject *
key_in_memo(PyObject *memo, Py_ssize_t max_key, PyObject *key)
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(key, &n);
    if (!u) {
        PyErr_Clear(); /* (a lone surrogate: key_hash says so) */
        return NULL;
    }
    if (n == 0 || n > max_key || memchr(u, 0, (size_t)n))
        return NULL;
    PyObject *kb = PyBytes_FromStringAndSize(u, n);
    if (!kb)
        return NULL;
    PyObject *hv = PyObject_CallOneArg(KeyHasher, kb); /* xxh3_64_intdigest, in C */
    unsigned long long h = hv ? PyLong_AsUnsignedLongLong(hv) : 0;
    Py_XDECREF(hv);
    if (!hv || (h == (unsigned long long)-1 && PyErr_Occurred())) {
        Py_DECREF(kb);
        return NULL; /* (an error set: the caller returns it) */
    }
    PyObject *hh = PyLong_FromUnsignedLongLong(h | 1); /* (never 0: segment.key_hash) */
    PyObject *kh = hh ? PyTuple_Pack(2, kb, hh) : NULL;
    Py_DECREF(kb);
    Py_XDECREF(hh);
    if (!kh || !memo)
        return kh;
    if (PyDict_GET_SIZE(memo) >= KEY_MEMO)
        PyDict_Clear(memo);
    if (PyDict_SetItem(memo, key, kh) < 0) {
        Py_DECREF(kh);
        return NULL;
    }
    return kh;
}

/* key_of(memo, key, max_key) -> (bytes, hash) | None: key_in_memo for the client's
 * _key_hash (None: not a str it takes, or the hasher unset: the Python path decides) */
static PyObject *
key_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "key_of(memo: dict, key, max_key: int)");
        return NULL;
    }
    Py_ssize_t max_key = PyLong_AsSsize_t(args[2]);
    if (max_key == -1 && PyErr_Occurred())
        return NULL;
    if (!KeyHasher || !PyUnicode_CheckExact(args[1]))
        Py_RETURN_NONE;
    PyObject *kh = key_in_memo(args[0], max_key, args[1]);
    if (kh || PyErr_Occurred())
        return kh;
    Py_RETURN_NONE;
}

/* (bytes, hash) of a valid key, new reference; memoised if ``remember`` (a key put once,
 * such as a LangGraph record's, is not: it would only push out the keys agents reuse) */
static PyObject *
batch_key(BatchOps *b, PyObject *key, int remember)
{
    if (PyUnicode_CheckExact(key)) {
        PyObject *kh = PyDict_GetItemWithError(b->memo, key);
        if (kh) {
            Py_INCREF(kh);
            return kh;
        }
        if (PyErr_Occurred())
            return NULL;
        if (KeyHasher && b->max_key > 0) {
            kh = key_in_memo(remember ? b->memo : NULL, b->max_key, key);
            if (kh || PyErr_Occurred())
                return kh;
        }
    }
    return PyObject_CallOneArg(b->key_hash, key); /* validates (InvalidKey) and memoises */
}

static int
batch_add(BatchOps *b, PyObject *op, PyObject *key, PyObject *value)
{
    if (PyList_Append(b->ops, op) < 0 || PyList_Append(b->keys, key) < 0 ||
        PyList_Append(b->values, value) < 0)
        return -1; /* (out of memory: the batch is not applied anyway) */
    return 0;
}

/* The arguments of a call with parameters ``names`` (all required, by position or keyword)
 * into out[]; 0, or -1 with TypeError as Python words it. */
static int
batch_args(const char *fn, const char *const *names, Py_ssize_t nparams, PyObject *const *args,
           Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
    if (nargs > nparams) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments but %zd were given",
                     fn, nparams, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nparams; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = 0;
        while (i < nparams && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == nparams) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, name);
            return -1;
        }
        if (out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < nparams; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    return 0;
}

/* Add a put of ``value`` under ``key``, its record's extension field ``ext`` (NULL: none):
 * 0, or -1 with InvalidKey, UnsupportedValue, ValueTooLarge (the batch unchanged) */
static int
batch_put(BatchOps *b, PyObject *key, PyObject *value, PyObject *ext)
{
    PyObject *kh = batch_key(b, key, 1);
    if (!kh)
        return -1;
    if (!PyTuple_Check(kh) || PyTuple_GET_SIZE(kh) != 2) {
        Py_DECREF(kh);
        PyErr_SetString(PyExc_TypeError, "key_hash must return (bytes, hash)");
        return -1;
    }
    PyObject *op;
    PyObject *payload = NULL; /* a Packed value's bytes (set_packed) */
    if (PackedType && Py_IS_TYPE(value, (PyTypeObject *)PackedType)) {
        payload = PyObject_GetAttr(value, PayloadName);
        if (!payload) {
            Py_DECREF(kh);
            return -1;
        }
        if (!PyBytes_CheckExact(payload) || PyBytes_GET_SIZE(payload) > b->max_value)
            Py_CLEAR(payload); /* (encode says what is wrong) */
    }
    if (payload) {
        op = PyTuple_Pack(ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                          PackedTag, EmptyBytes, payload, ext);
        Py_DECREF(payload);
    } else if (PyBytes_CheckExact(value) && PyBytes_GET_SIZE(value) <= b->max_value) {
        op = PyTuple_Pack(ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                          BytesTag, EmptyBytes, value, ext);
    } else {
        PyObject *enc = PyObject_CallOneArg(b->encode, value);
        if (!enc || !PyTuple_Check(enc) || PyTuple_GET_SIZE(enc) != 3) {
            if (enc)
                PyErr_SetString(PyExc_TypeError, "encode must return (tag, meta, payload)");
            Py_XDECREF(enc);
            Py_DECREF(kh);
            return -1;
        }
        op = PyTuple_Pack(ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                          PyTuple_GET_ITEM(enc, 0), PyTuple_GET_ITEM(enc, 1), PyTuple_GET_ITEM(enc, 2),
                          ext);
        Py_DECREF(enc);
    }
    Py_DECREF(kh);
    if (!op)
        return -1;
    int rc = batch_add(b, op, key, value);
    Py_DECREF(op);
    return rc;
}

/* put(key, value): add a put. Raises InvalidKey, UnsupportedValue, ValueTooLarge at once;
 * InvalidArgument (or SegmentError) when the batch no longer takes ops. */
static PyObject *
BatchOps_put(BatchOps *b, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"key", "value"};
    PyObject *parsed[2];
    if (nargs != 2 || kwnames) {
        if (batch_args("put", names, 2, args, nargs, kwnames, parsed) < 0)
            return NULL;
        args = parsed;
    }
    if (!BATCH_USABLE(b) && batch_refuse(b) < 0)
        return NULL;
    if (batch_put(b, args[0], args[1], b->ext) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _put_ext(key, value, ext): put(key, value) whose record carries ``ext`` (bytes; None: the
 * batch's own) as its extension field: a saver's thread head, its deadline its own */
static PyObject *
BatchOps_put_ext(BatchOps *b, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || (args[2] != Py_None && !PyBytes_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "_put_ext(key, value, ext: bytes | None)");
        return NULL;
    }
    if (!BATCH_USABLE(b) && batch_refuse(b) < 0)
        return NULL;
    if (batch_put(b, args[0], args[1], args[2] == Py_None ? b->ext : args[2]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* delete(key): add a delete. Raises InvalidKey at once; InvalidArgument (or SegmentError)
 * when the batch no longer takes ops. */
static PyObject *
BatchOps_delete(BatchOps *b, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"key"};
    PyObject *key;
    if (nargs != 1 || kwnames) {
        if (batch_args("delete", names, 1, args, nargs, kwnames, &key) < 0)
            return NULL;
    } else {
        key = args[0];
    }
    if (!BATCH_USABLE(b) && batch_refuse(b) < 0)
        return NULL;
    PyObject *kh = batch_key(b, key, 1);
    if (!kh)
        return NULL;
    int rc = batch_add(b, kh, key, Py_None);
    Py_DECREF(kh);
    if (rc < 0)
        return NULL;
    b->deletes++;
    Py_RETURN_NONE;
}

/* _put_packed(keys, records[, ext]): a put of each record (a list of str, bytes and None
 * fields: the LangGraph saver's) under its key, each stored as codec.Packed stores it:
 * the msgpack of the list (pack_plain) under the PACKED tag; a validator sees the list.
 * ``ext`` (bytes; None: the batch's own) is every put's extension field (a ttl's
 * deadline). A record pack_plain does not take goes through ``encode``. All or nothing:
 * what raises (InvalidKey, UnsupportedValue, ValueTooLarge, a used batch) leaves the batch
 * as it was. */
static PyObject *
BatchOps_put_packed(BatchOps *b, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]) ||
        (nargs == 3 && args[2] != Py_None && !PyBytes_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "_put_packed(keys: list, records: list of the same "
                                         "length[, ext: bytes | None])");
        return NULL;
    }
    if (!BATCH_USABLE(b) && batch_refuse(b) < 0)
        return NULL;
    PyObject *keys = args[0], *records = args[1];
    PyObject *ext = nargs == 3 && args[2] != Py_None ? args[2] : b->ext;
    Py_ssize_t start = PyList_GET_SIZE(b->ops);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *fields = PyList_GET_ITEM(records, i);
        PyObject *kh = batch_key(b, key, 0);
        if (!kh)
            goto fail;
        if (!PyTuple_Check(kh) || PyTuple_GET_SIZE(kh) != 2) {
            Py_DECREF(kh);
            PyErr_SetString(PyExc_TypeError, "key_hash must return (bytes, hash)");
            goto fail;
        }
        PyObject *op = NULL;
        PyObject *payload = pack_plain(NULL, fields);
        if (payload == Py_None || (payload && PyBytes_GET_SIZE(payload) > b->max_value)) {
            Py_CLEAR(payload);
            PyObject *enc = PyObject_CallOneArg(b->encode, fields); /* raises what is wrong */
            if (enc && PyTuple_Check(enc) && PyTuple_GET_SIZE(enc) == 3)
                op = PyTuple_Pack(ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                                  PyTuple_GET_ITEM(enc, 0), PyTuple_GET_ITEM(enc, 1),
                                  PyTuple_GET_ITEM(enc, 2), ext);
            else if (enc)
                PyErr_SetString(PyExc_TypeError, "encode must return (tag, meta, payload)");
            Py_XDECREF(enc);
        } else if (payload) {
            op = PyTuple_Pack(ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                              PackedTag ? PackedTag : BytesTag, EmptyBytes, payload, ext);
            Py_DECREF(payload);
        }
        Py_DECREF(kh);
        if (!op)
            goto fail;
        int rc = batch_add(b, op, key, fields);
        Py_DECREF(op);
        if (rc < 0)
            goto fail;
    }
    Py_RETURN_NONE;
fail:
    /* (the batch as it was: ops, keys and values cut back to their length before) */
    {
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        PyObject *lists[3] = {b->ops, b->keys, b->values};
        for (int j = 0; j < 3; j++)
            if (PyList_GET_SIZE(lists[j]) > start)
                PyList_SetSlice(lists[j], start, PyList_GET_SIZE(lists[j]), NULL);
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    return NULL;
}

/* _seal(): the with-block ended: OPEN -> APPLYING (no more ops: a validator adding one is
 * refused). Raises InvalidArgument for a batch never initialised or already ended
 * (WriteUnderLock while it is being applied). */
static PyObject *
BatchOps_seal(BatchOps *b, PyObject *Py_UNUSED(ignored))
{
    if (b->state != BATCH_OPEN) {
        batch_refuse(b);
        return NULL;
    }
    b->state = BATCH_APPLYING;
    Py_RETURN_NONE;
}

/* _check(): raises what put() would raise now for the batch's state (for __enter__) */
static PyObject *
BatchOps_check(BatchOps *b, PyObject *Py_UNUSED(ignored))
{
    if (!BATCH_USABLE(b) && batch_refuse(b) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _done(): the batch was applied or discarded: it takes no more ops */
static PyObject *
BatchOps_done(BatchOps *b, PyObject *Py_UNUSED(ignored))
{
    if (b->state != BATCH_NEW)
        b->state = BATCH_DONE;
    Py_RETURN_NONE;
}

static Py_ssize_t
BatchOps_len(BatchOps *b)
{
    return b->ops ? PyList_GET_SIZE(b->ops) : 0;
}

static PyMemberDef BatchOps_members[] = {
    {"_ops", T_OBJECT_EX, offsetof(BatchOps, ops), READONLY, "the ops, as Core.apply takes them"},
    {"_keys", T_OBJECT_EX, offsetof(BatchOps, keys), READONLY, "their keys"},
    {"_values", T_OBJECT_EX, offsetof(BatchOps, values), READONLY, "their values (None: delete)"},
    {"_deletes", T_PYSSIZET, offsetof(BatchOps, deletes), READONLY, "how many ops are deletes"},
    {NULL},
};

static PyMethodDef BatchOps_methods[] = {
    {"put", (PyCFunction)(void (*)(void))BatchOps_put, METH_FASTCALL | METH_KEYWORDS,
     "put($self, /, key, value)\n--\n\n"
     "Add a put of ``value`` under ``key``. Raises InvalidKey, UnsupportedValue, "
     "ValueTooLarge and InvalidArgument (a used batch) at once; the batch is unchanged then."},
    {"delete", (PyCFunction)(void (*)(void))BatchOps_delete, METH_FASTCALL | METH_KEYWORDS,
     "delete($self, /, key)\n--\n\n"
     "Add a delete of ``key`` (applied with the batch: :attr:`versions` says whether it "
     "deleted something). Raises InvalidKey and InvalidArgument (a used batch) at once; "
     "the batch is unchanged then."},
    {"_put_ext", (PyCFunction)(void (*)(void))BatchOps_put_ext, METH_FASTCALL,
     "_put_ext(key, value, ext): put(key, value), its record's extension field ext (bytes; "
     "None: the batch's own)"},
    {"_put_packed", (PyCFunction)(void (*)(void))BatchOps_put_packed, METH_FASTCALL,
     "_put_packed(keys, records[, ext]): a put of each list of plain fields, stored as "
     "codec.Packed is; all or nothing"},
    {"_seal", (PyCFunction)BatchOps_seal, METH_NOARGS, "the block ended: no more ops"},
    {"_check", (PyCFunction)BatchOps_check, METH_NOARGS, "raise if no op may be added now"},
    {"_done", (PyCFunction)BatchOps_done, METH_NOARGS, "applied or discarded: used up"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods BatchOps_as_sequence = {
    .sq_length = (lenfunc)BatchOps_len,
};

static PyTypeObject BatchOpsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._l2core.BatchOps",
    .tp_basicsize = sizeof(BatchOps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BatchOps_init,
    .tp_dealloc = (destructor)BatchOps_dealloc,
    .tp_traverse = (traverseproc)BatchOps_traverse,
    .tp_clear = (inquiry)BatchOps_clear,
    .tp_members = BatchOps_members,
    .tp_methods = BatchOps_methods,
    .tp_as_sequence = &BatchOps_as_sequence,
    .tp_doc = "BatchOps(keys, key_hash, encode, max_value, getter, live[, ext[, max_key]]): "
              "kv.batch()'s "
              "collecting half",
};

/* ------------------------------------------------------------------ a saver's step, whole
 *
 * Core.put_step(batch_args, keys, records, ext, absent, head, now_ms, max_dirty, timeout)
 *     -> (ops, expects, result)
 *
 * kvcomm._client.batch.put_records' embedded path in one call. The batch
 * BatchOps(*batch_args) collects _put_packed(keys, records, ext), then ``head`` = (key,
 * value, ext | None, judged) put last with its own ext; the compare-and-sets it is applied
 * with are each ``absent`` index (that key must be absent) and the head (``judged``: ()
 * absent, (counter, hlc) that version). Then the writer lock is taken within ``timeout``
 * seconds, the batch applied as Core.apply(..., compact=True) applies it, the lock released.
 *
 * ``result`` is (packed, vvxs), or None when the kernel cannot decide alone (look first, a
 * status such as a compare-and-set failed, corruption it found: the apply's SegmentError,
 * cleared): nothing was written, and Python's careful path applies ``ops`` with ``expects``
 * (a list, or None) and says what happened. What the batch raises (InvalidKey,
 * UnsupportedValue, a closed client...) and the lock's errors (Unavailable, WouldBlock, a
 * close meanwhile) propagate, nothing written. */
/* Append to ``expects`` the compare-and-set of ``op``'s key (an op of the batch) as
 * Core.apply takes it: (key, h) absent for ``judged`` NULL or (), (key, h, counter, hlc)
 * for (counter, hlc). 0, or -1 with an error set. */
static int
add_expect(PyObject *expects, PyObject *op, PyObject *judged)
{
    Py_ssize_t n = judged ? PyTuple_GET_SIZE(judged) : 0;
    PyObject *e;
    if (n == 0)
        e = PyTuple_Pack(2, PyTuple_GET_ITEM(op, 0), PyTuple_GET_ITEM(op, 1));
    else if (n == 2)
        e = PyTuple_Pack(4, PyTuple_GET_ITEM(op, 0), PyTuple_GET_ITEM(op, 1),
                         PyTuple_GET_ITEM(judged, 0), PyTuple_GET_ITEM(judged, 1));
    else {
        PyErr_SetString(PyExc_TypeError, "put_step: a head's judged is () or (counter, hlc)");
        return -1;
    }
    int rc = e ? PyList_Append(expects, e) : -1;
    Py_XDECREF(e);
    return rc;
}

static PyObject *
Core_put_step(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    PyObject *head = nargs == 9 ? args[5] : NULL;
    if (nargs != 9 || !PyTuple_Check(args[0]) ||
        (head != Py_None && (!PyTuple_Check(head) || PyTuple_GET_SIZE(head) != 4 ||
                             !PyTuple_Check(PyTuple_GET_ITEM(head, 3))))) {
        PyErr_SetString(PyExc_TypeError, "put_step(batch_args: tuple, keys, records, ext, "
                                         "absent, head: (key, value, ext, judged) | None, "
                                         "now_ms, max_dirty, timeout)");
        return NULL;
    }
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[6]);
    uint64_t max_dirty = PyLong_AsUnsignedLongLong(args[7]);
    double timeout = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *absent = PySequence_Fast(args[4], "put_step: absent is a sequence of indices");
    if (!absent)
        return NULL;
    PyObject *b = NULL, *expects = NULL, *res = NULL, *out = NULL;
    b = PyObject_Call((PyObject *)&BatchOpsType, args[0], NULL);
    if (!b)
        goto done;
    PyObject *r = BatchOps_put_packed((BatchOps *)b, args + 1, 3);
    if (!r)
        goto done;
    Py_DECREF(r);
    if (head != Py_None) {
        PyObject *hext = PyTuple_GET_ITEM(head, 2); /* (the head's own deadline) */
        if (hext != Py_None && !PyBytes_Check(hext)) {
            PyErr_SetString(PyExc_TypeError, "put_step: a head's ext is bytes or None");
            goto done;
        }
        if (batch_put((BatchOps *)b, PyTuple_GET_ITEM(head, 0), PyTuple_GET_ITEM(head, 1),
                      hext == Py_None ? ((BatchOps *)b)->ext : hext) < 0)
            goto done;
    }
    PyObject *ops = ((BatchOps *)b)->ops;
    Py_ssize_t na = PySequence_Fast_GET_SIZE(absent);
    Py_ssize_t nkeys = PyList_GET_SIZE(args[1]); /* (a list: _put_packed took it) */
    if (na || head != Py_None) {
        expects = PyList_New(0);
        if (!expects)
            goto done;
    }
    for (Py_ssize_t i = 0; i < na; i++) { /* (a record's key: absent) */
        Py_ssize_t j = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(absent, i));
        if (j == -1 && PyErr_Occurred())
            goto done;
        if (j < 0 || j >= nkeys) {
            PyErr_Format(PyExc_IndexError, "put_step: absent index %zd of %zd keys", j, nkeys);
            goto done;
        }
        if (add_expect(expects, PyList_GET_ITEM(ops, j), NULL) < 0)
            goto done;
    }
    if (head != Py_None && add_expect(expects, PyList_GET_ITEM(ops, PyList_GET_SIZE(ops) - 1),
                                      PyTuple_GET_ITEM(head, 3)) < 0)
        goto done;
    /* (collecting may have run Python code, an encode or a finalizer, and another thread's
     * close with it: the mapping is looked at again, nothing in between) */
    if (!view_ok(c, "this call collected its batch; nothing was written"))
        goto done;
    if (take_lock(c, timeout) < 0)
        goto done;
    res = needs_look(c, now_ms) ? Py_NewRef(Py_None)
          : apply_list(c, ops, now_ms, 0, max_dirty, 0, 1, expects);
    drop_lock(c);
    if (!res) {
        if (!PyErr_ExceptionMatches(SegmentError))
            goto done;
        PyErr_Clear(); /* (what the kernel found corrupt: the careful path repairs it) */
        res = Py_NewRef(Py_None);
    } else if (PyTuple_Check(res) && PyLong_Check(PyTuple_GET_ITEM(res, 0))) {
        Py_SETREF(res, Py_NewRef(Py_None)); /* a status: nothing written */
    }
    out = PyTuple_Pack(3, ops, expects ? expects : Py_None, res);
done:
    Py_DECREF(absent);
    Py_XDECREF(b);
    Py_XDECREF(expects);
    Py_XDECREF(res);
    return out;
}
