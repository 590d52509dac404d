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
        uint64_t off = slot_present(c, so) ? slot[SLOT_OFF] : EMPTY;
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

/* ------------------------------------------------------------------ the expiry hint
 * (tiers/shm/layout.py, "Expiry hint"): EXPIRY_NEXT is a lower bound of the deadlines of
 * the clean records, in ms since the epoch (0: none has one), read lock-free by the sweep
 * to know that nothing can have expired. */

/* a deadline (epoch seconds; 0: none) as the hint's ms, rounded down; 0 for none */
static inline uint64_t
deadline_ms(double d)
{
    if (!(d > 0))
        return 0;
    if (d >= 4e15) /* (past any clock, and past the conversion's range) */
        return 1ULL << 62;
    uint64_t ms = (uint64_t)(d * 1000.0);
    return ms ? ms : 1;
}

/* a record with deadline d is written, or becomes clean: lower the hint and the current
 * pass's least deadline   [lock held] */
static inline void
expiry_note(Core *c, double d)
{
    uint64_t ms = deadline_ms(d);
    if (!ms)
        return;
    uint64_t nx = *HW(c, H_EXPIRY_NEXT);
    if (!nx || ms < nx)
        ST(HW(c, H_EXPIRY_NEXT), ms);
    uint64_t ps = *HW(c, H_EXPIRY_PASS);
    if (!ps || ms < ps)
        *HW(c, H_EXPIRY_PASS) = ms;
}

/* whether a clean record may be past its deadline at now (epoch seconds) */
static inline int
expiry_due(Core *c, double now)
{
    uint64_t nx = LD(HW(c, H_EXPIRY_NEXT));
    return nx && (double)nx <= now * 1000.0;
}

/* the deadline of the live clean record in slot so (0: none, dirty, or not live) */
static double
clean_deadline(Core *c, uint64_t so, uint64_t *size)
{
    uint64_t *slot = W(c, so);
    if (!slot_present(c, so))
        return 0;
    uint64_t off = slot[SLOT_OFF];
    Rec r;
    if (off <= TOMB || (slot[SLOT_FLAGS] & FLAG_DIRTY) || !rec_parse(c, off, &r) || !r.xlen)
        return 0;
    *size = r.size;
    return ext_deadline((const unsigned char *)rec_ext(c, off, &r), r.xlen);
}

/* Reclaim the expired clean records of slots [from, to) (an EXPIRE event each), but not
 * those of the `protect` slots (a batch's own keys: it re-plans after this); returns the
 * least deadline (ms; 0: none) of the clean records left, or -1 (corrupt). */
static int64_t
expire_range(Core *c, uint64_t from, uint64_t to, double now, const uint64_t *protect,
             Py_ssize_t nprotect, uint64_t *reclaimed, uint64_t *freed)
{
    uint64_t least = 0, prev = *HW(c, H_BUSY);
    for (uint64_t i = from; i < to; i++) {
        uint64_t so = slot_off(c, i), size = 0;
        double d = clean_deadline(c, so, &size);
        if (!(d > 0))
            continue;
        int kept = d > now;
        for (Py_ssize_t k = 0; k < nprotect && !kept; k++)
            kept = protect[k] == so;
        if (kept) {
            uint64_t ms = deadline_ms(d);
            if (!least || ms < least)
                least = ms;
            continue;
        }
        ST(HW(c, H_BUSY), 1);
        if (drop_slot(c, so, KIND_EXPIRE) < 0)
            return -1;
        ST(HW(c, H_BUSY), prev);
        *reclaimed += 1;
        *freed += size;
    }
    return (int64_t)least;
}

/* One slice of the host's expiry pass: slots [cursor, cursor + count) (EXPIRY_CURSOR,
 * shared by every process), their expired clean records reclaimed (not the `protect`
 * slots'); at the pass's end EXPIRY_NEXT takes the least deadline it left. Returns 1 when
 * this slice ended a pass, 0 when not, -1 (corrupt).   [lock held] */
static int
sweep_slice(Core *c, uint64_t count, double now, const uint64_t *protect, Py_ssize_t nprotect,
            uint64_t *reclaimed, uint64_t *freed)
{
    uint64_t n = c->n_slots, i = *HW(c, H_EXPIRY_CURSOR);
    if (i >= n)
        i = 0;
    if (i == 0)
        *HW(c, H_EXPIRY_PASS) = 0; /* a new pass */
    uint64_t end = count >= n - i ? n : i + count;
    int64_t least = expire_range(c, i, end, now, protect, nprotect, reclaimed, freed);
    if (least < 0)
        return -1;
    uint64_t ps = *HW(c, H_EXPIRY_PASS);
    if (least && (!ps || (uint64_t)least < ps))
        *HW(c, H_EXPIRY_PASS) = (uint64_t)least;
    *HW(c, H_EXPIRY_CURSOR) = end == n ? 0 : end;
    if (end == n)
        ST(HW(c, H_EXPIRY_NEXT), *HW(c, H_EXPIRY_PASS));
    return end == n;
}

#define EVICT_SLICE 4096

/* Before a live entry is evicted: while a clean record may have expired, sweep the
 * host's pass on, a slice at a time, until a slice reclaims something or the pass ends
 * (then EXPIRY_NEXT is ahead of the clock, or a record expired during the pass). Each
 * slot is looked at once per pass, whichever writers' evictions and sweeps share it: the
 * work is amortised over the pass, never a scan per eviction. 1: space was reclaimed,
 * 0: none, -1: corrupt.   [lock held] */
static int
expire_before_evicting(Core *c, const uint64_t *protect, Py_ssize_t nprotect)
{
    double now = real_now();
    uint64_t reclaimed = 0, freed = 0;
    while (expiry_due(c, now)) {
        int passed = sweep_slice(c, EVICT_SLICE, now, protect, nprotect, &reclaimed, &freed);
        if (passed < 0)
            return -1;
        if (reclaimed)
            return 1;
        if (passed)
            break;
    }
    return 0;
}

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
    if (!slot_present(c, so))
        return 0;
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
    int got = expire_before_evicting(c, protect, nprotect);
    if (got)
        return got;
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
    double now = real_now();
    for (uint64_t k = 0; k < MAX_PROBE; k++) { /* an expired entry's space first */
        uint64_t so = slot_off(c, base + k);
        if (evictable(c, so, protect, nprotect) && slot_expired(c, so, now))
            return evict_slot(c, so, now) < 0 ? -1 : 1;
    }
    for (int round = 0; round < 2; round++) {
        for (uint64_t k = 0; k < MAX_PROBE; k++) {
            uint64_t so = slot_off(c, base + k);
            if (!evictable(c, so, protect, nprotect))
                continue;
            if (W(c, so)[SLOT_REF] && round == 0) {
                W(c, so)[SLOT_REF] = 0;
                continue;
            }
            return evict_slot(c, so, now) < 0 ? -1 : 1;
        }
    }
    return 0;
}
