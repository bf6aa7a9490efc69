// ThreadSanitizer annotations for Debian's abseil synchronization library.
//
// Debian builds libabsl_synchronization without -fsanitize=thread, so its
// absl::Mutex, CondVar, BlockingCounter and Notification carry none of the
// annotations an instrumented abseil has: TSan sees no happens-before edge
// through them and reports every access guarded by an absl::Mutex as a race
// (a two-thread counter under absl::MutexLock is enough). Linked into a TSan
// test binary only (tests/CMakeLists.txt, KVHOST_SANITIZE=thread), this file
// defines those entry points in the executable, which takes precedence over
// the shared library's definitions; each one calls the library's own
// (dlsym RTLD_NEXT) between the annotations abseil's TSan build makes:
//   * Lock / Unlock and friends: __tsan_mutex_pre/post_lock and _unlock, so
//     TSan tracks the lock (happens-before, lock-order inversions, double
//     unlock) and ignores what runs inside (abseil's Condition functions,
//     evaluated under the real lock);
//   * Await / CondVar::Wait: an unlock, the wait, a lock;
//   * BlockingCounter / Notification: a release before the signal, an
//     acquire after the wait.
// It knows nothing of kvhost and changes no behaviour: every call still goes
// to abseil.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#if !defined(__SANITIZE_THREAD__)
#error "tools/sanitizers/tsan_absl_sync.cc belongs in -fsanitize=thread builds only"
#endif

