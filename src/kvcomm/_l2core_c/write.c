/* ------------------------------------------------------------------ writes   [lock held]
 *
 * One op of a batch. kind: OP_PUT (a local write: a new dot; the replaced record's entries
 * of other hosts, vvx, carried over), OP_VPUT (a record with a given version: counter, hlc,
 * vvx; counter NEW_DOT asks for a fresh local dot over the given vector), OP_DEL (a delete:
 * a tombstone record when tombstones are on (cluster mode), else the slot is unlinked). A
 * delete given as (key, h, False) is one of a key L3 has no record of (the caller looked):
 * its tombstone covers only a record this host holds (or an earlier op of the batch
 * wrote); with none, it writes nothing, as there is nothing to tell L3.
 */
enum { OP_PUT = 0, OP_VPUT = 1, OP_DEL = 2 };

typedef struct {
    int kind;
    const char *key;
    uint64_t klen, h, tag;
    const char *meta;
    uint64_t mlen;
    Py_buffer val;
    int has_val;
    int only_held;       /* a delete: a tombstone only over a record held here */
    uint64_t x_counter, x_hlc;
    const char *x_vvx;
    uint64_t x_vvlen;
    const char *ext; /* the record's extension field (a msgpack map, checked by ExtCheck) */
    uint64_t xlen;
    /* the plan */
    int writes_record;   /* a put, or a tombstone */
    Py_ssize_t prev;     /* index+1 of the previous op on this key in the batch, 0 if none */
    uint64_t found;      /* the slot holding the key before the batch (0: none) */
    uint64_t slot;       /* the slot the key holds or will hold (found or claimed; 0: none) */
    int live_after, dirty_after;
    uint64_t vvlen;      /* bytes of vvx the record carries */
    uint64_t size, order, block;
    /* the result */
    uint64_t counter, hlc, so, seq;
    int existed;         /* the key had a live value (not a tombstone) before this op */
    int expired;         /* ...that was past its deadline: its EXPIRE event comes first */
    uint64_t exp_counter, exp_hlc; /* (that record's version, for the event) */
    PyObject *vvx_obj;
} Op;

static int
parse_items(PyObject *const *it, Py_ssize_t n, Op *op)
{
    memset(op, 0, sizeof(*op));
    if ((n != 2 && n != 3 && n != 5 && n != 6 && n != 8 && n != 9) || !PyBytes_Check(it[0])) {
        PyErr_SetString(PyExc_TypeError, "op: (key, h[, cover]) | (key, h, tag, meta, value[, ext]) | "
                                         "(key, h, tag, meta, value, counter, hlc, vvx[, ext])");
        return -1;
    }
    op->key = PyBytes_AS_STRING(it[0]);
    op->klen = (uint64_t)PyBytes_GET_SIZE(it[0]);
    op->h = PyLong_AsUnsignedLongLong(it[1]);
    if (PyErr_Occurred())
        return -1;
    if (op->klen == 0 || op->klen > MAX_KEY) {
        PyErr_SetString(PyExc_ValueError, "key length out of range");
        return -1;
    }
    if (n <= 3) {
        op->kind = OP_DEL;
        if (n == 3) {
            int cover = PyObject_IsTrue(it[2]);
            if (cover < 0)
                return -1;
            op->only_held = !cover;
        }
        return 0;
    }
    op->kind = n <= 6 ? OP_PUT : OP_VPUT;
    if (n == 6 || n == 9) {
        PyObject *ext = it[n - 1];
        if (!PyBytes_Check(ext)) {
            PyErr_SetString(PyExc_TypeError, "op ext must be bytes");
            return -1;
        }
        op->ext = PyBytes_AS_STRING(ext);
        op->xlen = (uint64_t)PyBytes_GET_SIZE(ext);
        /* one rule for what a valid field is (kvcomm.core.ext, shared with L3's readers):
           a field no other host could read is refused before the write is acknowledged */
        if (op->xlen && ExtCheck && ext != ExtOk) {
            PyObject *why = PyObject_CallOneArg(ExtCheck, ext);
            if (!why)
                return -1;
            int bad = PyUnicode_Check(why) && PyUnicode_GET_LENGTH(why) > 0;
            if (bad)
                PyErr_Format(InvalidArgument, "a record's extension field is refused: %U "
                             "(kvcomm.core.ext)", why);
            Py_DECREF(why);
            if (bad)
                return -1;
            Py_INCREF(ext); /* (a batch's ops share their writer's field: checked once) */
            Py_XSETREF(ExtOk, ext);
        }
    }
    op->tag = PyLong_AsUnsignedLongLong(it[2]);
    if (PyErr_Occurred() || !PyBytes_Check(it[3]) || op->tag > 0xFF ||
        (op->tag == TAG_TOMBSTONE && op->kind != OP_VPUT)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "op tag must be 0..255 (0, a tombstone, only with a "
                                             "version) and meta bytes");
        return -1;
    }
    op->meta = PyBytes_AS_STRING(it[3]);
    op->mlen = (uint64_t)PyBytes_GET_SIZE(it[3]);
    if (PyObject_GetBuffer(it[4], &op->val, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    op->has_val = 1;
    if (op->kind == OP_VPUT) {
        op->x_counter = PyLong_AsUnsignedLongLong(it[5]);
        op->x_hlc = PyLong_AsUnsignedLongLong(it[6]);
        if (PyErr_Occurred() || !PyBytes_Check(it[7])) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "op vvx must be bytes");
            return -1;
        }
        op->x_vvx = PyBytes_AS_STRING(it[7]);
        op->x_vvlen = (uint64_t)PyBytes_GET_SIZE(it[7]);
        if (op->x_counter != NEW_DOT && op->x_counter > MAX_COUNTER) {
            /* it would carry the host's write sequence past the bound (towards NEW_DOT) */
            PyErr_Format(InvalidArgument, "a version's counter %llu is over 2**53-1 "
                         "(kvcomm.core.versions.MAX_COUNTER): refused",
                         (unsigned long long)op->x_counter);
            return -1;
        }
    }
    return 0;
}

