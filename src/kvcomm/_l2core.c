/*
 * kvcomm._l2core: the L2 segment's memory operations, in C.
 *
 * tiers/l2.py owns the design (its module docstring is the theory of operation) and the
 * policies that need the operating system (which pids are alive, when to sweep, when to
 * recover). This file does, fast and without being interruptible by Python signals, every
 * operation that reads or changes the shared structures:
 *
 *   - the writer lock: a process-shared, robust, error-checking pthread mutex in the
 *     header. A holder that dies (SIGKILL, at any instruction) hands the lock to the next
 *     taker with EOWNERDEAD; no pid is ever compared, so pid reuse, zombies and PID
 *     namespaces do not matter;
 *   - the lock-free seqlock read, and the locked writes: a whole batch is planned, checked
 *     and given its space and slots before the first record is published, so it is applied
 *     whole or not at all;
 *   - the buddy heap, CLOCK eviction (never of dirty or pinned entries), pins, the change
 *     feed, crash recovery, and scans.
 *
 * The layout constants come from tiers/shm/layout.py through the generated _l2layout.h.
 *
 * Safety against a corrupt or hostile segment: every offset, length and order read from
 * shared memory is read ONCE into a local and checked before use, with arithmetic that
 * cannot wrap (every length is first bounded by the record's size, itself bounded by the
 * heap). A corrupt segment yields SegmentError, never a wild read or write.
 *
 * The BUSY word: a writer raises it before it mutates anything and restores it after; a
 * writer that finds corruption half-way leaves it raised. Whoever takes the lock next and
 * finds BUSY raised repairs the segment first (recover()): so a death or a corruption in
 * the middle of a mutation is repaired instead of being built upon.
 *
 * Memory order: stores that lock-free readers load are __atomic stores with release order
 * (plain moves on x86-64, but the compiler may not reorder them); the slot seq bumps are
 * sequentially consistent read-modify-writes (full barriers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_l2layout.h"

#define TAG_NDARRAY 4
#define NEW_DOT UINT64_MAX

/* statuses returned (as ints) when a write changed nothing */
#define ST_NEED_SPACE 1 /* (kept for compatibility of status numbers) */
#define ST_SLOT_FULL 2  /* a key's probe window is full of unflushed writes */
#define ST_TOO_LARGE 3  /* a record can never fit */
#define ST_CORRUPT 4    /* corruption found before anything changed; BUSY left raised */
#define ST_DIRTY_FULL 5 /* too many writes wait for L3 (cluster.outbound_max) */
#define ST_LOOK 6       /* lock taken and released: Python must look first (state, busy, pins) */
#define ST_FULL 7       /* no space can be made: pinned or unflushed data fills L2 */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;
    uint64_t size;
    uint64_t n_slots, mask, slots_off, meta_off, data_off, data_end, top_order;
    uint64_t feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key;
    pthread_mutex_t *mutex;
    pthread_t holder; /* the thread of this process that holds the lock, if held */
    int held;
} Core;

static PyObject *SegmentError;    /* kvcomm.errors.SegmentError, set at import */
static PyObject *Unavailable;     /* kvcomm.errors.Unavailable */
static PyObject *InvalidArgument; /* kvcomm.errors.InvalidArgument */

#define W(c, off) ((uint64_t *)((c)->base + (off)))
#define HW(c, name) W(c, (name) * 8)
#define LD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define LDR(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define SEQ_ADD(p) __atomic_add_fetch((p), 1, __ATOMIC_SEQ_CST)

_Static_assert(sizeof(pthread_mutex_t) <= MUTEX_SPACE, "pthread_mutex_t does not fit the header");

/* ------------------------------------------------------------------ geometry */

static inline uint64_t slot_off(Core *c, uint64_t i) { return c->slots_off + (i & c->mask) * SLOT_WORDS * 8; }
static inline uint64_t slot_index(Core *c, uint64_t so) { return (so - c->slots_off) / (SLOT_WORDS * 8); }
static inline int block_ok(Core *c, uint64_t off) {
    return off >= c->data_off && off < c->data_end && ((off - c->data_off) & 63) == 0;
}
static inline uint8_t *meta_at(Core *c, uint64_t off) { /* requires block_ok(off) */
    return (uint8_t *)(c->base + c->meta_off + ((off - c->data_off) >> MIN_ORDER));
}
static inline uint64_t order_for(uint64_t size) {
    uint64_t order = MIN_ORDER;
    while (order < 63 && (1ULL << order) < size)
        order++;
    return order;
}
static inline int aligned_block(Core *c, uint64_t off, uint64_t order) {
    return block_ok(c, off) && order >= MIN_ORDER && order <= c->top_order &&
           ((off - c->data_off) & ((1ULL << order) - 1)) == 0 && off + (1ULL << order) <= c->data_end;
}
static inline uint8_t meta_alloc(uint64_t order) { return (uint8_t)(order - MIN_ORDER + 1); }
static inline uint8_t meta_free(uint64_t order) { return (uint8_t)(0x80 | (order - MIN_ORDER + 1)); }

/* A record, every field read once and checked. */
typedef struct {
    uint64_t size, counter, hlc, klen, tag, vvlen, vlen, vrel, pins, mlen, xlen;
} Rec;

static int
rec_parse(Core *c, uint64_t off, Rec *r)
{
    if (!block_ok(c, off) || REC_HEADER > c->data_end - off)
        return 0;
    uint64_t *w = W(c, off);
    uint64_t info = LDR(&w[REC_INFO]), lens = LDR(&w[REC_LENS]);
    r->size = LDR(&w[REC_SIZE]);
    r->counter = LDR(&w[REC_COUNTER]);
    r->hlc = LDR(&w[REC_HLC]);
    r->vlen = LDR(&w[REC_VLEN]);
    r->vrel = LDR(&w[REC_VREL]);
    r->pins = LDR(&w[REC_PINS]);
    r->klen = info & 0xFFFF;
    r->tag = (info >> 16) & 0xFF;
    r->vvlen = info >> 32;
    r->mlen = lens & 0xFFFFFFFFULL;
    r->xlen = lens >> 32;
    if (r->size < REC_HEADER || r->size > c->data_end - off)
        return 0;
    /* every length is bounded by size (< 2**48) first, so the sums below cannot wrap */
    if (r->klen == 0 || r->klen > c->max_key || r->vvlen > r->size || r->mlen > r->size ||
        r->xlen > r->size || r->vrel > r->size || r->vlen > r->size)
        return 0;
    if (REC_HEADER + r->klen + r->vvlen + r->mlen + r->xlen > r->vrel || r->vrel + r->vlen != r->size)
        return 0;
    return 1;
}

static inline const char *rec_key(Core *c, uint64_t off) { return c->base + off + REC_HEADER; }
static inline const char *rec_vvx(Core *c, uint64_t off, Rec *r) { return c->base + off + REC_HEADER + r->klen; }
static inline const char *rec_meta(Core *c, uint64_t off, Rec *r) {
    return c->base + off + REC_HEADER + r->klen + r->vvlen;
}

static int
set_corrupt(Core *c, const char *what)
{
    /* BUSY stays raised: the next lock holder repairs the segment before using it */
    ST(HW(c, H_BUSY), 1);
    PyErr_Format(SegmentError, "L2 segment is corrupt (%s); it is repaired by the next writer, "
                 "or purge the namespace", what);
    return -1;
}

/* ------------------------------------------------------------------ init */

static int
Core_init(Core *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj))
        return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    self->base = self->view.buf;
    self->size = (uint64_t)self->view.len;
    self->held = 0;
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
             self->n_pins * 8 <= sz - self->defer_off;
    if (!ok) {
        PyErr_SetString(SegmentError, "L2 layout does not fit its mapping (corrupt header); purge it");
        return -1;
    }
    self->data_end = self->data_off + data_size;
    return 0;
}

/* A mapping is never unmapped while a thread of this process holds the lock through it:
 * the kernel releases a dead holder's robust mutex by walking the holder's list of held
 * mutexes, which it can only do if the memory is still mapped at exit. So a Core that goes
 * (closed, or collected at interpreter shutdown) while its lock is held keeps its buffer
 * export, and with it the mapping, until the process ends. */
static void
Core_dealloc(Core *self)
{
    if (self->has_view && !self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Core_release(Core *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        /* see Core_dealloc: leave the mapping in place */
        Py_RETURN_FALSE;
    }
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        self->base = NULL;
    }
    Py_RETURN_NONE;
}

#define NEED_VIEW(c)                                                          \
    if (!(c)->has_view) {                                                     \
        PyErr_SetString(SegmentError, "this L2 mapping is closed; reopen");   \
        return NULL;                                                          \
    }

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

/* ------------------------------------------------------------------ the writer lock */

