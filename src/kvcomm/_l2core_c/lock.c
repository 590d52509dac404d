/* ------------------------------------------------------------------ the writer lock
 *
 * A process-shared, robust, error-checking pthread mutex, taken with trylock only: a
 * writer that finds it held sleeps on its lock word with a plain FUTEX_WAIT (sleep_on),
 * never inside pthread_mutex_lock. Why: a thread asleep inside a robust mutex's lock
 * names the mutex in its robust list as its pending lock, and if its process ends then
 * (killed, or exiting while another of its threads waits), the kernel compares the lock
 * word's thread id with the dying thread's own. Thread ids are numbered per PID
 * namespace, and two containers sharing /dev/shm have colliding ones (each main thread is
 * pid 1 or 2 of its namespace): the kernel then took a live holder in the other container
 * for dead and handed the lock to a second writer. For the same reason glibc tells a
 * writer EDEADLK ("you hold it already") while another container's thread with its id
 * holds the lock: this kernel knows which segments this thread holds (held_here), and
 * reads EDEADLK on any other as "held".
 */

#ifdef __GLIBC__
#include <linux/futex.h>
#include <sys/syscall.h>
#define WORD_WAITERS 0x80000000U     /* FUTEX_WAITERS */
#define WORD_OWNER_DIED 0x40000000U  /* FUTEX_OWNER_DIED */
#endif

/* Sleep at most ``secs`` until the mutex's holder lets go (or dies), on its lock word
 * (see the top); returns at once when the word shows it free or its holder dead: the
 * caller's trylock decides. The caller releases the GIL around it. */
