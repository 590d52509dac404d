/* ------------------------------------------------------------------ lock-free read
 *
 * read_into() is the one seqlock probe: find the key's slot, parse its record (every
 * field checked), copy what the caller asks for, and check the slot's seq did not move
 * while copying. read(), version() and kv.get's C path (l1.c) are built on it.
 */

typedef struct {
    uint64_t word, seq, tag, counter, hlc, size, flags, vlen;
    double deadline; /* the record's expiry (epoch seconds, from its extension field); 0: none */
    PyObject *value; /* NULL when not asked for, Py_None for a large array (pin it) */
    PyObject *meta, *vvx, *ext; /* ext: only with WANT_EXT */
} Found;

enum { READ_ABSENT = 0, READ_FOUND = 1, READ_STUCK = 2, READ_ERROR = -1 };
#define WANT_VALUE 1
#define WANT_META 2
#define WANT_EXT 4

static void
found_clear(Found *f)
{
    Py_CLEAR(f->value);
    Py_CLEAR(f->meta);
    Py_CLEAR(f->vvx);
    Py_CLEAR(f->ext);
}

/* ------------------------------------------------------------------ expiry
 *
 * A record's deadline travels in its extension field (kvcomm.core.expiry): the key "e" of
 * the packed map, epoch seconds as a float or a positive int. ext_deadline() finds it
 * without allocating (the getter asks on every L2 read); it reads what
 * kvcomm.core.expiry.deadline_of reads, and anything it cannot read is no deadline, as
 * there. */

/* skip one msgpack value at *pi; -1 when malformed or truncated */
static int
mp_skip(const unsigned char *p, uint64_t n, uint64_t *pi)
{
    uint64_t i = *pi, pending = 1;
    while (pending) {
        if (i >= n)
            return -1;
        unsigned char b = p[i++];
        uint64_t len = 0, items = 0, lenb = 0;
        pending--;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            ;
        else if ((b & 0xe0) == 0xa0)
            len = b & 0x1f;
        else if ((b & 0xf0) == 0x90)
            items = b & 0x0f;
        else if ((b & 0xf0) == 0x80)
            items = 2 * (uint64_t)(b & 0x0f);
        else
            switch (b) {
            case 0xcc: case 0xd0: len = 1; break;
            case 0xcd: case 0xd1: len = 2; break;
            case 0xce: case 0xd2: case 0xca: len = 4; break;
            case 0xcf: case 0xd3: case 0xcb: len = 8; break;
            case 0xd9: case 0xc4: lenb = 1; break;
            case 0xda: case 0xc5: lenb = 2; break;
            case 0xdb: case 0xc6: lenb = 4; break;
            case 0xdc: case 0xde: case 0xdd: case 0xdf: {
                uint64_t w = (b == 0xdc || b == 0xde) ? 2 : 4, c = 0;
                if (n - i < w)
                    return -1;
                for (uint64_t k = 0; k < w; k++)
                    c = (c << 8) | p[i++];
                items = (b == 0xde || b == 0xdf) ? 2 * c : c;
                break;
            }
            default: return -1; /* ext types: never in an extension field */
            }
        if (lenb) {
            if (n - i < lenb)
                return -1;
            for (uint64_t k = 0; k < lenb; k++)
                len = (len << 8) | p[i++];
        }
        if (n - i < len || items > n)
            return -1;
        i += len;
        pending += items;
        if (pending > n)
            return -1;
    }
    *pi = i;
    return 0;
}

/* the number packed at v (left bytes), as a double; 0 when it is not one (nil, a bool, a
 * string...): msgpack's floats and integers, signed or not */
static double
mp_number(const unsigned char *v, uint64_t left)
{
    unsigned char b = v[0];
    uint64_t u = 0, w = 0;
    if (b <= 0x7f)
        return b;
    if (b >= 0xe0)
        return (double)(int8_t)b;
    if (b == 0xcb || b == 0xca || (b >= 0xcc && b <= 0xd3))
        w = b == 0xcb ? 8 : b == 0xca ? 4 : 1ULL << ((b - 0xcc) & 3);
    else
        return 0;
    if (left < 1 + w)
        return 0;
    for (uint64_t j = 1; j <= w; j++)
        u = (u << 8) | v[j];
    if (b == 0xcb) {
        double d;
        memcpy(&d, &u, 8);
        return d;
    }
    if (b == 0xca) {
        uint32_t u4 = (uint32_t)u;
        float f4;
        memcpy(&f4, &u4, 4);
        return f4;
    }
    if (b <= 0xcf)
        return (double)u;
    /* int8..int64: sign-extend from w bytes */
    if (w < 8 && (u >> (8 * w - 1)) & 1)
        u |= ~0ULL << (8 * w);
    return (double)(int64_t)u;
}

