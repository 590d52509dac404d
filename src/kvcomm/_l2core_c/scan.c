/* ------------------------------------------------------------------ purge, scans */

/* purge_mark(): mark the namespace purged and move every slot's seq on by two, so that
 * every process's L1 entries fail revalidation and every read and write raises
 * SegmentError. LOCK-FREE on purpose: a process stopped while holding the lock must not
 * keep the namespace alive (a writer mid-publish keeps its parity: +2 is even). */
static PyObject *
Core_purge_mark(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    __atomic_store_n(HW(c, H_STATE), STATE_PURGED, __ATOMIC_SEQ_CST);
    for (uint64_t i = 0; i < c->n_slots; i++)
        if (slot_present(c, slot_off(c, i))) /* (a slot never written has no L1 entry) */
            __atomic_add_fetch(&W(c, slot_off(c, i))[SLOT_SEQ], 2, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* scan(mode) -> list of keys (bytes). mode 0: live keys (not tombstones); mode 1: dirty
 * records (tombstones too): what L3 has not acknowledged; mode 2: every record (tombstones
 * too). Lock-free; concurrent writes may or
 * may not show. */
static PyObject *
Core_scan(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    for (uint64_t i = 0; i < c->n_slots; i++) {
        if (!slot_present(c, slot_off(c, i)))
            continue;
        uint64_t *slot = W(c, slot_off(c, i));
        uint64_t s = LD(&slot[SLOT_SEQ]);
        uint64_t off = LD(&slot[SLOT_OFF]), fl = LD(&slot[SLOT_FLAGS]);
        if ((s & 1) || off <= TOMB)
            continue;
        if (mode == 1 && !(fl & FLAG_DIRTY))
            continue;
        Rec r;
        if (!rec_parse(c, off, &r))
            continue;
        if (mode == 0 && r.tag == TAG_TOMBSTONE)
            continue;
        PyObject *k = PyBytes_FromStringAndSize(rec_key(c, off), (Py_ssize_t)r.klen);
        if (!k) {
            Py_DECREF(out);
            return NULL;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (LD(&slot[SLOT_SEQ]) != s || PyList_Append(out, k) < 0) {
            int err = PyErr_Occurred() != NULL;
            Py_DECREF(k);
            if (err) {
                Py_DECREF(out);
                return NULL;
            }
            continue;
        }
        Py_DECREF(k);
    }
    return out;
}
