/*
 * kvcomm._l2core: the hot memory operations of the L2 segment, in C, and the 64-bit
 * atomics its Python side uses for the writer lock.
 *
 * tiers/l2.py owns the design (its module docstring is the theory of operation) and
 * every policy: locking, eviction, pins, recovery, the invariant checker. This file
 * only does, fast, what Python did slowly: the lock-free seqlock read, and — with the
 * writer lock held by the caller — probing, the buddy heap, building and publishing a
 * record, deleting, and appending to the change feed. Layout constants must match
 * tiers/l2.py; tests/test_l2_*.py check both through L2Segment.check().
 *
 * Safety: every offset or length read from shared memory is bounds-checked before it
 * is dereferenced, so a corrupt or hostile segment yields SegmentError, never a wild
 * read or write. Stores that other processes read lock-free are __atomic stores with
 * release order (plain moves on x86-64, but the compiler may not reorder them); the
 * slot seq bumps are sequentially consistent read-modify-writes (full barriers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_ORDER 6
#define MAX_PROBE 32
#define SLOT_WORDS 5
#define REC_HEADER 64
#define EMPTY 0
#define TOMB 1
#define KIND_PUT 1
#define KIND_DELETE 2
#define TAG_NDARRAY 4

/* header word indexes (see tiers/l2.py) */
#define H_LOCK 16
#define H_BUSY 17
#define H_WSEQ 18
#define H_HLC 19
#define H_FEED_HEAD 20
#define H_STATE 22
#define H_RELEASED 23
#define H_ENTRIES 24
#define H_USED 25
#define H_DEFERRED 28
#define H_PIN_HWM 29
#define H_FREE 40

/* put() status codes when nothing was changed */
#define NEED_SPACE 1
#define NEED_SLOT 2
#define TOO_LARGE 3
#define CORRUPT 4

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;
    uint64_t size;
    uint64_t data_off, data_end, top_order, slots_off, mask;
    uint64_t meta_off, feed_off, feed_n, feed_esz, defer_off, n_defer, max_key;
} Core;

static PyObject *SegmentError; /* set by tiers/l2.py at import: kvcomm.errors.SegmentError */

#define W(c, off) ((uint64_t *)((c)->base + (off)))
#define LD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline uint64_t slot_off(Core *c, uint64_t i) { return c->slots_off + i * SLOT_WORDS * 8; }
static inline uint8_t *meta_at(Core *c, uint64_t off) {
    return (uint8_t *)(c->base + c->meta_off + ((off - c->data_off) >> MIN_ORDER));
}
static inline int block_ok(Core *c, uint64_t off) {
    return off >= c->data_off && off < c->data_end && ((off - c->data_off) & 63) == 0;
}

static int
Core_init(Core *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    unsigned long long data_off, data_size, top, slots_off, n_slots, meta_off, feed_off,
        feed_n, feed_esz, defer_off, n_defer, max_key;
    if (!PyArg_ParseTuple(args, "OKKKKKKKKKKKK", &obj, &data_off, &data_size, &top, &slots_off,
                          &n_slots, &meta_off, &feed_off, &feed_n, &feed_esz, &defer_off,
                          &n_defer, &max_key))
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
    self->data_off = data_off;
    self->data_end = data_off + data_size;
    self->top_order = top;
    self->slots_off = slots_off;
    self->mask = n_slots - 1;
    self->meta_off = meta_off;
    self->feed_off = feed_off;
    self->feed_n = feed_n;
    self->feed_esz = feed_esz;
    self->defer_off = defer_off;
    self->n_defer = n_defer;
    self->max_key = max_key;
    if (((uintptr_t)self->base & 7) || n_slots == 0 || (n_slots & (n_slots - 1)) ||
        self->data_end > self->size || slots_off + n_slots * SLOT_WORDS * 8 > self->size ||
        feed_off + feed_n * feed_esz > self->size || defer_off + n_defer * 8 > self->size ||
        top < MIN_ORDER || top > 47 || feed_esz < 32 + max_key) {
        PyErr_SetString(SegmentError, "L2 layout does not fit its mapping (corrupt header)");
        return -1;
    }
    return 0;
}

