/* ------------------------------------------------------------------ the writer lock
 *
 * A process-shared, robust pthread mutex of type NORMAL. Not ERRORCHECK (segments made
 * before 2026-12 have that type, kept in the segment): an error-checking mutex compares
 * the thread id in its lock word with the caller's, and a writer in another PID namespace
 * (a container sharing /dev/shm) may have the holder's number: it was told EDEADLK
 * (WriteUnderLock) instead of waiting. Re-entry is caught before the mutex: by the Core
 * (c->held), and, for another Core of the same segment in this thread (a validator
 * writing through a second client), by l2_locks_held below.
 */

/* L2 writer locks this thread holds, through any Core: a thread that holds one and finds
 * another held under its own thread id is writing from under a lock (a validator), which
 * would wait on itself with a NORMAL mutex */
static __thread int l2_locks_held;

static inline int
held_under_my_tid(Core *c)
{
#ifdef __GLIBC__
    if (l2_locks_held > 0) {
        unsigned lw = (unsigned)__atomic_load_n(&c->mutex->__data.__lock, __ATOMIC_RELAXED);
        return (lw & 0x3fffffffU) == (unsigned)gettid(); /* FUTEX_TID_MASK */
    }
#else
    (void)c;
#endif
    return 0;
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
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_NORMAL);
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

/* pthread_mutex_clocklock until monotonic time ``until``, the GIL released meanwhile */
static int
lock_until(Core *c, double until)
{
    struct timespec ts;
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_clocklock(c->mutex, CLOCK_MONOTONIC, &ts);
    Py_END_ALLOW_THREADS
    return rc;
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
    int rc = pthread_mutex_trylock(c->mutex);
    if (rc == EBUSY && held_under_my_tid(c))
        rc = EDEADLK; /* (this thread holds it through another Core: it would wait on itself) */
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
            rc = pthread_mutex_trylock(c->mutex);
        }
        if (rc == EBUSY && inline_wait > 0)
            rc = lock_until(c, mono_now() + inline_wait);
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
            rc = lock_until(c, now + 0.05 < deadline ? now + 0.05 : deadline);
            if (rc != ETIMEDOUT)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1; /* e.g. KeyboardInterrupt while waiting: nothing is held */
            if (mono_now() >= deadline) {
                long owner = 0;
#ifdef __GLIBC__
                owner = (long)c->mutex->__data.__owner;
#endif
                char secs[32];
                PyOS_snprintf(secs, sizeof(secs), "%.1f", timeout);
                PyErr_Format(Unavailable,
                             "the L2 writer lock has been held for over %ss (by thread %ld); "
                             "is a process stopped (SIGSTOP, a debugger) while writing? Nothing was "
                             "written; retry, or raise cache.lock_timeout",
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
    if (rc == EDEADLK) {
        PyErr_SetString(WriteUnderLock, "this thread already holds the L2 writer lock, through "
                                        "another client of this namespace (a write from inside a "
                                        "validator?); validators may read, not write");
        return -1;
    }
    if (rc != 0) {
        PyErr_Format(SegmentError, "the L2 writer lock is unusable (error %d: %s); purge the namespace",
                     rc, strerror(rc));
        return -1;
    }
    c->holder = self;
    c->held = 1;
    l2_locks_held++;
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
        l2_locks_held--;
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