static PyObject *
Core_init_lock(Core *c, PyObject *Py_UNUSED(ignored))
{
    /* by the creator only, before the magic is published */
    NEED_VIEW(c);
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    if (!rc) {
        memset(c->mutex, 0, MUTEX_SPACE);
        rc = pthread_mutex_init(c->mutex, &attr);
    }
    pthread_mutexattr_destroy(&attr);
    if (rc) {
        PyErr_Format(SegmentError, "cannot initialise the L2 writer lock (error %d)", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static inline int
needs_look(Core *c)
{
    return LDR(HW(c, H_STATE)) != STATE_OK || LDR(HW(c, H_BUSY)) || LD(HW(c, H_RELEASED)) ||
           LDR(HW(c, H_DEFERRED));
}

static double
mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Take the writer lock within timeout seconds. 0: taken; -1: a Python error is set and the
 * lock is NOT held (timeout → Unavailable, a signal's exception, a corrupt mutex). The GIL
 * is released while waiting, so the holder (maybe a thread of this process) can go on. */
static int
take_lock(Core *c, double timeout)
{
    pthread_t self = pthread_self();
    if (c->held && pthread_equal(c->holder, self)) {
        PyErr_SetString(InvalidArgument,
                        "kvcomm was called to write from inside a validator (or another callback "
                        "that runs under the L2 writer lock); validators may read, not write");
        return -1;
    }
    int rc = pthread_mutex_trylock(c->mutex);
    if (rc == EBUSY) {
        double deadline = mono_now() + (timeout > 0 ? timeout : 0);
        for (;;) {
            double now = mono_now();
            double until = now + 0.05 < deadline ? now + 0.05 : deadline;
            struct timespec ts;
            ts.tv_sec = (time_t)until;
            ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
            Py_BEGIN_ALLOW_THREADS
            rc = pthread_mutex_clocklock(c->mutex, CLOCK_MONOTONIC, &ts);
            Py_END_ALLOW_THREADS
            if (rc != ETIMEDOUT)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1; /* e.g. KeyboardInterrupt while waiting: nothing is held */
            if (mono_now() >= deadline) {
                long owner = 0;
#ifdef __GLIBC__
                owner = (long)c->mutex->__data.__owner;
#endif
                char secs[32];
                PyOS_snprintf(secs, sizeof(secs), "%.1f", timeout);
                PyErr_Format(Unavailable,
                             "the L2 writer lock has been held for over %ss (by thread %ld); "
                             "is a process stopped (SIGSTOP, a debugger) while writing? Nothing was "
                             "written; retry, or raise cache.lock_timeout",
                             secs, owner);
                return -1;
            }
        }
    }
    if (rc == EOWNERDEAD) {
        /* its holder died; BUSY (if raised) makes Python repair the segment before use */
        if (pthread_mutex_consistent(c->mutex) != 0) {
            pthread_mutex_unlock(c->mutex);
            PyErr_SetString(SegmentError, "the L2 writer lock cannot be recovered; purge the namespace");
            return -1;
        }
        __atomic_add_fetch(HW(c, H_OWNER_DEATHS), 1, __ATOMIC_SEQ_CST);
        rc = 0;
    }
    if (rc == EDEADLK) {
        PyErr_SetString(InvalidArgument, "this thread already holds the L2 writer lock (re-entrant write)");
        return -1;
    }
    if (rc != 0) {
        PyErr_Format(SegmentError, "the L2 writer lock is unusable (error %d: %s); purge the namespace",
                     rc, strerror(rc));
        return -1;
    }
    c->holder = self;
    c->held = 1;
    return 0;
}

static void
drop_lock(Core *c)
{
    if (c->held && pthread_equal(c->holder, pthread_self())) {
        c->held = 0;
        pthread_mutex_unlock(c->mutex);
    }
}

/* lock(timeout) -> 0: locked, nothing to look at; 1: locked, Python must look first
 * (purged, BUSY raised, released views or parked blocks). Raises Unavailable after timeout. */
static PyObject *
Core_lock(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (take_lock(c, timeout) < 0)
        return NULL;
    return PyLong_FromLong(needs_look(c));
}

/* unlock() -> True if this thread held the lock (and released it), else False: safe to call
 * from every `finally`, whether or not the lock was taken. BUSY is left as it is. */
static PyObject *
Core_unlock(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (!c->has_view)
        Py_RETURN_FALSE;
    if (c->held && pthread_equal(c->holder, pthread_self())) {
        drop_lock(c);
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* owner() -> the thread id holding the lock (in its own PID namespace), 0 if none or unknown.
 * For tools (a nemesis that must not stop a process inside the lock); glibc only. */
static PyObject *
Core_owner(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    long owner = 0;
#ifdef __GLIBC__
    owner = (long)__atomic_load_n(&c->mutex->__data.__owner, __ATOMIC_RELAXED);
#endif
    return PyLong_FromLong(owner);
}

static PyObject *
Core_held(Core *c, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(c->has_view && c->held && pthread_equal(c->holder, pthread_self()));
}

/* set_busy(v): raise (1) or lower (0) BUSY around a mutation done from Python   [lock held] */
static PyObject *
Core_set_busy(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    ST(HW(c, H_BUSY), (uint64_t)(v != 0));
    Py_RETURN_NONE;
}

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

/* ------------------------------------------------------------------ heap   [lock held]
 * Every free-list link is checked before it is followed; a bad one is corruption. */

static int
free_head_ok(Core *c, uint64_t off, uint64_t order)
{
    return off == 0 || (aligned_block(c, off, order) && *meta_at(c, off) == meta_free(order));
}

static int
push_free(Core *c, uint64_t off, uint64_t order)
{
    uint64_t *hd = HW(c, H_FREE + order);
    uint64_t head = *hd;
    if (!free_head_ok(c, head, order))
        return set_corrupt(c, "free-list head");
    uint64_t *blk = W(c, off);
    blk[1] = head;
    blk[2] = 0;
    if (head)
        W(c, head)[2] = off;
    *hd = off;
    *meta_at(c, off) = meta_free(order);
    return 0;
}

static int
unlink_free(Core *c, uint64_t off, uint64_t order)
{
    uint64_t *blk = W(c, off);
    uint64_t nxt = blk[1], prv = blk[2];
    if (!free_head_ok(c, nxt, order) || !free_head_ok(c, prv, order) || nxt == off || prv == off)
        return set_corrupt(c, "free-list link");
    if (prv)
        W(c, prv)[1] = nxt;
    else if (*HW(c, H_FREE + order) == off)
        *HW(c, H_FREE + order) = nxt;
    else
        return set_corrupt(c, "free-list head");
    if (nxt)
        W(c, nxt)[2] = prv;
    *meta_at(c, off) = 0;
    return 0;
}

/* a block of 2**order bytes; 0 when none is free; (uint64_t)-1 on corruption */
static uint64_t
heap_alloc(Core *c, uint64_t order)
{
    uint64_t j = order;
    while (j <= c->top_order && *HW(c, H_FREE + j) == 0)
        j++;
    if (j > c->top_order)
        return 0;
    uint64_t off = *HW(c, H_FREE + j);
    if (!free_head_ok(c, off, j) || unlink_free(c, off, j) < 0) {
        if (!PyErr_Occurred())
            set_corrupt(c, "free-list head");
        return (uint64_t)-1;
    }
    while (j > order) {
        j--;
        if (push_free(c, off + (1ULL << j), j) < 0)
            return (uint64_t)-1;
    }
    *meta_at(c, off) = meta_alloc(order);
    *HW(c, H_USED) += 1ULL << order;
    return off;
}

/* the order of an allocated block, or 0 if off is not one */
static uint64_t
alloc_order(Core *c, uint64_t off)
{
    if (!block_ok(c, off))
        return 0;
    uint8_t m = *meta_at(c, off);
    if (m == 0 || (m & 0x80))
        return 0;
    uint64_t order = (uint64_t)(m & 0x7F) + MIN_ORDER - 1;
    return aligned_block(c, off, order) ? order : 0;
}

static int
heap_free(Core *c, uint64_t off)
{
    uint64_t order = alloc_order(c, off);
    if (!order)
        return set_corrupt(c, "freeing a block that is not allocated");
    *HW(c, H_USED) -= 1ULL << order;
    while (order < c->top_order) {
        uint64_t buddy = ((off - c->data_off) ^ (1ULL << order)) + c->data_off;
        if (!aligned_block(c, buddy, order) || *meta_at(c, buddy) != meta_free(order))
            break;
        if (unlink_free(c, buddy, order) < 0)
            return -1;
        *meta_at(c, off > buddy ? off : buddy) = 0;
        if (buddy < off)
            off = buddy;
        order++;
    }
    return push_free(c, off, order);
}

/* free a block no slot references, or park it while zero-copy views pin it */
static int
release_block(Core *c, uint64_t off)
{
    uint64_t pins = block_ok(c, off) && REC_HEADER <= c->data_end - off ? W(c, off)[REC_PINS] : 0;
    if (pins == 0)
        return heap_free(c, off);
    uint64_t *d = W(c, c->defer_off);
    for (uint64_t i = 0; i < c->n_pins; i++) {
        if (d[i] == 0) {
            d[i] = off;
            *HW(c, H_DEFERRED) += 1;
            return 0;
        }
    }
    return set_corrupt(c, "deferred table full (pin counts)");
}

static uint64_t
deferred_free_entries(Core *c)
{
    uint64_t *d = W(c, c->defer_off), n = 0;
    for (uint64_t i = 0; i < c->n_pins; i++)
        n += d[i] == 0;
    return n;
}

/* ------------------------------------------------------------------ feed   [lock held] */

static void
feed_append(Core *c, uint64_t kind, const char *key, uint64_t klen, uint64_t counter, uint64_t hlc)
{
    uint64_t *headp = HW(c, H_FEED_HEAD);
    uint64_t head = *headp, seq = head + 1;
    uint64_t e = c->feed_off + (head % c->feed_n) * c->feed_esz;
    uint64_t *ent = W(c, e);
    if (klen > c->max_key)
        klen = c->max_key;
    ST(&ent[FEED_SEQ], 0);
    ST(&ent[FEED_INFO], kind | (klen << 8));
    ST(&ent[FEED_COUNTER], counter);
    ST(&ent[FEED_HLC], hlc);
    memcpy(c->base + e + FEED_KEY_AT, key, klen);
    ST(&ent[FEED_SEQ], seq);
    ST(headp, seq);
}

static uint64_t
hlc_next(Core *c, uint64_t now_ms)
{
    uint64_t *hp = HW(c, H_HLC);
    uint64_t hlc = now_ms << 16;
    if (hlc <= *hp)
        hlc = *hp + 1;
    *hp = hlc;
    return hlc;
}

/* ------------------------------------------------------------------ slots   [lock held] */

/* Probe for key. *found = slot byte offset holding it (0 if none); returns the first
 * reusable slot (0 if none). -1 on a corrupt record in the window (BUSY raised). */
static int
find(Core *c, const char *key, uint64_t klen, uint64_t h, uint64_t *found, uint64_t *reusable)
{
    uint64_t i = h & c->mask, free = 0;
    *found = 0;
    for (uint64_t probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
        uint64_t so = slot_off(c, i);
        uint64_t *slot = W(c, so);
        uint64_t off = slot[SLOT_OFF];
        if (off == EMPTY) {
            *reusable = free ? free : so;
            return 0;
        }
        if (off == TOMB) {
            if (!free)
                free = so;
            continue;
        }
        if (slot[SLOT_HASH] != h)
            continue;
        Rec r;
        if (!rec_parse(c, off, &r))
            return set_corrupt(c, "a slot points at a malformed record");
        if (r.klen == klen && memcmp(rec_key(c, off), key, klen) == 0) {
            *found = so;
            *reusable = free;
            return 0;
        }
    }
    *reusable = free;
    return 0;
}

/* evict the live, clean, unpinned record in slot so: no L3 write, a local EVICT event */
static int
evict_slot(Core *c, uint64_t so)
{
    uint64_t *slot = W(c, so);
    uint64_t off = slot[SLOT_OFF];
    Rec r;
    if (!rec_parse(c, off, &r))
        return set_corrupt(c, "evicting a malformed record");
    char keybuf[MAX_KEY];
    memcpy(keybuf, rec_key(c, off), r.klen);
    SEQ_ADD(&slot[SLOT_SEQ]);
    ST(&slot[SLOT_OFF], TOMB);
    ST(&slot[SLOT_HASH], 0);
    ST(&slot[SLOT_FLAGS], 0);
    SEQ_ADD(&slot[SLOT_SEQ]);
    *HW(c, H_ENTRIES) -= 1;
    *HW(c, H_EVICTIONS) += 1;
    if (release_block(c, off) < 0)
        return -1;
    feed_append(c, KIND_EVICT, keybuf, r.klen, r.counter, r.hlc);
    return 0;
}

/* a slot CLOCK may evict: live, clean, its block unpinned, not protected */
static int
evictable(Core *c, uint64_t so, const uint64_t *protect, Py_ssize_t nprotect)
{
    uint64_t *slot = W(c, so);
    uint64_t off = slot[SLOT_OFF];
    if (off <= TOMB || (slot[SLOT_FLAGS] & FLAG_DIRTY))
        return 0;
    if (!block_ok(c, off) || REC_HEADER > c->data_end - off || W(c, off)[REC_PINS])
        return 0;
    for (Py_ssize_t k = 0; k < nprotect; k++)
        if (protect[k] == so)
            return 0;
    return 1;
}

/* CLOCK: evict one entry anywhere. 1: evicted; 0: nothing evictable; -1: corrupt. */
static int
clock_evict_one(Core *c, const uint64_t *protect, Py_ssize_t nprotect)
{
    uint64_t n = c->n_slots;
    uint64_t hand = *HW(c, H_CLOCK) % n;
    for (uint64_t step = 0; step < 2 * n + 1; step++) {
        uint64_t so = slot_off(c, hand);
        hand = (hand + 1) % n;
        if (!evictable(c, so, protect, nprotect))
            continue;
        uint64_t *slot = W(c, so);
        if (slot[SLOT_REF]) {
            slot[SLOT_REF] = 0; /* a second chance */
            continue;
        }
        *HW(c, H_CLOCK) = hand;
        return evict_slot(c, so) < 0 ? -1 : 1;
    }
    *HW(c, H_CLOCK) = hand;
    return 0;
}

/* CLOCK within a key's probe window (all MAX_PROBE slots taken). Same returns. */
static int
window_evict_one(Core *c, uint64_t h, const uint64_t *protect, Py_ssize_t nprotect)
{
    uint64_t base = h & c->mask;
    for (int round = 0; round < 2; round++) {
        for (uint64_t k = 0; k < MAX_PROBE; k++) {
            uint64_t so = slot_off(c, base + k);
            if (!evictable(c, so, protect, nprotect))
                continue;
            if (W(c, so)[SLOT_REF] && round == 0) {
                W(c, so)[SLOT_REF] = 0;
                continue;
            }
            return evict_slot(c, so) < 0 ? -1 : 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ writes   [lock held]
 *
 * One op of a batch. kind: OP_PUT (a local write: a new dot; the replaced record's entries
 * of other hosts, vvx, carried over), OP_VPUT (a record with a given version: counter, hlc,
 * vvx; counter NEW_DOT asks for a fresh local dot over the given vector), OP_DEL (a delete:
 * a tombstone record when tombstones are on (cluster mode), else the slot is unlinked).
 */
enum { OP_PUT = 0, OP_VPUT = 1, OP_DEL = 2 };

typedef struct {
    int kind;
    const char *key;
    uint64_t klen, h, tag;
    const char *meta;
    uint64_t mlen;
    Py_buffer val;
    int has_val;
    uint64_t x_counter, x_hlc;
    const char *x_vvx;
    uint64_t x_vvlen;
    /* the plan */
    int writes_record;   /* a put, or a tombstone */
    Py_ssize_t prev;     /* index+1 of the previous op on this key in the batch, 0 if none */
    uint64_t found;      /* the slot holding the key before the batch (0: none) */
    uint64_t slot;       /* the slot the key holds or will hold (found or claimed; 0: none) */
    int live_after, dirty_after;
    uint64_t vvlen;      /* bytes of vvx the record carries */
    uint64_t size, order, block;
    /* the result */
    uint64_t counter, hlc, so, seq;
    int existed;         /* the key had a live value (not a tombstone) before this op */
    PyObject *vvx_obj;
} Op;

static int
parse_items(PyObject *const *it, Py_ssize_t n, Op *op)
{
    memset(op, 0, sizeof(*op));
    if ((n != 2 && n != 5 && n != 8) || !PyBytes_Check(it[0])) {
        PyErr_SetString(PyExc_TypeError, "op: (key, h) | (key, h, tag, meta, value) | "
                                         "(key, h, tag, meta, value, counter, hlc, vvx)");
        return -1;
    }
    op->key = PyBytes_AS_STRING(it[0]);
    op->klen = (uint64_t)PyBytes_GET_SIZE(it[0]);
    op->h = PyLong_AsUnsignedLongLong(it[1]);
    if (PyErr_Occurred())
        return -1;
    if (op->klen == 0 || op->klen > MAX_KEY) {
        PyErr_SetString(PyExc_ValueError, "key length out of range");
        return -1;
    }
    if (n == 2) {
        op->kind = OP_DEL;
        return 0;
    }
    op->kind = n == 5 ? OP_PUT : OP_VPUT;
    op->tag = PyLong_AsUnsignedLongLong(it[2]);
    if (PyErr_Occurred() || !PyBytes_Check(it[3]) || op->tag > 0xFF ||
        (op->tag == TAG_TOMBSTONE && n != 8)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "op tag must be 0..255 (0, a tombstone, only with a "
                                             "version) and meta bytes");
        return -1;
    }
    op->meta = PyBytes_AS_STRING(it[3]);
    op->mlen = (uint64_t)PyBytes_GET_SIZE(it[3]);
    if (PyObject_GetBuffer(it[4], &op->val, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    op->has_val = 1;
    if (n == 8) {
        op->x_counter = PyLong_AsUnsignedLongLong(it[5]);
        op->x_hlc = PyLong_AsUnsignedLongLong(it[6]);
        if (PyErr_Occurred() || !PyBytes_Check(it[7])) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "op vvx must be bytes");
            return -1;
        }
        op->x_vvx = PyBytes_AS_STRING(it[7]);
        op->x_vvlen = (uint64_t)PyBytes_GET_SIZE(it[7]);
    }
    return 0;
}

static int
parse_op(PyObject *t, Op *op)
{
    if (!PyTuple_Check(t)) {
        memset(op, 0, sizeof(*op));
        PyErr_SetString(PyExc_TypeError, "an op is a tuple");
        return -1;
    }
    return parse_items(&PyTuple_GET_ITEM(t, 0), PyTuple_GET_SIZE(t), op);
}

static void
release_ops(Op *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ops[i].has_val)
            PyBuffer_Release(&ops[i].val);
        ops[i].has_val = 0;
        Py_CLEAR(ops[i].vvx_obj);
    }
}

static int
same_key(Op *a, Op *b)
{
    return a->h == b->h && a->klen == b->klen && memcmp(a->key, b->key, a->klen) == 0;
}

/* The latest op of each key in the batch: a small open-addressing index. */
typedef struct {
    Py_ssize_t *slots; /* index+1 of the latest op of a key, 0 empty */
    uint64_t mask;
    Py_ssize_t local[64];
} KeyIndex;

static int
kidx_init(KeyIndex *ki, Py_ssize_t n)
{
    uint64_t cap = 64;
    while (cap < (uint64_t)n * 2)
        cap <<= 1;
    ki->mask = cap - 1;
    ki->slots = cap <= 64 ? ki->local : PyMem_Calloc((size_t)cap, sizeof(Py_ssize_t));
    if (!ki->slots) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ki->slots, 0, sizeof(Py_ssize_t) * (size_t)cap);
    return 0;
}

static void
kidx_free(KeyIndex *ki)
{
    if (ki->slots != ki->local)
        PyMem_Free(ki->slots);
}

/* index+1 of the previous op on ops[i]'s key (0: none); records i as the latest */
static Py_ssize_t
kidx_swap(KeyIndex *ki, Op *ops, Py_ssize_t i)
{
    uint64_t j = ops[i].h & ki->mask;
    for (;;) {
        Py_ssize_t v = ki->slots[j];
        if (v == 0) {
            ki->slots[j] = i + 1;
            return 0;
        }
        if (same_key(&ops[v - 1], &ops[i])) {
            ki->slots[j] = i + 1;
            return v;
        }
        j = (j + 1) & ki->mask;
    }
}

/* heap bytes that are free or that CLOCK could free (entries outside the batch) */
static uint64_t
reclaimable_bytes(Core *c, const uint64_t *protect, Py_ssize_t nprotect)
{
    uint64_t used = *HW(c, H_USED), total = c->data_end - c->data_off;
    uint64_t bytes = used < total ? total - used : 0;
    for (uint64_t i = 0; i < c->n_slots; i++) {
        uint64_t so = slot_off(c, i);
        if (!evictable(c, so, protect, nprotect))
            continue;
        uint64_t order = alloc_order(c, W(c, so)[SLOT_OFF]);
        if (order)
            bytes += 1ULL << order;
    }
    return bytes;
}

static int
give_back_blocks(Core *c, Op *ops, Py_ssize_t n)
{
    int rc = 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (ops[j].block) {
            if (rc == 0 && heap_free(c, ops[j].block) < 0)
                rc = -1;
            ops[j].block = 0;
        }
    return rc;
}

/* The plan: where each op goes, how big its record is, and whether the whole batch can be
 * applied. Changes nothing except evictions (local cache decisions, each complete), which
 * it makes only when the batch can then fit. Returns 0 (ready: every block allocated), a
 * status > 0 with *bad the op's index, or -1 (Python error; corruption raised BUSY). On a
 * status or an error no block of the batch stays allocated. */
static int
plan_batch(Core *c, Op *ops, Py_ssize_t n, int tombstones, uint64_t dirty_flag, uint64_t max_dirty,
           Py_ssize_t *bad)
{
    uint64_t protect_local[8], claims_local[8];
    uint64_t *protect = n <= 8 ? protect_local : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    uint64_t *claims = n <= 8 ? claims_local : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    KeyIndex ki;
    ki.slots = NULL;
    int status = -1;
    int checked_room = 0;
    if (!protect || !claims) {
        PyErr_NoMemory();
        goto out;
    }
    if (n > 1 && kidx_init(&ki, n) < 0)
        goto out;
    for (;;) {
        Py_ssize_t nprotect = 0, nclaims = 0;
        int64_t dirty_delta = 0;
        uint64_t need_defer = 0, need_bytes = 0;
        if (n > 1)
            memset(ki.slots, 0, sizeof(Py_ssize_t) * (size_t)(ki.mask + 1));
        int evicted = 0;
        for (Py_ssize_t i = 0; i < n && !evicted; i++) {
            Op *op = &ops[i];
            op->prev = n == 1 ? 0 : kidx_swap(&ki, ops, i);
            op->writes_record = op->kind != OP_DEL || tombstones;
            op->block = 0;
            uint64_t prev_vvlen = 0;
            int prev_dirty;
            if (op->prev) {
                Op *p = &ops[op->prev - 1];
                op->found = p->found;
                op->slot = p->slot;
                prev_dirty = p->dirty_after;
                prev_vvlen = p->live_after ? p->vvlen : 0;
                op->existed = p->live_after && !(p->kind == OP_DEL);
            } else {
                uint64_t reusable = 0;
                if (find(c, op->key, op->klen, op->h, &op->found, &reusable) < 0)
                    goto out;
                op->slot = op->found;
                prev_dirty = 0;
                op->existed = 0;
                if (op->found) {
                    Rec r;
                    rec_parse(c, W(c, op->found)[SLOT_OFF], &r); /* find checked it */
                    prev_vvlen = r.vvlen;
                    prev_dirty = (W(c, op->found)[SLOT_FLAGS] & FLAG_DIRTY) != 0;
                    op->existed = r.tag != TAG_TOMBSTONE;
                    need_defer += r.pins != 0;
                    protect[nprotect++] = op->found;
                }
            }
            if (op->writes_record && !op->slot) {
                /* a new key needs a free slot in its window that no earlier op claimed */
                uint64_t base = op->h & c->mask;
                for (uint64_t k = 0; k < MAX_PROBE && !op->slot; k++) {
                    uint64_t so = slot_off(c, base + k);
                    if (W(c, so)[SLOT_OFF] > TOMB)
                        continue;
                    int taken = 0;
                    for (Py_ssize_t q = 0; q < nclaims && !taken; q++)
                        taken = claims[q] == so;
                    if (!taken)
                        op->slot = so;
                }
                if (!op->slot) {
                    int ev = window_evict_one(c, op->h, protect, nprotect);
                    if (ev < 0)
                        goto out;
                    if (ev == 0) {
                        *bad = i;
                        status = ST_SLOT_FULL;
                        goto out;
                    }
                    evicted = 1; /* slots changed: plan again */
                    break;
                }
                claims[nclaims++] = op->slot;
            }
            op->vvlen = op->kind == OP_VPUT ? op->x_vvlen : prev_vvlen;
            if (op->writes_record) {
                uint64_t mlen = op->kind == OP_DEL ? 0 : op->mlen;
                uint64_t vlen = op->kind == OP_DEL ? 0 : (uint64_t)op->val.len;
                uint64_t vrel = REC_HEADER + op->klen + op->vvlen + mlen;
                if (op->kind != OP_DEL && op->tag == TAG_NDARRAY)
                    vrel = (vrel + 63) & ~63ULL;
                op->size = vrel + vlen; /* each term is below 2**48: no wrap */
                if (op->vvlen > 0xFFFFFFFFULL || mlen > 0xFFFFFFFFULL ||
                    op->size > (1ULL << c->top_order)) {
                    *bad = i;
                    status = ST_TOO_LARGE;
                    goto out;
                }
                op->order = order_for(op->size);
                need_bytes += 1ULL << op->order;
                op->live_after = 1;
                op->dirty_after = dirty_flag != 0;
            } else {
                op->live_after = 0;
                op->dirty_after = 0;
            }
            dirty_delta += (int64_t)op->dirty_after - (int64_t)prev_dirty;
        }
        if (evicted)
            continue;
        if (need_bytes > c->data_end - c->data_off) {
            *bad = n - 1;
            status = ST_TOO_LARGE;
            goto out;
        }
        if (max_dirty && dirty_delta > 0 && *HW(c, H_DIRTY) + (uint64_t)dirty_delta > max_dirty) {
            *bad = 0;
            status = ST_DIRTY_FULL;
            goto out;
        }
        if (need_defer > deferred_free_entries(c)) {
            set_corrupt(c, "the deferred table cannot hold the pinned blocks (pin counts)");
            goto out;
        }
        /* space: allocate every block; if one does not fit, give them back, evict one
           entry (only if the batch can fit at all), and plan again */
        int full = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Op *op = &ops[i];
            if (!op->writes_record)
                continue;
            uint64_t off = heap_alloc(c, op->order);
            if (off == (uint64_t)-1) {
                give_back_blocks(c, ops, i);
                goto out;
            }
            if (off == 0) {
                if (give_back_blocks(c, ops, i) < 0)
                    goto out;
                if (!checked_room) {
                    checked_room = 1;
                    if (reclaimable_bytes(c, protect, nprotect) < need_bytes) {
                        *bad = i;
                        status = ST_FULL;
                        goto out;
                    }
                }
                int ev = clock_evict_one(c, protect, nprotect);
                if (ev < 0)
                    goto out;
                if (ev == 0) {
                    *bad = i;
                    status = ST_FULL;
                    goto out;
                }
                full = 1;
                break;
            }
            op->block = off;
        }
        if (full)
            continue;
        status = 0;
        goto out;
    }
out:
    if (ki.slots)
        kidx_free(&ki);
    if (protect && protect != protect_local)
        PyMem_Free(protect);
    if (claims && claims != claims_local)
        PyMem_Free(claims);
    return status;
}

/* Unlink the record in slot `found` (an embedded-mode delete); feed a delete event. */
static int
unlink_record(Core *c, uint64_t found, Op *op, uint64_t now_ms)
{
    uint64_t *slot = W(c, found);
    uint64_t old = slot[SLOT_OFF];
    uint64_t counter = *HW(c, H_WSEQ) + 1;
    *HW(c, H_WSEQ) = counter;
    uint64_t hlc = hlc_next(c, now_ms);
    if (slot[SLOT_FLAGS] & FLAG_DIRTY)
        *HW(c, H_DIRTY) -= 1;
    SEQ_ADD(&slot[SLOT_SEQ]);
    ST(&slot[SLOT_OFF], TOMB);
    ST(&slot[SLOT_HASH], 0);
    ST(&slot[SLOT_FLAGS], 0);
    SEQ_ADD(&slot[SLOT_SEQ]);
    *HW(c, H_ENTRIES) -= 1;
    if (release_block(c, old) < 0)
        return -1;
    /* a free slot followed by an empty one ends no probe chain that matters: turn trailing
       tombstones back into empty slots so that misses stay short */
    uint64_t i = slot_index(c, found);
    if (W(c, slot_off(c, i + 1))[SLOT_OFF] == EMPTY) {
        for (uint64_t k = 0; k < MAX_PROBE && W(c, slot_off(c, i))[SLOT_OFF] == TOMB; k++) {
            uint64_t *s = W(c, slot_off(c, i));
            SEQ_ADD(&s[SLOT_SEQ]);
            ST(&s[SLOT_OFF], EMPTY);
            SEQ_ADD(&s[SLOT_SEQ]);
            i = (i - 1) & c->mask;
        }
    }
    feed_append(c, KIND_DELETE, op->key, op->klen, counter, hlc);
    op->counter = counter;
    op->hlc = hlc;
    return 0;
}

/* Publish one planned op: build its record in its block and swap it into its slot.
 * `planned`: nothing changed since the plan (a batch of one), so its slots stand; in a
 * larger batch earlier ops change slots, and the key is probed again. */
static int
publish(Core *c, Op *op, uint64_t now_ms, uint64_t flags, int planned)
{
    uint64_t found = 0, reusable = 0;
    if (planned) {
        found = op->found;
        reusable = op->found ? 0 : op->slot;
    } else if (find(c, op->key, op->klen, op->h, &found, &reusable) < 0) {
        return -1;
    }
    if (!op->writes_record)
        return found ? unlink_record(c, found, op, now_ms) : 0;
    uint64_t so = found ? found : reusable;
    if (!so)
        return set_corrupt(c, "a planned slot was taken");
    uint64_t old = found ? W(c, found)[SLOT_OFF] : 0;
    const char *vvx = NULL;
    uint64_t vvlen = 0;
    Rec oldr;
    if (op->kind == OP_VPUT) {
        vvx = op->x_vvx;
        vvlen = op->x_vvlen;
    } else if (old) {
        if (!rec_parse(c, old, &oldr))
            return set_corrupt(c, "a replaced record is malformed");
        vvx = rec_vvx(c, old, &oldr);
        vvlen = oldr.vvlen;
    }
    if (vvlen != op->vvlen)
        return set_corrupt(c, "a record changed between plan and publish");
    uint64_t counter, hlc;
    if (op->kind == OP_VPUT && op->x_counter == NEW_DOT) {
        counter = *HW(c, H_WSEQ) + 1;
        *HW(c, H_WSEQ) = counter;
        hlc = hlc_next(c, now_ms);
        if (hlc <= op->x_hlc) {
            hlc = op->x_hlc + 1;
            *HW(c, H_HLC) = hlc;
        }
    } else if (op->kind == OP_VPUT) {
        counter = op->x_counter;
        hlc = op->x_hlc;
        if (*HW(c, H_WSEQ) < counter)
            *HW(c, H_WSEQ) = counter;
        if (*HW(c, H_HLC) < hlc)
            *HW(c, H_HLC) = hlc;
    } else {
        counter = *HW(c, H_WSEQ) + 1;
        *HW(c, H_WSEQ) = counter;
        hlc = hlc_next(c, now_ms);
    }
    int del = op->kind == OP_DEL;
    uint64_t tag = del ? TAG_TOMBSTONE : op->tag;
    uint64_t mlen = del ? 0 : op->mlen;
    uint64_t vlen = del ? 0 : (uint64_t)op->val.len;
    uint64_t vrel = op->size - vlen;
    uint64_t off = op->block;
    uint64_t *rec = W(c, off);
    rec[REC_SIZE] = op->size;
    rec[REC_COUNTER] = counter;
    rec[REC_HLC] = hlc;
    rec[REC_INFO] = op->klen | (tag << 16) | (vvlen << 32);
    rec[REC_VLEN] = vlen;
    rec[REC_VREL] = vrel;
    rec[REC_PINS] = 0;
    rec[REC_LENS] = mlen;
    char *p = c->base + off + REC_HEADER;
    memcpy(p, op->key, op->klen);
    if (vvlen)
        memmove(p + op->klen, vvx, vvlen);
    if (mlen)
        memcpy(p + op->klen + vvlen, op->meta, mlen);
    if (vlen)
        memcpy(c->base + off + vrel, op->val.buf, vlen);
    /* publish: seq odd, swap, seq even (full barriers around the swap) */
    uint64_t *slot = W(c, so);
    int was_dirty = found && (slot[SLOT_FLAGS] & FLAG_DIRTY);
    SEQ_ADD(&slot[SLOT_SEQ]);
    if (!found)
        ST(&slot[SLOT_HASH], op->h);
    ST(&slot[SLOT_OFF], off);
    ST(&slot[SLOT_FLAGS], flags & FLAG_DIRTY);
    uint64_t seq = SEQ_ADD(&slot[SLOT_SEQ]);
    ST(&slot[SLOT_REF], 1);
    if ((flags & FLAG_DIRTY) && !was_dirty)
        *HW(c, H_DIRTY) += 1;
    else if (!(flags & FLAG_DIRTY) && was_dirty)
        *HW(c, H_DIRTY) -= 1;
    op->block = 0; /* published: no longer the batch's to give back */
    if (found) {
        if (release_block(c, old) < 0)
            return -1;
    } else {
        *HW(c, H_ENTRIES) += 1;
    }
    feed_append(c, tag == TAG_TOMBSTONE ? KIND_DELETE : KIND_PUT, op->key, op->klen, counter, hlc);
    op->counter = counter;
    op->hlc = hlc;
    op->so = so;
    op->seq = seq;
    return 0;
}

static PyObject *
op_result(Op *op)
{
    if (op->kind == OP_DEL) /* the delete's counter, 0 when there was nothing to delete */
        return PyLong_FromUnsignedLongLong(op->existed ? op->counter : 0);
    PyObject *vvx = op->vvx_obj;
    op->vvx_obj = NULL;
    return Py_BuildValue("(KKNKK)", (unsigned long long)op->counter, (unsigned long long)op->hlc, vvx,
                         (unsigned long long)(op->so / 8), (unsigned long long)op->seq);
}

/* The vvx bytes object each put will return, made before anything is published (so that
 * running out of memory cannot stop a batch half-way). */
static int
make_vvx_objects(Core *c, Op *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Op *op = &ops[i];
        if (op->kind == OP_DEL)
            continue;
        if (op->kind == OP_VPUT) {
            op->vvx_obj = PyBytes_FromStringAndSize(op->x_vvx, (Py_ssize_t)op->x_vvlen);
        } else if (op->vvlen == 0) {
            op->vvx_obj = PyBytes_FromStringAndSize("", 0);
        } else {
            /* carried over from the nearest earlier put of the key in the batch with a vvx
               object, else from the record in place before the batch */
            Py_ssize_t src = op->prev;
            while (src && !ops[src - 1].vvx_obj)
                src = ops[src - 1].prev;
            if (src) {
                op->vvx_obj = ops[src - 1].vvx_obj;
                Py_INCREF(op->vvx_obj);
            } else {
                uint64_t off = op->found ? W(c, op->found)[SLOT_OFF] : 0;
                Rec r;
                if (!off || !rec_parse(c, off, &r) || r.vvlen != op->vvlen) {
                    set_corrupt(c, "a record changed under the lock");
                    return -1;
                }
                op->vvx_obj = PyBytes_FromStringAndSize(rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen);
            }
        }
        if (!op->vvx_obj)
            return -1;
    }
    return 0;
}

/* Apply n parsed ops under the lock, all or nothing. Returns the results (a list; for a
 * single op its result alone), a status (an int for a single op, else (status, index)), or
 * NULL with an error (nothing published; BUSY raised if corruption was found). */
static PyObject *
apply_ops(Core *c, Op *ops, Py_ssize_t n, uint64_t now_ms, uint64_t flags, uint64_t max_dirty,
          int tombstones, int single)
{
    if (LDR(HW(c, H_STATE)) != STATE_OK) {
        PyErr_SetString(SegmentError, "this namespace was purged; open it again");
        return NULL;
    }
    if (*HW(c, H_BUSY)) {
        PyErr_SetString(SegmentError, "L2 must be repaired before it is written (recover first)");
        return NULL;
    }
    ST(HW(c, H_BUSY), 1);
    Py_ssize_t bad = 0;
    int st = plan_batch(c, ops, n, tombstones, flags & FLAG_DIRTY, max_dirty, &bad);
    if (st < 0)
        return NULL;
    if (st > 0) {
        ST(HW(c, H_BUSY), 0); /* nothing changed but evictions, which are complete */
        return single ? PyLong_FromLong(st) : Py_BuildValue("(in)", st, bad);
    }
    PyObject *results = single ? NULL : PyList_New(n);
    if ((!single && !results) || make_vvx_objects(c, ops, n) < 0) {
        Py_XDECREF(results);
        if (give_back_blocks(c, ops, n) == 0 && !PyErr_ExceptionMatches(SegmentError))
            ST(HW(c, H_BUSY), 0);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (publish(c, &ops[i], now_ms, flags, n == 1) < 0) {
            Py_XDECREF(results);
            return NULL; /* corruption found mid-publish: BUSY stays raised for repair */
        }
    }
    ST(HW(c, H_BUSY), 0);
    if (single)
        return op_result(&ops[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = op_result(&ops[i]);
        if (!r) { /* applied; only the answer could not be built (out of memory) */
            Py_DECREF(results);
            return NULL;
        }
        PyList_SET_ITEM(results, i, r);
    }
    return results;
}

/* apply(ops, now_ms, flags, max_dirty, tombstones) -> list | (status, index)   [lock held]
 * ops: (key, h) delete | (key, h, tag, meta, value) put | (..., counter, hlc, vvx) put with a
 * version. All or nothing: a status means nothing was written (evictions may have happened,
 * and only when the batch could then fit). Results per op: put → (counter, hlc, vvx, word,
 * seq); delete → its counter, 0 if there was nothing to delete. */
static PyObject *
Core_apply(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 5 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "apply(ops: list, now_ms, flags, max_dirty, tombstones)");
        return NULL;
    }
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t flags = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t max_dirty = PyLong_AsUnsignedLongLong(args[3]);
    int tombstones = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || tombstones < 0)
        return NULL;
    PyObject *list = args[0];
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n == 0)
        return PyList_New(0);
    Op local[4];
    Op *ops = n <= 4 ? local : PyMem_Calloc((size_t)n, sizeof(Op));
    if (!ops)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    Py_ssize_t parsed = 0;
    while (parsed < n) {
        int rc = parse_op(PyList_GET_ITEM(list, parsed), &ops[parsed]);
        parsed++;
        if (rc < 0)
            goto done;
    }
    out = apply_ops(c, ops, n, now_ms, flags, max_dirty, tombstones, 0);
done:
    release_ops(ops, parsed);
    if (ops != local)
        PyMem_Free(ops);
    return out;
}

