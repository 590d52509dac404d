/* ------------------------------------------------------------------ a mutex in a mapped file
 *
 * The writers' lock of a vector index file (tiers/vectors.py, layout 3 and later): a
 * process-shared, robust pthread mutex at an offset of a writable buffer
 * (the file's mapping), as the L2 writer lock is (lock.c), for writers that take it once
 * per write: uncontended, taking and releasing it are two atomic instructions, where an
 * flock is two system calls. A holder that dies hands it to the next taker with
 * EOWNERDEAD (mutex_lock answers True: the caller repairs what the dead holder left).
 *
 *   mutex_init(buffer, offset)           the creator's, before the file is published
 *   mutex_lock(buffer, offset[, timeout]) -> bool   True: the last holder died holding it
 *   mutex_unlock(buffer, offset)         SegmentError unless this thread holds it
 *   mutex_release(buffer, offset) -> bool   unlock if this thread holds it (for finally:
 *                                        a KeyboardInterrupt right after mutex_lock
 *                                        returned leaves no lock held)
 *
 * It is taken with trylock only, on a word that shows no live holder (lock.c's
 * trylock_free); a writer that finds it held sleeps on its lock word (lock.c's sleep_on),
 * never inside pthread_mutex_lock, for the reason lock.c gives at its top. This
 * thread's holds are kept here (vheld), by address: unlock never releases a hold of
 * another container's thread that has this thread's id.
 *
 * mutex_lock waits with the GIL released, in slices of 50 ms between which Python's
 * signal handlers run (a KeyboardInterrupt while waiting raises, nothing held); with a
 * timeout (seconds), at most that long, then Unavailable, nothing held: a holder that
 * never lets go (stopped by SIGSTOP or a debugger, or a lock word naming a thread that
 * is gone without the owner-died mark: a file copied or restored while held) is
 * reported, not waited on forever. No thread id is compared (see mutex_init). The
 * buffer must stay mapped while the mutex is held (its owner unmaps it only under its
 * own thread lock, which every holder holds).
 */
#define VMUTEX_SPACE 64
_Static_assert(sizeof(pthread_mutex_t) <= VMUTEX_SPACE, "pthread_mutex_t over 64 bytes");

#define VHELD_MAX 8
static __thread pthread_mutex_t *vheld[VHELD_MAX]; /* the file mutexes this thread holds */
static __thread int vheld_n;

static int
vheld_index(pthread_mutex_t *m)
{
    for (int i = 0; i < vheld_n; i++)
        if (vheld[i] == m)
            return i;
    return -1;
}

/* the mutex at args[1] of buffer args[0] (view filled, to release), or NULL (error set) */
static pthread_mutex_t *
vmutex_at(PyObject *const *args, Py_ssize_t nargs, Py_buffer *view, const char *name)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(buffer, offset%s)", name,
                     strcmp(name, "mutex_lock") ? "" : "[, timeout]");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (off < 0 || off % 8 || view->len < VMUTEX_SPACE || off > view->len - VMUTEX_SPACE) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: offset %zd is not 8-aligned within the buffer "
                     "with %d bytes after it", name, off, VMUTEX_SPACE);
        return NULL;
    }
    return (pthread_mutex_t *)((char *)view->buf + off);
}

