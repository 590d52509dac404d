/* ------------------------------------------------------------------ the host key filter
 *
 * bloom_has(buffer, bits, k, gens, digest) -> bool: is a key in any of ``gens`` Bloom
 * filters of ``bits`` bits each, laid end to end in ``buffer``? ``digest`` is the key's
 * xxh3-128 digest (16 bytes, canonical: high half first). The positions are those of
 * kvcomm.core.bloom.BloomFilter (double hashing: h1 = low half, h2 = high half | 1,
 * position i = (h1 + i*h2) mod bits, exact, as Python's integers compute it); a test holds
 * the two to agreement. Only the agents' membership test is here (the read path of every
 * cluster get); the daemon's adds and rotations stay in Python.
 *
 * The buffer is the read-only mapping of the filter file; the daemon clears and refills a
 * generation while agents test it, which a Bloom filter tolerates (the answer is "maybe",
 * and the other generation keeps answering during a refill).
 */
static uint64_t
be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *
bloom_has(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) != 16) {
        PyErr_SetString(PyExc_TypeError, "bloom_has(buffer, bits, k, gens, digest: 16 bytes)");
        return NULL;
    }
    uint64_t bits = PyLong_AsUnsignedLongLong(args[1]);
    long k = PyLong_AsLong(args[2]);
    long gens = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (bits == 0 || bits % 64 || k < 1 || k > 64 || gens < 1 || gens > 8) {
        PyErr_SetString(PyExc_ValueError, "bloom_has: bits must be a positive multiple of 64, "
                        "1 <= k <= 64, 1 <= gens <= 8");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t gen_bytes = bits / 8;
    if ((uint64_t)view.len / gen_bytes < (uint64_t)gens) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "bloom_has: buffer smaller than gens * bits / 8");
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(args[4]);
    uint64_t h2 = be64(d) | 1, h1 = be64(d + 8);
    uint64_t pos[64];
    for (long i = 0; i < k; i++)
        pos[i] = (uint64_t)(((unsigned __int128)h1 + (unsigned __int128)(uint64_t)i * h2) % bits);
    int found = 0;
    for (long g = 0; g < gens && !found; g++) {
        const volatile unsigned char *b = (const unsigned char *)view.buf + (uint64_t)g * gen_bytes;
        found = 1;
        for (long i = 0; i < k; i++) {
            if (!(b[pos[i] >> 3] & (1u << (pos[i] & 7)))) {
                found = 0;
                break;
            }
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}