static void
Core_dealloc(Core *self)
{
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Core_release(Core *self, PyObject *Py_UNUSED(ignored))
{
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

/* ------------------------------------------------------------------ atomics
 * load/store/cas/add on any 8-aligned word of the mapping. Python offers no atomic
 * read-modify-write on memory shared between processes; the L2 segment needs a
 * compare-and-set (the writer lock), a fetch-and-add with a full barrier, and loads and
 * stores with acquire/release order. A bad offset raises IndexError.
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

/* ------------------------------------------------------------------ lock-free read */

/* read(key, h, zero_copy) -> None | tuple | int
 * tuple: (slot word, seq, tag, meta, value or None, counter, hlc, vvx, size)
 * int -1: a slot stayed odd too long (its writer may have died): Python decides.   */
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
    uint64_t i = h & c->mask;
    for (int probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
        uint64_t *slot = W(c, slot_off(c, i));
        int spins = 0;
        for (;;) {
            uint64_t s = LD(&slot[0]);
            if (s & 1) {
                if (++spins > 20000)
                    return PyLong_FromLong(-1);
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            uint64_t off = LD(&slot[2]);
            if (off == EMPTY) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LD(&slot[0]) != s)
                    continue;
                Py_RETURN_NONE;
            }
            if (off == TOMB || LD(&slot[1]) != h)
                break;
            if (!block_ok(c, off) || off + REC_HEADER > c->data_end) {
                if (LD(&slot[0]) != s)
                    continue;
                PyErr_SetString(SegmentError, "L2 slot points outside the heap (corrupt); purge it");
                return NULL;
            }
            uint64_t *rec = W(c, off);
            uint64_t size = rec[0], counter = rec[1], hlc = rec[2], info = rec[3];
            uint64_t vlen = rec[4], vrel = rec[5], mlen = rec[7];
            uint64_t rklen = info & 0xFFFF, tag = (info >> 16) & 0xFF, vvlen = info >> 24;
            int sane = size >= REC_HEADER && off + size <= c->data_end &&
                       REC_HEADER + rklen + vvlen + mlen <= vrel && vrel + vlen == size;
            if (!sane) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LD(&slot[0]) != s)
                    continue; /* reused under us */
                PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
                return NULL;
            }
            if (rklen != klen || memcmp(c->base + off + REC_HEADER, key, klen) != 0) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LD(&slot[0]) != s)
                    continue;
                break; /* a hash collision: keep probing */
            }
            PyObject *value, *meta, *vvx;
            if (tag == TAG_NDARRAY && vlen >= zc) {
                value = Py_None;
                Py_INCREF(value);
            } else {
                value = PyBytes_FromStringAndSize(c->base + off + vrel, (Py_ssize_t)vlen);
            }
            meta = PyBytes_FromStringAndSize(c->base + off + REC_HEADER + klen + vvlen, (Py_ssize_t)mlen);
            vvx = PyBytes_FromStringAndSize(c->base + off + REC_HEADER + klen, (Py_ssize_t)vvlen);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (!value || !meta || !vvx || LD(&slot[0]) != s) {
                Py_XDECREF(value);
                Py_XDECREF(meta);
                Py_XDECREF(vvx);
                if (PyErr_Occurred())
                    return NULL;
                continue; /* changed under us: the copy may be torn, take it again */
            }
            if (!slot[3])
                ST(&slot[3], 1); /* CLOCK reference bit */
            uint64_t word = slot_off(c, i) / 8;
            return Py_BuildValue("(KKKNNKKNK)", (unsigned long long)word, (unsigned long long)s,
                                 (unsigned long long)tag, meta, value, (unsigned long long)counter,
                                 (unsigned long long)hlc, vvx, (unsigned long long)size);
        }
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ locked: heap */

static void
push_free(Core *c, uint64_t off, uint64_t order)
{
    uint64_t *hd = W(c, (H_FREE + order) * 8);
    uint64_t head = *hd;
    uint64_t *blk = W(c, off);
    blk[1] = head;
    blk[2] = 0;
    if (head)
        W(c, head)[2] = off;
    *hd = off;
    *meta_at(c, off) = (uint8_t)(0x80 | (order - MIN_ORDER + 1));
}