static int
parse_op(PyObject *t, Op *op)
{
    if (!PyTuple_Check(t)) {
        memset(op, 0, sizeof(*op));
        PyErr_SetString(PyExc_TypeError, "an op is a tuple");
        return -1;
    }
    return parse_items(&PyTuple_GET_ITEM(t, 0), PyTuple_GET_SIZE(t), op);
}

static void
release_ops(Op *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ops[i].has_val)
            PyBuffer_Release(&ops[i].val);
        ops[i].has_val = 0;
        Py_CLEAR(ops[i].vvx_obj);
    }
}

static int
same_key(Op *a, Op *b)
{
    return a->h == b->h && a->klen == b->klen && memcmp(a->key, b->key, a->klen) == 0;
}

/* The latest op of each key in the batch: a small open-addressing index. */
typedef struct {
    Py_ssize_t *slots; /* index+1 of the latest op of a key, 0 empty */
    uint64_t mask;
    Py_ssize_t local[64];
} KeyIndex;

static int
kidx_init(KeyIndex *ki, Py_ssize_t n)
{
    uint64_t cap = 64;
    while (cap < (uint64_t)n * 2)
        cap <<= 1;
    ki->mask = cap - 1;
    ki->slots = cap <= 64 ? ki->local : PyMem_Calloc((size_t)cap, sizeof(Py_ssize_t));
    if (!ki->slots) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ki->slots, 0, sizeof(Py_ssize_t) * (size_t)cap);
    return 0;
}

static void
kidx_free(KeyIndex *ki)
{
    if (ki->slots != ki->local)
        PyMem_Free(ki->slots);
}

/* index+1 of the previous op on ops[i]'s key (0: none); records i as the latest */
static Py_ssize_t
kidx_swap(KeyIndex *ki, Op *ops, Py_ssize_t i)
{
    uint64_t j = ops[i].h & ki->mask;
    for (;;) {
        Py_ssize_t v = ki->slots[j];
        if (v == 0) {
            ki->slots[j] = i + 1;
            return 0;
        }
        if (same_key(&ops[v - 1], &ops[i])) {
            ki->slots[j] = i + 1;
            return v;
        }
        j = (j + 1) & ki->mask;
    }
}

/* heap bytes that are free or that CLOCK could free (entries outside the batch), counted
 * until there are `need` (the walk of a large slot table stops as soon as it may) */
static uint64_t
reclaimable_bytes(Core *c, const uint64_t *protect, Py_ssize_t nprotect, uint64_t need)
{
    uint64_t used = *HW(c, H_USED), total = c->data_end - c->data_off;
    uint64_t bytes = used < total ? total - used : 0;
    for (uint64_t i = 0; i < c->n_slots && bytes < need; i++) {
        uint64_t so = slot_off(c, i);
        if (!evictable(c, so, protect, nprotect))
            continue;
        uint64_t order = alloc_order(c, W(c, so)[SLOT_OFF]);
        if (order)
            bytes += 1ULL << order;
    }
    return bytes;
}

static int
give_back_blocks(Core *c, Op *ops, Py_ssize_t n)
{
    int rc = 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (ops[j].block) {
            if (rc == 0 && heap_free(c, ops[j].block) < 0)
                rc = -1;
            ops[j].block = 0;
        }
    return rc;
}

/* whether record r at off is past its deadline now (the clock is read only for a record
 * that has one) */
static int
expired_now(Core *c, uint64_t off, Rec *r)
{
    double d = ext_deadline((const unsigned char *)rec_ext(c, off, r), r->xlen);
    return d > 0 && d <= real_now();
}

/* The plan: where each op goes, how big its record is, and whether the whole batch can be
 * applied. Changes nothing except evictions (local cache decisions, each complete), which
 * it makes only when the batch can then fit. Returns 0 (ready: every block allocated), a
 * status > 0 with *bad the op's index, or -1 (Python error; corruption raised BUSY). On a
 * status or an error no block of the batch stays allocated. */
