/* ------------------------------------------------------------------ pins (lock-free) */

/* an entry this process owns and is not using, or a newly claimed one; -1: none free */
static long long
claim_entry(Core *c)
{
    uint64_t token = my_token(c);
    if (!token)
        return -1; /* the process table is full: copies instead of views */
    if (c->n_owned > 0) {
        uint32_t i = c->owned[--c->n_owned];
        if (i < c->n_pins && __atomic_load_n(&pin_entry(c, i)[1], __ATOMIC_SEQ_CST) == token)
            return (long long)i;
        /* (swept as a dead process's while we thought it ours: claim another) */
    }
    for (uint64_t i = 0; i < c->n_pins; i++) {
        uint64_t *e = pin_entry(c, i);
        uint64_t expected = 0;
        if (LDR(&e[1]) != 0)
            continue;
        if (!__atomic_compare_exchange_n(&e[1], &expected, token, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            continue;
        __atomic_store_n(&e[0], 0, __ATOMIC_SEQ_CST);
        uint64_t hwm = __atomic_load_n(HW(c, H_PIN_HWM), __ATOMIC_SEQ_CST);
        while (hwm < i + 1 && !__atomic_compare_exchange_n(HW(c, H_PIN_HWM), &hwm, i + 1, 0,
                                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            ;
        return (long long)i;
    }
    return -1;
}

/* The calling thread's last pin, until a view owns it (pin_kept) or it is given back
 * (drop_pending): per thread, as two threads of one client may each be between a pin and
 * its view (one pending pin per Core let thread B's pin release thread A's, whose view
 * then read a block reused under it). */
static _Thread_local Core *pend_core;
static _Thread_local long long pend_idx = -1;
static _Thread_local uint64_t pend_word;

static int release_pin(Core *c, uint64_t index, uint64_t word);

/* publish a hazard on ``off`` in entry ``i`` (this process's): the new block word */
static uint64_t
set_hazard(Core *c, uint64_t i, uint64_t off)
{
    uint64_t *e = pin_entry(c, i);
    uint64_t gen = (HAZ_GEN(__atomic_load_n(&e[0], __ATOMIC_SEQ_CST)) + 1) & 0xFFFF;
    uint64_t word = off | (gen << 48);
    __atomic_store_n(&e[0], word, __ATOMIC_SEQ_CST);
    return word;
}

/* give an entry back: kept owned for the next view (its generation kept), or unowned */
static void
return_entry(Core *c, uint64_t i)
{
    uint64_t *e = pin_entry(c, i);
    __atomic_store_n(&e[0], HAZ_GEN(__atomic_load_n(&e[0], __ATOMIC_SEQ_CST)) << 48,
                     __ATOMIC_SEQ_CST);
    if (c->n_owned < OWNED_MAX) {
        c->owned[c->n_owned++] = (uint32_t)i;
        return;
    }
    uint64_t expected = c->token;
    __atomic_compare_exchange_n(&e[1], &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* After claim_entry: a process's first pin starts its token's sleeper thread with the GIL
 * released (my_token), and a close in another thread meanwhile left the mapping to this
 * call (Core_release): the entry given back, core_closed; 1. Else 0. */
static int
closed_meanwhile(Core *c, long long idx)
{
    if (!c->closing)
        return 0;
    if (idx >= 0)
        return_entry(c, (uint64_t)idx);
    core_closed(c, "this read was under way; open it again");
    return 1;
}

/* pin(key, h, zero_copy) -> None | (word, seq, tag, meta, counter, hlc, vvx, size, pin, voff,
 * vlen) | (..., -1, value bytes)   LOCK-FREE
 * Names the key's block in a hazard entry of this process, so that writers park instead of
 * free it: the returned (voff, vlen) stays valid until unpin(pin). pin -1: the pin table is
 * full, and the last element is a private copy of the value instead. None: absent or a
 * tombstone. -1 (an int): a slot stayed odd too long (Python decides). */
static PyObject *
Core_pin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pin(key: bytes, h: int)");
        return NULL;
    }
    const char *key = PyBytes_AS_STRING(args[0]);
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (LDR(HW(c, H_STATE)) != STATE_OK) {
        PyErr_SetString(SegmentError, "this namespace was purged; open it again");
        return NULL;
    }
    long long idx = -2; /* not claimed yet */
    for (int attempt = 0; attempt < 100000; attempt++) {
        /* find the key's slot and block, as a lock-free reader does */
        uint64_t so = 0, s = 0, off = 0;
        uint64_t i = h & c->mask;
        int odd = 0;
        for (uint64_t probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
            if (!slot_present(c, slot_off(c, i)))
                break; /* (never written: EMPTY) */
            uint64_t *slot = W(c, slot_off(c, i));
            uint64_t seq = LD(&slot[SLOT_SEQ]);
            if (seq & 1) {
                odd = 1;
                break;
            }
            uint64_t o = LD(&slot[SLOT_OFF]), sh = LD(&slot[SLOT_HASH]);
            if (o == EMPTY)
                break;
            if (o == TOMB || sh != h)
                continue;
            Rec r;
            int sane = rec_parse(c, o, &r);
            int match = sane && r.klen == klen && memcmp(rec_key(c, o), key, klen) == 0;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (LD(&slot[SLOT_SEQ]) != seq) {
                odd = 1; /* changed under us: look again */
                break;
            }
            if (!sane) {
                if (idx >= 0)
                    return_entry(c, (uint64_t)idx);
                PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
                return NULL;
            }
            if (match) {
                so = slot_off(c, i);
                s = seq;
                off = o;
                break;
            }
        }
        if (odd) {
            if (attempt > 20000) {
                if (idx >= 0)
                    return_entry(c, (uint64_t)idx);
                return PyLong_FromLong(-1);
            }
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        if (!so) {
            if (idx >= 0)
                return_entry(c, (uint64_t)idx);
            Py_RETURN_NONE;
        }
        if (idx == -2) {
            idx = claim_entry(c);
            if (closed_meanwhile(c, idx))
                return NULL;
        }
        uint64_t *slot = W(c, so);
        if (idx < 0) {
            /* the pin table is full: a consistent copy instead of a view */
            Rec r;
            if (!rec_parse(c, off, &r))
                continue;
            PyObject *copy = PyBytes_FromStringAndSize(c->base + off + r.vrel, (Py_ssize_t)r.vlen);
            PyObject *meta = PyBytes_FromStringAndSize(rec_meta(c, off, &r), (Py_ssize_t)r.mlen);
            PyObject *vvx = PyBytes_FromStringAndSize(rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (!copy || !meta || !vvx || LD(&slot[SLOT_SEQ]) != s) {
                Py_XDECREF(copy);
                Py_XDECREF(meta);
                Py_XDECREF(vvx);
                if (PyErr_Occurred())
                    return NULL;
                continue;
            }
            if (r.tag == TAG_TOMBSTONE) {
                Py_DECREF(copy);
                Py_DECREF(meta);
                Py_DECREF(vvx);
                Py_RETURN_NONE;
            }
            return Py_BuildValue("(KKKNKKNKLKN)", (unsigned long long)(so / 8), (unsigned long long)s,
                                 (unsigned long long)r.tag, meta, (unsigned long long)r.counter,
                                 (unsigned long long)r.hlc, vvx, (unsigned long long)r.size, -1LL,
                                 0ULL, copy);
        }
        /* publish the hazard, then check the slot still holds the block: if it does, no
           writer can have freed the block (it scans hazards after it publishes) */
        uint64_t word = set_hazard(c, (uint64_t)idx, off);
        if (__atomic_load_n(&slot[SLOT_SEQ], __ATOMIC_SEQ_CST) != s) {
            __atomic_store_n(&pin_entry(c, (uint64_t)idx)[0], HAZ_GEN(word) << 48, __ATOMIC_SEQ_CST);
            continue; /* replaced meanwhile: pin the new one */
        }
        Rec r;
        int sane = rec_parse(c, off, &r);
        if (!sane || r.tag == TAG_TOMBSTONE) {
            return_entry(c, (uint64_t)idx);
            if (!sane) {
                PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
                return NULL;
            }
            Py_RETURN_NONE;
        }
        if (!LDR(&slot[SLOT_REF]))
            ST(&slot[SLOT_REF], 1);
        c->active++;
        PyObject *out = Py_BuildValue(
            "(KKKy#KKy#KLKKK)", (unsigned long long)(so / 8), (unsigned long long)s,
            (unsigned long long)r.tag, rec_meta(c, off, &r), (Py_ssize_t)r.mlen,
            (unsigned long long)r.counter, (unsigned long long)r.hlc, rec_vvx(c, off, &r),
            (Py_ssize_t)r.vvlen, (unsigned long long)r.size, idx, (unsigned long long)(off + r.vrel),
            (unsigned long long)r.vlen, (unsigned long long)word);
        if (!out) {
            c->active--;
            return_entry(c, (uint64_t)idx);
            return NULL;
        }
        /* until Python says the view owns it (pin_kept), a release is pending: an
           exception before that gives it back (drop_pending) instead of leaking it */
        if (pend_core == c && pend_idx >= 0)
            release_pin(c, (uint64_t)pend_idx, pend_word);
        pend_core = c;
        pend_idx = idx;
        pend_word = word;
        return out;
    }
    if (idx >= 0)
        return_entry(c, (uint64_t)idx);
    return PyLong_FromLong(-1);
}

/* withdraw the hazard ``word`` in entry ``index`` if it is still this process's */
static int
release_pin(Core *c, uint64_t index, uint64_t word)
{
    if (!c->token || index >= c->n_pins || !HAZ_OFF(word) ||
        __atomic_load_n(&pin_entry(c, index)[1], __ATOMIC_SEQ_CST) != c->token ||
        __atomic_load_n(&pin_entry(c, index)[0], __ATOMIC_SEQ_CST) != word)
        return 0;
    return_entry(c, index);
    if (c->active)
        c->active--;
    if (pend_core == c && (long long)index == pend_idx)
        pend_idx = -1;
    __atomic_add_fetch(HW(c, H_RELEASED), 1, __ATOMIC_SEQ_CST);
    return 1;
}

/* unpin(index, word[, registry, ref]) -> bool: lock-free; withdraws this process's hazard
 * ``word`` (as pin() returned it) in entry ``index``: never another pin of the entry, never
 * another process's (a forked child's copy of a finalizer). The next writer frees a parked
 * block.
 *
 * With ``registry`` (a dict) and ``ref`` (a dead weakref): a view's weakref callback,
 * ``functools.partial(core.unpin, index, word, registry)``. It also removes
 * ``registry[id(ref)]``, and raises nothing: Python code run there (a Python callback)
 * would let a pending SIGINT's handler run where its KeyboardInterrupt is dropped
 * ("Exception ignored in"); C runs no bytecode, so the signal waits for the caller's next
 * one. */
static PyObject *
Core_unpin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unpin(index, word[, registry, ref])");
        return NULL;
    }
    if (nargs == 4) {
        if (PyDict_Check(args[2])) {
            PyObject *key = PyLong_FromVoidPtr(args[3]);
            if (key == NULL || PyDict_DelItem(args[2], key) < 0)
                PyErr_Clear();  /* (not there: a second call, a registry cleared by fork) */
            Py_XDECREF(key);
        }
    }
    if (!c->has_view || c->pid != (uint64_t)getpid())
        Py_RETURN_FALSE;  /* (closed; or a forked child's copy no forked() reached: its
                             pins are the parent's) */
    uint64_t index = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t word = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) {
        if (nargs == 4) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        return NULL;
    }
    return PyBool_FromLong(release_pin(c, index, word));
}

/* pin_kept(): the last pin now belongs to a view (its finalizer will release it) */
static PyObject *
Core_pin_kept(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (pend_core == c)
        pend_idx = -1;
    Py_RETURN_NONE;
}

/* drop_pending(): release the last pin if no view took it (an exception came between) */
static PyObject *
Core_drop_pending(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (pend_core == c && pend_idx >= 0) {
        if (c->has_view)
            release_pin(c, (uint64_t)pend_idx, pend_word);
        pend_idx = -1;
    }
    Py_RETURN_NONE;
}

/* pin_block(off) -> index | -1: a hazard of this process on block ``off`` (after fork,
 * for the views a child inherits; the parent's hazard protects the block meanwhile) */
static PyObject *
Core_pin_block(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t off = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (!block_ok(c, off))
        return PyLong_FromLong(-1);
    long long idx = claim_entry(c);
    if (closed_meanwhile(c, idx))
        return NULL;
    if (idx < 0)
        return Py_BuildValue("(LK)", -1LL, 0ULL);
    uint64_t word = set_hazard(c, (uint64_t)idx, off);
    c->active++;
    return Py_BuildValue("(LK)", idx, (unsigned long long)word);
}

/* pin_block_of(index) -> the block entry ``index`` names, 0 if none */
static PyObject *
Core_pinned_block(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t index = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (index >= c->n_pins)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(HAZ_OFF(__atomic_load_n(&pin_entry(c, index)[0], __ATOMIC_SEQ_CST)));
}

/* forked(): in a child after fork: the parent's lock, token, owned entries and pins are
 * not the child's (its sleeper thread did not survive the fork) */
static PyObject *
Core_forked(Core *c, PyObject *Py_UNUSED(ignored))
{
    c->pid = (uint64_t)getpid();
    c->token = 0;
    c->sleeper = NULL;
    c->n_owned = 0;
    c->active = 0;
    c->waiting = 0; /* (the parent's waiting threads are not here) */
    c->held = 0;
    held_n = held_over = 0; /* (the parent's locks are not the child's) */
    if (pend_core == c)
        pend_idx = -1;
    Py_RETURN_NONE;
}

/* sweep(next_check_ms) -> parked blocks left: clear the entries of processes that are gone
 * (their tokens dead: procs.c), free parked blocks no entry names, and set when writers
 * look again   [lock held] */
static PyObject *
Core_sweep(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    uint64_t next = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    uint64_t prev_busy = *HW(c, H_BUSY);
    ST(HW(c, H_BUSY), 1);
    uint64_t hwm = pin_hwm(c);
    for (uint64_t i = 0; i < hwm; i++) {
        uint64_t *e = pin_entry(c, i);
        uint64_t token = LDR(&e[1]);
        if (!token || token_alive(c, token))
            continue;
        /* block word first: no live reader can own a dead process's entry */
        __atomic_store_n(&e[0], 0, __ATOMIC_SEQ_CST);
        uint64_t expected = token;
        __atomic_compare_exchange_n(&e[1], &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    /* (the high-water mark is never lowered: a reader may be claiming an entry above any
       mark computed here, and a writer reading a lowered mark could miss its hazard.
       Claims take the lowest free entry, so the mark stays near the most views held.) */
    if (sweep_deferred(c) < 0)
        return NULL;
    ST(HW(c, H_DEAD_CHECK_MS), next);
    ST(HW(c, H_BUSY), prev_busy);
    return PyLong_FromUnsignedLongLong(*HW(c, H_DEFERRED));
}
