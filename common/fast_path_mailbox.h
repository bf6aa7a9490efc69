// The fast path's shared-memory mailbox (proto/kvhost/v1/fast_path.proto
// gives the layout and the protocol): its header words, the two areas, and
// the futex doorbell both sides ring. kvhostd and the client library share
// this header and nothing else of the fast path.
//
// Each side treats the other as hostile: a word is loaded once and checked
// before use, lengths are bounded by capacity, and nothing the other side
// writes can make this side touch memory outside the mapping.
//
// Thread safety: a Mailbox view is plain pointers into a mapping; the
// protocol allows one request in flight, so each side has one user at a
// time (the daemon's serving thread; the client's call under its lock).
#ifndef KVHOST_COMMON_FAST_PATH_MAILBOX_H_
#define KVHOST_COMMON_FAST_PATH_MAILBOX_H_

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

namespace kvhost {

// 2: the client acknowledges each reply (reply_read) before it rings again.
inline constexpr uint32_t kFastPathVersion = 2;
// Bytes before the request area (the header words live in its first 192).
inline constexpr uint64_t kFastPathHeaderBytes = 4096;
// Each area's default size: a 4096-token Backup is ~45 KB, an Alloc of
// 64 Ki tokens ~330 KB of reply; larger calls go over gRPC.
inline constexpr uint32_t kFastPathDefaultCapacity = 1u << 20;

// The most session ids a request frame (FastPathRequest.session_ids) may
// name: as many as a gRPC call's metadata holds, so that the fast path
// takes no caller gRPC would not. gRPC (1.51; kvhostd keeps its default)
// refuses a call whose metadata passes 8 KiB, each entry counted as its
// key, its value and 32 bytes (HPACK, RFC 7541 4.1): a kvhost-session
// entry of a session id ("ses-<n>-" and 32 hex digits, 38 bytes at least)
// takes 84, and the call's own headers (path, authority, user agent ...)
// about 500. Measured with the client library's channel: 91 such entries
// pass, 92 are RESOURCE_EXHAUSTED; the fast-path integration test checks
// both paths at this bound. An honest client names its session and a few
// past ones.
inline constexpr int kMaxCallerSessions = (8192 - 512) / (14 + 38 + 32);

// The header, as laid out in the mapping (static_asserts below pin the
// offsets the proto documents).
struct FastPathHeader {
  std::atomic<uint32_t> request_seq;
  std::atomic<uint32_t> request_bytes;
  // Where each side last ran (a hint, CPU number + 1; 0: unknown): a side
  // spins for the other only when they are on different CPUs, since on one
  // CPU the spin only delays the peer.
  std::atomic<uint32_t> client_cpu;
  // The client stores here the reply_seq of each reply it has read, before
  // it rings for its next call: kvhostd serves a ring only once the
  // previous reply was read.
  std::atomic<uint32_t> reply_read;
  char pad0[48];
  std::atomic<uint32_t> reply_seq;
  std::atomic<uint32_t> reply_bytes;
  std::atomic<uint32_t> server_cpu;
  char pad1[52];
  uint32_t version;
  uint32_t capacity;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "a futex word is 4 bytes");
static_assert(offsetof(FastPathHeader, request_bytes) == 4);
static_assert(offsetof(FastPathHeader, client_cpu) == 8);
static_assert(offsetof(FastPathHeader, reply_read) == 12);
static_assert(offsetof(FastPathHeader, server_cpu) == 72);
static_assert(offsetof(FastPathHeader, reply_seq) == 64);
static_assert(offsetof(FastPathHeader, reply_bytes) == 68);
static_assert(offsetof(FastPathHeader, version) == 128);
static_assert(offsetof(FastPathHeader, capacity) == 132);

// Bytes of a mailbox whose areas hold `capacity` bytes each.
inline constexpr uint64_t FastPathMailboxBytes(uint32_t capacity) {
  return kFastPathHeaderBytes + 2 * uint64_t{capacity};
}

// A view of a mapped mailbox of `capacity` bytes per area. The capacity is
// the one this side chose or checked against the mapping's size, never
// read back from the header alone.
struct FastPathMailbox {
  FastPathHeader* header = nullptr;
  uint8_t* request = nullptr;
  uint8_t* reply = nullptr;
  uint32_t capacity = 0;

  static FastPathMailbox Over(void* mapping, uint32_t capacity) {
    auto* base = static_cast<uint8_t*>(mapping);
    FastPathMailbox m;
    m.header = static_cast<FastPathHeader*>(mapping);
    m.request = base + kFastPathHeaderBytes;
    m.reply = base + kFastPathHeaderBytes + capacity;
    m.capacity = capacity;
    return m;
  }
};

// FUTEX_WAIT on a shared mapping's word while it holds `expected`, for at
// most `timeout_ns` (negative: no limit). Returns false on a timeout; true
// when woken, interrupted, or the word had changed (callers re-check).
inline bool FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  timespec* limit = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
    limit = &ts;
  }
  const long rc = ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
                            limit, nullptr, 0);
  return !(rc != 0 && errno == ETIMEDOUT);
}

// Wakes every waiter on the word (at most one exists by the protocol).
inline void FutexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
            0);
}

// This thread's CPU as a header hint (CPU number + 1).
inline uint32_t CpuHint() {
  const int cpu = ::sched_getcpu();
  return cpu < 0 ? 0 : static_cast<uint32_t>(cpu) + 1;
}

// Whether to spin for a peer whose hint is `peer`: only when both are
// known and differ.
inline bool SpinFor(uint32_t peer, uint32_t self) { return peer != 0 && self != 0 && peer != self; }

// Waits until `*word` differs from `old`: first loads it for up to
// `spin_ns` (a reply from a thread on another CPU comes within
// microseconds, sooner than a sleep and a wake-up; 0: no spin), then
// sleeps on the futex in slices of `slice_ns`, calling `keep_waiting()`
// after each slice and each wake-up that changed nothing (false: give up).
// Returns the new value, or `old` when keep_waiting gave up.
template <typename KeepWaiting>
uint32_t WaitForChange(std::atomic<uint32_t>* word, uint32_t old, int64_t spin_ns, int64_t slice_ns,
                       KeepWaiting&& keep_waiting) {
  if (spin_ns > 0) {
    timespec start{};
    ::clock_gettime(CLOCK_MONOTONIC, &start);
    while (true) {
      for (int i = 0; i < 16; ++i) {
        const uint32_t now = word->load(std::memory_order_acquire);
        if (now != old) return now;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      timespec t{};
      ::clock_gettime(CLOCK_MONOTONIC, &t);
      if ((t.tv_sec - start.tv_sec) * 1000000000 + (t.tv_nsec - start.tv_nsec) >= spin_ns) break;
    }
  }
  while (true) {
    const uint32_t now = word->load(std::memory_order_acquire);
    if (now != old) return now;
    FutexWait(word, old, slice_ns);
    const uint32_t after = word->load(std::memory_order_acquire);
    if (after != old) return after;
    if (!keep_waiting()) return old;
  }
}

}  // namespace kvhost

#endif  // KVHOST_COMMON_FAST_PATH_MAILBOX_H_