static void
sleep_on(pthread_mutex_t *m, double secs)
{
#ifdef __GLIBC__
    int *w = &m->__data.__lock;
    unsigned v = (unsigned)__atomic_load_n(w, __ATOMIC_ACQUIRE);
    if (v == 0 || (v & WORD_OWNER_DIED))
        return;
    if (!(v & WORD_WAITERS)) { /* (so that the holder's unlock wakes a sleeper: glibc's way) */
        int want = (int)(v | WORD_WAITERS), seen = (int)v;
        if (!__atomic_compare_exchange_n(w, &seen, want, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            return; /* (it changed: look again) */
        v |= WORD_WAITERS;
    }
    struct timespec ts;
    ts.tv_sec = (time_t)secs;
    ts.tv_nsec = (long)((secs - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, w, FUTEX_WAIT, (int)v, &ts, NULL, 0);
#else
    struct timespec ts = {0, secs < 1e-3 ? (long)(secs * 1e9) : 1000000L};
    (void)m;
    nanosleep(&ts, NULL);
#endif
}

/* After a trylock that followed a sleep took the mutex: mark the word as having waiters,
 * so that this holder's unlock wakes the next sleeper (glibc's lock does the same) */
static void
keep_waking(pthread_mutex_t *m)
{
#ifdef __GLIBC__
    __atomic_fetch_or(&m->__data.__lock, (int)WORD_WAITERS, __ATOMIC_SEQ_CST);
#else
    (void)m;
#endif
}

/* The segments whose writer lock this thread holds (their file's device and inode: two
 * mappings of one segment in a process are one segment) */
#define HELD_MAX 8
static __thread uint64_t held_dev[HELD_MAX], held_ino[HELD_MAX];
static __thread int held_n, held_over; /* (held_over: taken beyond HELD_MAX, not named) */

static int
held_here(Core *c)
{
    if (held_over)
        return 1; /* (unknown: a re-entry is likelier than a holder elsewhere with our id) */
    for (int i = 0; i < held_n; i++)
        if (held_dev[i] == c->seg_dev && held_ino[i] == c->seg_ino)
            return 1;
    return 0;
}

static void
note_held(Core *c, int taken)
{
    if (taken) {
        if (held_n < HELD_MAX) {
            held_dev[held_n] = c->seg_dev;
            held_ino[held_n] = c->seg_ino;
            held_n++;
        } else {
            held_over++;
        }
        return;
    }
    for (int i = 0; i < held_n; i++)
        if (held_dev[i] == c->seg_dev && held_ino[i] == c->seg_ino) {
            held_n--;
            held_dev[i] = held_dev[held_n];
            held_ino[i] = held_ino[held_n];
            return;
        }
    if (held_over)
        held_over--;
}

static PyObject *
Core_init_lock(Core *c, PyObject *Py_UNUSED(ignored))
{
    /* by the creator only, before the magic is published */
    NEED_VIEW(c);
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    if (!rc) {
        memset(c->mutex, 0, MUTEX_SPACE);
        rc = pthread_mutex_init(c->mutex, &attr);
    }
    pthread_mutexattr_destroy(&attr);
    if (!rc)
        rc = init_proc_mutexes(c);
    if (rc) {
        PyErr_Format(SegmentError, "cannot initialise the L2 writer lock (error %d)", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static uint64_t
wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Python must look before this holder writes: purged, a repair due, or (while replaced
 * blocks are parked for views) time to look for pins of dead processes. */
static inline int
needs_look(Core *c, uint64_t now_ms)
{
    return LDR(HW(c, H_STATE)) != STATE_OK || LDR(HW(c, H_BUSY)) ||
           (LDR(HW(c, H_DEFERRED)) && now_ms >= LDR(HW(c, H_DEAD_CHECK_MS)));
}

static double
mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* pthread_mutex_trylock, called only on a word that shows no live holder: glibc's robust
 * trylock names the mutex as this thread's pending operation in its robust list while it
 * tries, and a process killed in that window while a thread with its id in another
 * container holds the lock would have the kernel take that holder for dead (see the top).
 * Looking first leaves that window only to a race with another taker. */
static int
trylock_free(pthread_mutex_t *m)
{
#ifdef __GLIBC__
    unsigned v = (unsigned)__atomic_load_n(&m->__data.__lock, __ATOMIC_ACQUIRE);
    if ((v & FUTEX_TID_MASK) && !(v & WORD_OWNER_DIED))
        return EBUSY;
#endif
    return pthread_mutex_trylock(m);
}

/* Try the writer lock once: EBUSY when held, EDEADLK when this thread holds it (through
 * another mapping), as glibc would say; EDEADLK read as EBUSY (and *other set) when this
 * thread does not hold this segment: a holder elsewhere with this thread's id (see the
 * top). */
static int
try_once(Core *c, int *other)
{
    int rc = trylock_free(c->mutex);
#ifdef __GLIBC__
    if (rc == EBUSY && held_here(c)) { /* (rare: what trylock would have said) */
        unsigned v = (unsigned)__atomic_load_n(&c->mutex->__data.__lock, __ATOMIC_ACQUIRE);
        if ((v & FUTEX_TID_MASK) == (unsigned)syscall(SYS_gettid))
            rc = EDEADLK;
    }
#endif
    *other = rc == EDEADLK && !held_here(c);
    return *other ? EBUSY : rc;
}

/* The client was closed while this thread slept on its writer lock (core_closed):
 * ECANCELED, nothing held or written. Also after a signal handler ran between two waits,
 * which may have closed it (then the mapping is gone already). */
static int
closed_while_waiting(Core *c)
{
    core_closed(c, "this call waited for the L2 writer lock; nothing was written");
    return ECANCELED;
}

/* Wait for the lock until monotonic time ``until``: asleep on its lock word (sleep_on,
 * never inside the mutex: see the top), taking it with trylock when it lets go. ETIMEDOUT
 * at ``until``; the GIL released while asleep. */
static int
wait_for_lock(Core *c, double until, int *other)
{
    for (;;) {
        double left = until - mono_now();
        if (left <= 0)
            return ETIMEDOUT;
        c->waiting++; /* (the GIL held: a close meanwhile keeps the mapping: Core_release) */
        Py_BEGIN_ALLOW_THREADS
        sleep_on(c->mutex, left);
        Py_END_ALLOW_THREADS
        c->waiting--;
        if (c->closing)
            return closed_while_waiting(c);
        int rc = try_once(c, other);
        if (rc != EBUSY) {
            if (rc == 0 || rc == EOWNERDEAD)
                keep_waking(c->mutex);
            return rc;
        }
    }
}

/* Take the writer lock within timeout seconds. 0: taken; -1: a Python error is set and the
 * lock is NOT held (timeout → Unavailable, a signal's exception, a corrupt mutex). The GIL
 * is released while waiting, so the holder (maybe a thread of this process) can go on.
 * quiet: -2 and no error when another thread holds the lock now, without waiting (a caller
 * that can do without the lock makes no Unavailable, which would count in
 * kvcomm_errors_total though nothing failed). */
static int
take_lock_or_not(Core *c, double timeout, int quiet)
{
    pthread_t self = pthread_self();
    if (c->held && pthread_equal(c->holder, self)) {
        PyErr_SetString(WriteUnderLock,
                        "kvcomm was called to write from inside a validator (or another callback "
                        "that runs under the L2 writer lock); validators may read, not write");
        return -1;
    }
    int other = 0;
    int rc = try_once(c, &other);
    if (rc == EBUSY && quiet)
        return -2;
    if (rc == EBUSY && inline_wait >= 0) {
        /* an event loop's thread: wait at most inline_wait here (holds take microseconds),
         * then WouldBlock, nothing held or written: the caller reruns the call in a thread */
        /* a holder keeps the lock a microsecond or two: try again a few µs before sleeping
         * (a futex sleep and wake-up on a busy host costs more than the hold) */
        for (int spin = 0; spin < 256 && rc == EBUSY; spin++) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            rc = try_once(c, &other);
        }
        if (rc == EBUSY && inline_wait > 0)
            rc = wait_for_lock(c, mono_now() + inline_wait, &other);
        if (rc == ECANCELED)
            return -1;
        if (rc == EBUSY || rc == ETIMEDOUT) {
            PyErr_SetString(WouldBlock, "the L2 writer lock is held by another thread or "
                                        "process (this call runs again off the event loop)");
            return -1;
        }
    }
    if (rc == EBUSY) {
        double deadline = mono_now() + (timeout > 0 ? timeout : 0);
        for (;;) {
            double now = mono_now();
            rc = wait_for_lock(c, now + 0.05 < deadline ? now + 0.05 : deadline, &other);
            if (rc == ECANCELED)
                return -1;
            if (rc != ETIMEDOUT)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1; /* e.g. KeyboardInterrupt while waiting: nothing is held */
            if (c->closing) { /* (a signal handler closed the client) */
                closed_while_waiting(c);
                return -1;
            }
            if (mono_now() >= deadline) {
                long owner = 0;
#ifdef __GLIBC__
                owner = (long)c->mutex->__data.__owner;
#endif
                char secs[32];
                PyOS_snprintf(secs, sizeof(secs), "%.1f", timeout);
                PyErr_Format(Unavailable,
                             "the L2 writer lock has been held for over %ss (by thread %ld, "
                             "in its PID namespace); is a process stopped (SIGSTOP, a "
                             "debugger) while writing? Nothing was written; retry, or raise "
                             "cache.lock_timeout",
                             secs, owner);
                return -1;
            }
        }
    }
    if (rc == EOWNERDEAD) {
        /* its holder died; BUSY (if raised) makes Python repair the segment before use */
        if (pthread_mutex_consistent(c->mutex) != 0) {
            pthread_mutex_unlock(c->mutex);
            PyErr_SetString(SegmentError, "the L2 writer lock cannot be recovered; purge the namespace");
            return -1;
        }
        __atomic_add_fetch(HW(c, H_OWNER_DEATHS), 1, __ATOMIC_SEQ_CST);
        rc = 0;
    }
    if (rc == EDEADLK) { /* (held_here: this thread holds it through another mapping) */
        PyErr_SetString(WriteUnderLock, "this thread already holds the L2 writer lock, through "
                                        "another mapping of this namespace (a write from inside "
                                        "a validator?); validators may read, not write");
        return -1;
    }
    if (rc != 0) {
        PyErr_Format(SegmentError, "the L2 writer lock is unusable (error %d: %s); purge the namespace",
                     rc, strerror(rc));
        return -1;
    }
    c->holder = self;
    c->held = 1;
    note_held(c, 1);
    return 0;
}

static int
take_lock(Core *c, double timeout)
{
    return take_lock_or_not(c, timeout, 0);
}

static void
drop_lock(Core *c)
{
    if (c->held && pthread_equal(c->holder, pthread_self())) {
        c->held = 0;
        note_held(c, 0);
        pthread_mutex_unlock(c->mutex);
    }
}

/* lock(timeout) -> 0: locked, nothing to look at; 1: locked, Python must look first
 * (purged, BUSY raised, released views or parked blocks). Raises Unavailable after timeout. */
static PyObject *
Core_lock(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (take_lock(c, timeout) < 0)
        return NULL;
    return PyLong_FromLong(needs_look(c, wall_ms()));
}

/* try_lock() -> -1: another thread holds the lock now (no error raised); else as lock(0). */
static PyObject *
Core_try_lock(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    int rc = take_lock_or_not(c, 0.0, 1);
    if (rc == -2)
        return PyLong_FromLong(-1);
    if (rc < 0)
        return NULL;
    return PyLong_FromLong(needs_look(c, wall_ms()));
}

/* unlock() -> True if this thread held the lock (and released it), else False: safe to call
 * from every `finally`, whether or not the lock was taken. BUSY is left as it is. */
static PyObject *
Core_unlock(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (!c->has_view)
        Py_RETURN_FALSE;
    if (c->held && pthread_equal(c->holder, pthread_self())) {
        drop_lock(c);
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* owner() -> the thread id holding the lock (in its own PID namespace), 0 if none or unknown.
 * For tools (a nemesis that must not stop a process inside the lock); glibc only. */
static PyObject *
Core_owner(Core *c, PyObject *Py_UNUSED(ignored))
{
    NEED_VIEW(c);
    long owner = 0;
#ifdef __GLIBC__
    owner = (long)__atomic_load_n(&c->mutex->__data.__owner, __ATOMIC_RELAXED);
#endif
    return PyLong_FromLong(owner);
}

static PyObject *
Core_held(Core *c, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(c->has_view && c->held && pthread_equal(c->holder, pthread_self()));
}

/* set_busy(v): raise (1) or lower (0) BUSY around a mutation done from Python   [lock held] */
static PyObject *
Core_set_busy(Core *c, PyObject *arg)
{
    NEED_VIEW(c);
    NEED_LOCK(c);
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    ST(HW(c, H_BUSY), (uint64_t)(v != 0));
    Py_RETURN_NONE;
}