/* The deadline in the packed map p[0..n), 0 when none. Read as Python's msgpack (and
 * Redis's cmsgpack) read it, so that every reader of a field L2 accepts sees the same
 * deadline (kvcomm.core.expiry.deadline_of): a fixmap, map16 or map32 header,
 * the key "e" in any str encoding, the LAST "e" when it repeats, any integer or float
 * encoding; a malformed field, or bytes after the map, is no deadline. */
static double
ext_deadline(const unsigned char *p, uint64_t n)
{
    uint64_t i = 1, count;
    double d = 0;
    if (n == 0)
        return 0;
    if ((p[0] & 0xF0) == 0x80)
        count = p[0] & 0x0F;
    else if (p[0] == 0xde && n >= 3) {
        count = ((uint64_t)p[1] << 8) | p[2];
        i = 3;
    } else if (p[0] == 0xdf && n >= 5) {
        count = ((uint64_t)p[1] << 24) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 8) | p[4];
        i = 5;
    } else
        return 0;
    if (count > n)
        return 0;
    for (uint64_t k = 0; k < count; k++) {
        uint64_t j = i;
        if (mp_skip(p, n, &j) < 0 || j >= n)
            return 0;
        uint64_t kl = j - i;
        const unsigned char *key = p + i;
        int is_e = (kl == 2 && key[0] == 0xa1 && key[1] == 'e') ||
                   (kl == 3 && key[0] == 0xd9 && key[1] == 1 && key[2] == 'e') ||
                   (kl == 4 && key[0] == 0xda && key[1] == 0 && key[2] == 1 && key[3] == 'e') ||
                   (kl == 6 && key[0] == 0xdb && key[1] == 0 && key[2] == 0 && key[3] == 0 &&
                    key[4] == 1 && key[5] == 'e');
        if (is_e)
            d = mp_number(p + j, n - j);
        i = j;
        if (mp_skip(p, n, &i) < 0)
            return 0;
    }
    if (i != n)
        return 0;
    return (d > 0 && d < 1e300) ? d : 0; /* (NaN fails both) */
}

static inline double
real_now(void)
{
    /* rounded as Python's time.time() rounds the same reading (nanoseconds, then / 1e9):
     * sec + nsec * 1e-9 may land one step below it, and a read that Python timed at the
     * deadline would be served */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (ts.tv_nsec == 0)
        return (double)ts.tv_sec;
    return (double)((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
}

/* READ_FOUND (f filled: new references), READ_ABSENT, READ_STUCK (a slot stayed odd: a
 * writer is stopped or died mid-publish) or READ_ERROR (an exception is set: purged,
 * corrupt, out of memory). Arrays of ``zc`` bytes or more get value Py_None. */
static int
read_into(Core *c, const char *key, uint64_t klen, uint64_t h, uint64_t zc, int want, Found *f)
{
    memset(f, 0, sizeof(*f));
    if (LDR(HW(c, H_STATE)) != STATE_OK) {
        PyErr_SetString(SegmentError, "this namespace was purged; open it again");
        return READ_ERROR;
    }
    uint64_t i = h & c->mask;
    for (uint64_t probe = 0; probe < MAX_PROBE; probe++, i = (i + 1) & c->mask) {
        uint64_t so = slot_off(c, i);
        uint64_t *slot = W(c, so);
        if (!slot_present(c, so))
            return READ_ABSENT; /* (never written: EMPTY) */
        int spins = 0;
        for (;;) {
            uint64_t s = LD(&slot[SLOT_SEQ]);
            if (s & 1) {
                if (++spins > 20000)
                    return READ_STUCK;
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            uint64_t off = LD(&slot[SLOT_OFF]);
            uint64_t sh = LD(&slot[SLOT_HASH]);
            uint64_t fl = LD(&slot[SLOT_FLAGS]);
            if (off == EMPTY) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LD(&slot[SLOT_SEQ]) != s)
                    continue;
                return READ_ABSENT;
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
                return READ_ERROR;
            }
            if (!match)
                break; /* a hash collision: keep probing */
            if (want & WANT_VALUE) {
                if (r.tag == TAG_NDARRAY && r.vlen >= zc) {
                    f->value = Py_None;
                    Py_INCREF(Py_None);
                } else {
                    f->value = PyBytes_FromStringAndSize(c->base + off + r.vrel, (Py_ssize_t)r.vlen);
                }
            }
            if (want & WANT_META)
                f->meta = PyBytes_FromStringAndSize(rec_meta(c, off, &r), (Py_ssize_t)r.mlen);
            f->vvx = PyBytes_FromStringAndSize(rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen);
            if (want & WANT_EXT)
                f->ext = PyBytes_FromStringAndSize(rec_ext(c, off, &r), (Py_ssize_t)r.xlen);
            f->deadline = r.xlen ? ext_deadline((const unsigned char *)rec_ext(c, off, &r), r.xlen) : 0;
            if (((want & WANT_VALUE) && !f->value) || ((want & WANT_META) && !f->meta) || !f->vvx ||
                ((want & WANT_EXT) && !f->ext)) {
                found_clear(f);
                return READ_ERROR;
            }
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (LD(&slot[SLOT_SEQ]) != s) {
                found_clear(f);
                continue; /* the copy may be torn: take it again */
            }
            if (!LDR(&slot[SLOT_REF]) && !QUIET(c))
                ST(&slot[SLOT_REF], 1); /* CLOCK reference bit (not the daemon's reads) */
            f->word = so / 8;
            f->seq = s;
            f->tag = r.tag;
            f->counter = r.counter;
            f->hlc = r.hlc;
            f->size = r.size;
            f->vlen = r.vlen;
            f->flags = fl;
            return READ_FOUND;
        }
    }
    return READ_ABSENT;
}

static int
parse_key_h(PyObject *const *args, const char **key, uint64_t *klen, uint64_t *h)
{
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "the key is bytes");
        return -1;
    }
    *key = PyBytes_AS_STRING(args[0]);
    *klen = (uint64_t)PyBytes_GET_SIZE(args[0]);
    *h = PyLong_AsUnsignedLongLong(args[1]);
    return PyErr_Occurred() ? -1 : 0;
}

