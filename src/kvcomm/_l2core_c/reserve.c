/* ------------------------------------------------------------------ reservation   [lock held]
 *
 * The segment file is sparse (layout.py, "Reservation map"): a page's memory is reserved
 * (fallocate) before anything is written to it, and its bit in the map set after, so a
 * full tmpfs is a SegmentError from the write that wanted the room, never a SIGBUS. Bits
 * are only ever set (until the purge): what a namespace has held stays reserved for it.
 */

static void
resv_mark(Core *c, uint64_t from, uint64_t to) /* set the bits of pages [from, to) */
{
    for (uint64_t p = from; p < to && p < c->resv_pages; p++) {
        uint64_t *w = W(c, c->resv_off + (p >> 6) * 8);
        if (!((LD(w) >> (p & 63)) & 1))
            __atomic_fetch_or(w, 1ULL << (p & 63), __ATOMIC_SEQ_CST);
    }
}

static int
resv_failed(Core *c, uint64_t bytes, int err)
{
    c->no_room = 1;
    char link[64], path[512];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", c->fd);
    ssize_t n = c->has_fd ? readlink(link, path, sizeof(path) - 1) : -1;
    if (n < 0)
        n = snprintf(path, sizeof(path), "(its file)") > 0 ? (ssize_t)strlen(path) : 0;
    path[n] = 0;
    PyErr_Format(SegmentError, "cannot reserve %llu KiB more memory for the L2 segment %s (%s): "
                 "its tmpfs (cache.l2_dir) is full. Nothing was written; free space there, "
                 "lower cache.l2_size, or point cache.l2_dir at a larger tmpfs (Docker: "
                 "--shm-size)", (unsigned long long)(bytes >> 10), path,
                 c->has_fd ? strerror(err) : "no file to reserve it in");
    return -1;
}

/* Reserve the pages of [off, off + len), rounded out to `chunk` bytes (a multiple of
 * RESV_PAGE) but not outside [lo, hi): 0, or -1 with SegmentError set (nothing else
 * changed). Pages already reserved cost a bit test each. */
static int
reserve(Core *c, uint64_t off, uint64_t len, uint64_t chunk, uint64_t lo, uint64_t hi)
{
    uint64_t p = off / RESV_PAGE, last = (off + (len ? len : 1) - 1) / RESV_PAGE;
    while (p <= last && page_reserved(c, p * RESV_PAGE))
        p++;
    if (p > last)
        return 0;
    uint64_t a = p * RESV_PAGE / chunk * chunk, b = (off + len + chunk - 1) / chunk * chunk;
    if (a < lo)
        a = lo;
    if (b > hi)
        b = hi;
    if (b > c->size)
        b = c->size;
    if (!c->has_fd || a >= b)
        return resv_failed(c, b > a ? b - a : 0, 0);
    int err;
    do /* (a signal interrupts a large one: the pages it got stay, the rest is asked again) */
        err = posix_fallocate(c->fd, (off_t)a, (off_t)(b - a));
    while (err == EINTR);
    if (err)
        return resv_failed(c, b - a, err);
    resv_mark(c, a / RESV_PAGE, (b + RESV_PAGE - 1) / RESV_PAGE);
    return 0;
}

/* a slot's pages, before it is first written (a new key) */
static inline int
reserve_slot(Core *c, uint64_t so)
{
    return slot_present(c, so) ? 0 : reserve(c, so, SLOT_WORDS * 8, RESV_PAGE, 0, c->size);
}

/* heap bytes [off, off + len), before a record or a free-list link is written there */
static inline int
reserve_heap(Core *c, uint64_t off, uint64_t len)
{
    return reserve(c, off, len, RESV_HEAP_CHUNK, c->data_off, c->data_end);
}

/* reserved() -> bytes of the file whose pages are reserved (the map's count) */
static PyObject *
Core_reserved(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    uint64_t n = 0;
    for (uint64_t i = 0; i < (c->resv_pages + 63) / 64; i++)
        n += (uint64_t)__builtin_popcountll(LD(W(c, c->resv_off + i * 8)));
    return PyLong_FromUnsignedLongLong(n * RESV_PAGE);
}
