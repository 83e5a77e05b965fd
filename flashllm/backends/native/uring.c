/* flashllm's io_uring read engine (Linux): one ring per reader, the file registered, destinations registered
 * as fixed buffers where they fit a slot (no page pinning per read: bench/results/cpu_overhead.md).
 * Takes the same request records as the AIO engine (struct iocb of linux/aio_abi.h, built by numpy in
 * flashllm/io/aio.py) and hands back the same completion records (struct io_event), so one queue drives
 * either. Raw syscalls, no liburing. Built and loaded like kernels.c (flashllm/backends/native). */
#include <errno.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

typedef struct {  /* linux/aio_abi.h struct iocb, little-endian */
    uint64_t data; uint32_t key; int32_t rw_flags; uint16_t opcode; int16_t reqprio; uint32_t fildes;
    uint64_t buf, nbytes; int64_t offset; uint64_t reserved2; uint32_t flags, resfd;
} fl_iocb;
typedef struct { uint64_t data, obj; int64_t res, res2; } fl_event;  /* struct io_event */

#define MAX_SLOTS 64
typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, sq_mask, sq_entries, *sq_array;
    unsigned *cq_head, *cq_tail, cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
    int fixed_file;
    uint64_t lo[MAX_SLOTS], hi[MAX_SLOTS];  /* registered buffer slots: [lo, hi), empty when lo == hi */
} fl_ring;

static long sys_setup(unsigned n, struct io_uring_params *p) { return syscall(__NR_io_uring_setup, n, p); }
static long sys_enter(int fd, unsigned submit, unsigned wait, unsigned flags) {
    return syscall(__NR_io_uring_enter, fd, submit, wait, flags, NULL, 0);
}
static long sys_register(int fd, unsigned op, void *arg, unsigned n) {
    return syscall(__NR_io_uring_register, fd, op, arg, n);
}

int fl_uring_slots(void) { return MAX_SLOTS; }

void fl_uring_close(fl_ring *r) {
    if (!r) return;
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_len);
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

/* A ring for `depth` reads of file `file_fd` (registered as fixed file 0 where allowed); buffer slots
 * are reserved sparse (filled by fl_uring_buffer). NULL with *err = errno where io_uring is unavailable. */
fl_ring *fl_uring_open(unsigned depth, int file_fd, int *err) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * depth;
    fl_ring *r = calloc(1, sizeof *r);
    if (!r) { *err = ENOMEM; return NULL; }
    r->fd = (int)sys_setup(depth, &p);
    if (r->fd < 0) { *err = errno; free(r); return NULL; }
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    r->sq_map = mmap(0, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    r->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP) ? r->sq_map
        : mmap(0, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED) goto fail;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(0, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head); r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = *(unsigned *)(sq + p.sq_off.ring_mask); r->sq_entries = p.sq_entries;
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head); r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = *(unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->fixed_file = sys_register(r->fd, IORING_REGISTER_FILES, &file_fd, 1) == 0;
    struct io_uring_rsrc_register reg;
    memset(&reg, 0, sizeof reg);
    reg.nr = MAX_SLOTS;
    reg.flags = IORING_RSRC_REGISTER_SPARSE;
    if (sys_register(r->fd, IORING_REGISTER_BUFFERS2, &reg, sizeof reg) != 0)
        for (int i = 0; i < MAX_SLOTS; i++) r->hi[i] = r->lo[i] = 1;  /* no fixed buffers: plain reads */
    return r;
fail:
    *err = errno;
    fl_uring_close(r);
    return NULL;
}

/* Register [addr, addr + len) as buffer slot `slot` (len 0: empty it); 0, or -errno (e.g. ENOMEM past
 * RLIMIT_MEMLOCK for a user without CAP_IPC_LOCK): then reads into it stay plain reads. */