static void
unlink_free(Core *c, uint64_t off, uint64_t order)
{
    uint64_t *blk = W(c, off);
    uint64_t nxt = blk[1], prv = blk[2];
    if (prv)
        W(c, prv)[1] = nxt;
    else
        *W(c, (H_FREE + order) * 8) = nxt;
    if (nxt)
        W(c, nxt)[2] = prv;
    *meta_at(c, off) = 0;
}

static uint64_t
heap_alloc(Core *c, uint64_t order)
{
    uint64_t j = order;
    while (j <= c->top_order && *W(c, (H_FREE + j) * 8) == 0)
        j++;
    if (j > c->top_order)
        return 0;
    uint64_t off = *W(c, (H_FREE + j) * 8);
    unlink_free(c, off, j);
    while (j > order) {
        j--;
        push_free(c, off + (1ULL << j), j);
    }
    *meta_at(c, off) = (uint8_t)(order - MIN_ORDER + 1);
    *W(c, H_USED * 8) += 1ULL << order;
    return off;
}

static void
heap_free(Core *c, uint64_t off)
{
    uint64_t order = (*meta_at(c, off) & 0x7F) + MIN_ORDER - 1;
    *W(c, H_USED * 8) -= 1ULL << order;
    while (order < c->top_order) {
        uint64_t buddy = ((off - c->data_off) ^ (1ULL << order)) + c->data_off;
        if (*meta_at(c, buddy) != (uint8_t)(0x80 | (order - MIN_ORDER + 1)))
            break;
        unlink_free(c, buddy, order);
        *meta_at(c, off > buddy ? off : buddy) = 0;
        if (buddy < off)
            off = buddy;
        order++;
    }
    push_free(c, off, order);
}

/* free a block no slot references, or park it while zero-copy views pin it */
static int
release_block(Core *c, uint64_t off)
{
    if (W(c, off)[6] == 0) {
        heap_free(c, off);
        return 0;
    }
    uint64_t *d = W(c, c->defer_off);
    for (uint64_t i = 0; i < c->n_defer; i++) {
        if (d[i] == 0) {
            d[i] = off;
            *W(c, H_DEFERRED * 8) += 1;
            return 0;
        }
    }
    return -1;
}

static void
feed_append(Core *c, uint64_t kind, const char *key, uint64_t klen, uint64_t counter, uint64_t hlc)
{
    uint64_t *headp = W(c, H_FEED_HEAD * 8);
    uint64_t head = *headp, seq = head + 1;
    uint64_t e = c->feed_off + (head % c->feed_n) * c->feed_esz;
    uint64_t *ent = W(c, e);
    if (klen > c->max_key)
        klen = c->max_key;
    ST(&ent[0], 0);
    ST(&ent[1], kind | (klen << 8));
    ST(&ent[2], counter);
    ST(&ent[3], hlc);
    memcpy(c->base + e + 32, key, klen);
    ST(&ent[0], seq);
    ST(headp, seq);
}

/* probe under the lock: *found = slot byte offset of key or 0; returns first reusable or 0 */
static uint64_t
find(Core *c, const char *key, uint64_t klen, uint64_t h, uint64_t *found)
{
    uint64_t i = h & c->mask, free = 0;
    *found = 0;
    for (int probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
        uint64_t so = slot_off(c, i);
        uint64_t *slot = W(c, so);
        uint64_t off = slot[2];
        if (off == EMPTY)
            return free ? free : so;
        if (off == TOMB) {
            if (!free)
                free = so;
        } else if (slot[1] == h && block_ok(c, off) && (W(c, off)[3] & 0xFFFF) == klen &&
                   memcmp(c->base + off + REC_HEADER, key, klen) == 0) {
            *found = so;
            return free;
        }
    }
    return free;
}

static uint64_t
hlc_next(Core *c, uint64_t now_ms)
{
    uint64_t *hp = W(c, H_HLC * 8);
    uint64_t hlc = now_ms << 16;
    if (hlc <= *hp)
        hlc = *hp + 1;
    *hp = hlc;
    return hlc;
}

