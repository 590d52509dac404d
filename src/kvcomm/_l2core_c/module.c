/* ------------------------------------------------------------------ the type */

static PyMethodDef Core_methods[] = {
    {"load", (PyCFunction)Core_load, METH_O, "load(off) -> int (acquire)"},
    {"store", (PyCFunction)(void (*)(void))Core_store, METH_FASTCALL, "store(off, v) (release)"},
    {"cas", (PyCFunction)(void (*)(void))Core_cas, METH_FASTCALL, "cas(off, expected, desired) -> bool"},
    {"add", (PyCFunction)(void (*)(void))Core_add, METH_FASTCALL, "add(off, delta) -> new value"},
    {"init_lock", (PyCFunction)Core_init_lock, METH_NOARGS, "initialise the writer lock (creator)"},
    {"init_heap", (PyCFunction)Core_init_heap, METH_NOARGS, "free the whole heap (creator)"},
    {"lock", (PyCFunction)Core_lock, METH_O, "lock(timeout) -> 0 | 1 (look first)"},
    {"try_lock", (PyCFunction)Core_try_lock, METH_NOARGS, "try_lock() -> -1 (held: no error) | 0 | 1"},
    {"unlock", (PyCFunction)Core_unlock, METH_NOARGS, "release the lock if this thread holds it"},
    {"held", (PyCFunction)Core_held, METH_NOARGS, "does this thread hold the lock"},
    {"owner", (PyCFunction)Core_owner, METH_NOARGS, "the thread id holding the lock (glibc)"},
    {"set_busy", (PyCFunction)Core_set_busy, METH_O, "raise/lower BUSY (lock held)"},
    {"read", (PyCFunction)(void (*)(void))Core_read, METH_FASTCALL, "lock-free read"},
    {"version", (PyCFunction)(void (*)(void))Core_version, METH_FASTCALL, "lock-free version read"},
    {"writers", (PyCFunction)Core_writers, METH_O, "lock-free (ext, value length) of many keys"},
    {"put", (PyCFunction)(void (*)(void))Core_put, METH_FASTCALL, "lock, put one, unlock"},
    {"apply", (PyCFunction)(void (*)(void))Core_apply, METH_FASTCALL, "apply a batch (lock held)"},
    {"put_step", (PyCFunction)(void (*)(void))Core_put_step, METH_FASTCALL,
     "a batch of records (and a head) collected, then locked, applied (compact), unlocked"},
    {"evict_key", (PyCFunction)(void (*)(void))Core_evict_key, METH_FASTCALL, "drop a clean record (lock held)"},
    {"take_ref", (PyCFunction)(void (*)(void))Core_take_ref, METH_FASTCALL, "read and clear the reference bit (lock held)"},
    {"set_quiet", (PyCFunction)Core_set_quiet, METH_O, "the calling thread's reads and writes leave reference bits unset"},
    {"expire_key", (PyCFunction)(void (*)(void))Core_expire_key, METH_FASTCALL, "reclaim an expired clean record (lock held)"},
    {"sweep_expired", (PyCFunction)(void (*)(void))Core_sweep_expired, METH_FASTCALL, "the bounded expiry sweep (lock held)"},
    {"mark_clean", (PyCFunction)(void (*)(void))Core_mark_clean, METH_FASTCALL, "clear dirty (lock held)"},
    {"pin", (PyCFunction)(void (*)(void))Core_pin, METH_FASTCALL, "pin a block (lock-free)"},
    {"unpin", (PyCFunction)(void (*)(void))Core_unpin, METH_FASTCALL, "release a pin (lock-free)"},
    {"pin_kept", (PyCFunction)Core_pin_kept, METH_NOARGS, "the last pin belongs to a view"},
    {"drop_pending", (PyCFunction)Core_drop_pending, METH_NOARGS, "release a pin no view took"},
    {"pin_block", (PyCFunction)Core_pin_block, METH_O, "pin a known block (after fork)"},
    {"pinned_block", (PyCFunction)Core_pinned_block, METH_O, "the block a pin entry names"},
    {"forked", (PyCFunction)Core_forked, METH_NOARGS, "in a child after fork"},
    {"sweep", (PyCFunction)Core_sweep, METH_O, "dead pins, parked blocks (lock held)"},
    {"purge_mark", (PyCFunction)Core_purge_mark, METH_NOARGS, "mark purged (lock held)"},
    {"scan", (PyCFunction)Core_scan, METH_O, "keys: 0 live, 1 dirty"},
    {"recover", (PyCFunction)Core_recover, METH_NOARGS, "repair after a death (lock held)"},
    {"reserved", (PyCFunction)Core_reserved, METH_NOARGS, "bytes of the file reserved (the map)"},
    {"release", (PyCFunction)Core_release, METH_NOARGS, "drop the buffer export"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._l2core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_doc = "Core(mmap[, fd]): the L2 operations over one mapped segment (layout read from its header; fd: its file, through which writers reserve memory as they first use a page)",
};

static PyObject *
set_errors(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "set_errors(SegmentError, Unavailable, InvalidArgument, WriteUnderLock)");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(SegmentError, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(Unavailable, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(InvalidArgument, args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(WriteUnderLock, args[3]);
    Py_RETURN_NONE;
}

static PyObject *
set_ext_check(PyObject *mod, PyObject *fn)
{
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_ext_check(fn: bytes -> str)");
        return NULL;
    }
    Py_INCREF(fn);
    Py_XSETREF(ExtCheck, fn);
    Py_CLEAR(ExtOk);
    Py_RETURN_NONE;
}

/* set_inline_wait(seconds) -> the previous value: the calling thread's inline budget for a
 * contended writer lock (negative: none, wait up to the caller's timeout); see lock.c */
static PyObject *
set_inline_wait(PyObject *mod, PyObject *arg)
{
    double w = PyFloat_AsDouble(arg);
    if (w == -1.0 && PyErr_Occurred())
        return NULL;
    double prev = inline_wait;
    inline_wait = w;
    return PyFloat_FromDouble(prev);
}

/* inline_wait() -> the calling thread's inline budget (negative: none): Python's network
 * paths raise WouldBlock when it is set (base.py _network) */
static PyObject *
get_inline_wait(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    return PyFloat_FromDouble(inline_wait);
}

static PyMethodDef module_methods[] = {
    {"inline_wait", get_inline_wait, METH_NOARGS,
     "inline_wait() -> this thread's inline budget for a held writer lock (negative: none)"},
    {"set_inline_wait", set_inline_wait, METH_O,
     "set_inline_wait(seconds) -> previous: this thread's inline budget for a held writer "
     "lock, after which it raises WouldBlock (negative: none)"},
    {"set_errors", (PyCFunction)(void (*)(void))set_errors, METH_FASTCALL,
     "the exception classes to raise: SegmentError, Unavailable, InvalidArgument, "
     "WriteUnderLock"},
    {"set_ext_check", set_ext_check, METH_O,
     "fn(ext: bytes) -> str: why a write's non-empty extension field is refused ('' if not)"},
    {"approx_size", approx_size, METH_O, "approximate bytes held by a decoded value"},
    {"bloom_has", (PyCFunction)(void (*)(void))bloom_has, METH_FASTCALL,
     "bloom_has(buffer, bits, k, gens, digest) -> bool: the key filter's membership test"},
    {"mutex_init", (PyCFunction)(void (*)(void))mutex_init, METH_FASTCALL,
     "mutex_init(buffer, offset): a robust process-shared mutex there (a file's creator)"},
    {"mutex_lock", (PyCFunction)(void (*)(void))mutex_lock, METH_FASTCALL,
     "mutex_lock(buffer, offset[, timeout]) -> bool: take it (True: its last holder died "
     "holding it); Unavailable after timeout seconds"},
    {"mutex_unlock", (PyCFunction)(void (*)(void))mutex_unlock, METH_FASTCALL,
     "mutex_unlock(buffer, offset): release it"},
    {"mutex_forget", (PyCFunction)mutex_forget, METH_NOARGS,
     "mutex_forget(): in a child after fork, this thread holds no file mutex"},
    {"mutex_release", (PyCFunction)(void (*)(void))mutex_release, METH_FASTCALL,
     "mutex_release(buffer, offset) -> bool: release it if this thread holds it"},
    {"plain_component", plain_component, METH_O,
     "plain_component(s) -> bool: s is a str without %, /, =, C0 controls or DEL"},
    {"step_metadata", (PyCFunction)(void (*)(void))step_metadata, METH_FASTCALL,
     "step_metadata(excluded, fallback, config, metadata) -> dict: LangGraph's "
     "get_checkpoint_metadata(config, metadata) (fallback's for other shapes)"},
    {"checkpoint_record", (PyCFunction)(void (*)(void))checkpoint_record, METH_FASTCALL,
     "checkpoint_record(dumps, checkpoint, metadata, parent, values) -> (record, inline): "
     "the LangGraph saver's checkpoint record and its inlined channels"},
    {"task_records", (PyCFunction)(void (*)(void))task_records, METH_FASTCALL,
     "task_records(dumps, writes, task_id, task_path, idx_map) -> (records, indices, "
     "regular) | None: the LangGraph saver's records of a task's writes"},
    {"step_keys", (PyCFunction)(void (*)(void))step_keys, METH_FASTCALL,
     "step_keys(memo, max, fallback, thread_id, ns, checkpoint_id) -> (checkpoint key, "
     "blobs' prefix, head key): the LangGraph saver's Keys.step"},
    {"write_keys", (PyCFunction)(void (*)(void))write_keys, METH_FASTCALL,
     "write_keys(memo, max, fallback, thread_id, ns, checkpoint_id, task_id, indices) -> "
     "keys: the LangGraph saver's Keys.step_writes"},
    {"pack_plain", pack_plain, METH_O,
     "pack_plain(fields) -> bytes | None: msgpack of a list of str, bytes and None fields"},
    {"key_of", (PyCFunction)(void (*)(void))key_of, METH_FASTCALL,
     "key_of(memo, key, max_key) -> (bytes, hash) | None: a new key checked, hashed and "
     "memoised as the client's _key_hash does (None: the Python path decides)"},
    {"set_key_hasher", set_key_hasher, METH_O,
     "set_key_hasher(fn): fn(key_bytes) -> int, the hash BatchOps gives a new key (| 1)"},
    {"set_packed", (PyCFunction)(void (*)(void))set_packed, METH_FASTCALL,
     "set_packed(cls, tag): BatchOps.put stores cls's instances as their payload under tag"},
    {"unit_f32", (PyCFunction)(void (*)(void))unit_f32, METH_FASTCALL,
     "unit_f32(vector, dims) -> bytes | None: a list of floats as a unit float32 row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvcomm._l2core", "L2 segment operations", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__l2core(void)
{
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&GetterType) < 0 ||
        PyType_Ready(&BudgetType) < 0 || PyType_Ready(&L1Type) < 0 ||
        PyType_Ready(&BatchOpsType) < 0 || PyType_Ready(&NoPickleType) < 0 ||
        lgstep_names() < 0)
        return NULL;
    BytesTag = PyLong_FromLong(TAG_BYTES);
    EmptyBytes = PyBytes_FromStringAndSize("", 0);
    if (!BytesTag || !EmptyBytes)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (!collections)
        return NULL;
    OrderedDictType = PyObject_GetAttrString(collections, "OrderedDict");
    DequeType = PyObject_GetAttrString(collections, "deque");
    ChainMapType = PyObject_GetAttrString(collections, "ChainMap");
    Py_DECREF(collections);
    if (!OrderedDictType || !DequeType || !ChainMapType)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    SegmentError = PyExc_RuntimeError;
    Unavailable = PyExc_RuntimeError;
    InvalidArgument = PyExc_ValueError;
    WriteUnderLock = PyExc_ValueError;
    Py_INCREF(SegmentError);
    Py_INCREF(Unavailable);
    Py_INCREF(InvalidArgument);
    Py_INCREF(WriteUnderLock);
    WouldBlock = PyErr_NewExceptionWithDoc(
        "kvcomm._l2core.WouldBlock",
        "A call on an event loop's thread would wait (a held writer lock, the network): "
        "nothing was done; kvcomm.aio runs it again in a thread. A BaseException, so that no "
        "`except Exception` on the way takes it for the call's own failure.",
        PyExc_BaseException, NULL);
    if (!WouldBlock || PyModule_AddObject(m, "WouldBlock", Py_NewRef(WouldBlock)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "KEY_MEMO", KEY_MEMO) < 0 ||
        PyModule_AddIntConstant(m, "MAX_COUNTER", (long)MAX_COUNTER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CoreType);
    Py_INCREF(&BatchOpsType);
    if (PyModule_AddObject(m, "BatchOps", (PyObject *)&BatchOpsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "NoPickle", Py_NewRef((PyObject *)&NoPickleType)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&BudgetType);
    Py_INCREF(&L1Type);
    if (PyModule_AddObject(m, "Budget", (PyObject *)&BudgetType) < 0 ||
        PyModule_AddObject(m, "L1", (PyObject *)&L1Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GetterType);
    if (PyModule_AddObject(m, "Getter", (PyObject *)&GetterType) < 0) {
        Py_DECREF(&GetterType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ST_SLOT_FULL", ST_SLOT_FULL) < 0 ||
        PyModule_AddIntConstant(m, "ST_TOO_LARGE", ST_TOO_LARGE) < 0 ||
        PyModule_AddIntConstant(m, "ST_CORRUPT", ST_CORRUPT) < 0 ||
        PyModule_AddIntConstant(m, "ST_DIRTY_FULL", ST_DIRTY_FULL) < 0 ||
        PyModule_AddIntConstant(m, "ST_LOOK", ST_LOOK) < 0 ||
        PyModule_AddIntConstant(m, "ST_FULL", ST_FULL) < 0 ||
        PyModule_AddIntConstant(m, "ST_CONFLICT", ST_CONFLICT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
