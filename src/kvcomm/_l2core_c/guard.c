/* ------------------------------------------------------------------ the truncation guard
 *
 * A segment file shrunk under a live mapping (a truncate, a careless cleanup script)
 * makes the next access to the lost pages fault with SIGBUS, which would kill the
 * process whatever code touched them — C here, or Python through a memoryview. The guard
 * is a SIGBUS handler that knows every mapping this process has of a segment: a fault in
 * one replaces the whole mapping with zero pages (so the faulting access, and every
 * later one, reads zeros instead of faulting) and marks it lost; every kernel entry then
 * raises SegmentError ("the segment was truncated: reopen"). A fault anywhere else goes
 * to the handler that was there before (Python's faulthandler, or the default: death).
 */

#define GUARD_MAX 64

static struct {
    volatile uintptr_t base;
    volatile size_t size;
    volatile int lost;
} guarded[GUARD_MAX];
static struct sigaction guard_previous;
static int guard_installed;

static void
guard_handler(int sig, siginfo_t *info, void *uctx)
{
    uintptr_t addr = (uintptr_t)info->si_addr;
    for (int i = 0; i < GUARD_MAX; i++) {
        uintptr_t base = guarded[i].base;
        size_t size = guarded[i].size;
        if (base && addr >= base && addr - base < size) {
            /* zeros instead of the lost pages: the access is retried and reads them */
            void *p = mmap((void *)base, size, PROT_READ | PROT_WRITE,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p != MAP_FAILED) {
                guarded[i].lost = 1;
                return;
            }
            break;
        }
    }
    if (guard_previous.sa_flags & SA_SIGINFO) {
        if (guard_previous.sa_sigaction) {
            guard_previous.sa_sigaction(sig, info, uctx);
            return;
        }
    } else if (guard_previous.sa_handler != SIG_DFL && guard_previous.sa_handler != SIG_IGN) {
        guard_previous.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL); /* not ours: the default action (the process ends, as it would) */
    raise(sig);
}

static int
guard_add(uintptr_t base, size_t size)
{
    if (!guard_installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_sigaction = guard_handler;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &guard_previous) != 0)
            return -1;
        guard_installed = 1;
    }
    for (int i = 0; i < GUARD_MAX; i++) {
        if (guarded[i].base == 0) {
            guarded[i].lost = 0;
            guarded[i].size = size;
            __atomic_store_n(&guarded[i].base, base, __ATOMIC_SEQ_CST);
            return i;
        }
    }
    return -1; /* (more than GUARD_MAX mappings: the rest are not guarded) */
}

static void
guard_remove(int i)
{
    if (i >= 0 && i < GUARD_MAX) {
        __atomic_store_n(&guarded[i].base, 0, __ATOMIC_SEQ_CST);
        guarded[i].size = 0;
    }
}

static inline int
guard_lost(int i)
{
    return i >= 0 && i < GUARD_MAX && guarded[i].lost;
}
