// Collectives between the tensor-parallel ranks of one machine through a shared memory segment
// (kvshare/model/tensor_parallel.py: ShmTransport). gloo over loopback TCP costs 1-2 ms per
// all-reduce on a small VM (its ring takes several socket round trips, each a thread wake-up),
// and a sharded forward does two per layer; here an all-reduce is a copy, a flag store and a
// wait on the other ranks' flags: microseconds when the ranks arrive together.
//
// Layout of the segment (set up by Python): `size` flag words, one per rank, each on its own
// 64-byte line, then two banks of `size` slots of `slot_bytes` each. Operation number `seq`
// (counted alike on every rank) uses bank seq & 1. Each rank writes only its own slot, then
// publishes seq in its flag (release); a rank reads the others' slots only after seeing their
// flags reach seq (acquire). Every operation waits for every rank's flag, so no rank can begin
// operation seq + 2 (which rewrites this bank) before every rank has posted seq + 1, that is,
// before every rank has finished reading operation seq.
//
// Waiting spins for `spin_us` (the ranks usually arrive within microseconds of each other), then
// sleeps on the flag word with a futex (the worker ranks wait for the next step plan this way
// while the engine is idle, at no CPU cost). A poster wakes sleepers only when there are any.
// Without futexes (not Linux) the wait sleeps 50 us between checks instead.
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

namespace {

struct alignas(64) Flag {
    std::atomic<uint32_t> seq;
    std::atomic<uint32_t> sleepers;
};

inline bool reached(uint32_t value, uint32_t seq) {
    return static_cast<int32_t>(value - seq) >= 0;  // wraps around after 2^32 operations
}

inline double now_us() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// 0: flag reached seq; 1: timeout_ms passed first (the caller checks its peers, then waits again).
int wait_flag(Flag* f, uint32_t seq, double spin_us, int64_t timeout_ms) {
    double t0 = now_us();
    while (true) {
        uint32_t v = f->seq.load(std::memory_order_acquire);
        if (reached(v, seq)) return 0;
        double waited = now_us() - t0;
        if (waited >= timeout_ms * 1e3) return 1;
        if (waited < spin_us) {
            cpu_relax();
            continue;
        }
#ifdef __linux__
        f->sleepers.fetch_add(1, std::memory_order_seq_cst);
        v = f->seq.load(std::memory_order_seq_cst);
        if (!reached(v, seq)) {
            timespec ts{0, 50 * 1000 * 1000};  // wake at least every 50 ms to re-check the deadline
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&f->seq), FUTEX_WAIT, v, &ts, nullptr, 0);
        }
        f->sleepers.fetch_sub(1, std::memory_order_seq_cst);
#else
        usleep(50);  // no futex: a short sleep between checks
#endif
    }
}

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

}  // namespace

extern "C" {

// Publish operation `seq` from `rank` (its slot is written), waking any rank asleep on it.
void kvs_shm_post(void* flags, int64_t rank, uint32_t seq) {
    Flag* f = static_cast<Flag*>(flags) + rank;
    f->seq.store(seq, std::memory_order_seq_cst);
#ifdef __linux__
    if (f->sleepers.load(std::memory_order_seq_cst) > 0)
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&f->seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

// Wait until every rank has posted `seq`. Returns -1 when done, else the rank still awaited
// after timeout_ms.
int64_t kvs_shm_wait_all(void* flags, int64_t size, uint32_t seq, double spin_us, int64_t timeout_ms) {
    Flag* f = static_cast<Flag*>(flags);
    for (int64_t r = 0; r < size; ++r)
        if (wait_flag(f + r, seq, spin_us, timeout_ms)) return r;
    return -1;
}

}  // extern "C"

// The ranks' shared memory as one rank sees it, and its operation counter. Python's
// ShmTransport owns it (kvshare/model/tp_transport.py); its all-reduces and the fused decode
// step's (decode_step.cpp, built in the same translation unit) all go through
// kvs_shm_allreduce_comm, so both cut a message into the same pieces and count alike.
struct ShmComm {
  void* flags;
  char* banks;
  int64_t slot_bytes;
  int64_t rank, size;
  uint32_t seq;  // the last operation number used (Python's gathers and broadcasts advance it too)
  // Called when a wait for `rank` has lasted another second; nonzero gives up (that rank is gone).
  int (*on_late)(int64_t rank);
};

namespace {

// The sum over ranks 0, 1, ... in order, in float32 (so every rank gets the same bits), of
// operation `seq`'s slots into x, once every rank has posted it.
void sum_slots(const ShmComm* c, uint32_t seq, void* x, int64_t n, int bf16) {
    const int64_t size = c->size, slot_bytes = c->slot_bytes;
    char* bank = c->banks + static_cast<int64_t>(seq & 1u) * size * slot_bytes;
    if (bf16) {
        uint16_t* out = static_cast<uint16_t*>(x);
        for (int64_t i = 0; i < n; ++i) {
            float acc = from_bf16(reinterpret_cast<const uint16_t*>(bank)[i]);
            for (int64_t r = 1; r < size; ++r) acc += from_bf16(reinterpret_cast<const uint16_t*>(bank + r * slot_bytes)[i]);
            out[i] = to_bf16(acc);
        }
        return;
    }
    float* out = static_cast<float*>(x);
    const float* first = reinterpret_cast<const float*>(bank);
    if (size == 2) {
        const float* second = reinterpret_cast<const float*>(bank + slot_bytes);
        for (int64_t i = 0; i < n; ++i) out[i] = first[i] + second[i];
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        float acc = first[i];
        for (int64_t r = 1; r < size; ++r) acc += reinterpret_cast<const float*>(bank + r * slot_bytes)[i];
        out[i] = acc;
    }
}

}  // namespace

extern "C" {

// x (n floats, or n bfloat16 when bf16 != 0) <- the sum over ranks of every rank's x, in pieces of
// one slot, each one operation. 0, or 1 with a message in err when on_late gave up on a rank.
int kvs_shm_allreduce_comm(ShmComm* c, void* x, int64_t n, int bf16, char* err, int64_t err_len) {
  const int64_t elem = bf16 ? 2 : 4, per = c->slot_bytes / elem;
  for (int64_t i = 0; i < n; i += per) {
    const int64_t k = n - i < per ? n - i : per;
    char* part = static_cast<char*>(x) + i * elem;
    const uint32_t seq = ++c->seq;
    char* bank = c->banks + static_cast<int64_t>(seq & 1u) * c->size * c->slot_bytes;
    std::memcpy(bank + c->rank * c->slot_bytes, part, k * elem);
    kvs_shm_post(c->flags, c->rank, seq);
    int64_t late;
    while ((late = kvs_shm_wait_all(c->flags, c->size, seq, 200.0, 1000)) >= 0) {
      if (c->on_late != nullptr && c->on_late(late)) {
        std::snprintf(err, size_t(err_len), "tensor parallel: rank %lld is gone", static_cast<long long>(late));
        return 1;
      }
    }
    sum_slots(c, seq, part, k, bf16);
  }
  return 0;
}

}  // extern "C"