namespace {

#define KVHOST_STRINGIFY_INNER(x) #x
#define KVHOST_STRINGIFY(x) KVHOST_STRINGIFY_INNER(x)

// The library's definition of absl::<rest>, by its mangled name: "_ZN" (or
// "_ZNK" for a const method) "4absl" "<n><inline namespace>" rest.
template <typename Fn>
Fn Real(bool is_const, const char* rest) {
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string ns = KVHOST_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name =
      std::string(is_const ? "_ZNK" : "_ZN") + "4absl" + std::to_string(ns.size()) + ns + rest;
#else
  const std::string name = std::string(is_const ? "_ZNK" : "_ZN") + "4absl" + rest;
#endif
  void* fn = ::dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found in abseil: %s\n", name.c_str(), ::dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// One static per function: looked up on first use.
#define KVHOST_REAL(type, is_const, rest) static const auto real = Real<type>(is_const, rest)

// The mangled-name tail of the types abseil's signatures use ("NS0_" is the
// inline namespace).
#define MANGLED_CONDITION "RKNS0_9ConditionE"
#define MANGLED_DURATION "NS0_8DurationE"
#define MANGLED_TIME "NS0_4TimeE"

void Locked(void* mu, unsigned flags) { __tsan_mutex_post_lock(mu, flags, 0); }

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  KVHOST_REAL(void (*)(Mutex*), false, "5Mutex4LockEv");
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  Locked(this, 0);
}

void Mutex::ReaderLock() {
  KVHOST_REAL(void (*)(Mutex*), false, "5Mutex10ReaderLockEv");
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  real(this);
  Locked(this, __tsan_mutex_read_lock);
}

bool Mutex::TryLock() {
  KVHOST_REAL(bool (*)(Mutex*), false, "5Mutex7TryLockEv");
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool locked = real(this);
  __tsan_mutex_post_lock(
      this, locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock | __tsan_mutex_try_lock_failed,
      0);
  return locked;
}

bool Mutex::ReaderTryLock() {
  KVHOST_REAL(bool (*)(Mutex*), false, "5Mutex13ReaderTryLockEv");
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(this, flags);
  const bool locked = real(this);
  __tsan_mutex_post_lock(this, locked ? flags : flags | __tsan_mutex_try_lock_failed, 0);
  return locked;
}

void Mutex::Unlock() {
  KVHOST_REAL(void (*)(Mutex*), false, "5Mutex6UnlockEv");
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderUnlock() {
  KVHOST_REAL(void (*)(Mutex*), false, "5Mutex12ReaderUnlockEv");
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

void Mutex::LockWhen(const Condition& cond) {
  KVHOST_REAL(void (*)(Mutex*, const Condition&), false, "5Mutex8LockWhenE" MANGLED_CONDITION);
  __tsan_mutex_pre_lock(this, 0);
  real(this, cond);
  Locked(this, 0);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  KVHOST_REAL(bool (*)(Mutex*, const Condition&, absl::Duration), false,
              "5Mutex19LockWhenWithTimeoutE" MANGLED_CONDITION MANGLED_DURATION);
  __tsan_mutex_pre_lock(this, 0);
  const bool met = real(this, cond, timeout);
  Locked(this, 0);
  return met;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  KVHOST_REAL(bool (*)(Mutex*, const Condition&, absl::Time), false,
              "5Mutex20LockWhenWithDeadlineE" MANGLED_CONDITION MANGLED_TIME);
  __tsan_mutex_pre_lock(this, 0);
  const bool met = real(this, cond, deadline);
  Locked(this, 0);
  return met;
}

// Await: the caller holds the lock; abseil releases it while waiting and
// takes it back. For TSan: an unlock (others' writes meanwhile are theirs),
// the wait ignored (conditions are evaluated under the real lock), a lock.
namespace {
template <typename Wait>
auto AwaitAnnotated(Mutex* mu, Wait wait) {
  __tsan_mutex_pre_unlock(mu, 0);
  auto result = wait();
  __tsan_mutex_post_unlock(mu, 0);
  __tsan_mutex_pre_lock(mu, 0);
  Locked(mu, 0);
  return result;
}
}  // namespace

void Mutex::Await(const Condition& cond) {
  KVHOST_REAL(void (*)(Mutex*, const Condition&), false, "5Mutex5AwaitE" MANGLED_CONDITION);
  AwaitAnnotated(this, [&] {
    real(this, cond);
    return true;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  KVHOST_REAL(bool (*)(Mutex*, const Condition&, absl::Duration), false,
              "5Mutex16AwaitWithTimeoutE" MANGLED_CONDITION MANGLED_DURATION);
  return AwaitAnnotated(this, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  KVHOST_REAL(bool (*)(Mutex*, const Condition&, absl::Time), false,
              "5Mutex17AwaitWithDeadlineE" MANGLED_CONDITION MANGLED_TIME);
  return AwaitAnnotated(this, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  KVHOST_REAL(void (*)(CondVar*, Mutex*), false, "7CondVar4WaitEPNS0_5MutexE");
  AwaitAnnotated(mu, [&] {
    real(this, mu);
    return true;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  KVHOST_REAL(bool (*)(CondVar*, Mutex*, absl::Duration), false,
              "7CondVar15WaitWithTimeoutEPNS0_5MutexE" MANGLED_DURATION);
  return AwaitAnnotated(mu, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  KVHOST_REAL(bool (*)(CondVar*, Mutex*, absl::Time), false,
              "7CondVar16WaitWithDeadlineEPNS0_5MutexE" MANGLED_TIME);
  return AwaitAnnotated(mu, [&] { return real(this, mu, deadline); });
}

bool BlockingCounter::DecrementCount() {
  KVHOST_REAL(bool (*)(BlockingCounter*), false, "15BlockingCounter14DecrementCountEv");
  __tsan_release(this);
  return real(this);
}

void BlockingCounter::Wait() {
  KVHOST_REAL(void (*)(BlockingCounter*), false, "15BlockingCounter4WaitEv");
  real(this);
  __tsan_acquire(this);
}

void Notification::Notify() {
  KVHOST_REAL(void (*)(Notification*), false, "12Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  KVHOST_REAL(void (*)(const Notification*), true, "12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  KVHOST_REAL(bool (*)(const Notification*, absl::Duration), true,
              "12Notification30WaitForNotificationWithTimeoutE" MANGLED_DURATION);
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  KVHOST_REAL(bool (*)(const Notification*, absl::Time), true,
              "12Notification31WaitForNotificationWithDeadlineE" MANGLED_TIME);
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
