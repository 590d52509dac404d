/*
 * kvcomm._l2core: the L2 segment's memory operations, in C.
 *
 * tiers/l2.py owns the design (its module docstring is the theory of operation) and the
 * policies that need the operating system (which pids are alive, when to sweep, when to
 * recover). This file does, fast and without being interruptible by Python signals, every
 * operation that reads or changes the shared structures:
 *
 *   - the writer lock: a process-shared, robust pthread mutex in the header. A holder
 *     that dies (SIGKILL, at any instruction) hands the lock to the next
 *     taker with EOWNERDEAD; no pid is ever compared, so pid reuse, zombies and PID
 *     namespaces do not matter;
 *   - the lock-free seqlock read, and the locked writes: a whole batch is planned, checked
 *     and given its space and slots before the first record is published, so it is applied
 *     whole or not at all;
 *   - the buddy heap, CLOCK eviction (never of dirty or pinned entries), pins, the change
 *     feed, crash recovery, and scans.
 *
 * The layout constants come from tiers/shm/layout.py through the generated _l2layout.h.
 *
 * Safety against a corrupt or hostile segment: every offset, length and order read from
 * shared memory is read ONCE into a local and checked before use, with arithmetic that
 * cannot wrap (every length is first bounded by the record's size, itself bounded by the
 * heap). A corrupt segment yields SegmentError, never a wild read or write.
 *
 * The BUSY word: a writer raises it before it mutates anything and restores it after; a
 * writer that finds corruption half-way leaves it raised. Whoever takes the lock next and
 * finds BUSY raised repairs the segment first (recover()): so a death or a corruption in
 * the middle of a mutation is repaired instead of being built upon.
 *
 * Memory order: stores that lock-free readers load are __atomic stores with release order
 * (plain moves on x86-64, but the compiler may not reorder them); the slot seq bumps are
 * sequentially consistent read-modify-writes (full barriers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "_l2layout.h"

#define TAG_BYTES 1
#define TAG_NDARRAY 4
#define NEW_DOT UINT64_MAX
#define MAX_COUNTER ((1ULL << 53) - 1) /* kvcomm.core.versions.MAX_COUNTER: a version's bound */
#define OWNED_MAX 16 /* pin entries a process keeps owned, unused, for its next views */

/* statuses returned (as ints) when a write changed nothing */
#define ST_NEED_SPACE 1 /* (kept for compatibility of status numbers) */
#define ST_SLOT_FULL 2  /* a key's probe window is full of unflushed writes */
#define ST_TOO_LARGE 3  /* a record can never fit */
#define ST_CORRUPT 4    /* corruption found before anything changed; BUSY left raised */
#define ST_DIRTY_FULL 5 /* too many writes wait for L3 (cluster.outbound_max) */
#define ST_LOOK 6       /* lock taken and released: Python must look first (state, busy, pins) */
#define ST_FULL 7       /* no space can be made: pinned or unflushed data fills L2 */
#define ST_CONFLICT 8   /* a batch's compare-and-set (expects) failed: nothing written */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;
    uint64_t size;
    uint64_t n_slots, mask, slots_off, meta_off, data_off, data_end, top_order;
    uint64_t feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key;
    pthread_mutex_t *mutex;
    pthread_t holder; /* the thread of this process that holds the lock, if held */
    int held;
    uint64_t pid;      /* this process (set again in a child after fork) */
    uint64_t procs_off, n_procs;
    uint64_t token;    /* this process's owner token (procs.c), 0 until it takes a pin */
    void *sleeper;     /* the thread that keeps the token alive */
    uint64_t active;   /* pins of this process in use through this mapping */
    int waiting;       /* threads of this process asleep on the writer lock (GIL released):
                          the mapping is not dropped under them (release, dealloc) */
    int closing;       /* release() asked: every call refuses (NEED_VIEW), a waiter wakes to
                          SegmentError, and the last one drops the mapping (core_drop) */
    uint32_t owned[OWNED_MAX]; /* pin entries this process owns and is not using */
    int n_owned;
    int guard;         /* this mapping's entry in the truncation guard (guard.c), or -1 */
    int quiet;         /* quiet_thread's reads and writes through this mapping leave CLOCK
                          reference bits unset (the node daemon's loop: only agents' reads
                          count; set_quiet) */
    pthread_t quiet_thread;
    uint64_t resv_off, resv_pages; /* the reservation map (reserve.c) and the pages it covers */
    int fd, has_fd;    /* the segment file (a duplicate this Core owns), to reserve memory */
    uint64_t seg_dev, seg_ino; /* which segment (its file; without one, the mapping): the
                                  writer locks a thread holds are named so (lock.c) */
    int no_room;       /* the last reservation failed (reserve.c): an error, not damage */
} Core;

#define QUIET(c) ((c)->quiet && pthread_equal((c)->quiet_thread, pthread_self()))

static PyTypeObject CoreType;
#define CoreType_ref CoreType
static PyObject *SegmentError;    /* kvcomm.errors.SegmentError, set at import */
static PyObject *Unavailable;     /* kvcomm.errors.Unavailable */
static PyObject *InvalidArgument; /* kvcomm.errors.InvalidArgument */
static PyObject *WriteUnderLock;  /* kvcomm.errors.WriteUnderLock (an InvalidArgument) */
static PyObject *WouldBlock;      /* kvcomm._l2core.WouldBlock (a BaseException: see lock.c) */
/* The calling thread's inline budget (seconds) for a contended writer lock; negative: none
 * (wait up to the caller's timeout). Set by kvcomm.aio around calls run on the event loop:
 * a lock still held after it raises WouldBlock before anything is written. */
static _Thread_local double inline_wait = -1.0;
static PyObject *ExtCheck;        /* kvcomm.core.ext.l2_ext_problem, set at import (NULL: none) */
static PyObject *ExtOk;           /* the last field ExtCheck passed: bytes are immutable, so the
                                     same object (a client's packed agent id) passes again unasked */

#define W(c, off) ((uint64_t *)((c)->base + (off)))
#define HW(c, name) W(c, (name) * 8)
#define LD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define LDR(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define SEQ_ADD(p) __atomic_add_fetch((p), 1, __ATOMIC_SEQ_CST)

_Static_assert(sizeof(pthread_mutex_t) <= MUTEX_SPACE, "pthread_mutex_t does not fit the header");

/* The kernel, one file per concern, compiled as one unit (so that its helpers stay
 * static and inline): read them in this order. */
#include "_l2core_c/geometry.h"
#include "_l2core_c/guard.c"
#include "_l2core_c/procs.c"
#include "_l2core_c/segment.c"
#include "_l2core_c/reserve.c"
#include "_l2core_c/lock.c"
#include "_l2core_c/read.c"
#include "_l2core_c/heap.c"
#include "_l2core_c/hazards.c"
#include "_l2core_c/feed.c"
#include "_l2core_c/slots.c"
#include "_l2core_c/write.c"
#include "_l2core_c/pins.c"
#include "_l2core_c/scan.c"
#include "_l2core_c/recover.c"
#include "_l2core_c/l1.c"
#include "_l2core_c/packplain.c"
#include "_l2core_c/batch.c"
#include "_l2core_c/lgstep.c"  /* (after batch.c: batch_args) */
#include "_l2core_c/bloom.c"
#include "_l2core_c/vmutex.c"
#include "_l2core_c/unitvec.c"
#include "_l2core_c/module.c"