/* find(key, h) -> (slot word or -1, first reusable slot word or -1)   [lock held] */
static PyObject *
Core_find(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "find(key: bytes, h: int)");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found;
    uint64_t free = find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, &found);
    return Py_BuildValue("(LL)", found ? (long long)(found / 8) : -1LL, free ? (long long)(free / 8) : -1LL);
}

/* put(key, h, tag, meta, value, now_ms, flags[, counter, hlc, vvx])
 *     -> (counter, hlc, vvx, word, seq) | int status                          [lock held]
 * A local write: a new dot (counter = the host's next write sequence), the next HLC, and
 * the replaced record's vector entries of other hosts (vvx) carried over. With the last
 * three arguments the record stores exactly that version instead (a remote or merged
 * version: counter is this host's entry, 0 if none); the host's write sequence and HLC
 * are raised past it so later local writes descend from it. counter = 2**64-1 asks for
 * a fresh local dot on top of the given vector (a value an application resolver made).
 * A status means nothing changed: NEED_SPACE (evict, retry), NEED_SLOT (the key's probe
 * window is full: evict in it, retry), TOO_LARGE, CORRUPT.                               */
static PyObject *
Core_put(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if ((nargs != 7 && nargs != 10) || !PyBytes_Check(args[0]) || !PyBytes_Check(args[3]) ||
        (nargs == 10 && !PyBytes_Check(args[9]))) {
        PyErr_SetString(PyExc_TypeError,
                        "put(key, h, tag, meta, value, now_ms, flags[, counter, hlc, vvx])");
        return NULL;
    }
    int explicit = nargs == 10;
    uint64_t x_counter = 0, x_hlc = 0;
    if (explicit) {
        x_counter = PyLong_AsUnsignedLongLong(args[7]);
        x_hlc = PyLong_AsUnsignedLongLong(args[8]);
    }
    const char *key = PyBytes_AS_STRING(args[0]);
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t tag = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[5]);
    uint64_t flags = PyLong_AsUnsignedLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer val;
    if (PyObject_GetBuffer(args[4], &val, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    const char *meta = PyBytes_AS_STRING(args[3]);
    uint64_t mlen = (uint64_t)PyBytes_GET_SIZE(args[3]);
    uint64_t vlen = (uint64_t)val.len;

    uint64_t found;
    uint64_t free = find(c, key, klen, h, &found);
    uint64_t old = found ? W(c, found)[2] : 0;
    const char *vvx = NULL;
    uint64_t vvlen = 0;
    if (explicit) {
        vvx = PyBytes_AS_STRING(args[9]);
        vvlen = (uint64_t)PyBytes_GET_SIZE(args[9]);
    } else if (old) {
        uint64_t info = W(c, old)[3];
        vvlen = info >> 24;
        vvx = c->base + old + REC_HEADER + (info & 0xFFFF);
        if (old + REC_HEADER + (info & 0xFFFF) + vvlen > c->data_end) {
            PyBuffer_Release(&val);
            return PyLong_FromLong(CORRUPT);
        }
    }
    uint64_t vrel = REC_HEADER + klen + vvlen + mlen;
    if (tag == TAG_NDARRAY)
        vrel = (vrel + 63) & ~63ULL;
    uint64_t size = vrel + vlen;
    if (size > (1ULL << c->top_order)) {
        PyBuffer_Release(&val);
        return PyLong_FromLong(TOO_LARGE);
    }
    if (!found && !free) {
        PyBuffer_Release(&val);
        return PyLong_FromLong(NEED_SLOT);
    }
    uint64_t order = MIN_ORDER;
    while ((1ULL << order) < size)
        order++;
    uint64_t off = heap_alloc(c, order);
    if (!off) {
        PyBuffer_Release(&val);
        return PyLong_FromLong(NEED_SPACE);
    }
    /* build the record, unpublished */
    uint64_t counter, hlc;
    if (explicit && x_counter == UINT64_MAX) {
        /* a new local write on top of a given (merged) vector: a fresh dot, an HLC past
           both the local clock and the given timestamp */
        counter = *W(c, H_WSEQ * 8) + 1;
        *W(c, H_WSEQ * 8) = counter;
        hlc = hlc_next(c, now_ms);
        if (hlc <= x_hlc) {
            hlc = x_hlc + 1;
            *W(c, H_HLC * 8) = hlc;
        }
    } else if (explicit) {
        counter = x_counter;
        hlc = x_hlc;
        if (*W(c, H_WSEQ * 8) < counter)
            *W(c, H_WSEQ * 8) = counter;
        if (*W(c, H_HLC * 8) < hlc)
            *W(c, H_HLC * 8) = hlc;
    } else {
        counter = *W(c, H_WSEQ * 8) + 1;
        *W(c, H_WSEQ * 8) = counter;
        hlc = hlc_next(c, now_ms);
    }
    uint64_t *rec = W(c, off);
    rec[0] = size;
    rec[1] = counter;
    rec[2] = hlc;
    rec[3] = klen | (tag << 16) | (vvlen << 24);
    rec[4] = vlen;
    rec[5] = vrel;
    rec[6] = 0;
    rec[7] = mlen;
    char *p = c->base + off + REC_HEADER;
    memcpy(p, key, klen);
    if (vvlen)
        memmove(p + klen, vvx, vvlen);
    if (mlen)
        memcpy(p + klen + vvlen, meta, mlen);
    memcpy(c->base + off + vrel, val.buf, vlen);
    PyBuffer_Release(&val);
    PyObject *vvx_obj = PyBytes_FromStringAndSize(p + klen, (Py_ssize_t)vvlen);
    if (!vvx_obj)
        return NULL; /* nothing published yet; the block leaks until recovery: only on OOM */
    /* publish: seq odd, swap, seq even (full barriers around the swap) */
    uint64_t so = found ? found : free;
    uint64_t *slot = W(c, so);
    __atomic_add_fetch(&slot[0], 1, __ATOMIC_SEQ_CST);
    if (!found)
        ST(&slot[1], h);
    ST(&slot[2], off);
    ST(&slot[4], flags);
    uint64_t seq = __atomic_add_fetch(&slot[0], 1, __ATOMIC_SEQ_CST);
    ST(&slot[3], 1);
    int bad = 0;
    if (found)
        bad = release_block(c, old);
    else
        *W(c, H_ENTRIES * 8) += 1;
    feed_append(c, KIND_PUT, key, klen, counter, hlc);
    if (bad) {
        Py_DECREF(vvx_obj);
        PyErr_SetString(SegmentError, "deferred table overflow (corrupt pin counts); purge it");
        return NULL;
    }
    return Py_BuildValue("(KKNKK)", (unsigned long long)counter, (unsigned long long)hlc, vvx_obj,
                         (unsigned long long)(so / 8), (unsigned long long)seq);
}

/* remove the record in slot byte offset so; feed a delete event   [lock held] */
static int
unlink_slot(Core *c, uint64_t so, uint64_t counter, uint64_t hlc)
{
    uint64_t *slot = W(c, so);
    uint64_t old = slot[2];
    uint64_t klen = W(c, old)[3] & 0xFFFF;
    char keybuf[4096 + 1];
    if (klen > sizeof(keybuf) - 1)
        klen = sizeof(keybuf) - 1;
    memcpy(keybuf, c->base + old + REC_HEADER, klen);
    __atomic_add_fetch(&slot[0], 1, __ATOMIC_SEQ_CST);
    ST(&slot[2], TOMB);
    ST(&slot[1], 0);
    __atomic_add_fetch(&slot[0], 1, __ATOMIC_SEQ_CST);
    *W(c, H_ENTRIES * 8) -= 1;
    int bad = release_block(c, old);
    /* a tombstone followed by an empty slot ends every probe chain: turn trailing
       tombstones back into empty slots so that misses stay short */
    uint64_t i = (so - c->slots_off) / (SLOT_WORDS * 8);
    if (W(c, slot_off(c, (i + 1) & c->mask))[2] == EMPTY) {
        while (W(c, slot_off(c, i))[2] == TOMB) {
            uint64_t *s = W(c, slot_off(c, i));
            __atomic_add_fetch(&s[0], 1, __ATOMIC_SEQ_CST);
            ST(&s[2], EMPTY);
            __atomic_add_fetch(&s[0], 1, __ATOMIC_SEQ_CST);
            i = (i - 1) & c->mask;
        }
    }
    feed_append(c, KIND_DELETE, keybuf, klen, counter, hlc);
    return bad;
}

/* delete(key, h, now_ms) -> the delete's write counter (its feed event's), 0 if absent
 * [lock held] */
static PyObject *
Core_delete(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "delete(key: bytes, h: int, now_ms: int)");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found;
    find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, &found);
    if (!found)
        return PyLong_FromLong(0);
    uint64_t counter = *W(c, H_WSEQ * 8) + 1;
    *W(c, H_WSEQ * 8) = counter;
    if (unlink_slot(c, found, counter, hlc_next(c, now_ms))) {
        PyErr_SetString(SegmentError, "deferred table overflow (corrupt pin counts); purge it");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(counter);
}

