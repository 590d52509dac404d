/* ------------------------------------------------------------------ recovery   [lock held]
 *
 * recover() -> live entries: after a writer died (or found corruption) mid-mutation.
 * Slots: odd seqs made even; references to malformed, misplaced, overlapping or duplicate
 * blocks dropped. Pins: kept for live processes (procs.c); what they name stays parked.
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
    if (!block_ok(c, off) || !page_reserved(c, off) || !rec_parse(c, off, &r))
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
Core_recover(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    NEED_LOCK(c);
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
        if (!slot_present(c, slot_off(c, i)))
            continue; /* never written: EMPTY */
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
        entries++;
        dirty += (slot[SLOT_FLAGS] & FLAG_DIRTY) != 0;
        used += 1ULL << order;
    }
    /* pin entries: a dead process's entries are cleared — its block word first, then its
       token, so that no reader can claim the entry in between; a live process's entries
       stay, and a block one names that no slot references stays parked. Readers claim and
       fill entries concurrently (lock-free): an entry is only written here while its
       token is a dead one, which no live reader can own. */
    uint64_t *d = W(c, c->defer_off);
    for (uint64_t i = 0; i < c->n_pins; i++)
        d[i] = 0;
    for (uint64_t i = 0; i < c->n_pins; i++) {
        uint64_t *e = pin_entry(c, i);
        uint64_t token = __atomic_load_n(&e[1], __ATOMIC_SEQ_CST);
        if (!token)
            continue;
        if (!token_alive(c, token)) {
            __atomic_store_n(&e[0], 0, __ATOMIC_SEQ_CST);
            uint64_t expected = token;
            __atomic_compare_exchange_n(&e[1], &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            continue;
        }
        uint64_t off = HAZ_OFF(__atomic_load_n(&e[0], __ATOMIC_SEQ_CST));
        if (!off || (block_ok(c, off) && bit_get(u.start, (off - c->data_off) >> MIN_ORDER)))
            continue; /* nothing named, or a live record (or an already parked block) */
        uint64_t order = plausible(c, &u, off);
        if (order && deferred < c->n_pins) {
            mark_block(c, &u, off, order);
            d[deferred++] = off;
            used += 1ULL << order;
        }
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
            if (reserve_heap(c, off, 24) < 0) { /* (BUSY stays raised: tried again) */
                free(u.start);
                free(u.cover);
                return NULL;
            }
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
    if (*HW(c, H_PIN_HWM) > c->n_pins)
        *HW(c, H_PIN_HWM) = c->n_pins; /* (a corrupt mark: every entry is scanned) */
    ST(HW(c, H_RELEASED), 0);
    *HW(c, H_RECOVERIES) += 1;
    /* the expiry hint may be off: a pass is due, from the start */
    *HW(c, H_EXPIRY_CURSOR) = 0;
    *HW(c, H_EXPIRY_PASS) = 0;
    ST(HW(c, H_EXPIRY_NEXT), 1);
    feed_append(c, KIND_RESYNC, "", 0, *HW(c, H_WSEQ), *HW(c, H_HLC));
    ST(HW(c, H_BUSY), 0);
    return PyLong_FromUnsignedLongLong(entries);
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
