/* ------------------------------------------------------------------ init */

static int
Core_init(Core *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    int fd = -1;
    if (!PyArg_ParseTuple(args, "O|i", &obj, &fd))
        return -1;
    if (self->has_fd) {
        close(self->fd);
        self->has_fd = 0;
    }
    if (fd >= 0) { /* the Core's own duplicate: writers reserve memory through it */
        self->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (self->fd < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->has_fd = 1;
    }
    if (self->has_view) {
        guard_remove(self->guard);
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->guard = -1;
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    self->base = self->view.buf;
    self->size = (uint64_t)self->view.len;
    self->guard = guard_add((uintptr_t)self->base, (size_t)self->size);
    struct stat st;
    if (self->has_fd && fstat(self->fd, &st) == 0) {
        self->seg_dev = (uint64_t)st.st_dev;
        self->seg_ino = (uint64_t)st.st_ino;
    } else {
        self->seg_dev = 0;
        self->seg_ino = (uint64_t)(uintptr_t)self->base;
    }
    self->held = 0;
    self->pid = (uint64_t)getpid();
    self->n_owned = 0;
    self->token = 0;
    self->sleeper = NULL;
    self->active = 0;
    self->waiting = 0;
    if (((uintptr_t)self->base & 63) || self->size < HEADER_SIZE) {
        PyErr_SetString(SegmentError, "L2 mapping is too small or misaligned");
        return -1;
    }
    uint64_t *h = (uint64_t *)self->base;
    uint64_t n_slots = h[H_NSLOTS], data_size = h[H_DATA_SIZE];
    self->n_slots = n_slots;
    self->mask = n_slots - 1;
    self->slots_off = h[H_SLOTS_OFF];
    self->meta_off = h[H_META_OFF];
    self->data_off = h[H_DATA_OFF];
    self->top_order = h[H_TOP_ORDER];
    self->feed_off = h[H_FEED_OFF];
    self->feed_n = h[H_FEED_N];
    self->feed_esz = h[H_FEED_ESZ];
    self->pins_off = h[H_PINS_OFF];
    self->n_pins = h[H_NPINS];
    self->defer_off = h[H_DEFER_OFF];
    self->max_key = h[H_MAX_KEY];
    self->procs_off = h[H_PROCS_OFF];
    self->n_procs = h[H_NPROCS];
    self->resv_off = h[H_RESV_OFF];
    self->resv_pages = self->size / RESV_PAGE;
    self->mutex = (pthread_mutex_t *)(self->base + MUTEX_AT);
    uint64_t sz = self->size;
    /* each quantity is bounded before it is multiplied, so no product wraps */
    int ok = n_slots > 0 && n_slots <= (1ULL << 32) && (n_slots & (n_slots - 1)) == 0 &&
             self->slots_off == HEADER_SIZE &&
             self->meta_off >= self->slots_off + n_slots * SLOT_WORDS * 8 &&
             self->top_order >= MIN_ORDER && self->top_order <= MAX_ORDER &&
             data_size > 0 && data_size <= sz && (data_size & ((1ULL << self->top_order) - 1)) == 0 &&
             self->data_off <= sz && self->data_off % 4096 == 0 &&
             self->meta_off <= self->data_off && (data_size >> MIN_ORDER) <= self->data_off - self->meta_off &&
             data_size <= sz - self->data_off &&
             self->max_key >= 1 && self->max_key <= MAX_KEY &&
             self->feed_n >= 1 && self->feed_n <= (1ULL << 32) && self->feed_esz % 8 == 0 &&
             self->feed_esz >= FEED_KEY_AT + self->max_key && self->feed_esz <= (1ULL << 16) &&
             self->feed_off == self->data_off + data_size && self->feed_off <= sz &&
             self->feed_n * self->feed_esz <= sz - self->feed_off &&
             self->n_pins >= 1 && self->n_pins <= (1ULL << 24) &&
             self->pins_off == self->feed_off + self->feed_n * self->feed_esz &&
             self->pins_off <= sz && self->n_pins * PIN_WORDS * 8 <= sz - self->pins_off &&
             self->defer_off == self->pins_off + self->n_pins * PIN_WORDS * 8 &&
             self->n_pins * 8 <= sz - self->defer_off &&
             self->n_procs >= 1 && self->n_procs < (1ULL << TOKEN_SLOT_BITS) - 1 &&
             self->procs_off % 64 == 0 && self->procs_off >= self->defer_off + self->n_pins * 8 &&
             self->procs_off <= sz && self->n_procs * PROC_BYTES <= sz - self->procs_off &&
             self->resv_off % 8 == 0 && self->resv_off <= sz &&
             (self->resv_pages + 63) / 64 * 8 <= sz - self->resv_off;
    if (!ok) {
        PyErr_SetString(SegmentError, "L2 layout does not fit its mapping (corrupt header); purge it");
        return -1;
    }
    self->data_end = self->data_off + data_size;
    return 0;
}

/* No call of this process needs the mapping now: no writer lock held through it, no pin
 * in use, no thread asleep on it with the GIL released */
static inline int
core_idle(Core *c)
{
    return !c->held && !c->active && !c->waiting;
}

/* Let go of the mapping (the token, the file, the buffer), closing set first: a call that
 * comes in while release_token has the GIL released is refused (NEED_VIEW). unmap: also
 * close the mmap the buffer came from (a close the segment's own close() left to the
 * waiters: its mm.close() could not unmap it then); one still exported stays mapped */
static void
core_drop(Core *self, int unmap)
{
    self->closing = 1;
    if (self->token)
        release_token(self);
    if (self->has_fd) {
        close(self->fd);
        self->has_fd = 0;
    }
    if (self->has_view) {
        PyObject *mm = unmap ? Py_XNewRef(self->view.obj) : NULL;
        guard_remove(self->guard);
        self->guard = -1;
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        self->base = NULL;
        if (mm) {
            PyObject *et, *ev, *tb; /* (none set when called: kept all the same) */
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *r = PyObject_CallMethod(mm, "close", NULL);
            if (r)
                Py_DECREF(r);
            else
                PyErr_Clear(); /* (BufferError: views of it alive; unmapped when they go) */
            PyErr_Restore(et, ev, tb);
            Py_DECREF(mm);
        }
    }
}

/* A call that let go of the GIL (asleep on the writer lock, starting its token's sleeper)
 * finds its client closed meanwhile (closing: Core_release left the mapping to it): the
 * mapping let go if no other call needs it, SegmentError "...closed while <what>" */
static void
core_closed(Core *c, const char *what)
{
    if (core_idle(c))
        core_drop(c, 1);
    PyErr_Format(SegmentError, "this kvcomm client was closed while %s", what);
}

/* A mapping is never unmapped while a thread of this process holds the lock through it:
 * the kernel releases a dead holder's robust mutex by walking the holder's list of held
 * mutexes, which it can only do if the memory is still mapped at exit. So a Core that goes
 * (closed, or collected at interpreter shutdown) while its lock is held keeps its buffer
 * export, and with it the mapping, until the process ends. */
static void
Core_dealloc(Core *self)
{
    if (self->has_view && core_idle(self))
        core_drop(self, 0);
    else if (self->has_fd) {
        close(self->fd);
        self->has_fd = 0;
    }
    /* (else the mapping stays: a held lock, or pins of this process still in use, which
       the process table's sleeper vouches for until the process ends) */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Core_release(Core *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held || self->active) {
        /* see Core_dealloc: leave the mapping in place */
        Py_RETURN_FALSE;
    }
    if (self->waiting) {
        /* threads asleep on the writer lock through this mapping would wake in unmapped
           memory: they wake to SegmentError instead, the last one drops it (lock.c) */
        self->closing = 1;
        Py_RETURN_FALSE;
    }
    core_drop(self, 0);
    Py_RETURN_NONE;
}

/* Whether a call may use the mapping now: 1, or 0 with SegmentError set (closed or being
 * closed; its file truncated under this process). ``during``: what the call was doing when
 * it looked again after running Python code (a close may have come then), or NULL */
static int
view_ok(Core *c, const char *during)
{
    if (!c->has_view || c->closing) {
        if (during)
            PyErr_Format(SegmentError, "this kvcomm client was closed while %s", during);
        else
            PyErr_SetString(SegmentError, "this L2 mapping is closed; reopen");
        return 0;
    }
    if (guard_lost(c->guard)) {
        PyErr_SetString(SegmentError, "the L2 segment file was truncated under this process "
                                      "(its data here is lost); open the namespace again");
        return 0;
    }
    return 1;
}

#define NEED_VIEW(c)          \
    if (!view_ok((c), NULL))  \
        return NULL;

#define NEED_LOCK(c)                                                                  \
    if (!(c)->held || !pthread_equal((c)->holder, pthread_self())) {                  \
        PyErr_SetString(PyExc_RuntimeError, "L2 writer lock not held by this thread"); \
        return NULL;                                                                  \
    }

/* ------------------------------------------------------------------ atomics
 * load/store/cas/add on any 8-aligned word of the mapping: Python has no atomic
 * read-modify-write on memory shared between processes. A bad offset raises IndexError.
 */

static uint64_t *
word_at(Core *c, PyObject *off_obj)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || off % 8 != 0 || (uint64_t)off + 8 > c->size) {
        PyErr_Format(PyExc_IndexError, "bad atomic offset %zd", off);
        return NULL;
    }
    return (uint64_t *)(c->base + off);
}

static PyObject *
Core_load(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t *p = word_at(c, arg);
    return p ? PyLong_FromUnsignedLongLong(LD(p)) : NULL;
}

static PyObject *
Core_store(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "store(off, value)"); return NULL; }
    uint64_t *p = word_at(c, args[0]);
    uint64_t v = PyLong_AsUnsignedLongLong(args[1]);
    if (!p || PyErr_Occurred()) return NULL;
    ST(p, v);
    Py_RETURN_NONE;
}

static PyObject *
Core_cas(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cas(off, expected, desired)"); return NULL; }
    uint64_t *p = word_at(c, args[0]);
    uint64_t expected = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t desired = PyLong_AsUnsignedLongLong(args[2]);
    if (!p || PyErr_Occurred()) return NULL;
    if (__atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *
Core_add(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    /* fetch-and-add with a full barrier; delta may be negative. Returns the new value. */
    NEED_VIEW(c);
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "add(off, delta)"); return NULL; }
    uint64_t *p = word_at(c, args[0]);
    long long delta = PyLong_AsLongLong(args[1]);
    if (!p || PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_add_fetch(p, (uint64_t)delta, __ATOMIC_SEQ_CST));
}