/* evict(word) -> None: remove the live record in that slot, feed a delete   [lock held] */
static PyObject *
Core_evict(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t word = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    uint64_t so = word * 8;
    if (so < c->slots_off || so >= c->slots_off + (c->mask + 1) * SLOT_WORDS * 8 ||
        W(c, so)[2] <= TOMB || !block_ok(c, W(c, so)[2])) {
        PyErr_SetString(PyExc_ValueError, "evict: not a live slot");
        return NULL;
    }
    uint64_t counter = *W(c, H_WSEQ * 8) + 1;
    *W(c, H_WSEQ * 8) = counter;
    if (unlink_slot(c, so, counter, *W(c, H_HLC * 8))) {
        PyErr_SetString(SegmentError, "deferred table overflow (corrupt pin counts); purge it");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* free(off): return a block to the heap   [lock held] */
static PyObject *
Core_free(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t off = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (!block_ok(c, off) || (*meta_at(c, off) & 0x80) || *meta_at(c, off) == 0) {
        PyErr_SetString(PyExc_ValueError, "free: not an allocated block");
        return NULL;
    }
    heap_free(c, off);
    Py_RETURN_NONE;
}

/* push_free(off, order): add a free block (recovery rebuilds the heap with it) */
static PyObject *
Core_push_free(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "push_free(off, order)");
        return NULL;
    }
    uint64_t off = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t order = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (!block_ok(c, off) || order < MIN_ORDER || order > c->top_order ||
        off + (1ULL << order) > c->data_end) {
        PyErr_SetString(PyExc_ValueError, "push_free: bad block");
        return NULL;
    }
    push_free(c, off, order);
    Py_RETURN_NONE;
}

