/* hpdl.offload's native executor: runs the flattened plans of one node's ranks without the interpreter.
 *
 * Python (hpdl/offload/native.py) compiles every registered request once into arrays: per operation its kind,
 * dependency count, users, and the byte segments it copies or reduces (absolute addresses in this process:
 * the agent maps the ranks' shared-memory buffers); per message between two ranks of the node one "match"
 * with the segments from the sender's box straight into the receiver's (one copy, no staging). This file
 * runs them: a dispatcher thread issues an operation when its dependency count reaches zero (MPICH gentran's
 * rule), hands the bytes of each pass to worker threads (pinned to the agent's reserved cores) and completes
 * requests by writing the mailbox words the Python executor writes, then waking the waiting rank's futex.
 *
 * Wake-ups never poll indefinitely: the dispatcher spins at most `spin_ns` after activity, then sleeps on a
 * futex word of the agent's status block (clients write it and FUTEX_WAKE after writing START); workers sleep
 * on a futex of their own. The GIL is never involved: these are plain pthreads.
 *
 * Memory ordering: the engine publishes DONE/FAILED/SEQ and reads START with __atomic acquire/release; the
 * ranks' side (numpy words in Python) still relies on x86-64's total store order (docs/offload.md, Limits).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* mailbox words (hpdl/offload/shm.py) */
enum { W_START = 0, W_PICKED = 1, W_DONE = 2, W_FAILED = 3, W_TPICKED = 4, W_TDONE = 5, W_SEQ = 6 };
enum { K_COPY = 0, K_REDUCE = 1, K_HALF = 2, K_NOP = 3 };
enum { S_IDLE = 0, S_DEPS = 1, S_MATCH = 2, S_RUN = 3, S_DONE = 4 };
enum { FAIL_NONE = 0, FAIL_PARTNER = 1, FAIL_BY_CALLER = 2 };
#define DESC 8 /* int32 words per op: kind, ndeps, nusers, users_off, seg_off, nseg, dtype, redop */
#define PIECE (64 * 1024)

typedef struct { int64_t src, dst, n; } seg_t;

typedef struct {
    int kind, ndeps, nusers, users_off, seg_off, nseg, dtype, redop, match;
} op_t;

typedef struct {
    int used, nops, left, active, failed, fail_code;
    int64_t gen, seen;
    volatile int64_t *mb;
    op_t *ops;
    int32_t *users;
    seg_t *segs;
    int32_t *counts;
    int8_t *state;
} inst_t;

typedef struct {
    int used, s_inst, s_op, r_inst, r_op, s_ready, r_ready, nseg;
    seg_t *segs;
} match_t;

/* a piece: one span [src, src + n) -> dst, or (segs != NULL) a run of nseg small segments copied one after
 * another: the unit a worker takes with one atomic. Strided boxes (the FFT's row transpose: 256-byte runs)
 * made one piece per segment, and the shared counter's cache line then cost more than the copies. */
typedef struct { int64_t src, dst, n; int dtype, redop; const seg_t *segs; int nseg; } piece_t;
typedef struct { int inst, op, match; } done_t;

typedef struct engine engine_t;
typedef struct { engine_t *e; int index, cpu; pthread_t th; } worker_t;

