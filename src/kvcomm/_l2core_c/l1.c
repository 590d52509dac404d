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

/* ------------------------------------------------------------------ L1
 *
 * Budget: the process's bound on bytes held by every L1 (tiers/l1.py sets max_bytes to the
 * smallest cache.l1_size of the open clients). L1(budget): one namespace's decoded values,
 * an OrderedDict key -> (value, slot word, seq, size, counter, hlc, vvx) in least recently
 * stored (or sampled) first order. Every change happens in C, under the GIL: no thread can
 * see an entry and its accounting disagree.
 */

typedef struct {
    PyObject_HEAD
    Py_ssize_t max_bytes;
    Py_ssize_t bytes;
    PyObject *caches; /* list of the L1s drawing on it */
} Budget;

typedef struct {
    PyObject_HEAD
    PyObject *entries;
    Budget *budget;
    Py_ssize_t bytes;
    unsigned long long evictions;
} L1;

static PyTypeObject BudgetType, L1Type;
static PyObject *OrderedDictType;

static Py_ssize_t
entry_size(PyObject *e)
{
    if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) < 4)
        return 0;
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 3));
    if (n < 0) {
        PyErr_Clear(); /* (an int too large: no Python code ran, so no signal's exception) */
        return 0;
    }
    return n;
}

/* evict the least recent entry of l; 0 when it has none; -1 on error */
static int
l1_pop_oldest(L1 *l)
{
    if (PyDict_GET_SIZE(l->entries) == 0)
        return 0;
    PyObject *item = PyObject_CallMethod(l->entries, "popitem", "O", Py_False);
    if (!item)
        return -1;
    Py_ssize_t n = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 ? entry_size(PyTuple_GET_ITEM(item, 1)) : 0;
    Py_DECREF(item);
    l->bytes -= n;
    l->budget->bytes -= n;
    l->evictions++;
    return 1;
}

/* evict least recent entries, from l first (keeping its newest if keep), then from the
 * process's other caches, until the budget holds */
static int
budget_shrink(Budget *b, L1 *l, int keep)
{
    while (b->bytes > b->max_bytes) {
        int r = 0;
        if (l && PyDict_GET_SIZE(l->entries) > (keep ? 1 : 0))
            r = l1_pop_oldest(l);
        for (Py_ssize_t i = 0; r == 0 && i < PyList_GET_SIZE(b->caches); i++) {
            L1 *o = (L1 *)PyList_GET_ITEM(b->caches, i);
            if (o != l)
                r = l1_pop_oldest(o);
        }
        if (r < 0)
            return -1;
        if (r == 0)
            break;
    }
    return 0;
}

static int
l1_discard(L1 *l, PyObject *key)
{
    PyObject *old = PyDict_GetItemWithError(l->entries, key);
    if (!old)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t n = entry_size(old);
    if (PyObject_DelItem(l->entries, key) < 0)
        return -1;
    l->bytes -= n;
    l->budget->bytes -= n;
    return 0;
}

/* keep entry (size bytes) for key, as the most recent; over the budget it is not kept */
static int
l1_store(L1 *l, PyObject *key, PyObject *entry, Py_ssize_t size)
{
    if (l1_discard(l, key) < 0)
        return -1;
    if (size > l->budget->max_bytes)
        return 0;
    if (PyObject_SetItem(l->entries, key, entry) < 0)
        return -1;
    l->bytes += size;
    l->budget->bytes += size;
    return budget_shrink(l->budget, l, 1);
}

static int
Budget_init(Budget *b, PyObject *args, PyObject *kwds)
{
    b->max_bytes = 0;
    b->bytes = 0;
    Py_XSETREF(b->caches, PyList_New(0));
    return b->caches ? 0 : -1;
}

static int
Budget_traverse(Budget *b, visitproc visit, void *arg)
{
    Py_VISIT(b->caches);
    return 0;
}

static int
Budget_clear(Budget *b)
{
    Py_CLEAR(b->caches);
    return 0;
}