static int
plan_batch(Core *c, Op *ops, Py_ssize_t n, int tombstones, uint64_t dirty_flag, uint64_t max_dirty,
           Py_ssize_t *bad)
{
    uint64_t protect_local[8], claims_local[8];
    uint64_t *protect = n <= 8 ? protect_local : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    uint64_t *claims = n <= 8 ? claims_local : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    KeyIndex ki;
    ki.slots = NULL;
    int status = -1;
    int checked_room = 0;
    if (!protect || !claims) {
        PyErr_NoMemory();
        goto out;
    }
    if (n > 1 && kidx_init(&ki, n) < 0)
        goto out;
    for (;;) {
        Py_ssize_t nprotect = 0, nclaims = 0;
        int64_t dirty_delta = 0;
        uint64_t need_bytes = 0;
        if (n > 1)
            memset(ki.slots, 0, sizeof(Py_ssize_t) * (size_t)(ki.mask + 1));
        int evicted = 0;
        for (Py_ssize_t i = 0; i < n && !evicted; i++) {
            Op *op = &ops[i];
            op->prev = n == 1 ? 0 : kidx_swap(&ki, ops, i);
            op->expired = 0;
            op->writes_record = op->kind != OP_DEL || tombstones;
            op->block = 0;
            uint64_t prev_vvlen = 0;
            int prev_dirty;
            if (op->prev) {
                Op *p = &ops[op->prev - 1];
                op->found = p->found;
                op->slot = p->slot;
                prev_dirty = p->dirty_after;
                prev_vvlen = p->live_after ? p->vvlen : 0;
                op->existed = p->live_after && !(p->kind == OP_DEL);
            } else {
                uint64_t reusable = 0;
                if (find(c, op->key, op->klen, op->h, &op->found, &reusable) < 0)
                    goto out;
                op->slot = op->found;
                prev_dirty = 0;
                op->existed = 0;
                if (op->found) {
                    Rec r;
                    rec_parse(c, W(c, op->found)[SLOT_OFF], &r); /* find checked it */
                    prev_vvlen = r.vvlen;
                    prev_dirty = (W(c, op->found)[SLOT_FLAGS] & FLAG_DIRTY) != 0;
                    op->existed = r.tag != TAG_TOMBSTONE;
                    /* an expired record is absent: the write records its expiry first (an
                       EXPIRE event, as a read or the sweep would), a delete finds nothing */
                    op->expired = op->existed && r.xlen && expired_now(c, W(c, op->found)[SLOT_OFF], &r);
                    if (op->expired) {
                        op->existed = 0;
                        op->exp_counter = r.counter;
                        op->exp_hlc = r.hlc;
                    }
                    protect[nprotect++] = op->found;
                }
            }
            if (op->only_held && !op->slot)
                op->writes_record = 0; /* nothing held here, nothing in L3: nothing to cover */
            if (op->writes_record && !op->slot) {
                /* a new key needs a free slot in its window that no earlier op claimed */
                uint64_t base = op->h & c->mask;
                for (uint64_t k = 0; k < MAX_PROBE && !op->slot; k++) {
                    uint64_t so = slot_off(c, base + k);
                    if (slot_present(c, so) && W(c, so)[SLOT_OFF] > TOMB)
                        continue;
                    int taken = 0;
                    for (Py_ssize_t q = 0; q < nclaims && !taken; q++)
                        taken = claims[q] == so;
                    if (!taken)
                        op->slot = so;
                }
                if (!op->slot) {
                    int ev = window_evict_one(c, op->h, protect, nprotect);
                    if (ev < 0)
                        goto out;
                    if (ev == 0) {
                        *bad = i;
                        status = ST_SLOT_FULL;
                        goto out;
                    }
                    evicted = 1; /* slots changed: plan again */
                    break;
                }
                claims[nclaims++] = op->slot;
                if (reserve_slot(c, op->slot) < 0)
                    goto out;
            }
            op->vvlen = op->kind == OP_VPUT ? op->x_vvlen : prev_vvlen;
            if (op->writes_record) {
                uint64_t mlen = op->kind == OP_DEL ? 0 : op->mlen;
                uint64_t xlen = op->kind == OP_DEL ? 0 : op->xlen;
                uint64_t vlen = op->kind == OP_DEL ? 0 : (uint64_t)op->val.len;
                uint64_t vrel = REC_HEADER + op->klen + op->vvlen + mlen + xlen;
                if (op->kind != OP_DEL && op->tag == TAG_NDARRAY)
                    vrel = (vrel + 63) & ~63ULL;
                op->size = vrel + vlen; /* each term is below 2**48: no wrap */
                if (op->vvlen > 0xFFFFFFFFULL || mlen > 0xFFFFFFFFULL || xlen > 0xFFFFFFFFULL ||
                    op->size > (1ULL << c->top_order)) {
                    *bad = i;
                    status = ST_TOO_LARGE;
                    goto out;
                }
                op->order = order_for(op->size);
                need_bytes += 1ULL << op->order;
                op->live_after = 1;
                op->dirty_after = dirty_flag != 0;
            } else {
                op->live_after = 0;
                op->dirty_after = 0;
            }
            dirty_delta += (int64_t)op->dirty_after - (int64_t)prev_dirty;
        }
        if (evicted)
            continue;
        if (need_bytes > c->data_end - c->data_off) {
            *bad = n - 1;
            status = ST_TOO_LARGE;
            goto out;
        }
        if (max_dirty && dirty_delta > 0 && *HW(c, H_DIRTY) + (uint64_t)dirty_delta > max_dirty) {
            *bad = 0;
            status = ST_DIRTY_FULL;
            goto out;
        }
        /* space: allocate every block; if one does not fit, give them back, evict one
           entry (only if the batch can fit at all), and plan again */
        int full = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Op *op = &ops[i];
            if (!op->writes_record)
                continue;
            uint64_t off = heap_alloc(c, op->order);
            if (off == (uint64_t)-1) {
                give_back_blocks(c, ops, i);
                goto out;
            }
            if (off == 0) {
                if (give_back_blocks(c, ops, i) < 0)
                    goto out;
                if (!checked_room) {
                    checked_room = 1;
                    if (reclaimable_bytes(c, protect, nprotect, need_bytes) < need_bytes) {
                        *bad = i;
                        status = ST_FULL;
                        goto out;
                    }
                }
                int ev = clock_evict_one(c, protect, nprotect);
                if (ev < 0)
                    goto out;
                if (ev == 0) {
                    *bad = i;
                    status = ST_FULL;
                    goto out;
                }
                full = 1;
                break;
            }
            op->block = off;
            if (reserve_heap(c, off, op->size) < 0) {
                give_back_blocks(c, ops, i + 1);
                goto out;
            }
        }
        if (full)
            continue;
        status = 0;
        goto out;
    }
out:
    if (ki.slots)
        kidx_free(&ki);
    if (protect && protect != protect_local)
        PyMem_Free(protect);
    if (claims && claims != claims_local)
        PyMem_Free(claims);
    return status;
}