/* feed(kind, key, counter, hlc): append one change-feed event   [lock held] */
static PyObject *
Core_feed(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 4 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "feed(kind, key: bytes, counter, hlc)");
        return NULL;
    }
    uint64_t kind = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t counter = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t hlc = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    feed_append(c, kind, PyBytes_AS_STRING(args[1]), (uint64_t)PyBytes_GET_SIZE(args[1]), counter, hlc);
    Py_RETURN_NONE;
}

/* try_lock(pid) -> 0: locked, busy set, nothing to do first
 *                  1: held by another (or another thread): take the slow path
 *                  2: locked, but Python must look first (purged, a writer died mid-operation,
 *                     views released or deferred): busy is NOT set                           */
static PyObject *
Core_try_lock(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    uint64_t pid = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    uint64_t expected = 0;
    if (!__atomic_compare_exchange_n(W(c, H_LOCK * 8), &expected, pid, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST))
        return PyLong_FromLong(1);
    if (*W(c, H_STATE * 8) || *W(c, H_BUSY * 8) || LD(W(c, H_RELEASED * 8)) || *W(c, H_DEFERRED * 8))
        return PyLong_FromLong(2);
    *W(c, H_BUSY * 8) = 1;
    return PyLong_FromLong(0);
}

/* unlock(): clear busy and release the writer lock (release order: all our stores first) */
static PyObject *
Core_unlock(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    *W(c, H_BUSY * 8) = 0;
    ST(W(c, H_LOCK * 8), 0);
    Py_RETURN_NONE;
}

/* pin(key, h, pid) -> None | (word, seq, tag, meta, counter, hlc, vvx, size, pin, voff, vlen)
 * [lock held] Records (block, pid) in the first free pin entry and counts the pin on the
 * block, so writers park instead of free it. pin == -1: the pin table is full.          */