static void
Budget_dealloc(Budget *b)
{
    PyObject_GC_UnTrack(b);
    Budget_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *
Budget_get_max(Budget *b, void *closure)
{
    return PyLong_FromSsize_t(b->max_bytes);
}

static int
Budget_set_max(Budget *b, PyObject *v, void *closure)
{
    Py_ssize_t n = v ? PyLong_AsSsize_t(v) : -1;
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "max_bytes is a size in bytes >= 0");
        return -1;
    }
    b->max_bytes = n;
    return b->caches ? budget_shrink(b, NULL, 0) : 0;
}

static PyObject *
Budget_add(Budget *b, PyObject *l)
{
    if (!PyObject_TypeCheck(l, &L1Type)) {
        PyErr_SetString(PyExc_TypeError, "add(l1)");
        return NULL;
    }
    if (PyList_Append(b->caches, l) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Budget_remove(Budget *b, PyObject *l)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(b->caches); i++)
        if (PyList_GET_ITEM(b->caches, i) == l)
        {
            if (PySequence_DelItem(b->caches, i) < 0)
                return NULL;
            break;
        }
    Py_RETURN_NONE;
}

static PyMemberDef Budget_members[] = {
    {"bytes", T_PYSSIZET, offsetof(Budget, bytes), READONLY, "bytes held by every L1 of the process"},
    {NULL},
};
static PyGetSetDef Budget_getset[] = {
    {"max_bytes", (getter)Budget_get_max, (setter)Budget_set_max, "the bound (setting it evicts)", NULL},
    {NULL},
};
static PyMethodDef Budget_methods[] = {
    {"add", (PyCFunction)Budget_add, METH_O, "an L1 draws on this budget"},
    {"remove", (PyCFunction)Budget_remove, METH_O, "it no longer does"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BudgetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._l2core.Budget",
    .tp_basicsize = sizeof(Budget),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Budget_init,
    .tp_dealloc = (destructor)Budget_dealloc,
    .tp_traverse = (traverseproc)Budget_traverse,
    .tp_clear = (inquiry)Budget_clear,
    .tp_members = Budget_members,
    .tp_getset = Budget_getset,
    .tp_methods = Budget_methods,
    .tp_doc = "Budget(): the process's bound on the bytes its L1 caches hold",
};

static int
L1_init(L1 *l, PyObject *args, PyObject *kwds)
{
    PyObject *b;
    if (!PyArg_ParseTuple(args, "O!", &BudgetType, &b))
        return -1;
    Py_INCREF(b);
    Py_XSETREF(l->budget, (Budget *)b);
    Py_XSETREF(l->entries, PyObject_CallNoArgs(OrderedDictType));
    l->bytes = 0;
    l->evictions = 0;
    return l->entries ? 0 : -1;
}

static int
L1_traverse(L1 *l, visitproc visit, void *arg)
{
    Py_VISIT(l->entries);
    Py_VISIT(l->budget);
    return 0;
}

static int
L1_clear_refs(L1 *l)
{
    Py_CLEAR(l->entries);
    Py_CLEAR(l->budget);
    return 0;
}

static void
L1_dealloc(L1 *l)
{
    PyObject_GC_UnTrack(l);
    L1_clear_refs(l);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

/* store(key, entry): keep entry (a tuple; its size at [3]) as the most recent */
static PyObject *
L1_store(L1 *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store(key, entry)");
        return NULL;
    }
    if (l1_store(l, args[0], args[1], entry_size(args[1])) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
L1_discard(L1 *l, PyObject *key)
{
    if (l1_discard(l, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
L1_clear(L1 *l, PyObject *Py_UNUSED(ignored))
{
    l->budget->bytes -= l->bytes;
    l->bytes = 0;
    if (PyDict_GET_SIZE(l->entries)) {
        PyObject *r = PyObject_CallMethod(l->entries, "clear", NULL);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

/* touch(key): the entry becomes the most recent (sampled hits refresh LRU order) */
static PyObject *
L1_touch(L1 *l, PyObject *key)
{
    if (!PyDict_Contains(l->entries, key))
        Py_RETURN_NONE;
    PyObject *r = PyObject_CallMethod(l->entries, "move_to_end", "O", key);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
L1_get_max(L1 *l, void *closure)
{
    return PyLong_FromSsize_t(l->budget ? l->budget->max_bytes : 0);
}

static PyMemberDef L1_members[] = {
    {"entries", T_OBJECT_EX, offsetof(L1, entries), READONLY, "key -> entry (read only)"},
    {"bytes", T_PYSSIZET, offsetof(L1, bytes), READONLY, "bytes its entries hold"},
    {"evictions", T_ULONGLONG, offsetof(L1, evictions), READONLY, "entries evicted"},
    {NULL},
};
static PyGetSetDef L1_getset[] = {
    {"max_bytes", (getter)L1_get_max, NULL, "the process's bound", NULL},
    {NULL},
};
static PyMethodDef L1_methods[] = {
    {"store", (PyCFunction)(void (*)(void))L1_store, METH_FASTCALL, "store(key, entry)"},
    {"discard", (PyCFunction)L1_discard, METH_O, "discard(key)"},
    {"clear", (PyCFunction)L1_clear, METH_NOARGS, "drop every entry"},
    {"touch", (PyCFunction)L1_touch, METH_O, "make key the most recent"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject L1Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcomm._l2core.L1",
    .tp_basicsize = sizeof(L1),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)L1_init,
    .tp_dealloc = (destructor)L1_dealloc,
    .tp_traverse = (traverseproc)L1_traverse,
    .tp_clear = (inquiry)L1_clear_refs,
    .tp_members = L1_members,
    .tp_getset = L1_getset,
    .tp_methods = L1_methods,
    .tp_doc = "L1(budget): one namespace's decoded values in this process, bounded by budget",
};

/* ------------------------------------------------------------------ kv.get
 *
 * Getter(l1, core, keys, decode, slow, sampled, sample, zero_copy, l1_on): ``kv.get``
 * itself, in C because a Python call alone costs what a whole hit does here.
 *
 * * A hit: one lookup in L1 and one load of the entry's L2 slot seq word: equal means L2
 *   still holds the value L1 decoded, which is returned — unless the key has a deadline
 *   (an 8th element in its entry) that the clock has passed: no entry outlives its key.
 * * A miss of a key already validated (in ``keys``, the client's key -> (bytes, hash)
 *   memo): one lock-free L2 read; bytes are returned as they are, str and msgpack values
 *   through ``decode(tag, meta, raw)``; the value enters L1.
 * * Anything else — a key never seen, absent from L2 (cluster mode: L3), a tombstone, a
 *   large array (a view), damage, a decoding error — goes to ``slow(key, default,
 *   False)``, the client's Python path, which also raises the errors; ``slow(key,
 *   default, False, True, None)`` when the L2 read here found no record of the key (the
 *   slow path then does not read L2 again: the read took effect here).
 * One read in ``sample_every`` (at random gaps) is counted for hot keys (getter_sample).
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    L1 *l1; /* NULL once closed */
    Core *core;
    PyObject *keys, *decode, *slow, *flush;
    PyObject *hot; /* key -> sampled reads not yet added to the host's sketch */
    long long sample, sample_every;
    uint64_t rng; /* xorshift state: the gaps between sampled reads */
    double hot_since;
    unsigned long long zc;
    unsigned long long hits, l2_hits;
    int l1_on;
    /* sampled latency (kvcomm metrics): every lat_every-th read is timed, and an L1 or L2
     * hit served here lands in lat[tier]: LAT_BUCKETS counts (the last is +Inf), the sum
     * in ns, the count; cumulative. Bounds in ns from time_every(). */
    long long lat_every, lat_left;
    unsigned long long lat_bounds[LAT_BUCKETS - 1];
    unsigned long long lat[2][LAT_BUCKETS + 2];
    PyObject *wrapped; /* what help() and inspect show: the Python method this stands in for */
} Getter;

static inline unsigned long long
lat_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static void
lat_note(Getter *g, int tier, unsigned long long t0)
{
    unsigned long long ns = lat_now() - t0;
    int b = 0;
    while (b < LAT_BUCKETS - 1 && ns > g->lat_bounds[b])
        b++;
    g->lat[tier][b]++;
    g->lat[tier][LAT_BUCKETS] += ns;
    g->lat[tier][LAT_BUCKETS + 1]++;
}

/* The reads until the next sampled one: uniform in 1 .. 2 * sample_every - 1 (mean
 * sample_every). A fixed gap would alias with an agent's loop: reading 2 neighbours a
 * tick, every 16th read is always the same neighbour, and the other is never seen. */
static long long
getter_gap(Getter *g)
{
    uint64_t x = g->rng ? g->rng : 0x9E3779B97F4A7C15ULL; /* (0 is xorshift's fixed point) */
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    g->rng = x;
    if (g->sample_every > (1LL << 40))
        return g->sample_every; /* (a rate this low needs no care, and 2N must not wrap) */
    return 1 + (long long)(x % (uint64_t)(2 * g->sample_every - 1));
}

/* One read in ``sample_every`` on average (at random gaps: getter_gap): count it (scaled)
 * in the buffer, refresh the key's LRU place in L1, and call ``flush()`` (which takes the
 * buffer to the host's sketch) when the buffer holds 256 keys or is a second old. */
static int
getter_sample(Getter *g, PyObject *key)
{
    if (--g->sample > 0)
        return 0;
    if (g->sample_every <= 0 || !g->hot) {
        g->sample = LLONG_MAX;
        return 0;
    }
    g->sample = getter_gap(g);
    if (g->l1 && PyDict_Contains(g->l1->entries, key) == 1) {
        PyObject *r = PyObject_CallMethod(g->l1->entries, "move_to_end", "O", key);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    PyObject *n = PyDict_GetItemWithError(g->hot, key);
    long long count = n ? PyLong_AsLongLong(n) : 0;
    if (PyErr_Occurred())
        return -1;
    PyObject *v = PyLong_FromLongLong(count + g->sample_every);
    if (!v || PyDict_SetItem(g->hot, key, v) < 0) {
        Py_XDECREF(v);
        return -1;
    }
    Py_DECREF(v);
    if (PyDict_GET_SIZE(g->hot) >= 256 || mono_now() - g->hot_since > 1.0) {
        PyObject *r = PyObject_CallNoArgs(g->flush);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* Clear the error set when it is an Exception: what the fast path leaves to the slow
 * one, which says what is wrong (or repairs it). 0 then; -1 when it is a KeyboardInterrupt,
 * SystemExit or other BaseException, left set: a signal always reaches the caller, even
 * from inside the decoder's Python code. */
static int
clear_exception(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

/* the L2 path in C; NULL with no error set: take the slow path (*absent: L2 has no
 * record of the key) */
static PyObject *
getter_miss(Getter *g, PyObject *key, int *absent)
{
    Core *c = g->core;
    if (!PyUnicode_CheckExact(key))
        return NULL;
    PyObject *kh = PyDict_GetItemWithError(g->keys, key);
    if (!kh || !PyTuple_Check(kh) || PyTuple_GET_SIZE(kh) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(kh, 0))) {
        if (PyErr_Occurred())
            clear_exception();
        return NULL;
    }
    PyObject *kb = PyTuple_GET_ITEM(kh, 0);
    uint64_t h = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(kh, 1));
    if (PyErr_Occurred()) {
        clear_exception();
        return NULL;
    }
    Found f;
    int st = read_into(c, PyBytes_AS_STRING(kb), (uint64_t)PyBytes_GET_SIZE(kb), h, g->zc,
                       WANT_VALUE | WANT_META, &f);
    if (st != READ_FOUND) {
        *absent = st == READ_ABSENT;
        if (st == READ_ERROR)
            clear_exception(); /* (purged, damaged: the slow path says or repairs it) */
        return NULL;
    }
    if (f.tag == TAG_TOMBSTONE || f.value == Py_None || f.tag == TAG_NDARRAY ||
        (f.deadline > 0 && f.deadline <= real_now())) { /* (expired: the slow path reclaims it) */
        found_clear(&f);
        return NULL;
    }
    PyObject *value;
    if (f.tag == TAG_BYTES) {
        value = f.value;
        Py_INCREF(value);
    } else {
        value = PyObject_CallFunction(g->decode, "KOO", (unsigned long long)f.tag, f.meta, f.value);
        if (!value) {
            clear_exception(); /* (a Ctrl-C inside the decoder stays set: raised) */
            found_clear(&f);
            return NULL;
        }
    }
    if (g->l1_on) {
        Py_ssize_t size = approx(value, 0);
        /* a key with a deadline gets an 8th element, its deadline: the hit path compares
         * it with the clock; entries of keys without one stay 7 long and pay nothing */
        PyObject *entry = f.deadline > 0 ?
            Py_BuildValue("(OKKnKKOd)", value, (unsigned long long)f.word,
                          (unsigned long long)f.seq, size, (unsigned long long)f.counter,
                          (unsigned long long)f.hlc, f.vvx, f.deadline) :
            Py_BuildValue("(OKKnKKO)", value, (unsigned long long)f.word,
                          (unsigned long long)f.seq, size, (unsigned long long)f.counter,
                          (unsigned long long)f.hlc, f.vvx);
        if (!entry || l1_store(g->l1, key, entry, size) < 0) {
            Py_XDECREF(entry);
            found_clear(&f);
            Py_DECREF(value);
            return NULL; /* an error set: raised */
        }
        Py_DECREF(entry);
    }
    found_clear(&f);
    g->l2_hits++;
    return value;
}

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
    unsigned long long t0 = 0;
    int absent = 0;
    if (g->lat_every > 0 && --g->lat_left <= 0) { /* one read in lat_every is timed */
        g->lat_left = g->lat_every;
        t0 = lat_now();
    }
    if (g->l1 && c && c->has_view && !guard_lost(c->guard)) {
        PyObject *e = PyDict_GetItemWithError(g->l1->entries, key);
        if (e && PyTuple_Check(e) && PyTuple_GET_SIZE(e) >= 3) {
            uint64_t word = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 1));
            uint64_t seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 2));
            if (PyErr_Occurred())
                return NULL;
            if (word < c->size / 8 && LD(W(c, word * 8)) == seq &&
                (PyTuple_GET_SIZE(e) < 8 || PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(e, 7)) > real_now())) {
                PyObject *value = PyTuple_GET_ITEM(e, 0);
                Py_INCREF(value);
                g->hits++;
                if (getter_sample(g, key) < 0) {
                    Py_DECREF(value);
                    return NULL;
                }
                if (t0)
                    lat_note(g, 0, t0);
                return value;
            }
        } else if (!e && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear(); /* an unhashable key: the slow path says what is wrong */
        }
        PyObject *value = getter_miss(g, key, &absent);
        if (value) {
            if (getter_sample(g, key) < 0) {
                Py_DECREF(value);
                return NULL;
            }
            if (t0)
                lat_note(g, 1, t0);
            return value;
        }
        if (PyErr_Occurred())
            return NULL;
    }
    PyObject *call[5] = {key, dflt, Py_False, Py_True, Py_None};
    return PyObject_Vectorcall(g->slow, call, absent ? 5 : 3, NULL);
}

static int
Getter_init(Getter *g, PyObject *args, PyObject *kwds)
{
    PyObject *l1, *core, *keys, *decode, *slow, *flush;
    long long sample_every;
    unsigned long long zc;
    int l1_on;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOLKp", &L1Type, &l1, &CoreType_ref, &core, &PyDict_Type,
                          &keys, &decode, &slow, &flush, &sample_every, &zc, &l1_on))
        return -1;
    if (!PyCallable_Check(decode) || !PyCallable_Check(slow) || !PyCallable_Check(flush)) {
        PyErr_SetString(PyExc_TypeError, "decode, slow and flush are callables");
        return -1;
    }
    Py_INCREF(l1);
    Py_XSETREF(g->l1, (L1 *)l1);
    Py_INCREF(core);
    Py_XSETREF(g->core, (Core *)core);
    Py_INCREF(keys);
    Py_XSETREF(g->keys, keys);
    Py_INCREF(decode);
    Py_XSETREF(g->decode, decode);
    Py_INCREF(slow);
    Py_XSETREF(g->slow, slow);
    Py_INCREF(flush);
    Py_XSETREF(g->flush, flush);
    Py_XSETREF(g->hot, PyDict_New());
    if (!g->hot)
        return -1;
    g->sample_every = sample_every;
    g->rng = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)g ^ (uint64_t)(mono_now() * 1e9);
    if (!g->rng)
        g->rng = 0x9E3779B97F4A7C15ULL;
    g->sample = sample_every > 0 ? getter_gap(g) : LLONG_MAX;
    g->hot_since = mono_now();
    g->zc = zc;
    g->l1_on = l1_on;
    g->hits = g->l2_hits = 0;
    g->lat_every = g->lat_left = 0;
    memset(g->lat, 0, sizeof g->lat);
    g->vectorcall = (vectorcallfunc)Getter_vectorcall;
    return 0;
}

static int
Getter_traverse(Getter *g, visitproc visit, void *arg)
{
    Py_VISIT(g->l1);
    Py_VISIT(g->core);
    Py_VISIT(g->keys);
    Py_VISIT(g->decode);
    Py_VISIT(g->slow);
    Py_VISIT(g->flush);
    Py_VISIT(g->hot);
    Py_VISIT(g->wrapped);
    return 0;
}

static int
Getter_clear(Getter *g)
{
    Py_CLEAR(g->l1);
    Py_CLEAR(g->core);
    Py_CLEAR(g->keys);
    Py_CLEAR(g->decode);
    Py_CLEAR(g->slow);
    Py_CLEAR(g->flush);
    Py_CLEAR(g->hot);
    Py_CLEAR(g->wrapped);
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
    Py_CLEAR(g->l1);
    Py_CLEAR(g->core);
    Py_CLEAR(g->keys);
    Py_CLEAR(g->decode);
    Py_CLEAR(g->flush);
    Py_RETURN_NONE;
}

/* take_hot() -> the sampled reads buffered so far (key -> count); the buffer starts anew */
static PyObject *
Getter_take_hot(Getter *g, PyObject *Py_UNUSED(ignored))
{
    PyObject *fresh = PyDict_New();
    if (!fresh)
        return NULL;
    PyObject *out = g->hot ? g->hot : PyDict_New();
    g->hot = fresh;
    g->hot_since = mono_now();
    return out;
}

/* sampled(key): the sampling step of a read served by the Python path */
static PyObject *
Getter_sampled(Getter *g, PyObject *key)
{
    if (getter_sample(g, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* time_every(n, bounds): time one read in n (0: none) into buckets with these upper
 * bounds in ns (LAT_BUCKETS - 1 of them, increasing) */
static PyObject *
Getter_time_every(Getter *g, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != LAT_BUCKETS - 1) {
        PyErr_Format(PyExc_TypeError, "time_every(n, bounds): bounds is a tuple of %d ints",
                     (int)(LAT_BUCKETS - 1));
        return NULL;
    }
    long long n = PyLong_AsLongLong(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long bounds[LAT_BUCKETS - 1];
    for (Py_ssize_t i = 0; i < LAT_BUCKETS - 1; i++) {
        bounds[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[1], i));
        if (PyErr_Occurred())
            return NULL;
        if (i && bounds[i] <= bounds[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "time_every: bounds must increase");
            return NULL;
        }
    }
    memcpy(g->lat_bounds, bounds, sizeof bounds);
    g->lat_every = n > 0 ? n : 0;
    g->lat_left = g->lat_every;
    Py_RETURN_NONE;
}

/* latency -> ((l1 buckets..., sum_ns, count), (l2 ...)): cumulative */
static PyObject *
Getter_get_latency(Getter *g, void *closure)
{
    PyObject *out = PyTuple_New(2);
    if (!out)
        return NULL;
    for (int t = 0; t < 2; t++) {
        PyObject *row = PyTuple_New(LAT_BUCKETS + 2);
        if (!row) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, t, row);
        for (int i = 0; i < LAT_BUCKETS + 2; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(g->lat[t][i]);
            if (!v) {
                Py_DECREF(out);
                return NULL;
            }
            PyTuple_SET_ITEM(row, i, v);
        }
    }
    return out;
}

/* The getter explains itself as the method it stands in for (``__wrapped__``, set by the
 * client to its ``Reads.get``): ``inspect.signature`` follows ``__wrapped__``, and
 * ``__doc__``, ``__name__`` and ``__qualname__`` are the method's; without one, the type's.
 * Attribute lookups only: the call (Getter_vectorcall) never reads them. */
static PyObject *
Getter_get_wrapped(Getter *g, void *closure)
{
    if (!g->wrapped) {
        PyErr_SetString(PyExc_AttributeError, "__wrapped__");
        return NULL;
    }
    return Py_NewRef(g->wrapped);
}

static int
Getter_set_wrapped(Getter *g, PyObject *value, void *closure)
{
    Py_XSETREF(g->wrapped, Py_XNewRef(value));
    return 0;
}

static PyObject *
Getter_get_wrapped_attr(Getter *g, void *name)
{
    if (g->wrapped)
        return PyObject_GetAttrString(g->wrapped, (const char *)name);
    if (strcmp((const char *)name, "__doc__") == 0)
        return PyUnicode_FromString(Py_TYPE(g)->tp_doc);
    return PyUnicode_FromString("Getter");
}

/* A non-data descriptor that binds to nothing (``type(kv).x = kv.get`` would still be the
 * getter): it lets inspect and pydoc treat the getter as a method, as a C method is. */
static PyObject *
Getter_descr_get(PyObject *g, PyObject *obj, PyObject *type)
{
    return Py_NewRef(g);
}

static PyGetSetDef Getter_getset[] = {
    {"latency", (getter)Getter_get_latency, NULL, "sampled L1/L2 hit latency (cumulative)", NULL},
    {"__wrapped__", (getter)Getter_get_wrapped, (setter)Getter_set_wrapped,
     "the Python method this getter stands in for (signature and documentation)", NULL},
    {"__doc__", (getter)Getter_get_wrapped_attr, NULL, NULL, "__doc__"},
    {"__name__", (getter)Getter_get_wrapped_attr, NULL, NULL, "__name__"},
    {"__qualname__", (getter)Getter_get_wrapped_attr, NULL, NULL, "__qualname__"},
    {NULL},
};

static PyObject *
Getter_call(Getter *g, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call((PyObject *)g, args, kwargs);
}

static PyMemberDef Getter_members[] = {
    {"sample", T_LONGLONG, offsetof(Getter, sample), 0, "reads until the next sampled one"},
    {"rng", T_ULONGLONG, offsetof(Getter, rng), 0, "the sampling gaps' random state (non-zero)"},
    {"hits", T_ULONGLONG, offsetof(Getter, hits), 0, "L1 hits served"},
    {"l2_hits", T_ULONGLONG, offsetof(Getter, l2_hits), 0, "L2 reads served in C"},
    {NULL},
};

static PyMethodDef Getter_methods[] = {
    {"close", (PyCFunction)Getter_close, METH_NOARGS, "serve no more reads"},
    {"take_hot", (PyCFunction)Getter_take_hot, METH_NOARGS, "the sampled reads buffered"},
    {"sampled", (PyCFunction)Getter_sampled, METH_O, "count a read for hot keys"},
    {"time_every", (PyCFunction)(void (*)(void))Getter_time_every, METH_FASTCALL,
     "time_every(n, bounds): time one read in n"},
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
    .tp_getset = Getter_getset,
    .tp_descr_get = Getter_descr_get,
    .tp_doc = "kv.get: Getter(l1, core, keys, decode, slow, flush, sample_every, zero_copy, l1_on)",
};

