/* ------------------------------------------------------------------ heap   [lock held]
 * Every free-list link is checked before it is followed; a bad one is corruption. */

static int
free_head_ok(Core *c, uint64_t off, uint64_t order)
{
    return off == 0 || (aligned_block(c, off, order) && *meta_at(c, off) == meta_free(order));
}

static int
push_free(Core *c, uint64_t off, uint64_t order)
{
    if (reserve_heap(c, off, 24) < 0) /* (the links' page: reserved already but at init) */
        return -1;
    uint64_t *hd = HW(c, H_FREE + order);
    uint64_t head = *hd;
    if (!free_head_ok(c, head, order))
        return set_corrupt(c, "free-list head");
    uint64_t *blk = W(c, off);
    blk[1] = head;
    blk[2] = 0;
    if (head)
        W(c, head)[2] = off;
    *hd = off;
    *meta_at(c, off) = meta_free(order);
    return 0;
}

static int
unlink_free(Core *c, uint64_t off, uint64_t order)
{
    uint64_t *blk = W(c, off);
    uint64_t nxt = blk[1], prv = blk[2];
    if (!free_head_ok(c, nxt, order) || !free_head_ok(c, prv, order) || nxt == off || prv == off)
        return set_corrupt(c, "free-list link");
    if (prv)
        W(c, prv)[1] = nxt;
    else if (*HW(c, H_FREE + order) == off)
        *HW(c, H_FREE + order) = nxt;
    else
        return set_corrupt(c, "free-list head");
    if (nxt)
        W(c, nxt)[2] = prv;
    *meta_at(c, off) = 0;
    return 0;
}

/* a block of 2**order bytes; 0 when none is free; (uint64_t)-1 on corruption, or when the
 * memory for the links of the halves it splits off cannot be reserved (reserve.c: nothing
 * changed then). The caller reserves the pages of what it writes into the block. */
static uint64_t
heap_alloc(Core *c, uint64_t order)
{
    uint64_t j = order;
    while (j <= c->top_order && *HW(c, H_FREE + j) == 0)
        j++;
    if (j > c->top_order)
        return 0;
    uint64_t off = *HW(c, H_FREE + j);
    int head_ok = free_head_ok(c, off, j);
    for (uint64_t k = j; head_ok && k > order; k--)
        if (reserve_heap(c, off + (1ULL << (k - 1)), 24) < 0)
            return (uint64_t)-1;
    if (!head_ok || unlink_free(c, off, j) < 0) {
        if (!PyErr_Occurred())
            set_corrupt(c, "free-list head");
        return (uint64_t)-1;
    }
    while (j > order) {
        j--;
        if (push_free(c, off + (1ULL << j), j) < 0)
            return (uint64_t)-1;
    }
    *meta_at(c, off) = meta_alloc(order);
    *HW(c, H_USED) += 1ULL << order;
    return off;
}

/* the order of an allocated block, or 0 if off is not one */
static uint64_t
alloc_order(Core *c, uint64_t off)
{
    if (!block_ok(c, off))
        return 0;
    uint8_t m = *meta_at(c, off);
    if (m == 0 || (m & 0x80))
        return 0;
    uint64_t order = (uint64_t)(m & 0x7F) + MIN_ORDER - 1;
    return aligned_block(c, off, order) ? order : 0;
}

static int
heap_free(Core *c, uint64_t off)
{
    uint64_t order = alloc_order(c, off);
    if (!order)
        return set_corrupt(c, "freeing a block that is not allocated");
    *HW(c, H_USED) -= 1ULL << order;
    while (order < c->top_order) {
        uint64_t buddy = ((off - c->data_off) ^ (1ULL << order)) + c->data_off;
        if (!aligned_block(c, buddy, order) || *meta_at(c, buddy) != meta_free(order))
            break;
        if (unlink_free(c, buddy, order) < 0)
            return -1;
        *meta_at(c, off > buddy ? off : buddy) = 0;
        if (buddy < off)
            off = buddy;
        order++;
    }
    return push_free(c, off, order);
}