/* Unlink the record in slot `found` (an embedded-mode delete); feed a delete event. */
static int
unlink_record(Core *c, uint64_t found, Op *op, uint64_t now_ms, int tidy)
{
    uint64_t *slot = W(c, found);
    uint64_t old = slot[SLOT_OFF];
    uint64_t counter = *HW(c, H_WSEQ) + 1;
    *HW(c, H_WSEQ) = counter;
    uint64_t hlc = hlc_next(c, now_ms);
    if (slot[SLOT_FLAGS] & FLAG_DIRTY)
        *HW(c, H_DIRTY) -= 1;
    SEQ_ADD(&slot[SLOT_SEQ]);
    ST(&slot[SLOT_OFF], TOMB);
    ST(&slot[SLOT_HASH], 0);
    ST(&slot[SLOT_FLAGS], 0);
    SEQ_ADD(&slot[SLOT_SEQ]);
    *HW(c, H_ENTRIES) -= 1;
    if (release_block(c, old) < 0)
        return -1;
    /* a free slot followed by an empty one ends no probe chain that matters: turn trailing
       tombstones back into empty slots so that misses stay short (not inside a larger
       batch, whose later ops were planned on these slots' probe chains) */
    uint64_t i = slot_index(c, found);
    uint64_t next = slot_off(c, i + 1);
    if (tidy && (!slot_present(c, next) || W(c, next)[SLOT_OFF] == EMPTY)) {
        for (uint64_t k = 0; k < MAX_PROBE && W(c, slot_off(c, i))[SLOT_OFF] == TOMB; k++) {
            uint64_t *s = W(c, slot_off(c, i));
            SEQ_ADD(&s[SLOT_SEQ]);
            ST(&s[SLOT_OFF], EMPTY);
            SEQ_ADD(&s[SLOT_SEQ]);
            i = (i - 1) & c->mask;
        }
    }
    feed_append(c, KIND_DELETE, op->key, op->klen, counter, hlc);
    op->counter = counter;
    op->hlc = hlc;
    return 0;
}

/* Publish one planned op: build its record in its block and swap it into its slot.
 * ``found``: the slot that holds the key now, by the plan (nothing but this batch has run
 * since it, and a batch moves no key: the key's first op found it in place, and a later
 * op of the same key finds it where the earlier one left it). ``tidy``: a batch of one,
 * whose delete may shorten probe chains. */
static int
publish(Core *c, Op *op, uint64_t found, uint64_t now_ms, uint64_t flags, int tidy)
{
    if (!op->writes_record) {
        if (!found)
            return 0;
        if (!op->expired)
            return unlink_record(c, found, op, now_ms, tidy);
        if (W(c, found)[SLOT_FLAGS] & FLAG_DIRTY) /* (reclaimed as expired, not deleted) */
            *HW(c, H_DIRTY) -= 1;
        return drop_slot(c, found, KIND_EXPIRE);
    }
    if (op->expired)
        feed_append(c, KIND_EXPIRE, op->key, op->klen, op->exp_counter, op->exp_hlc);
    /* a key not in place takes the slot its plan claimed: the first free one of its
       window that no earlier op of the batch claimed (another key's op must not take it) */
    uint64_t so = found ? found : op->slot;
    if (!so || (!found && W(c, so)[SLOT_OFF] > TOMB))
        return set_corrupt(c, "a planned slot was taken");
    uint64_t old = found ? W(c, found)[SLOT_OFF] : 0;
    const char *vvx = NULL;
    uint64_t vvlen = 0;
    Rec oldr;
    if (op->kind == OP_VPUT) {
        vvx = op->x_vvx;
        vvlen = op->x_vvlen;
    } else if (old) {
        if (!rec_parse(c, old, &oldr))
            return set_corrupt(c, "a replaced record is malformed");
        vvx = rec_vvx(c, old, &oldr);
        vvlen = oldr.vvlen;
    }
    if (vvlen != op->vvlen)
        return set_corrupt(c, "a record changed between plan and publish");
    uint64_t counter, hlc;
    if (op->kind == OP_VPUT && op->x_counter == NEW_DOT) {
        counter = *HW(c, H_WSEQ) + 1;
        *HW(c, H_WSEQ) = counter;
        hlc = hlc_next(c, now_ms);
        if (hlc <= op->x_hlc) {
            hlc = op->x_hlc + 1;
            *HW(c, H_HLC) = hlc;
        }
    } else if (op->kind == OP_VPUT) {
        counter = op->x_counter;
        hlc = op->x_hlc;
        if (*HW(c, H_WSEQ) < counter)
            *HW(c, H_WSEQ) = counter;
        if (*HW(c, H_HLC) < hlc)
            *HW(c, H_HLC) = hlc;
    } else {
        counter = *HW(c, H_WSEQ) + 1;
        *HW(c, H_WSEQ) = counter;
        hlc = hlc_next(c, now_ms);
    }
    int del = op->kind == OP_DEL;
    uint64_t tag = del ? TAG_TOMBSTONE : op->tag;
    uint64_t mlen = del ? 0 : op->mlen;
    uint64_t xlen = del ? 0 : op->xlen;
    uint64_t vlen = del ? 0 : (uint64_t)op->val.len;
    uint64_t vrel = op->size - vlen;
    uint64_t off = op->block;
    uint64_t *rec = W(c, off);
    rec[REC_SIZE] = op->size;
    rec[REC_COUNTER] = counter;
    rec[REC_HLC] = hlc;
    rec[REC_INFO] = op->klen | (tag << 16) | (vvlen << 32);
    rec[REC_VLEN] = vlen;
    rec[REC_VREL] = vrel;
    rec[REC_SPARE] = 0;
    rec[REC_LENS] = mlen | (xlen << 32);
    char *p = c->base + off + REC_HEADER;
    memcpy(p, op->key, op->klen);
    if (vvlen)
        memmove(p + op->klen, vvx, vvlen);
    if (mlen)
        memcpy(p + op->klen + vvlen, op->meta, mlen);
    if (xlen) {
        memcpy(p + op->klen + vvlen + mlen, op->ext, xlen);
        expiry_note(c, ext_deadline((const unsigned char *)op->ext, xlen));
    }
    if (vlen)
        memcpy(c->base + off + vrel, op->val.buf, vlen);
    /* publish: seq odd, swap, seq even (full barriers around the swap) */
    uint64_t *slot = W(c, so);
    int was_dirty = found && (slot[SLOT_FLAGS] & FLAG_DIRTY);
    SEQ_ADD(&slot[SLOT_SEQ]);
    if (!found)
        ST(&slot[SLOT_HASH], op->h);
    ST(&slot[SLOT_OFF], off);
    ST(&slot[SLOT_FLAGS], flags & FLAG_DIRTY);
    uint64_t seq = SEQ_ADD(&slot[SLOT_SEQ]);
    /* (the daemon's writes are no agent's reads: a key it brings in is unread; one it
       changes keeps what agents did since the daemon last asked: take_ref) */
    if (!QUIET(c))
        ST(&slot[SLOT_REF], 1);
    else if (!found)
        ST(&slot[SLOT_REF], 0);
    if ((flags & FLAG_DIRTY) && !was_dirty)
        *HW(c, H_DIRTY) += 1;
    else if (!(flags & FLAG_DIRTY) && was_dirty)
        *HW(c, H_DIRTY) -= 1;
    op->block = 0; /* published: no longer the batch's to give back */
    if (found) {
        if (release_block(c, old) < 0)
            return -1;
    } else {
        *HW(c, H_ENTRIES) += 1;
    }
    feed_append(c, tag == TAG_TOMBSTONE ? KIND_DELETE : KIND_PUT, op->key, op->klen, counter, hlc);
    op->counter = counter;
    op->hlc = hlc;
    op->so = so;
    op->seq = seq;
    return 0;
}