/* put(key, h, tag, meta, value, now_ms, flags, max_dirty, timeout) -> tuple | int status
 * The common write in one call: take the lock, apply one put, release it. ST_LOOK: Python
 * must look first (purged, repair, pins to sweep): nothing was written. */
static PyObject *
Core_put(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "put(key, h, tag, meta, value, now_ms, flags, max_dirty, timeout)");
        return NULL;
    }
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[5]);
    uint64_t flags = PyLong_AsUnsignedLongLong(args[6]);
    uint64_t max_dirty = PyLong_AsUnsignedLongLong(args[7]);
    double timeout = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred())
        return NULL;
    Op op;
    if (parse_items(args, 5, &op) < 0) {
        release_ops(&op, 1);
        return NULL;
    }
    PyObject *out = NULL;
    if (take_lock(c, timeout) == 0) {
        out = needs_look(c) ? PyLong_FromLong(ST_LOOK)
                            : apply_ops(c, &op, 1, now_ms, flags, max_dirty, 0, 1);
        drop_lock(c);
    }
    release_ops(&op, 1);
    return out;
}

/* version(key, h) -> None | (word, seq, tag, counter, hlc, vvx, flags): a lock-free read of
 * the version only (tag 0: a tombstone). -1 when a slot stays odd. */
static PyObject *
Core_version(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "version(key: bytes, h: int)");
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
                continue;
            }
            uint64_t off = LD(&slot[SLOT_OFF]), sh = LD(&slot[SLOT_HASH]), fl = LD(&slot[SLOT_FLAGS]);
            if (off == EMPTY) {
                if (LD(&slot[SLOT_SEQ]) != s)
                    continue;
                Py_RETURN_NONE;
            }
            if (off == TOMB || sh != h)
                break;
            Rec r;
            int sane = rec_parse(c, off, &r);
            int match = sane && r.klen == klen && memcmp(rec_key(c, off), key, klen) == 0;
            PyObject *vvx = match ? PyBytes_FromStringAndSize(rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen) : NULL;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (LD(&slot[SLOT_SEQ]) != s) {
                Py_XDECREF(vvx);
                continue;
            }
            if (!sane) {
                PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
                return NULL;
            }
            if (!match)
                break;
            if (!vvx)
                return NULL;
            return Py_BuildValue("(KKKKKNK)", (unsigned long long)(so / 8), (unsigned long long)s,
                                 (unsigned long long)r.tag, (unsigned long long)r.counter,
                                 (unsigned long long)r.hlc, vvx, (unsigned long long)fl);
        }
    }
    Py_RETURN_NONE;
}