int fl_uring_buffer(fl_ring *r, int slot, uint64_t addr, uint64_t len) {
    if (slot < 0 || slot >= MAX_SLOTS) return -EINVAL;
    struct iovec iov = {(void *)addr, len};
    uint64_t tag = 0;
    struct io_uring_rsrc_update2 up;
    memset(&up, 0, sizeof up);
    up.offset = slot; up.data = (uint64_t)&iov; up.tags = (uint64_t)&tag; up.nr = 1;
    r->lo[slot] = r->hi[slot] = 0;
    if (sys_register(r->fd, IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof up) < 0) return -errno;
    if (len) { r->lo[slot] = addr; r->hi[slot] = addr + len; }
    return 0;
}

static int slot_of(const fl_ring *r, uint64_t at, uint64_t n) {
    for (int i = 0; i < MAX_SLOTS; i++)
        if (r->lo[i] < r->hi[i] && at >= r->lo[i] && at + n <= r->hi[i]) return i;
    return -1;
}

/* Queue up to n requests (IOCB_CMD_PREAD: a read into buf, fixed where a slot holds it; IOCB_CMD_PREADV:
 * a vectored read over nbytes iovecs) and enter them; the number the kernel took, or -errno if none. */
long fl_uring_submit(fl_ring *r, const fl_iocb *iocbs, long n) {
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE), tail = *r->sq_tail;
    long room = (long)r->sq_entries - (long)(tail - head);
    if (n > room) n = room;
    for (long k = 0; k < n; k++) {
        const fl_iocb *c = iocbs + k;
        struct io_uring_sqe *s = r->sqes + ((tail + k) & r->sq_mask);
        memset(s, 0, sizeof *s);
        s->fd = r->fixed_file ? 0 : (int)c->fildes;
        s->flags = r->fixed_file ? IOSQE_FIXED_FILE : 0;
        s->off = (uint64_t)c->offset;
        s->addr = c->buf;
        s->len = (unsigned)c->nbytes;
        s->user_data = c->data;
        if (c->opcode == 7) {
            s->opcode = IORING_OP_READV;
        } else {
            int slot = slot_of(r, c->buf, c->nbytes);
            s->opcode = slot >= 0 ? IORING_OP_READ_FIXED : IORING_OP_READ;
            if (slot >= 0) s->buf_index = (uint16_t)slot;
        }
        r->sq_array[(tail + k) & r->sq_mask] = (tail + k) & r->sq_mask;
    }
    __atomic_store_n(r->sq_tail, tail + (unsigned)n, __ATOMIC_RELEASE);
    long got;
    int e = 0;
    do got = sys_enter(r->fd, (unsigned)n, 0, 0); while (got < 0 && errno == EINTR);
    if (got < 0) { e = errno; got = 0; }
    if (got < n) __atomic_store_n(r->sq_tail, tail + (unsigned)got, __ATOMIC_RELEASE);  /* no SQPOLL: only we read */
    return got ? got : (n ? -(e ? e : EAGAIN) : 0);
}

/* Wait until at least min_nr completions are there; copy at most max_nr into `out` as io_events. */
long fl_uring_reap(fl_ring *r, long min_nr, long max_nr, fl_event *out) {
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    while ((long)(tail - head) < min_nr) {
        if (sys_enter(r->fd, 0, (unsigned)(min_nr - (long)(tail - head)), IORING_ENTER_GETEVENTS) < 0 &&
            errno != EINTR && errno != EAGAIN && errno != EBUSY)
            return -errno;
        tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    }
    long n = (long)(tail - head);
    if (n > max_nr) n = max_nr;
    for (long k = 0; k < n; k++) {
        const struct io_uring_cqe *c = r->cqes + ((head + k) & r->cq_mask);
        out[k].data = c->user_data; out[k].obj = 0; out[k].res = c->res; out[k].res2 = 0;
    }
    __atomic_store_n(r->cq_head, head + (unsigned)n, __ATOMIC_RELEASE);
    return n;
}