static PyObject *
op_result(Op *op)
{
    if (op->kind == OP_DEL) /* the delete's counter, 0 when there was nothing to delete */
        return PyLong_FromUnsignedLongLong(op->existed ? op->counter : 0);
    PyObject *t = PyTuple_New(5);
    if (!t)
        return NULL;
    PyObject *a = PyLong_FromUnsignedLongLong(op->counter), *b = PyLong_FromUnsignedLongLong(op->hlc),
             *d = PyLong_FromUnsignedLongLong(op->so / 8), *e = PyLong_FromUnsignedLongLong(op->seq);
    if (!a || !b || !d || !e) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(d);
        Py_XDECREF(e);
        Py_DECREF(t);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, a);
    PyTuple_SET_ITEM(t, 1, b);
    PyTuple_SET_ITEM(t, 2, op->vvx_obj); /* (the reference moves into the tuple) */
    op->vvx_obj = NULL;
    PyTuple_SET_ITEM(t, 3, d);
    PyTuple_SET_ITEM(t, 4, e);
    return t;
}

/* The vvx bytes object each put will return, made before anything is published (so that
 * running out of memory cannot stop a batch half-way). */
static int
make_vvx_objects(Core *c, Op *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Op *op = &ops[i];
        if (op->kind == OP_DEL)
            continue;
        if (op->kind == OP_VPUT) {
            op->vvx_obj = PyBytes_FromStringAndSize(op->x_vvx, (Py_ssize_t)op->x_vvlen);
        } else if (op->vvlen == 0) {
            op->vvx_obj = PyBytes_FromStringAndSize("", 0);
        } else {
            /* carried over from the nearest earlier put of the key in the batch with a vvx
               object, else from the record in place before the batch */
            Py_ssize_t src = op->prev;
            while (src && !ops[src - 1].vvx_obj)
                src = ops[src - 1].prev;
            if (src) {
                op->vvx_obj = ops[src - 1].vvx_obj;
                Py_INCREF(op->vvx_obj);
            } else {
                uint64_t off = op->found ? W(c, op->found)[SLOT_OFF] : 0;
                Rec r;
                if (!off || !rec_parse(c, off, &r) || r.vvlen != op->vvlen) {
                    set_corrupt(c, "a record changed under the lock");
                    return -1;
                }
                op->vvx_obj = PyBytes_FromStringAndSize(rec_vvx(c, off, &r), (Py_ssize_t)r.vvlen);
            }
        }
        if (!op->vvx_obj)
            return -1;
    }
    return 0;
}

enum { RESULTS_LIST = 0, RESULTS_SINGLE = 1, RESULTS_COMPACT = 2 };

/* A batch's compare-and-set, judged in apply before anything changes: each expect is
 * (key, h) for "absent" (no record, a tombstone, or past its deadline) or (key, h,
 * counter, hlc) for "a live record of this host's dot ``counter`` at ``hlc`` and no other
 * host's entries" (the Version ((host, counter),), hlc) in embedded mode). Returns 0 when
 * all hold, 1 with *bad the index of the first that does not, -1 on an error (a malformed
 * expect: TypeError; corruption: BUSY raised). */
