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

/* whether the live record in slot so is past its deadline at now (epoch seconds) */
static int
slot_expired(Core *c, uint64_t so, double now)
{
    uint64_t off = W(c, so)[SLOT_OFF];
    Rec r;
    if (off <= TOMB || !rec_parse(c, off, &r) || !r.xlen)
        return 0;
    double d = ext_deadline((const unsigned char *)rec_ext(c, off, &r), r.xlen);
    return d > 0 && d <= now;
}

static int drop_slot(Core *c, uint64_t so, int kind);

/* evict the live, clean, unpinned record in slot so: no L3 write, a local EVICT event
 * (an EXPIRE event when it is past its deadline at now, epoch seconds: its space was the
 * expiry's to reclaim) */
static int
evict_slot(Core *c, uint64_t so, double now)
{
    if (slot_expired(c, so, now))
        return drop_slot(c, so, KIND_EXPIRE);
    *HW(c, H_EVICTIONS) += 1;
    return drop_slot(c, so, KIND_EVICT);
}

/* unlink the record in slot so and feed `kind` for it (a local event) */
static int
drop_slot(Core *c, uint64_t so, int kind)
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
    if (release_block(c, off) < 0)
        return -1;
    feed_append(c, kind, keybuf, r.klen, r.counter, r.hlc);
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
    if (!block_ok(c, off) || REC_HEADER > c->data_end - off || hazard_held(c, off))
        return 0; /* (a named block would only be parked: no room made) */
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
    double now = real_now();
    for (uint64_t step = 0; step < 2 * n + 1; step++) {
        uint64_t so = slot_off(c, hand);
        hand = (hand + 1) % n;
        if (!evictable(c, so, protect, nprotect))
            continue;
        uint64_t *slot = W(c, so);
        if (slot[SLOT_REF] && !slot_expired(c, so, now)) {
            slot[SLOT_REF] = 0; /* a second chance (none for an expired entry) */
            continue;
        }
        *HW(c, H_CLOCK) = hand;
        return evict_slot(c, so, now) < 0 ? -1 : 1;
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
            return evict_slot(c, so, real_now()) < 0 ? -1 : 1;
        }
    }
    return 0;
}