static PyObject *
mutex_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer view;
    pthread_mutex_t *m = vmutex_at(args, nargs, &view, "mutex_init");
    if (!m)
        return NULL;
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    /* NORMAL, not ERRORCHECK: an error-checking mutex compares its owner's thread id with
     * the caller's, and a writer in another PID namespace (a container sharing /dev/shm)
     * may have the holder's number: it would be told EDEADLK instead of waiting. Such a
     * writer polls (mutex_lock): never asleep in the mutex. A thread of this process
     * never takes it twice: VectorFile's thread lock is held around it. */
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_NORMAL);
    if (!rc) {
        memset(m, 0, VMUTEX_SPACE);
        rc = pthread_mutex_init(m, &attr);
    }
    pthread_mutexattr_destroy(&attr);
    PyBuffer_Release(&view);
    if (rc) {
        PyErr_Format(SegmentError, "cannot initialise a file's writer lock (error %d: %s)", rc,
                     strerror(rc));
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
mutex_lock(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer view;
    double timeout = -1.0; /* (none: wait until it is free) */
    if (nargs == 3) {
        timeout = PyFloat_AsDouble(args[2]);
        if (timeout == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(timeout >= 0)) {
            PyErr_SetString(PyExc_ValueError, "mutex_lock: timeout must be >= 0 seconds");
            return NULL;
        }
        nargs = 2;
    }
    pthread_mutex_t *m = vmutex_at(args, nargs, &view, "mutex_lock");
    if (!m)
        return NULL;
    if (vheld_index(m) >= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(WriteUnderLock, "this thread holds this vector index's writer lock "
                                        "already (a write from inside a write of it?)");
        return NULL;
    }
    if (vheld_n >= VHELD_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(SegmentError, "this thread holds 8 vector index locks already");
        return NULL;
    }
    double deadline = timeout < 0 ? 0 : mono_now() + timeout;
    int rc = trylock_free(m), slept = 0;
    while (rc == EBUSY || rc == EDEADLK) {
        double now = mono_now();
        if (timeout >= 0 && now >= deadline) {
            unsigned owner = 0;
#ifdef __GLIBC__
            owner = (unsigned)__atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) & 0x3fffffffU;
#endif
            PyBuffer_Release(&view);
            char secs[32];
            PyOS_snprintf(secs, sizeof(secs), "%.1f", timeout); /* (PyErr_Format has no %f) */
            PyErr_Format(Unavailable, "a vector index's writer lock has been held for over "
                         "%ss (by thread %lu, in its PID namespace): is a process stopped "
                         "(SIGSTOP, a debugger) while writing, or was the file copied while "
                         "held? Nothing was written; retry, or purge the namespace",
                         secs, (unsigned long)owner);
            return NULL;
        }
        double nap = 0.05;
        if (timeout >= 0 && deadline - now < nap)
            nap = deadline - now;
        Py_BEGIN_ALLOW_THREADS
        sleep_on(m, nap);
        Py_END_ALLOW_THREADS
        slept = 1;
        rc = trylock_free(m);
        if ((rc == EBUSY || rc == EDEADLK) && PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&view);
            return NULL; /* nothing held */
        }
    }
    if (slept && (rc == 0 || rc == EOWNERDEAD))
        keep_waking(m);
    int died = 0;
    if (rc == EOWNERDEAD) {
        if (pthread_mutex_consistent(m) != 0) {
            pthread_mutex_unlock(m);
            PyBuffer_Release(&view);
            PyErr_SetString(SegmentError, "a file's writer lock cannot be recovered; purge the "
                                          "namespace");
            return NULL;
        }
        died = 1;
        rc = 0;
    }
    PyBuffer_Release(&view);
    if (rc) {
        PyErr_Format(SegmentError, "a file's writer lock is unusable (error %d: %s); purge "
                     "the namespace", rc, strerror(rc));
        return NULL;
    }
    vheld[vheld_n++] = m;
    return PyBool_FromLong(died);
}

/* unlock the mutex if this thread holds it: 1 unlocked, 0 not held, -1 error set */
static int
vmutex_drop(pthread_mutex_t *m)
{
    int i = vheld_index(m);
    if (i < 0)
        return 0;
    vheld[i] = vheld[--vheld_n];
    int rc = pthread_mutex_unlock(m);
    if (rc) {
        PyErr_Format(SegmentError, "cannot release a file's writer lock (error %d: %s)", rc,
                     strerror(rc));
        return -1;
    }
    return 1;
}

/* mutex_forget(): in a child after fork: the forking thread's holds are not the child's */
static PyObject *
mutex_forget(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    vheld_n = 0;
    Py_RETURN_NONE;
}

/* release the mutex at args if this thread holds it: 1 released, 0 not held, -1 error set */
static int
vmutex_release_at(PyObject *const *args, Py_ssize_t nargs, const char *name)
{
    Py_buffer view;
    pthread_mutex_t *m = vmutex_at(args, nargs, &view, name);
    if (!m)
        return -1;
    int rc = vmutex_drop(m);
    PyBuffer_Release(&view);
    return rc;
}

static PyObject *
mutex_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int rc = vmutex_release_at(args, nargs, "mutex_release");
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *
mutex_unlock(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int rc = vmutex_release_at(args, nargs, "mutex_unlock");
    if (rc < 0)
        return NULL;
    if (rc == 0) {
        PyErr_SetString(SegmentError, "cannot release a file's writer lock: this thread does "
                                      "not hold it (error 1: Operation not permitted)");
        return NULL;
    }
    Py_RETURN_NONE;
}
