/* ------------------------------------------------------------------ lock-free read */

static PyObject *
build_read(Core *c, uint64_t so, uint64_t s, uint64_t off, Rec *r, int copy_value)
{
    PyObject *value, *meta, *vvx;
    if (!copy_value) {
        value = Py_None;
        Py_INCREF(value);
    } else {
        value = PyBytes_FromStringAndSize(c->base + off + r->vrel, (Py_ssize_t)r->vlen);
    }
    meta = PyBytes_FromStringAndSize(rec_meta(c, off, r), (Py_ssize_t)r->mlen);
    vvx = PyBytes_FromStringAndSize(rec_vvx(c, off, r), (Py_ssize_t)r->vvlen);
    if (!value || !meta || !vvx) {
        Py_XDECREF(value);
        Py_XDECREF(meta);
        Py_XDECREF(vvx);
        return NULL;
    }
    return Py_BuildValue("(KKKNNKKNK)", (unsigned long long)(so / 8), (unsigned long long)s,
                         (unsigned long long)r->tag, meta, value, (unsigned long long)r->counter,
                         (unsigned long long)r->hlc, vvx, (unsigned long long)r->size);
}

/* read(key, h, zero_copy) -> None | tuple | -1
 * tuple: (slot word, seq, tag, meta, value or None, counter, hlc, vvx, size); tag 0 is a
 * tombstone (the key is deleted, L3 not told yet). value is None for an array of zero_copy
 * bytes or more (the caller pins it). -1: a slot stayed odd too long (a writer is stopped or
 * died mid-publish): Python decides. Raises SegmentError on a purged or corrupt segment.  */
static PyObject *
Core_read(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "read(key: bytes, h: int, zero_copy: int)");
        return NULL;
    }
    const char *key = PyBytes_AS_STRING(args[0]);
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long zc = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (LDR(HW(c, H_STATE)) != STATE_OK) {
        PyErr_SetString(SegmentError, "this namespace was purged; open it again");
        return NULL;
    }
    uint64_t i = h & c->mask;
    for (uint64_t probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
        uint64_t so = slot_off(c, i);
        uint64_t *slot = W(c, so);
        int spins = 0;
        for (;;) {
            uint64_t s = LD(&slot[SLOT_SEQ]);
            if (s & 1) {
                if (++spins > 20000)
                    return PyLong_FromLong(-1);
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            uint64_t off = LD(&slot[SLOT_OFF]);
            uint64_t sh = LD(&slot[SLOT_HASH]);
            if (off == EMPTY) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LD(&slot[SLOT_SEQ]) != s)
                    continue;
                Py_RETURN_NONE;
            }
            if (off == TOMB || sh != h)
                break;
            Rec r;
            int sane = rec_parse(c, off, &r);
            int match = sane && r.klen == klen && memcmp(rec_key(c, off), key, klen) == 0;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (LD(&slot[SLOT_SEQ]) != s)
                continue; /* changed under us */
            if (!sane) {
                PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
                return NULL;
            }
            if (!match)
                break; /* a hash collision: keep probing */
            PyObject *out = build_read(c, so, s, off, &r, !(r.tag == TAG_NDARRAY && r.vlen >= zc));
            if (!out)
                return NULL;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (LD(&slot[SLOT_SEQ]) != s) {
                Py_DECREF(out);
                continue; /* the copy may be torn: take it again */
            }
            if (!LDR(&slot[SLOT_REF]))
                ST(&slot[SLOT_REF], 1); /* CLOCK reference bit */
            return out;
        }
    }
    Py_RETURN_NONE;
}