struct engine {
    pthread_mutex_t mu;
    pthread_t dispatcher;
    int stop, nworkers, started;
    int64_t spin_ns;
    int64_t par_min; /* bytes per pass from which workers help */
    uint32_t *bell;   /* futex word in the agent's status block */
    inst_t *insts; int ninst;
    match_t *matches; int nmatch;
    int32_t *ready; int nready, cap_ready; /* pairs (inst, op) */
    piece_t *pieces; int npieces, cap_pieces;
    done_t *done; int ndone, cap_done;
    worker_t *workers;
    /* a pass's pieces, shared with the workers */
    uint32_t job_gen;          /* futex: workers wait for it to change */
    int job_next, job_left;    /* next piece to take; workers still in the job */
    uint32_t job_done;         /* futex: the dispatcher waits for it to change */
    int dispatcher_cpu;
    int64_t passes, wakeups, jobs, bytes, pieces_run;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void futex_wait(uint32_t *addr, uint32_t val, int64_t timeout_ns, int shared) {
    struct timespec ts = {timeout_ns / 1000000000LL, timeout_ns % 1000000000LL};
    syscall(SYS_futex, addr, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, val, &ts, NULL, 0);
}

static void futex_wake(uint32_t *addr, int n, int shared) {
    syscall(SYS_futex, addr, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

#define GROW(ptr, n, cap, extra)                                                   \
    do {                                                                           \
        if ((n) + (extra) > (cap)) {                                               \
            int nc = (cap) ? (cap) * 2 : 64;                                       \
            while (nc < (n) + (extra)) nc *= 2;                                    \
            (ptr) = realloc((ptr), sizeof(*(ptr)) * (size_t)nc);                   \
            (cap) = nc;                                                            \
        }                                                                          \
    } while (0)

/* ---- element kernels ------------------------------------------------------------------------------ */
#define REDUCE_LOOP(T, FLOAT)                                                            \
    {                                                                                    \
        T *d = (T *)(intptr_t)dst;                                                       \
        const T *s = (const T *)(intptr_t)src;                                           \
        int64_t n = nbytes / (int64_t)sizeof(T);                                         \
        switch (redop) {                                                                 \
        case 0: for (int64_t i = 0; i < n; i++) d[i] = d[i] + s[i]; break;               \
        case 1: for (int64_t i = 0; i < n; i++) d[i] = d[i] * s[i]; break;               \
        case 2: for (int64_t i = 0; i < n; i++) {                                        \
                    T a = d[i], b = s[i];                                                \
                    d[i] = (FLOAT && (a != a || b != b)) ? (T)(a + b) : (b < a ? b : a); \
                } break;                                                                 \
        default: for (int64_t i = 0; i < n; i++) {                                       \
                    T a = d[i], b = s[i];                                                \
                    d[i] = (FLOAT && (a != a || b != b)) ? (T)(a + b) : (b > a ? b : a); \
                } break;                                                                 \
        }                                                                                \
    }

static void run_span(int64_t src, int64_t dst, int64_t nbytes, int dtype, int redop) {
    if (redop < 0) {
        memcpy((void *)(intptr_t)dst, (const void *)(intptr_t)src, (size_t)nbytes);
        return;
    }
    switch (dtype) {
    case 0: REDUCE_LOOP(float, 1) break;
    case 1: REDUCE_LOOP(double, 1) break;
    case 2: REDUCE_LOOP(int32_t, 0) break;
    case 3: REDUCE_LOOP(int64_t, 0) break;
    }
}

static void run_piece(const piece_t *p) {
    if (p->segs == NULL) {
        run_span(p->src, p->dst, p->n, p->dtype, p->redop);
        return;
    }
    for (int k = 0; k < p->nseg; k++) run_span(p->segs[k].src, p->segs[k].dst, p->segs[k].n, p->dtype, p->redop);
}

static void run_pieces(engine_t *e) {
    int i;
    while ((i = __atomic_fetch_add(&e->job_next, 1, __ATOMIC_ACQ_REL)) < e->npieces) run_piece(&e->pieces[i]);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    engine_t *e = w->e;
    pin(w->cpu);
    uint32_t seen = 0; /* job_gen starts at 0: a job published before this thread ran is still taken */
    while (!__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) {
        uint32_t g = __atomic_load_n(&e->job_gen, __ATOMIC_ACQUIRE);
        if (g == seen) {
            int64_t t0 = now_ns();
            while (g == seen && now_ns() - t0 < e->spin_ns) {
                sched_yield();
                g = __atomic_load_n(&e->job_gen, __ATOMIC_ACQUIRE);
            }
            if (g == seen) {
                futex_wait(&e->job_gen, seen, 100000000LL, 0);
                continue;
            }
        }
        seen = g;
        if (__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) break;
        run_pieces(e);
        if (__atomic_sub_fetch(&e->job_left, 1, __ATOMIC_ACQ_REL) == 0) {
            __atomic_add_fetch(&e->job_done, 1, __ATOMIC_RELEASE);
            futex_wake(&e->job_done, 1, 0);
        }
    }
    return NULL;
}

/* ---- the graph ------------------------------------------------------------------------------------- */
static void push_ready(engine_t *e, int inst, int op) {
    GROW(e->ready, 2 * e->nready, e->cap_ready, 2);
    e->ready[2 * e->nready] = inst;
    e->ready[2 * e->nready + 1] = op;
    e->nready++;
}

static void signal_rank(inst_t *in) {
    uint32_t *seq = (uint32_t *)(in->mb + W_SEQ);
    __atomic_add_fetch(seq, 1, __ATOMIC_RELEASE);
    futex_wake(seq, INT_MAX, 1);
}

static void finish(inst_t *in) {
    in->active = 0;
    in->mb[W_TDONE] = now_ns();
    __atomic_store_n(&in->mb[W_DONE], in->gen, __ATOMIC_RELEASE);
    signal_rank(in);
}

static void fail(inst_t *in, int code) {
    in->failed = 1;
    in->fail_code = code;
    in->active = 0;
    __atomic_store_n(&in->mb[W_FAILED], in->gen, __ATOMIC_RELEASE);
    signal_rank(in);
}

static void complete(engine_t *e, int ii, int oi) {
    inst_t *in = &e->insts[ii];
    if (!in->active) return;
    op_t *o = &in->ops[oi];
    in->state[oi] = S_DONE;
    for (int k = 0; k < o->nusers; k++) {
        int u = in->users[o->users_off + k];
        if (--in->counts[u] == 0) push_ready(e, ii, u);
    }
    if (--in->left == 0) finish(in);
}

static void begin(engine_t *e, int ii, int64_t gen) {
    inst_t *in = &e->insts[ii];
    in->gen = gen;
    in->active = 1;
    in->left = in->nops;
    in->mb[W_TPICKED] = now_ns();
    __atomic_store_n(&in->mb[W_PICKED], gen, __ATOMIC_RELEASE);
    for (int i = 0; i < in->nops; i++) {
        in->counts[i] = in->ops[i].ndeps;
        in->state[i] = S_DEPS;
    }
    if (in->nops == 0) {
        finish(in);
        return;
    }
    for (int i = 0; i < in->nops; i++)
        if (in->ops[i].ndeps == 0) push_ready(e, ii, i);
}

static piece_t *new_piece(engine_t *e, int dtype, int redop) {
    GROW(e->pieces, e->npieces, e->cap_pieces, 1);
    piece_t *p = &e->pieces[e->npieces++];
    p->dtype = dtype;
    p->redop = redop;
    p->segs = NULL;
    p->nseg = 0;
    return p;
}

/* segments of at least PIECE bytes are cut into equal pieces (no tiny tail); runs of smaller consecutive
 * segments are grouped into pieces of about PIECE bytes. The segs arrays stay put while the job runs (it runs
 * under the engine's lock, which registration and freeing take). */
static void add_pieces(engine_t *e, const seg_t *segs, int nseg, int dtype, int redop) {
    int k = 0;
    while (k < nseg) {
        int64_t n = segs[k].n;
        if (n >= PIECE) {
            int64_t off = 0;
            while (off < n) {
                int64_t len = n - off < PIECE + PIECE / 2 ? n - off : PIECE;
                piece_t *p = new_piece(e, dtype, redop);
                p->src = segs[k].src + off;
                p->dst = segs[k].dst + off;
                p->n = len;
                off += len;
            }
            k++;
            continue;
        }
        int k0 = k;
        int64_t total = 0;
        while (k < nseg && segs[k].n < PIECE && total < PIECE) total += segs[k++].n;
        piece_t *p = new_piece(e, dtype, redop);
        if (k - k0 == 1) {
            p->src = segs[k0].src;
            p->dst = segs[k0].dst;
            p->n = segs[k0].n;
        } else {
            p->segs = segs + k0;
            p->nseg = k - k0;
            p->n = total;
        }
    }
}

static void push_done(engine_t *e, int inst, int op, int match) {
    GROW(e->done, e->ndone, e->cap_done, 1);
    e->done[e->ndone].inst = inst;
    e->done[e->ndone].op = op;
    e->done[e->ndone].match = match;
    e->ndone++;
}

/* issue every ready operation: copies and reductions become pieces of this pass */
static void issue(engine_t *e) {
    for (int r = 0; r < e->nready; r++) {
        int ii = e->ready[2 * r], oi = e->ready[2 * r + 1];
        inst_t *in = &e->insts[ii];
        if (!in->active) continue;
        op_t *o = &in->ops[oi];
        if (o->kind == K_NOP) {
            push_done(e, ii, oi, -1);
        } else if (o->kind == K_COPY || o->kind == K_REDUCE) {
            in->state[oi] = S_RUN;
            add_pieces(e, in->segs + o->seg_off, o->nseg, o->dtype, o->kind == K_REDUCE ? o->redop : -1);
            push_done(e, ii, oi, -1);
        } else { /* one half of a message between two ranks of this node */
            if (o->match < 0 || !e->matches[o->match].used) {
                fail(in, FAIL_PARTNER);
                continue;
            }
            match_t *m = &e->matches[o->match];
            in->state[oi] = S_MATCH;
            if (m->s_inst == ii && m->s_op == oi) m->s_ready = 1; else m->r_ready = 1;
            if (m->s_ready && m->r_ready) {
                m->s_ready = m->r_ready = 0;
                e->insts[m->s_inst].state[m->s_op] = S_RUN;
                e->insts[m->r_inst].state[m->r_op] = S_RUN;
                add_pieces(e, m->segs, m->nseg, 0, -1);
                push_done(e, -1, -1, o->match);
            }
        }
    }
    e->nready = 0;
}

static void run_job(engine_t *e) {
    int64_t total = 0;
    for (int i = 0; i < e->npieces; i++) total += e->pieces[i].n;
    e->bytes += total;
    e->pieces_run += e->npieces;
    e->job_next = 0;
    if (e->nworkers > 0 && total >= e->par_min && e->npieces > 1) {
        e->jobs++;
        e->job_left = e->nworkers;
        uint32_t d0 = __atomic_load_n(&e->job_done, __ATOMIC_ACQUIRE);
        __atomic_add_fetch(&e->job_gen, 1, __ATOMIC_RELEASE);
        futex_wake(&e->job_gen, INT_MAX, 0);
        run_pieces(e);
        int64_t t0 = now_ns();
        while (__atomic_load_n(&e->job_done, __ATOMIC_ACQUIRE) == d0) {
            if (now_ns() - t0 < e->spin_ns) sched_yield();
            else futex_wait(&e->job_done, d0, 10000000LL, 0);
        }
    } else {
        run_pieces(e);
    }
    e->npieces = 0;
}

static void complete_done(engine_t *e) {
    int n = e->ndone;
    for (int k = 0; k < n; k++) {
        done_t d = e->done[k];
        if (d.match >= 0) {
            match_t *m = &e->matches[d.match];
            if (!m->used) continue;
            complete(e, m->s_inst, m->s_op);
            complete(e, m->r_inst, m->r_op);
        } else {
            complete(e, d.inst, d.op);
        }
    }
    e->ndone = 0;
}

/* one pass under the lock: new starts, then issue / copy / complete until nothing is ready */
static int pass(engine_t *e) {
    int busy = 0;
    e->passes++;
    for (int ii = 0; ii < e->ninst; ii++) {
        inst_t *in = &e->insts[ii];
        if (!in->used || in->active) continue;
        int64_t s = __atomic_load_n(&in->mb[W_START], __ATOMIC_ACQUIRE);
        if (s == in->seen) continue;
        in->seen = s;
        if (in->failed) continue;
        begin(e, ii, s);
        busy = 1;
    }
    while (e->nready) {
        busy = 1;
        issue(e);
        if (e->npieces) run_job(e);
        complete_done(e);
    }
    return busy;
}

static void *dispatcher_main(void *arg) {
    engine_t *e = arg;
    pin(e->dispatcher_cpu);
    int64_t last = now_ns();
    while (!__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) {
        uint32_t b = __atomic_load_n(e->bell, __ATOMIC_ACQUIRE);
        pthread_mutex_lock(&e->mu);
        int busy = pass(e);
        pthread_mutex_unlock(&e->mu);
        int64_t t = now_ns();
        if (busy) {
            last = t;
            continue;
        }
        if (t - last < e->spin_ns) {
            sched_yield();
            continue;
        }
        e->wakeups++;
        futex_wait(e->bell, b, 100000000LL, 1);
    }
    return NULL;
}

/* ---- API (ctypes) ---------------------------------------------------------------------------------- */
engine_t *hpe_create(int nworkers, const int32_t *cpus, int ncpus, int64_t spin_ns, int64_t par_min,
                     uint32_t *bell) {
    engine_t *e = calloc(1, sizeof(engine_t));
    pthread_mutex_init(&e->mu, NULL);
    e->nworkers = nworkers;
    e->spin_ns = spin_ns;
    e->par_min = par_min;
    e->bell = bell;
    e->dispatcher_cpu = ncpus > 0 ? cpus[0] : -1;
    e->workers = calloc((size_t)(nworkers > 0 ? nworkers : 1), sizeof(worker_t));
    for (int i = 0; i < nworkers; i++) {
        e->workers[i].e = e;
        e->workers[i].index = i;
        e->workers[i].cpu = ncpus > 1 ? cpus[(1 + i) % ncpus] : -1;
        pthread_create(&e->workers[i].th, NULL, worker_main, &e->workers[i]);
    }
    pthread_create(&e->dispatcher, NULL, dispatcher_main, e);
    e->started = 1;
    return e;
}

void hpe_destroy(engine_t *e) {
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(e->bell, 1, __ATOMIC_RELEASE);
    futex_wake(e->bell, INT_MAX, 1);
    pthread_join(e->dispatcher, NULL);
    __atomic_add_fetch(&e->job_gen, 1, __ATOMIC_RELEASE);
    futex_wake(&e->job_gen, INT_MAX, 0);
    for (int i = 0; i < e->nworkers; i++) pthread_join(e->workers[i].th, NULL);
    for (int i = 0; i < e->ninst; i++) {
        inst_t *in = &e->insts[i];
        free(in->ops); free(in->users); free(in->segs); free(in->counts); free(in->state);
    }
    for (int i = 0; i < e->nmatch; i++) free(e->matches[i].segs);
    free(e->insts); free(e->matches); free(e->ready); free(e->pieces); free(e->done); free(e->workers);
    free(e);
}

void hpe_ring(engine_t *e) {
    __atomic_add_fetch(e->bell, 1, __ATOMIC_RELEASE);
    futex_wake(e->bell, 1, 1);
}

int hpe_add_inst(engine_t *e, int64_t *mb, int nops, const int32_t *desc, const int32_t *users, int nusers,
                 const int64_t *segs, int nseg) {
    pthread_mutex_lock(&e->mu);
    int id = -1;
    for (int i = 0; i < e->ninst; i++)
        if (!e->insts[i].used) { id = i; break; }
    if (id < 0) {
        e->insts = realloc(e->insts, sizeof(inst_t) * (size_t)(e->ninst + 1));
        id = e->ninst++;
    }
    inst_t *in = &e->insts[id];
    memset(in, 0, sizeof(*in));
    in->used = 1;
    in->mb = mb;
    in->nops = nops;
    in->seen = __atomic_load_n(&mb[W_START], __ATOMIC_ACQUIRE);
    in->ops = calloc((size_t)(nops ? nops : 1), sizeof(op_t));
    for (int i = 0; i < nops; i++) {
        const int32_t *d = desc + DESC * i;
        op_t *o = &in->ops[i];
        o->kind = d[0]; o->ndeps = d[1]; o->nusers = d[2]; o->users_off = d[3];
        o->seg_off = d[4]; o->nseg = d[5]; o->dtype = d[6]; o->redop = d[7]; o->match = -1;
    }
    in->users = malloc(sizeof(int32_t) * (size_t)(nusers ? nusers : 1));
    if (nusers) memcpy(in->users, users, sizeof(int32_t) * (size_t)nusers);
    in->segs = malloc(sizeof(seg_t) * (size_t)(nseg ? nseg : 1));
    if (nseg) memcpy(in->segs, segs, sizeof(seg_t) * (size_t)nseg);
    in->counts = calloc((size_t)(nops ? nops : 1), sizeof(int32_t));
    in->state = calloc((size_t)(nops ? nops : 1), 1);
    pthread_mutex_unlock(&e->mu);
    return id;
}

int hpe_add_match(engine_t *e, int s_inst, int s_op, int r_inst, int r_op, const int64_t *segs, int nseg) {
    pthread_mutex_lock(&e->mu);
    int id = -1;
    for (int i = 0; i < e->nmatch; i++)
        if (!e->matches[i].used) { id = i; break; }
    if (id < 0) {
        e->matches = realloc(e->matches, sizeof(match_t) * (size_t)(e->nmatch + 1));
        id = e->nmatch++;
    }
    match_t *m = &e->matches[id];
    memset(m, 0, sizeof(*m));
    m->used = 1;
    m->s_inst = s_inst; m->s_op = s_op; m->r_inst = r_inst; m->r_op = r_op;
    m->nseg = nseg;
    m->segs = malloc(sizeof(seg_t) * (size_t)(nseg ? nseg : 1));
    if (nseg) memcpy(m->segs, segs, sizeof(seg_t) * (size_t)nseg);
    e->insts[s_inst].ops[s_op].match = id;
    e->insts[r_inst].ops[r_op].match = id;
    /* no half can be ready yet: compile() returns on every rank only after all of them registered, and a
       half issued without its match fails its request (FAIL_PARTNER) rather than waiting for ever */
    pthread_mutex_unlock(&e->mu);
    return id;
}

/* Remove a request. Partners waiting in a match for one of its halves fail (FAIL_PARTNER); their indices are
   written to `orphans` (at most `cap`), and their count returned. */
int hpe_remove_inst(engine_t *e, int id, int32_t *orphans, int cap) {
    pthread_mutex_lock(&e->mu);
    int n = 0;
    inst_t *in = &e->insts[id];
    for (int k = 0; k < e->nmatch; k++) {
        match_t *m = &e->matches[k];
        if (!m->used || (m->s_inst != id && m->r_inst != id)) continue;
        int oi = m->s_inst == id ? m->r_inst : m->s_inst;
        int oo = m->s_inst == id ? m->r_op : m->s_op;
        inst_t *other = &e->insts[oi];
        if (oi != id && other->used) {
            other->ops[oo].match = -1;
            if (other->active && other->state[oo] == S_MATCH) {
                fail(other, FAIL_PARTNER);
                if (n < cap) orphans[n] = oi;
                n++;
            }
        }
        m->used = 0;
        free(m->segs);
        m->segs = NULL;
    }
    in->active = 0;
    in->used = 0;
    free(in->ops); free(in->users); free(in->segs); free(in->counts); free(in->state);
    in->ops = NULL; in->users = NULL; in->segs = NULL; in->counts = NULL; in->state = NULL;
    pthread_mutex_unlock(&e->mu);
    return n;
}

void hpe_fail(engine_t *e, int id) {
    pthread_mutex_lock(&e->mu);
    if (e->insts[id].used) fail(&e->insts[id], FAIL_BY_CALLER);
    pthread_mutex_unlock(&e->mu);
}

/* state of every op (S_*) into `out`; returns active | failed << 1 | fail_code << 2 */
int hpe_query(engine_t *e, int id, int8_t *out, int32_t *counts) {
    pthread_mutex_lock(&e->mu);
    inst_t *in = &e->insts[id];
    int r = 0;
    if (in->used) {
        memcpy(out, in->state, (size_t)in->nops);
        memcpy(counts, in->counts, sizeof(int32_t) * (size_t)in->nops);
        r = in->active | (in->failed << 1) | (in->fail_code << 2);
    }
    pthread_mutex_unlock(&e->mu);
    return r;
}

void hpe_stats(engine_t *e, int64_t *out) {
    out[0] = e->passes; out[1] = e->wakeups; out[2] = e->jobs; out[3] = e->bytes; out[4] = e->pieces_run;
}
