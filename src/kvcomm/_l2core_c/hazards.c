/* ------------------------------------------------------------------ hazards (pins)
 * A zero-copy view is protected by a hazard entry in the pin table: (block, owner pid).
 * Readers publish one without the lock (pin()); a writer that replaces or evicts a
 * record frees its block only if no entry names it, else parks it in the deferred table;
 * a later writer frees parked blocks nobody names any more. Every store and load of an
 * entry's block word, and the writer's publish before its scan, are sequentially
 * consistent: either the writer sees the reader's hazard, or the reader sees the slot
 * changed and withdraws it (see pin()). */

/* An entry's block word: the block (low 48 bits) and a generation (high 16) that each pin
 * of the entry changes, so that a release aimed at an earlier pin of the same entry (a
 * finalizer running twice, say) can never withdraw a later one. */
#define HAZ_OFF(w) ((w) & ((1ULL << 48) - 1))
#define HAZ_GEN(w) ((w) >> 48)

static inline uint64_t *
pin_entry(Core *c, uint64_t i)
{
    return W(c, c->pins_off + i * PIN_WORDS * 8);
}

static inline uint64_t
pin_hwm(Core *c)
{
    uint64_t hwm = __atomic_load_n(HW(c, H_PIN_HWM), __ATOMIC_SEQ_CST);
    return hwm < c->n_pins ? hwm : c->n_pins;
}

static int
hazard_held(Core *c, uint64_t off)
{
    uint64_t hwm = pin_hwm(c);
    for (uint64_t i = 0; i < hwm; i++)
        if (HAZ_OFF(__atomic_load_n(&pin_entry(c, i)[0], __ATOMIC_SEQ_CST)) == off)
            return 1;
    return 0;
}

/* free parked blocks no hazard names any more   [lock held] */
static int
sweep_deferred(Core *c)
{
    uint64_t released = LD(HW(c, H_RELEASED));
    if (*HW(c, H_DEFERRED)) {
        uint64_t *d = W(c, c->defer_off);
        for (uint64_t i = 0; i < c->n_pins; i++) {
            uint64_t off = d[i];
            if (!off || hazard_held(c, off))
                continue;
            d[i] = 0;
            *HW(c, H_DEFERRED) -= 1;
            if (heap_free(c, off) < 0)
                return -1;
        }
    }
    if (released)
        __atomic_sub_fetch(HW(c, H_RELEASED), released, __ATOMIC_SEQ_CST);
    return 0;
}

/* free a block no slot references, or park it while a hazard names it   [lock held] */
static int
release_block(Core *c, uint64_t off)
{
    if (!hazard_held(c, off))
        return heap_free(c, off);
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t *d = W(c, c->defer_off);
        for (uint64_t i = 0; i < c->n_pins; i++) {
            if (d[i] == 0) {
                d[i] = off;
                *HW(c, H_DEFERRED) += 1;
                return 0;
            }
        }
        /* full of parked blocks: some are no longer named (each named one has an entry
           of its own, and there are as many entries as parked places) */
        if (attempt == 0 && sweep_deferred(c) < 0)
            return -1;
    }
    return set_corrupt(c, "the deferred table is full of named blocks (pin table)");
}
