/* ------------------------------------------------------------------ geometry */

static inline uint64_t slot_off(Core *c, uint64_t i) { return c->slots_off + (i & c->mask) * SLOT_WORDS * 8; }
/* whether the page holding byte off is reserved (the reservation map, layout.py): a page
 * whose bit is clear is never read through the mapping (a read would allocate it) */
static inline int page_reserved(Core *c, uint64_t off) {
    uint64_t p = off / RESV_PAGE;
    return p < c->resv_pages && (LD(W(c, c->resv_off + (p >> 6) * 8)) >> (p & 63)) & 1;
}
/* whether slot so may be read: a slot on a page never reserved was never written (EMPTY) */
static inline int slot_present(Core *c, uint64_t so) {
    return page_reserved(c, so) && page_reserved(c, so + SLOT_WORDS * 8 - 1);
}
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
    uint64_t size, counter, hlc, klen, tag, vvlen, vlen, vrel, mlen, xlen;
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
static inline const char *rec_ext(Core *c, uint64_t off, Rec *r) {
    return c->base + off + REC_HEADER + r->klen + r->vvlen + r->mlen;
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