/* mark_clean(key, h, counter, hlc) -> bool: clear the dirty flag if the key still holds the
 * write (counter, hlc), i.e. L3 has it   [lock held] */
static PyObject *
Core_mark_clean(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "mark_clean(key, h, counter, hlc)");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t counter = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t hlc = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found = 0, reusable = 0;
    if (find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, &found, &reusable) < 0)
        return NULL;
    if (!found)
        Py_RETURN_FALSE;
    uint64_t *slot = W(c, found);
    Rec r;
    rec_parse(c, slot[SLOT_OFF], &r);
    if (r.counter != counter || r.hlc != hlc || !(slot[SLOT_FLAGS] & FLAG_DIRTY))
        Py_RETURN_FALSE;
    ST(&slot[SLOT_FLAGS], slot[SLOT_FLAGS] & ~(uint64_t)FLAG_DIRTY);
    *HW(c, H_DIRTY) -= 1;
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ pins */

/* pin(key, h, pid) -> None | (word, seq, tag, meta, counter, hlc, vvx, size, pin, voff, vlen)
 * [lock held] Records (block, pid) in a free pin entry and counts the pin on the block, so
 * writers park instead of free it. pin == -1: the pin table is full. None: absent or a
 * tombstone. */
static PyObject *
Core_pin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pin(key: bytes, h: int, pid: int)");
        return NULL;
    }
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t pid = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found = 0, reusable = 0;
    if (find(c, PyBytes_AS_STRING(args[0]), klen, h, &found, &reusable) < 0)
        return NULL;
    if (!found)
        Py_RETURN_NONE;
    uint64_t *slot = W(c, found);
    uint64_t off = slot[SLOT_OFF];
    Rec r;
    if (!rec_parse(c, off, &r))
    {
        set_corrupt(c, "pinning a malformed record");
        return NULL;
    }
    if (r.tag == TAG_TOMBSTONE)
        Py_RETURN_NONE;
    long long index = -1;
    uint64_t *pins = W(c, c->pins_off);
    for (uint64_t i = 0; i < c->n_pins; i++) {
        if (pins[PIN_WORDS * i] == 0) {
            pins[PIN_WORDS * i + 1] = pid;
            ST(&pins[PIN_WORDS * i], off);
            W(c, off)[REC_PINS] += 1;
            if (i >= *HW(c, H_PIN_HWM))
                *HW(c, H_PIN_HWM) = i + 1;
            index = (long long)i;
            break;
        }
    }
    ST(&slot[SLOT_REF], 1);
    return Py_BuildValue("(KKKy#KKy#KLKK)", (unsigned long long)(found / 8),
                         (unsigned long long)slot[SLOT_SEQ], (unsigned long long)r.tag,
                         rec_meta(c, off, &r), (Py_ssize_t)r.mlen, (unsigned long long)r.counter,
                         (unsigned long long)r.hlc, rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen,
                         (unsigned long long)r.size, index, (unsigned long long)(off + r.vrel),
                         (unsigned long long)r.vlen);
}

