/* ------------------------------------------------------------------ feed   [lock held] */

static void
feed_append(Core *c, uint64_t kind, const char *key, uint64_t klen, uint64_t counter, uint64_t hlc)
{
    uint64_t *headp = HW(c, H_FEED_HEAD);
    uint64_t head = *headp, seq = head + 1;
    uint64_t e = c->feed_off + (head % c->feed_n) * c->feed_esz;
    uint64_t *ent = W(c, e);
    if (klen > c->max_key)
        klen = c->max_key;
    ST(&ent[FEED_SEQ], 0);
    ST(&ent[FEED_INFO], kind | (klen << 8));
    ST(&ent[FEED_COUNTER], counter);
    ST(&ent[FEED_HLC], hlc);
    memcpy(c->base + e + FEED_KEY_AT, key, klen);
    ST(&ent[FEED_SEQ], seq);
    ST(headp, seq);
}

static uint64_t
hlc_next(Core *c, uint64_t now_ms)
{
    uint64_t *hp = HW(c, H_HLC);
    uint64_t hlc = now_ms << 16;
    if (hlc <= *hp)
        hlc = *hp + 1;
    *hp = hlc;
    return hlc;
}