static int
check_expects(Core *c, PyObject *expects, Py_ssize_t *bad)
{
    Py_ssize_t n = PyList_GET_SIZE(expects);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(expects, i);
        Py_ssize_t k = PyTuple_Check(e) ? PyTuple_GET_SIZE(e) : 0;
        if ((k != 2 && k != 4) || !PyBytes_Check(PyTuple_GET_ITEM(e, 0))) {
            PyErr_SetString(PyExc_TypeError, "an expect is (key: bytes, h) or (key, h, counter, hlc)");
            return -1;
        }
        PyObject *kb = PyTuple_GET_ITEM(e, 0);
        uint64_t h = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 1));
        uint64_t want_counter = 0, want_hlc = 0;
        if (k == 4 && !PyErr_Occurred())
            want_counter = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 2));
        if (k == 4 && !PyErr_Occurred())
            want_hlc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 3));
        if (PyErr_Occurred())
            return -1;
        uint64_t found = 0, reusable = 0;
        if (find(c, PyBytes_AS_STRING(kb), (uint64_t)PyBytes_GET_SIZE(kb), h, &found,
                 &reusable) < 0)
            return -1;
        int live = 0;
        Rec r = {0};
        if (found) {
            uint64_t off = W(c, found)[SLOT_OFF];
            rec_parse(c, off, &r); /* find checked it */
            live = r.tag != TAG_TOMBSTONE && !(r.xlen && expired_now(c, off, &r));
        }
        int holds = k == 2 ? !live
                           : live && r.counter == want_counter && r.hlc == want_hlc && r.vvlen == 0;
        if (!holds) {
            *bad = i;
            return 1;
        }
    }
    return 0;
}

/* Apply n parsed ops under the lock, all or nothing. Returns the results (RESULTS_LIST: a
 * list; RESULTS_SINGLE: the one op's result alone; RESULTS_COMPACT: (packed, vvxs), see
 * Core_apply), a status (an int for a single op, else (status, index)), or NULL with an
 * error (nothing published; BUSY raised if corruption was found). */
static PyObject *
apply_ops(Core *c, Op *ops, Py_ssize_t n, uint64_t now_ms, uint64_t flags, uint64_t max_dirty,
          int tombstones, int mode, PyObject *expects)
{
    int single = mode == RESULTS_SINGLE;
    if (LDR(HW(c, H_STATE)) != STATE_OK) {
        PyErr_SetString(SegmentError, "this namespace was purged; open it again");
        return NULL;
    }
    if (*HW(c, H_BUSY)) {
        PyErr_SetString(SegmentError, "L2 must be repaired before it is written (recover first)");
        return NULL;
    }
    ST(HW(c, H_BUSY), 1);
    if (LD(HW(c, H_RELEASED)) && sweep_deferred(c) < 0)
        return NULL;
    Py_ssize_t bad = 0;
    if (expects) {
        int failed = check_expects(c, expects, &bad);
        if (failed < 0) { /* corruption keeps BUSY raised; a malformed expect changed nothing */
            if (!PyErr_ExceptionMatches(SegmentError))
                ST(HW(c, H_BUSY), 0);
            return NULL;
        }
        if (failed) {
            ST(HW(c, H_BUSY), 0);
            return single ? PyLong_FromLong(ST_CONFLICT) : Py_BuildValue("(in)", ST_CONFLICT, bad);
        }
    }
    c->no_room = 0;
    int st = plan_batch(c, ops, n, tombstones, flags & FLAG_DIRTY, max_dirty, &bad);
    if (st < 0) {
        if (c->no_room) /* a full tmpfs: the plan changed nothing but complete evictions */
            ST(HW(c, H_BUSY), 0);
        return NULL;
    }
    if (st > 0) {
        ST(HW(c, H_BUSY), 0); /* nothing changed but evictions, which are complete */
        return single ? PyLong_FromLong(st) : Py_BuildValue("(in)", st, bad);
    }
    /* the new dots this batch takes must stay within MAX_COUNTER: a write with a dot past
       it is acknowledged here and then refused by every other reader (L3's push set it
       aside as malformed). The sequence gets there only when lifted (a version
       naming this host's dot near the bound, a junk write mark): refuse, nothing written */
    uint64_t fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        fresh += ops[i].kind != OP_VPUT || ops[i].x_counter == NEW_DOT;
    if (fresh && *HW(c, H_WSEQ) > MAX_COUNTER - fresh) {
        if (give_back_blocks(c, ops, n) < 0)
            return NULL;
        ST(HW(c, H_BUSY), 0);
        PyErr_Format(InvalidArgument, "this host's write sequence (%llu) leaves no dot "
                     "within 2**53-1 (kvcomm.core.versions.MAX_COUNTER) for this write: "
                     "refused, nothing written; a version from elsewhere named a dot of this "
                     "host that far (see kvcomm info, and the host's write mark in L3)",
                     (unsigned long long)*HW(c, H_WSEQ));
        return NULL;
    }
    /* (the answer's containers are made before anything is published: no allocation can
       fail once the batch is applied, but the ints of a list's tuples) */
    PyObject *results = single ? NULL : PyList_New(n);
    PyObject *packed = mode == RESULTS_COMPACT ? PyBytes_FromStringAndSize(NULL, 16 * n) : NULL;
    if ((!single && !results) || (mode == RESULTS_COMPACT && !packed) ||
        make_vvx_objects(c, ops, n) < 0) {
        Py_XDECREF(results);
        Py_XDECREF(packed);
        if (give_back_blocks(c, ops, n) == 0 && !PyErr_ExceptionMatches(SegmentError))
            ST(HW(c, H_BUSY), 0);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Op *op = &ops[i];
        uint64_t found = op->prev ? (ops[op->prev - 1].live_after ? op->slot : 0) : op->found;
        if (publish(c, op, found, now_ms, flags, n == 1) < 0) {
            Py_XDECREF(results);
            Py_XDECREF(packed);
            return NULL; /* corruption found mid-publish: BUSY stays raised for repair */
        }
    }
    ST(HW(c, H_BUSY), 0);
    if (single)
        return op_result(&ops[0]);
    if (mode == RESULTS_COMPACT) {
        uint64_t *w = (uint64_t *)PyBytes_AS_STRING(packed);
        for (Py_ssize_t i = 0; i < n; i++) {
            Op *op = &ops[i];
            PyObject *v = op->vvx_obj ? op->vvx_obj : Py_None;
            if (!op->vvx_obj)
                Py_INCREF(v);
            op->vvx_obj = NULL; /* (the reference moves into the list) */
            PyList_SET_ITEM(results, i, v);
            w[2 * i] = op->kind == OP_DEL ? (op->existed ? op->counter : 0) : op->counter;
            w[2 * i + 1] = op->kind == OP_DEL ? 0 : op->hlc;
        }
        return Py_BuildValue("(NN)", packed, results);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = op_result(&ops[i]);
        if (!r) { /* applied; only the answer could not be built (out of memory) */
            Py_DECREF(results);
            return NULL;
        }
        PyList_SET_ITEM(results, i, r);
    }
    return results;
}

