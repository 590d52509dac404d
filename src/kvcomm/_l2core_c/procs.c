/* ------------------------------------------------------------------ processes (owner tokens)
 *
 * Who owns a pin entry must be decidable by any process of the host, whatever its PID
 * namespace, however pids are reused, and zombies included: a pid is none of that. So a
 * process that takes zero-copy views registers in the segment's process table: a thread
 * of its own (the "sleeper": it blocks every signal and waits) takes one entry's robust
 * mutex and holds it for as long as the process lives. Its owner token is the entry's
 * index + 1 and the entry's generation. Alive = the generation is unchanged and the
 * mutex is held (trylock says EBUSY); when the process dies, the kernel releases the
 * mutex (EOWNERDEAD for the next taker). The thread does not survive fork(): a child
 * registers anew (its pins are its own).
 */

typedef struct {
    Core *c;
    uint64_t slot, gen;
    int state; /* 0 starting, 1 registered, -1 no free entry */
    int stop;  /* the Core lets go: unlock and end */
    pthread_mutex_t m;
    pthread_cond_t cv;
} Sleeper;

static inline char *proc_at(Core *c, uint64_t i) { return c->base + c->procs_off + i * PROC_BYTES; }
static inline pthread_mutex_t *proc_mutex(Core *c, uint64_t i) {
    return (pthread_mutex_t *)(proc_at(c, i) + PROC_MUTEX_AT);
}
static inline uint64_t *proc_words(Core *c, uint64_t i) { return (uint64_t *)proc_at(c, i); }

#define TOKEN_GEN_MASK ((1ULL << (64 - TOKEN_SLOT_BITS)) - 1)

static int
init_proc_mutexes(Core *c)
{
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    for (uint64_t i = 0; !rc && i < c->n_procs; i++) {
        memset(proc_at(c, i), 0, PROC_BYTES);
        rc = pthread_mutex_init(proc_mutex(c, i), &attr);
    }
    pthread_mutexattr_destroy(&attr);
    return rc;
}

static void *
sleeper_main(void *arg)
{
    Sleeper *s = arg;
    Core *c = s->c;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are the other threads' business */
    long long got = -1;
    uint64_t gen = 0;
    for (uint64_t i = 0; i < c->n_procs; i++) {
        pthread_mutex_t *mx = proc_mutex(c, i);
        int rc = pthread_mutex_trylock(mx);
        if (rc == EOWNERDEAD) {
            if (pthread_mutex_consistent(mx) != 0) {
                pthread_mutex_unlock(mx);
                continue;
            }
            rc = 0;
        }
        if (rc != 0)
            continue; /* held by a live process, or unusable */
        gen = __atomic_add_fetch(&proc_words(c, i)[PROC_GEN], 1, __ATOMIC_SEQ_CST) & TOKEN_GEN_MASK;
        __atomic_store_n(&proc_words(c, i)[PROC_PID], (uint64_t)getpid(), __ATOMIC_SEQ_CST);
        got = (long long)i;
        break;
    }
    pthread_mutex_lock(&s->m);
    if (got < 0) {
        s->state = -1;
    } else {
        s->state = 1;
        s->slot = (uint64_t)got;
        s->gen = gen;
    }
    pthread_cond_broadcast(&s->cv);
    while (got >= 0 && !s->stop)
        pthread_cond_wait(&s->cv, &s->m);
    pthread_mutex_unlock(&s->m);
    if (got < 0)
        return NULL; /* the creator frees s */
    __atomic_store_n(&proc_words(c, (uint64_t)got)[PROC_PID], 0, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(proc_mutex(c, (uint64_t)got));
    pthread_mutex_lock(&s->m); /* done with the mapping: the Core may unmap it now */
    s->state = 2;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->m);
    return NULL;
}

/* this process's owner token, registering it first if need be; 0 when the process table
 * is full (the caller falls back to copies) */
static uint64_t
my_token(Core *c)
{
    if (c->token)
        return c->token;
    Sleeper *s = calloc(1, sizeof(Sleeper));
    if (!s)
        return 0;
    s->c = c;
    pthread_mutex_init(&s->m, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_attr_t attr;
    pthread_t th;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    /* the thread starts with every signal blocked (it inherits this mask): between its
       start and its own pthread_sigmask, a Ctrl-C handed to it would leave the main
       thread asleep in a blocking call, the handler's flag set but no call interrupted */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&th, &attr, sleeper_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(s);
        return 0;
    }
    c->waiting++; /* (a close meanwhile leaves the mapping to this call: Core_release;
                     pins.c closed_meanwhile) */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->m);
    while (s->state == 0)
        pthread_cond_wait(&s->cv, &s->m);
    pthread_mutex_unlock(&s->m);
    Py_END_ALLOW_THREADS
    c->waiting--;
    if (s->state < 0) {
        pthread_mutex_destroy(&s->m);
        pthread_cond_destroy(&s->cv);
        free(s);
        return 0;
    }
    c->sleeper = s;
    c->token = (s->gen << TOKEN_SLOT_BITS) | (s->slot + 1);
    return c->token;
}

/* the sleeper lets go of its entry and ends; returns once it no longer touches the
 * mapping (only when no pin of this process is in use through this Core) */
static void
release_token(Core *c)
{
    Sleeper *s = c->sleeper;
    c->sleeper = NULL;
    c->token = 0;
    c->n_owned = 0;
    if (!s || c->pid != (uint64_t)getpid())
        return;  /* (a forked child's copy of a Core no forked() reached: one closed with
                    views alive, which their callbacks keep; the sleeper thread is the
                    parent's, and waiting for it would never end) */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->m);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    while (s->state != 2)
        pthread_cond_wait(&s->cv, &s->m);
    pthread_mutex_unlock(&s->m);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&s->m);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* is the process of ``token`` alive? A corrupt entry counts as alive: its pins leak
 * (bounded), which is better than freeing a block a live view may hold */
static int
token_alive(Core *c, uint64_t token)
{
    uint64_t slot = (token & ((1ULL << TOKEN_SLOT_BITS) - 1));
    if (slot == 0 || slot > c->n_procs)
        return 0;
    slot -= 1;
    if ((__atomic_load_n(&proc_words(c, slot)[PROC_GEN], __ATOMIC_SEQ_CST) & TOKEN_GEN_MASK) !=
        (token >> TOKEN_SLOT_BITS))
        return 0; /* the entry was taken again: its owner died */
    pthread_mutex_t *mx = proc_mutex(c, slot);
    int rc = pthread_mutex_trylock(mx);
    if (rc == EBUSY)
        return 1;
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(mx);
        pthread_mutex_unlock(mx);
        return 0;
    }
    if (rc == 0) {
        pthread_mutex_unlock(mx);
        return 0;
    }
    return 1;
}