static PyObject *
Core_pin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pin(key: bytes, h: int, pid: int)");
        return NULL;
    }
    uint64_t klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t pid = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found;
    find(c, PyBytes_AS_STRING(args[0]), klen, h, &found);
    if (!found)
        Py_RETURN_NONE;
    uint64_t *slot = W(c, found);
    uint64_t off = slot[2];
    uint64_t *rec = W(c, off);
    uint64_t info = rec[3], vvlen = info >> 24, mlen = rec[7];
    if (off + rec[0] > c->data_end || REC_HEADER + klen + vvlen + mlen > rec[5] ||
        rec[5] + rec[4] != rec[0]) {
        PyErr_SetString(SegmentError, "corrupt L2 record; purge the namespace");
        return NULL;
    }
    const char *p = c->base + off + REC_HEADER + klen;
    long long index = -1;
    uint64_t *pins = W(c, c->defer_off - c->n_defer * 16);
    for (uint64_t i = 0; i < c->n_defer; i++) {
        if (pins[2 * i] == 0) {
            pins[2 * i] = off;
            pins[2 * i + 1] = pid;
            rec[6] += 1;
            if (i >= *W(c, H_PIN_HWM * 8))
                *W(c, H_PIN_HWM * 8) = i + 1;
            index = (long long)i;
            break;
        }
    }
    ST(&slot[3], 1);
    return Py_BuildValue("(KKKy#KKy#KLKK)", (unsigned long long)(found / 8),
                         (unsigned long long)slot[0], (unsigned long long)((info >> 16) & 0xFF),
                         p + vvlen, (Py_ssize_t)mlen, (unsigned long long)rec[1],
                         (unsigned long long)rec[2], p, (Py_ssize_t)vvlen,
                         (unsigned long long)rec[0], index, (unsigned long long)(off + rec[5]),
                         (unsigned long long)rec[4]);
}

static PyMethodDef Core_methods[] = {
    {"load", (PyCFunction)Core_load, METH_O, "load(off) -> int (acquire)"},
    {"store", (PyCFunction)(void (*)(void))Core_store, METH_FASTCALL, "store(off, v) (release)"},
    {"cas", (PyCFunction)(void (*)(void))Core_cas, METH_FASTCALL, "cas(off, expected, desired) -> bool"},
    {"add", (PyCFunction)(void (*)(void))Core_add, METH_FASTCALL, "add(off, delta) -> new value"},
    {"pin", (PyCFunction)(void (*)(void))Core_pin, METH_FASTCALL, "pin a block (lock held)"},
    {"try_lock", (PyCFunction)Core_try_lock, METH_O, "take the writer lock if free"},
    {"unlock", (PyCFunction)Core_unlock, METH_NOARGS, "release the writer lock"},
    {"read", (PyCFunction)(void (*)(void))Core_read, METH_FASTCALL, "lock-free read"},
    {"find", (PyCFunction)(void (*)(void))Core_find, METH_FASTCALL, "probe (lock held)"},
    {"put", (PyCFunction)(void (*)(void))Core_put, METH_FASTCALL, "store a record (lock held)"},
    {"delete", (PyCFunction)(void (*)(void))Core_delete, METH_FASTCALL, "delete (lock held)"},
    {"evict", (PyCFunction)Core_evict, METH_O, "evict a slot (lock held)"},
    {"free", (PyCFunction)Core_free, METH_O, "free a block (lock held)"},
    {"push_free", (PyCFunction)(void (*)(void))Core_push_free, METH_FASTCALL, "add a free block"},
    {"feed", (PyCFunction)(void (*)(void))Core_feed, METH_FASTCALL, "append a feed event"},
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
    .tp_doc = "Core(mmap, layout...): hot L2 operations over one mapped segment",
};

static PyObject *
set_error(PyObject *mod, PyObject *exc)
{
    Py_XINCREF(exc);
    Py_XSETREF(SegmentError, exc);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_segment_error", set_error, METH_O, "the exception class raised on corrupt segments"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvcomm._l2core", "hot L2 operations", -1, module_methods,
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
    Py_INCREF(SegmentError);
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
