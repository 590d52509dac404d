/* ------------------------------------------------------------------ batches: collecting ops
 *
 * BatchOps(keys, key_hash, encode, max_value[, ext]): the collecting half of ``kv.batch()``
 * (kvcomm._client.Batch derives from it and applies the ops on exit). put() and delete()
 * are the per-operation cost of a batch, so they are here: a key already validated is
 * found in the client's memo ``keys`` (key -> (bytes, hash)), a bytes value is taken as
 * it is; anything else goes through ``key_hash(key)`` / ``encode(value)``, which validate
 * and raise. The ops are the tuples Core.apply takes; with ``ext`` (bytes) every put op
 * carries it as the record's extension field (the writer's agent id).
 */
typedef struct {
    PyObject_HEAD
    PyObject *ops, *keys, *values;
    PyObject *memo, *key_hash, *encode;
    PyObject *ext; /* the extension field every put carries (NULL: none) */
    Py_ssize_t max_value;
    Py_ssize_t deletes; /* how many of the ops are deletes */
} BatchOps;

static PyObject *BytesTag, *EmptyBytes;

static int
BatchOps_init(BatchOps *b, PyObject *args, PyObject *kwds)
{
    PyObject *memo, *key_hash, *encode, *ext = NULL;
    Py_ssize_t max_value;
    if (!PyArg_ParseTuple(args, "O!OOn|O!", &PyDict_Type, &memo, &key_hash, &encode, &max_value,
                          &PyBytes_Type, &ext))
        return -1;
    Py_XINCREF(ext);
    Py_XSETREF(b->ext, ext);
    Py_INCREF(memo);
    Py_XSETREF(b->memo, memo);
    Py_INCREF(key_hash);
    Py_XSETREF(b->key_hash, key_hash);
    Py_INCREF(encode);
    Py_XSETREF(b->encode, encode);
    Py_XSETREF(b->ops, PyList_New(0));
    Py_XSETREF(b->keys, PyList_New(0));
    Py_XSETREF(b->values, PyList_New(0));
    b->max_value = max_value;
    b->deletes = 0;
    return b->ops && b->keys && b->values ? 0 : -1;
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
    return 0;
}

static void
BatchOps_dealloc(BatchOps *b)
{
    PyObject_GC_UnTrack(b);
    BatchOps_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* (bytes, hash) of a valid key, new reference */
static PyObject *
batch_key(BatchOps *b, PyObject *key)
{
    if (PyUnicode_CheckExact(key)) {
        PyObject *kh = PyDict_GetItemWithError(b->memo, key);
        if (kh) {
            Py_INCREF(kh);
            return kh;
        }
        if (PyErr_Occurred())
            return NULL;
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

/* put(key, value): add a put. Raises InvalidKey, UnsupportedValue, ValueTooLarge at once. */
static PyObject *
BatchOps_put(BatchOps *b, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(key, value)");
        return NULL;
    }
    PyObject *kh = batch_key(b, args[0]);
    if (!kh)
        return NULL;
    if (!PyTuple_Check(kh) || PyTuple_GET_SIZE(kh) != 2) {
        Py_DECREF(kh);
        PyErr_SetString(PyExc_TypeError, "key_hash must return (bytes, hash)");
        return NULL;
    }
    PyObject *op;
    PyObject *value = args[1];
    if (PyBytes_CheckExact(value) && PyBytes_GET_SIZE(value) <= b->max_value) {
        op = PyTuple_Pack(b->ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                          BytesTag, EmptyBytes, value, b->ext);
    } else {
        PyObject *enc = PyObject_CallOneArg(b->encode, value);
        if (!enc || !PyTuple_Check(enc) || PyTuple_GET_SIZE(enc) != 3) {
            if (enc)
                PyErr_SetString(PyExc_TypeError, "encode must return (tag, meta, payload)");
            Py_XDECREF(enc);
            Py_DECREF(kh);
            return NULL;
        }
        op = PyTuple_Pack(b->ext ? 6 : 5, PyTuple_GET_ITEM(kh, 0), PyTuple_GET_ITEM(kh, 1),
                          PyTuple_GET_ITEM(enc, 0), PyTuple_GET_ITEM(enc, 1), PyTuple_GET_ITEM(enc, 2),
                          b->ext);
        Py_DECREF(enc);
    }
    Py_DECREF(kh);
    if (!op)
        return NULL;
    int rc = batch_add(b, op, args[0], value);
    Py_DECREF(op);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* delete(key): add a delete. Raises InvalidKey at once. */
static PyObject *
BatchOps_delete(BatchOps *b, PyObject *key)
{
    PyObject *kh = batch_key(b, key);
    if (!kh)
        return NULL;
    int rc = batch_add(b, kh, key, Py_None);
    Py_DECREF(kh);
    if (rc < 0)
        return NULL;
    b->deletes++;
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
    {"put", (PyCFunction)(void (*)(void))BatchOps_put, METH_FASTCALL,
     "put(key, value): add a put (raises InvalidKey, UnsupportedValue, ValueTooLarge at once)"},
    {"delete", (PyCFunction)BatchOps_delete, METH_O, "delete(key): add a delete (raises InvalidKey)"},
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
    .tp_doc = "BatchOps(keys, key_hash, encode, max_value[, ext]): kv.batch()'s collecting half",
};