/* apply's work on a list of ops (the lock held) */
static PyObject *
apply_list(Core *c, PyObject *list, uint64_t now_ms, uint64_t flags, uint64_t max_dirty,
           int tombstones, int compact, PyObject *expects)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n == 0)
        return compact ? Py_BuildValue("(y#N)", "", (Py_ssize_t)0, PyList_New(0)) : PyList_New(0);
    Op local[4];
    Op *ops = n <= 4 ? local : PyMem_Calloc((size_t)n, sizeof(Op));
    if (!ops)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    Py_ssize_t parsed = 0;
    while (parsed < n) {
        int rc = parse_op(PyList_GET_ITEM(list, parsed), &ops[parsed]);
        parsed++;
        if (rc < 0)
            goto done;
    }
    out = apply_ops(c, ops, n, now_ms, flags, max_dirty, tombstones,
                    compact ? RESULTS_COMPACT : RESULTS_LIST, expects);
done:
    release_ops(ops, parsed);
    if (ops != local)
        PyMem_Free(ops);
    return out;
}

/* apply(ops, now_ms, flags, max_dirty, tombstones[, compact]) -> results | (status, index)
 *                                                                            [lock held]
 * ops: (key, h[, cover]) delete | (key, h, tag, meta, value[, ext]) put | (..., counter, hlc,
 * vvx[, ext]) put with a version (see Op). All or nothing: a status means nothing was written (evictions
 * may have happened, and only when the batch could then fit). Results per op: put →
 * (counter, hlc, vvx, word, seq); delete → its counter, 0 if there was nothing to delete.
 * compact (kv.batch(), which needs the versions only if asked): (packed, vvxs) instead,
 * packed holding two native u64 per op (a put's counter and hlc; a delete's counter and
 * 0), vvxs a put's vvx or None for a delete. */
static PyObject *
Core_apply(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs < 5 || nargs > 7 || !PyList_Check(args[0]) ||
        (nargs == 7 && args[6] != Py_None && !PyList_Check(args[6]))) {
        PyErr_SetString(PyExc_TypeError, "apply(ops: list, now_ms, flags, max_dirty, tombstones"
                                         "[, compact[, expects: list | None]])");
        return NULL;
    }
    PyObject *expects = nargs == 7 && args[6] != Py_None ? args[6] : NULL;
    int compact = nargs >= 6 ? PyObject_IsTrue(args[5]) : 0;
    if (compact < 0)
        return NULL;
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t flags = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t max_dirty = PyLong_AsUnsignedLongLong(args[3]);
    int tombstones = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || tombstones < 0)
        return NULL;
    return apply_list(c, args[0], now_ms, flags, max_dirty, tombstones, compact, expects);
}

/* put(key, h, tag, meta, value, now_ms, flags, max_dirty, timeout) -> tuple | int status
 * The common write in one call: take the lock, apply one put, release it. ST_LOOK: Python
 * must look first (purged, repair, pins to sweep): nothing was written. */
static PyObject *
Core_put(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "put(key, h, tag, meta, value, now_ms, flags, max_dirty, timeout[, ext])");
        return NULL;
    }
    uint64_t now_ms = PyLong_AsUnsignedLongLong(args[5]);
    uint64_t flags = PyLong_AsUnsignedLongLong(args[6]);
    uint64_t max_dirty = PyLong_AsUnsignedLongLong(args[7]);
    double timeout = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred())
        return NULL;
    Op op;
    if (parse_items(args, 5, &op) < 0) {
        release_ops(&op, 1);
        return NULL;
    }
    if (nargs == 10) { /* the record's extension field (the writer's agent id, ...) */
        if (!PyBytes_Check(args[9])) {
            release_ops(&op, 1);
            PyErr_SetString(PyExc_TypeError, "put ext must be bytes");
            return NULL;
        }
        op.ext = PyBytes_AS_STRING(args[9]);
        op.xlen = (uint64_t)PyBytes_GET_SIZE(args[9]);
    }
    PyObject *out = NULL;
    if (take_lock(c, timeout) == 0) {
        out = needs_look(c, now_ms) ? PyLong_FromLong(ST_LOOK)
                            : apply_ops(c, &op, 1, now_ms, flags, max_dirty, 0, RESULTS_SINGLE, NULL);
        drop_lock(c);
    }
    release_ops(&op, 1);
    return out;
}

/* evict_key and expire_key: the slot of the clean record of key args[0] (hash args[1])
 * in *found, 0 when absent or dirty (a write not yet in L3 stays); -1: an error is set */