/* read(key, h, zero_copy) -> None | tuple | -1
 * tuple: (slot word, seq, tag, meta, value or None, counter, hlc, vvx, size, deadline);
 * deadline: the record's expiry in epoch seconds (0.0: none; kvcomm.core.expiry); tag 0 is a
 * tombstone (the key is deleted, L3 not told yet). value is None for an array of zero_copy
 * bytes or more (the caller pins it). -1: a slot stayed odd too long (a writer is stopped or
 * died mid-publish): Python decides. Raises SegmentError on a purged or corrupt segment.  */
static PyObject *
Core_read(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    const char *key;
    uint64_t klen, h;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read(key: bytes, h: int, zero_copy: int)");
        return NULL;
    }
    if (parse_key_h(args, &key, &klen, &h) < 0)
        return NULL;
    unsigned long long zc = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Found f;
    switch (read_into(c, key, klen, h, zc, WANT_VALUE | WANT_META, &f)) {
    case READ_ABSENT:
        Py_RETURN_NONE;
    case READ_STUCK:
        return PyLong_FromLong(-1);
    case READ_ERROR:
        return NULL;
    }
    return Py_BuildValue("(KKKNNKKNKd)", (unsigned long long)f.word, (unsigned long long)f.seq,
                         (unsigned long long)f.tag, f.meta, f.value, (unsigned long long)f.counter,
                         (unsigned long long)f.hlc, f.vvx, (unsigned long long)f.size, f.deadline);
}

/* version(key, h) -> None | (word, seq, tag, counter, hlc, vvx, flags, ext): a lock-free read
 * of the version and the record's extension field (tag 0: a tombstone). -1 when a slot stays
 * odd. */
static PyObject *
Core_version(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    const char *key;
    uint64_t klen, h;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "version(key: bytes, h: int)");
        return NULL;
    }
    if (parse_key_h(args, &key, &klen, &h) < 0)
        return NULL;
    Found f;
    switch (read_into(c, key, klen, h, 0, WANT_EXT, &f)) {
    case READ_ABSENT:
        Py_RETURN_NONE;
    case READ_STUCK:
        return PyLong_FromLong(-1);
    case READ_ERROR:
        return NULL;
    }
    return Py_BuildValue("(KKKKKNKN)", (unsigned long long)f.word, (unsigned long long)f.seq,
                         (unsigned long long)f.tag, (unsigned long long)f.counter,
                         (unsigned long long)f.hlc, f.vvx, (unsigned long long)f.flags, f.ext);
}

/* writers(pairs) -> list: for each (key, h) of ``pairs``, (ext, value length) of its record:
 * the extension field (b"": none) and the value's bytes; None when the key is absent, a
 * tombstone, or its slot stays odd. Lock-free, one seqlock probe per key (placement reads
 * who wrote each sampled key: once per flush of the sampled reads, never on a hit). */
static PyObject *
Core_writers(Core *c, PyObject *pairs)
{
    NEED_VIEW(c);
    if (!PyList_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "writers(pairs: list of (key: bytes, h: int))");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pairs, i);
        const char *key;
        uint64_t klen, h;
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2 ||
            parse_key_h(&PyTuple_GET_ITEM(p, 0), &key, &klen, &h) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "writers(pairs: list of (key: bytes, h: int))");
            Py_DECREF(out);
            return NULL;
        }
        Found f;
        PyObject *item;
        switch (read_into(c, key, klen, h, 0, WANT_EXT, &f)) {
        case READ_FOUND:
            if (f.tag == TAG_TOMBSTONE) {
                found_clear(&f);
                item = Py_None;
                Py_INCREF(item);
            } else {
                item = Py_BuildValue("(OK)", f.ext, (unsigned long long)f.vlen);
                found_clear(&f);
            }
            break;
        case READ_ERROR:
            Py_DECREF(out);
            return NULL;
        default: /* absent, or stuck: a sample can do without it */
            item = Py_None;
            Py_INCREF(item);
        }
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}
