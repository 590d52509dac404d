/* ------------------------------------------------------------------ plain records
 *
 * pack_plain(fields) -> bytes | None: the msgpack encoding of a list of str, bytes and
 * None fields, byte for byte what ``msgpack.packb(fields, use_bin_type=True)`` makes
 * (the LangGraph saver's records: kvcomm.core.codec.Packed). None for anything else: not
 * an exact list, another field type, a str with a lone surrogate, a field of 4 GiB or
 * more; the caller then takes the Python path, which raises what it should. No error is
 * left set when it returns None.
 *
 * set_packed(cls, tag): BatchOps.put stores an instance of ``cls`` (Packed) as its
 * ``payload`` bytes under ``tag`` without calling back into Python (codec.encode would
 * return exactly that).
 */

static PyObject *PackedType, *PackedTag, *PayloadName;
static PyObject *KeyHasher; /* xxhash.xxh3_64_intdigest (set_key_hasher): BatchOps's new keys */
#define KEY_MEMO 65536     /* keys a client's memo holds before it is cleared (base.py) */

static PyObject *
set_key_hasher(PyObject *self, PyObject *fn)
{
    (void)self;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_key_hasher(fn)");
        return NULL;
    }
    Py_INCREF(fn);
    Py_XSETREF(KeyHasher, fn);
    Py_RETURN_NONE;
}

static inline char *
put_len(char *p, unsigned char small_base, int small_bits, unsigned char b8, unsigned char b16,
        unsigned char b32, uint64_t n)
{
    if (small_bits && n < (1ULL << small_bits)) {
        *p++ = (char)(small_base | n);
    } else if (b8 && n <= 0xFF) {
        *p++ = (char)b8;
        *p++ = (char)n;
    } else if (n <= 0xFFFF) {
        *p++ = (char)b16;
        *p++ = (char)(n >> 8);
        *p++ = (char)n;
    } else {
        *p++ = (char)b32;
        *p++ = (char)(n >> 24);
        *p++ = (char)(n >> 16);
        *p++ = (char)(n >> 8);
        *p++ = (char)n;
    }
    return p;
}

static inline uint64_t
len_bytes(int small_bits, int has8, uint64_t n)
{
    if (small_bits && n < (1ULL << small_bits))
        return 1;
    if (has8 && n <= 0xFF)
        return 2;
    return n <= 0xFFFF ? 3 : 5;
}

static PyObject *
pack_plain(PyObject *self, PyObject *fields)
{
    (void)self;
    if (!PyList_CheckExact(fields))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(fields);
    if ((uint64_t)n > 0xFFFFFFFFULL)
        Py_RETURN_NONE;
    uint64_t size = len_bytes(4, 0, (uint64_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyList_GET_ITEM(fields, i);
        Py_ssize_t len;
        if (f == Py_None) {
            size += 1;
            continue;
        }
        if (PyUnicode_CheckExact(f)) {
            if (!PyUnicode_AsUTF8AndSize(f, &len)) {
                PyErr_Clear(); /* (a lone surrogate: the Python path says so) */
                Py_RETURN_NONE;
            }
            if ((uint64_t)len > 0xFFFFFFFFULL)
                Py_RETURN_NONE;
            size += len_bytes(5, 1, (uint64_t)len) + (uint64_t)len;
        } else if (PyBytes_CheckExact(f)) {
            len = PyBytes_GET_SIZE(f);
            if ((uint64_t)len > 0xFFFFFFFFULL)
                Py_RETURN_NONE;
            size += len_bytes(0, 1, (uint64_t)len) + (uint64_t)len;
        } else {
            Py_RETURN_NONE;
        }
    }
    if (size > (uint64_t)PY_SSIZE_T_MAX)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (!out)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    p = put_len(p, 0x90, 4, 0, 0xdc, 0xdd, (uint64_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyList_GET_ITEM(fields, i);
        if (f == Py_None) {
            *p++ = (char)0xc0;
        } else if (PyUnicode_CheckExact(f)) {
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(f, &len); /* (cached by the first pass) */
            p = put_len(p, 0xa0, 5, 0xd9, 0xda, 0xdb, (uint64_t)len);
            memcpy(p, s, (size_t)len);
            p += len;
        } else {
            Py_ssize_t len = PyBytes_GET_SIZE(f);
            p = put_len(p, 0, 0, 0xc4, 0xc5, 0xc6, (uint64_t)len);
            memcpy(p, PyBytes_AS_STRING(f), (size_t)len);
            p += len;
        }
    }
    return out;
}

static PyObject *
set_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyType_Check(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_packed(cls, tag)");
        return NULL;
    }
    if (!PayloadName && !(PayloadName = PyUnicode_InternFromString("payload")))
        return NULL;
    Py_INCREF(args[0]);
    Py_XSETREF(PackedType, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(PackedTag, args[1]);
    Py_RETURN_NONE;
}
