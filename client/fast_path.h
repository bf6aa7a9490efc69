// Client::FastPath: a Client's fast-path state (ClientOptions::fast_path):
// its mailbox, when it may be tried again, and what it served. Internal to
// the client library (client/fast_path.cc uses it; session.cc makes it).
#ifndef KVHOST_CLIENT_FAST_PATH_H_
#define KVHOST_CLIENT_FAST_PATH_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/fast_path_channel.h"
#include "kvhost/client.h"

namespace kvhost {

struct Client::FastPath {
  // Held for one call (TryLock: a busy mailbox sends the call to gRPC).
  absl::Mutex mu;
  std::unique_ptr<FastPathChannel> channel ABSL_GUARDED_BY(mu);
  // No open before this (after a failed one).
  absl::Time retry_after ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  std::atomic<bool> open{false};
  std::atomic<uint64_t> calls{0};
};

}  // namespace kvhost

#endif  // KVHOST_CLIENT_FAST_PATH_H_