static int
find_clean(Core *c, PyObject *const *args, uint64_t *found)
{
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return -1;
    uint64_t reusable = 0;
    *found = 0;
    if (find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, found, &reusable) < 0)
        return -1;
    if (*found && (W(c, *found)[SLOT_FLAGS] & FLAG_DIRTY))
        *found = 0;
    return 0;
}

/* drop the record in slot so, the segment marked busy meanwhile (a writer dying inside
 * leaves it to be repaired): an EXPIRE event when expire, else evict_slot's event; True */
static PyObject *
drop_busy(Core *c, uint64_t so, int expire)
{
    uint64_t prev = *HW(c, H_BUSY);
    ST(HW(c, H_BUSY), 1);
    if ((expire ? drop_slot(c, so, KIND_EXPIRE) : evict_slot(c, so, real_now())) < 0)
        return NULL;
    ST(HW(c, H_BUSY), prev);
    Py_RETURN_TRUE;
}

/* evict_key(key, h) -> bool: drop the key's record from this host's L2 if it is clean (a
 * local event, as CLOCK's evictions: an "evict" feed event, never a delete in L3). False
 * when absent or dirty (a write not yet in L3 stays)   [lock held] */
static PyObject *
Core_evict_key(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "evict_key(key, h)");
        return NULL;
    }
    uint64_t found;
    if (find_clean(c, args, &found) < 0)
        return NULL;
    if (!found)
        Py_RETURN_FALSE;
    return drop_busy(c, found, 0);
}

/* take_ref(key, h) -> int: whether the key's record was read since the last take_ref of
 * it (its CLOCK reference bit: every read through L2 sets it, and so does every write, but
 * for those of a quiet thread), the bit cleared; -1 when absent. The node daemon's loop is
 * quiet: it asks at each remote change of a key it holds whether an agent read the key
 * since the last one (its own writes leave the bit as it was, or unset for a new key).
 * [lock held] */
static PyObject *
Core_take_ref(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take_ref(key, h)");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found = 0, reusable = 0;
    if (find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, &found, &reusable) < 0)
        return NULL;
    if (!found)
        return PyLong_FromLong(-1);
    uint64_t *slot = W(c, found);
    long ref = LDR(&slot[SLOT_REF]) ? 1 : 0;
    if (ref)
        ST(&slot[SLOT_REF], 0);
    return PyLong_FromLong(ref);
}

/* set_quiet(flag): the calling thread's reads and writes through this mapping leave
 * reference bits unset (one thread at a time; flag false: none) */
static PyObject *
Core_set_quiet(Core *c, PyObject *flag)
{
    int q = PyObject_IsTrue(flag);
    if (q < 0)
        return NULL;
    c->quiet_thread = pthread_self();
    c->quiet = q;
    Py_RETURN_NONE;
}

/* expire_key(key, h, now) -> bool: reclaim the key's record if it is past its deadline at
 * ``now`` (epoch seconds) and clean (a dirty one reaches L3 first); an EXPIRE event is fed.
 * False when absent, live, dirty, or a tombstone.   [lock held] */
static PyObject *
Core_expire_key(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "expire_key(key, h, now)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found;
    if (find_clean(c, args, &found) < 0)
        return NULL;
    if (!found || !slot_expired(c, found, now))
        Py_RETURN_FALSE;
    return drop_busy(c, found, 1);
}

/* sweep_expired(count, now) -> (reclaimed, bytes, passed): one slice of the shared
 * expiry pass. Look at ``count`` slots from the shared cursor (EXPIRY_CURSOR, where the
 * last slice of any process stopped) and reclaim every clean record past its deadline at
 * ``now`` as expire_key does; ``bytes`` is the record bytes freed, ``passed`` whether
 * this slice ended a pass over the whole table (then EXPIRY_NEXT holds the least deadline
 * of the clean records left: tiers/shm/layout.py "Expiry hint").   [lock held] */
static PyObject *
Core_sweep_expired(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "sweep_expired(count, now)");
        return NULL;
    }
    uint64_t count = PyLong_AsUnsignedLongLong(args[0]);
    double now = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t reclaimed = 0, freed = 0;
    int passed = sweep_slice(c, count, now, NULL, 0, &reclaimed, &freed);
    if (passed < 0)
        return NULL;
    return Py_BuildValue("(KKO)", (unsigned long long)reclaimed, (unsigned long long)freed,
                         passed ? Py_True : Py_False);
}

/* mark_clean(key, h, counter, hlc) -> bool: clear the dirty flag if the key still holds the
 * write (counter, hlc), i.e. L3 has it   [lock held] */
static PyObject *
Core_mark_clean(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "mark_clean(key, h, counter, hlc)");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t counter = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t hlc = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    uint64_t found = 0, reusable = 0;
    if (find(c, PyBytes_AS_STRING(args[0]), (uint64_t)PyBytes_GET_SIZE(args[0]), h, &found, &reusable) < 0)
        return NULL;
    if (!found)
        Py_RETURN_FALSE;
    uint64_t *slot = W(c, found);
    Rec r;
    rec_parse(c, slot[SLOT_OFF], &r);
    if (r.counter != counter || r.hlc != hlc || !(slot[SLOT_FLAGS] & FLAG_DIRTY))
        Py_RETURN_FALSE;
    ST(&slot[SLOT_FLAGS], slot[SLOT_FLAGS] & ~(uint64_t)FLAG_DIRTY);
    *HW(c, H_DIRTY) -= 1;
    if (r.xlen) /* clean now: the sweep's to reclaim at its deadline */
        expiry_note(c, ext_deadline((const unsigned char *)rec_ext(c, slot[SLOT_OFF], &r), r.xlen));
    Py_RETURN_TRUE;
}