/* unpin(index, pid) -> bool: lock-free; marks pin entry `index` released if `pid` holds it
 * (a forked child never releases its parent's pin). The next writer's sweep frees it. */
static PyObject *
Core_unpin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (!c->has_view)
        Py_RETURN_FALSE;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "unpin(index, pid)");
        return NULL;
    }
    uint64_t index = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t pid = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (index >= c->n_pins || pid == 0)
        Py_RETURN_FALSE;
    uint64_t *p = W(c, c->pins_off + (PIN_WORDS * index + 1) * 8);
    uint64_t expected = pid;
    if (!__atomic_compare_exchange_n(p, &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        Py_RETURN_FALSE;
    __atomic_add_fetch(HW(c, H_RELEASED), 1, __ATOMIC_SEQ_CST);
    Py_RETURN_TRUE;
}

/* pin_pids() -> set of the pids holding pins (lock-free; for Python's liveness check) */
static PyObject *
Core_pin_pids(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    PyObject *out = PySet_New(NULL);
    if (!out)
        return NULL;
    uint64_t *pins = W(c, c->pins_off);
    uint64_t hwm = LDR(HW(c, H_PIN_HWM));
    if (hwm > c->n_pins)
        hwm = c->n_pins;
    for (uint64_t i = 0; i < hwm; i++) {
        uint64_t off = LDR(&pins[PIN_WORDS * i]), pid = LDR(&pins[PIN_WORDS * i + 1]);
        if (off && pid) {
            PyObject *v = PyLong_FromUnsignedLongLong(pid);
            if (!v || PySet_Add(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return out;
}

/* sweep(dead_pids) -> blocks freed: drop released pins and those of dead pids, unpin their
 * blocks, free parked blocks nobody pins any more   [lock held] */
static PyObject *
Core_sweep(Core *c, PyObject *dead)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (!PyAnySet_Check(dead)) {
        PyErr_SetString(PyExc_TypeError, "sweep(dead_pids: set)");
        return NULL;
    }
    uint64_t prev_busy = *HW(c, H_BUSY);
    ST(HW(c, H_BUSY), 1);
    uint64_t released = LD(HW(c, H_RELEASED));
    uint64_t *pins = W(c, c->pins_off);
    uint64_t hwm = *HW(c, H_PIN_HWM), new_hwm = 0, freed = 0;
    if (hwm > c->n_pins)
        hwm = c->n_pins;
    for (uint64_t i = 0; i < hwm; i++) {
        uint64_t off = pins[PIN_WORDS * i];
        if (!off)
            continue;
        uint64_t pid = LD(&pins[PIN_WORDS * i + 1]);
        int drop = pid == 0;
        if (!drop && PySet_GET_SIZE(dead)) {
            PyObject *v = PyLong_FromUnsignedLongLong(pid);
            if (!v)
                return NULL; /* BUSY stays raised: repaired next time */
            drop = PySet_Contains(dead, v);
            Py_DECREF(v);
            if (drop < 0)
                return NULL;
        }
        if (!drop) {
            new_hwm = i + 1;
            continue;
        }
        pins[PIN_WORDS * i + 1] = 0;
        ST(&pins[PIN_WORDS * i], 0);
        if (block_ok(c, off) && REC_HEADER <= c->data_end - off && W(c, off)[REC_PINS])
            W(c, off)[REC_PINS] -= 1;
    }
    *HW(c, H_PIN_HWM) = new_hwm;
    if (released)
        __atomic_sub_fetch(HW(c, H_RELEASED), released, __ATOMIC_SEQ_CST);
    if (*HW(c, H_DEFERRED)) {
        uint64_t *d = W(c, c->defer_off);
        for (uint64_t i = 0; i < c->n_pins; i++) {
            uint64_t off = d[i];
            if (!off)
                continue;
            if (!block_ok(c, off) || REC_HEADER > c->data_end - off) {
                set_corrupt(c, "a parked block is outside the heap");
                return NULL;
            }
            if (W(c, off)[REC_PINS] == 0) {
                d[i] = 0;
                *HW(c, H_DEFERRED) -= 1;
                if (heap_free(c, off) < 0)
                    return NULL;
                freed++;
            }
        }
    }
    ST(HW(c, H_BUSY), prev_busy);
    return PyLong_FromUnsignedLongLong(freed);
}

/* ------------------------------------------------------------------ purge, scans */

/* purge_mark(): mark the namespace purged and move every slot's seq on, so that every
 * process's L1 entries fail revalidation and every read raises SegmentError   [lock held] */
static PyObject *
Core_purge_mark(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    ST(HW(c, H_STATE), STATE_PURGED);
    for (uint64_t i = 0; i < c->n_slots; i++) {
        uint64_t *s = W(c, slot_off(c, i));
        uint64_t v = LDR(&s[SLOT_SEQ]);
        ST(&s[SLOT_SEQ], (v | 1) + 1); /* even, and moved on */
    }
    Py_RETURN_NONE;
}

/* scan(mode) -> list of keys (bytes). mode 0: live keys (not tombstones); mode 1: dirty
 * records (tombstones too): what L3 has not acknowledged. Lock-free; concurrent writes may or
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

/* ------------------------------------------------------------------ recovery   [lock held]
 *
 * recover(live_pids) -> live entries: after a writer died (or found corruption) mid-mutation.
 * Slots: odd seqs made even; references to malformed, misplaced, overlapping or duplicate
 * blocks dropped. Pins: kept for live pids on live or parked blocks, counts recomputed.
 * Parked blocks: kept if still pinned. Heap: the block meta and every free list rebuilt from
 * what slots and parked entries reference. Counters recounted. Watchers told to resync.
 */

typedef struct {
    uint8_t *start; /* bit per 64-byte unit: a live block starts here */
    uint8_t *cover; /* bit per unit: covered by a live block */
    uint64_t units;
} Units;

static inline int bit_get(uint8_t *b, uint64_t i) { return (b[i >> 3] >> (i & 7)) & 1; }
static inline void bit_set(uint8_t *b, uint64_t i) { b[i >> 3] |= (uint8_t)(1 << (i & 7)); }

/* the order of a plausible record block at off not overlapping what is marked; 0 if not */
static uint64_t
plausible(Core *c, Units *u, uint64_t off)
{
    Rec r;
    if (!rec_parse(c, off, &r))
        return 0;
    uint64_t order = order_for(r.size);
    if (!aligned_block(c, off, order))
        return 0;
    uint64_t first = (off - c->data_off) >> MIN_ORDER, n = 1ULL << (order - MIN_ORDER);
    for (uint64_t k = 0; k < n; k++)
        if (bit_get(u->cover, first + k))
            return 0;
    return order;
}

static void
mark_block(Core *c, Units *u, uint64_t off, uint64_t order)
{
    uint64_t first = (off - c->data_off) >> MIN_ORDER, n = 1ULL << (order - MIN_ORDER);
    bit_set(u->start, first);
    for (uint64_t k = 0; k < n; k++)
        bit_set(u->cover, first + k);
}

static PyObject *
Core_recover(Core *c, PyObject *live_pids)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (!PyAnySet_Check(live_pids)) {
        PyErr_SetString(PyExc_TypeError, "recover(live_pids: set)");
        return NULL;
    }
    ST(HW(c, H_BUSY), 1);
    Units u;
    u.units = (c->data_end - c->data_off) >> MIN_ORDER;
    u.start = calloc((size_t)(u.units / 8 + 1), 1);
    u.cover = calloc((size_t)(u.units / 8 + 1), 1);
    if (!u.start || !u.cover) {
        free(u.start);
        free(u.cover);
        return PyErr_NoMemory();
    }
    uint64_t entries = 0, dirty = 0, deferred = 0, used = 0;
    for (uint64_t i = 0; i < c->n_slots; i++) {
        uint64_t *slot = W(c, slot_off(c, i));
        if (slot[SLOT_SEQ] & 1)
            SEQ_ADD(&slot[SLOT_SEQ]);
        uint64_t off = slot[SLOT_OFF];
        if (off <= TOMB) {
            if (off == EMPTY && slot[SLOT_HASH]) {
                SEQ_ADD(&slot[SLOT_SEQ]);
                ST(&slot[SLOT_HASH], 0);
                SEQ_ADD(&slot[SLOT_SEQ]);
            }
            continue;
        }
        uint64_t order = plausible(c, &u, off);
        if (!order) {
            SEQ_ADD(&slot[SLOT_SEQ]);
            ST(&slot[SLOT_OFF], TOMB);
            ST(&slot[SLOT_HASH], 0);
            ST(&slot[SLOT_FLAGS], 0);
            SEQ_ADD(&slot[SLOT_SEQ]);
            continue;
        }
        if (slot[SLOT_FLAGS] & ~(uint64_t)FLAG_DIRTY)
            ST(&slot[SLOT_FLAGS], slot[SLOT_FLAGS] & FLAG_DIRTY);
        mark_block(c, &u, off, order);
        W(c, off)[REC_PINS] = 0;
        entries++;
        dirty += (slot[SLOT_FLAGS] & FLAG_DIRTY) != 0;
        used += 1ULL << order;
    }
    /* parked blocks: keep the plausible ones that live pins still hold (counted below) */
    uint64_t *d = W(c, c->defer_off);
    uint64_t *pins = W(c, c->pins_off);
    for (uint64_t i = 0; i < c->n_pins; i++) {
        uint64_t off = d[i];
        d[i] = 0;
        if (!off)
            continue;
        int held = 0;
        for (uint64_t j = 0; j < c->n_pins && !held; j++) {
            uint64_t pid = pins[PIN_WORDS * j + 1];
            if (pins[PIN_WORDS * j] != off || !pid)
                continue;
            PyObject *v = PyLong_FromUnsignedLongLong(pid);
            if (!v)
                goto nomem;
            held = PySet_Contains(live_pids, v) == 1;
            Py_DECREF(v);
        }
        uint64_t order = held ? plausible(c, &u, off) : 0;
        if (order) {
            mark_block(c, &u, off, order);
            W(c, off)[REC_PINS] = 0;
            d[deferred++] = off;
            used += 1ULL << order;
        }
    }
    /* pins: keep those of live pids on live blocks; recount */
    uint64_t hwm = 0;
    for (uint64_t i = 0; i < c->n_pins; i++) {
        uint64_t off = pins[PIN_WORDS * i], pid = pins[PIN_WORDS * i + 1];
        int keep = 0;
        if (off && pid && block_ok(c, off) && bit_get(u.start, (off - c->data_off) >> MIN_ORDER)) {
            PyObject *v = PyLong_FromUnsignedLongLong(pid);
            if (!v)
                goto nomem;
            keep = PySet_Contains(live_pids, v) == 1;
            Py_DECREF(v);
        }
        if (keep) {
            W(c, off)[REC_PINS] += 1;
            hwm = i + 1;
        } else {
            pins[PIN_WORDS * i + 1] = 0;
            pins[PIN_WORDS * i] = 0;
        }
    }
    /* a parked block whose pins all went is free after all */
    for (uint64_t i = 0; i < deferred;) {
        uint64_t off = d[i];
        if (W(c, off)[REC_PINS] == 0) {
            uint64_t order = order_for(W(c, off)[REC_SIZE]);
            uint64_t first = (off - c->data_off) >> MIN_ORDER, n = 1ULL << (order - MIN_ORDER);
            u.start[first >> 3] &= (uint8_t)~(1 << (first & 7));
            for (uint64_t k = 0; k < n; k++)
                u.cover[(first + k) >> 3] &= (uint8_t)~(1 << ((first + k) & 7));
            used -= 1ULL << order;
            d[i] = d[--deferred];
            d[deferred] = 0;
            continue;
        }
        i++;
    }
    /* heap: meta and free lists rebuilt; everything not live is free, in maximal blocks */
    memset(c->base + c->meta_off, 0, (size_t)u.units);
    for (uint64_t k = 0; k <= MAX_ORDER; k++)
        *HW(c, H_FREE + k) = 0;
    uint64_t pos = 0; /* in 64-byte units */
    while (pos < u.units) {
        if (bit_get(u.start, pos)) {
            uint64_t off = c->data_off + (pos << MIN_ORDER);
            uint64_t order = order_for(W(c, off)[REC_SIZE]);
            *meta_at(c, off) = meta_alloc(order);
            pos += 1ULL << (order - MIN_ORDER);
            continue;
        }
        /* a gap: up to the next unit a live block covers */
        uint64_t end = pos;
        while (end < u.units && !bit_get(u.cover, end))
            end++;
        while (pos < end) { /* fill it with maximal aligned blocks */
            uint64_t order = c->top_order;
            while (order > MIN_ORDER &&
                   ((pos & ((1ULL << (order - MIN_ORDER)) - 1)) || pos + (1ULL << (order - MIN_ORDER)) > end))
                order--;
            uint64_t off = c->data_off + (pos << MIN_ORDER);
            uint64_t *blk = W(c, off);
            uint64_t head = *HW(c, H_FREE + order);
            blk[1] = head;
            blk[2] = 0;
            if (head)
                W(c, head)[2] = off;
            *HW(c, H_FREE + order) = off;
            *meta_at(c, off) = meta_free(order);
            pos += 1ULL << (order - MIN_ORDER);
        }
    }
    free(u.start);
    free(u.cover);
    *HW(c, H_USED) = used;
    *HW(c, H_ENTRIES) = entries;
    *HW(c, H_DIRTY) = dirty;
    *HW(c, H_DEFERRED) = deferred;
    *HW(c, H_PIN_HWM) = hwm;
    ST(HW(c, H_RELEASED), 0);
    *HW(c, H_RECOVERIES) += 1;
    feed_append(c, KIND_RESYNC, "", 0, *HW(c, H_WSEQ), *HW(c, H_HLC));
    ST(HW(c, H_BUSY), 0);
    return PyLong_FromUnsignedLongLong(entries);
nomem:
    free(u.start);
    free(u.cover);
    return NULL; /* BUSY stays raised: the next holder tries again */
}

/* init_heap(): the whole data area free, one top-order block per tile (creator only) */
static PyObject *
Core_init_heap(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    memset(c->base + c->meta_off, 0, (size_t)((c->data_end - c->data_off) >> MIN_ORDER));
    for (uint64_t k = 0; k <= MAX_ORDER; k++)
        *HW(c, H_FREE + k) = 0;
    uint64_t step = 1ULL << c->top_order;
    for (uint64_t off = c->data_end - step;; off -= step) {
        if (push_free(c, off, c->top_order) < 0)
            return NULL;
        if (off == c->data_off)
            break;
    }
    Py_RETURN_NONE;
}

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

/* ------------------------------------------------------------------ the type */

static PyMethodDef Core_methods[] = {
    {"load", (PyCFunction)Core_load, METH_O, "load(off) -> int (acquire)"},
    {"store", (PyCFunction)(void (*)(void))Core_store, METH_FASTCALL, "store(off, v) (release)"},
    {"cas", (PyCFunction)(void (*)(void))Core_cas, METH_FASTCALL, "cas(off, expected, desired) -> bool"},
    {"add", (PyCFunction)(void (*)(void))Core_add, METH_FASTCALL, "add(off, delta) -> new value"},
    {"init_lock", (PyCFunction)Core_init_lock, METH_NOARGS, "initialise the writer lock (creator)"},
    {"init_heap", (PyCFunction)Core_init_heap, METH_NOARGS, "free the whole heap (creator)"},
    {"lock", (PyCFunction)Core_lock, METH_O, "lock(timeout) -> 0 | 1 (look first)"},
    {"unlock", (PyCFunction)Core_unlock, METH_NOARGS, "release the lock if this thread holds it"},
    {"held", (PyCFunction)Core_held, METH_NOARGS, "does this thread hold the lock"},
    {"owner", (PyCFunction)Core_owner, METH_NOARGS, "the thread id holding the lock (glibc)"},
    {"set_busy", (PyCFunction)Core_set_busy, METH_O, "raise/lower BUSY (lock held)"},
    {"read", (PyCFunction)(void (*)(void))Core_read, METH_FASTCALL, "lock-free read"},
    {"version", (PyCFunction)(void (*)(void))Core_version, METH_FASTCALL, "lock-free version read"},
    {"put", (PyCFunction)(void (*)(void))Core_put, METH_FASTCALL, "lock, put one, unlock"},
    {"apply", (PyCFunction)(void (*)(void))Core_apply, METH_FASTCALL, "apply a batch (lock held)"},
    {"mark_clean", (PyCFunction)(void (*)(void))Core_mark_clean, METH_FASTCALL, "clear dirty (lock held)"},
    {"pin", (PyCFunction)(void (*)(void))Core_pin, METH_FASTCALL, "pin a block (lock held)"},
    {"unpin", (PyCFunction)(void (*)(void))Core_unpin, METH_FASTCALL, "release a pin (lock-free)"},
    {"pin_pids", (PyCFunction)Core_pin_pids, METH_NOARGS, "pids holding pins"},
    {"sweep", (PyCFunction)Core_sweep, METH_O, "free released/dead pins (lock held)"},
    {"purge_mark", (PyCFunction)Core_purge_mark, METH_NOARGS, "mark purged (lock held)"},
    {"scan", (PyCFunction)Core_scan, METH_O, "keys: 0 live, 1 dirty"},
    {"recover", (PyCFunction)Core_recover, METH_O, "repair after a death (lock held)"},
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
    .tp_doc = "Core(mmap): the L2 operations over one mapped segment (layout read from its header)",
};

static PyObject *
set_errors(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_errors(SegmentError, Unavailable, InvalidArgument)");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(SegmentError, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(Unavailable, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(InvalidArgument, args[2]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_errors", (PyCFunction)(void (*)(void))set_errors, METH_FASTCALL,
     "the exception classes to raise: SegmentError, Unavailable, InvalidArgument"},
    {"approx_size", approx_size, METH_O, "approximate bytes held by a decoded value"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvcomm._l2core", "L2 segment operations", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__l2core(void)
{
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    SegmentError = PyExc_RuntimeError;
    Unavailable = PyExc_RuntimeError;
    InvalidArgument = PyExc_ValueError;
    Py_INCREF(SegmentError);
    Py_INCREF(Unavailable);
    Py_INCREF(InvalidArgument);
    Py_INCREF(&CoreType);
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
        PyModule_AddIntConstant(m, "ST_FULL", ST_FULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
