// StorageBackend: the distributed cache under the L3 tier, as the tier sees
// it: items (a key and a value of bytes) set, got and tested in batches.
// Implementations: MemcachedBackend (a memcached cluster through
// libmemcached), FakeBackend (in memory, for tests).
//
// Keys reach a backend as PartKey made them (printable, at most 250 bytes);
// values are at most max_item_bytes(). Nothing here knows pages: the tier
// (server/storage/storage_tier.h) cuts pages into items and checks them.
//
// Thread safety: every method may be called from many threads at once.
#ifndef KVHOST_SERVER_STORAGE_BACKEND_H_
#define KVHOST_SERVER_STORAGE_BACKEND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvhost {

struct StorageItem {
  std::string key;
  std::string value;
};

// One key's answer to Get.
struct FetchedItem {
  bool found = false;
  std::string value;  // when found
  std::string error;  // when not found because a server failed ("" for a plain miss)
};

// One server of a backend, as its last probe found it.
struct BackendServer {
  std::string address;  // "host:port"
  bool up = false;
  std::string error;  // why it is down, in words ("connection failure"); "" while up
  absl::Time since;   // when `up` last changed (or the backend was made)
};

class StorageBackend {
 public:
  virtual ~StorageBackend() = default;

  // The largest value one item may hold.
  virtual uint64_t max_item_bytes() const = 0;
  // Stores every item; one status per item, in order (UNAVAILABLE naming the
  // server for one that cannot be reached, RESOURCE_EXHAUSTED for one the
  // cache refuses for its size).
  virtual std::vector<absl::Status> Set(absl::Span<const StorageItem> items) = 0;
  // The value under each key, in order.
  virtual std::vector<FetchedItem> Get(absl::Span<const std::string> keys) = 0;
  // Whether each key is present, in order, stopping at the first that is
  // not: the result may be shorter than `keys` (its size is the prefix
  // length plus at most one false).
  virtual std::vector<bool> ExistPrefix(absl::Span<const std::string> keys) = 0;
  // "memcached 127.0.0.1:11211,... (2 replicas)" for logs and DaemonStatus.
  virtual std::string Describe() const = 0;
  // Its servers, in configuration order, each as last probed; empty for a
  // backend without servers (FakeBackend).
  virtual std::vector<BackendServer> Servers() const { return {}; }
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_BACKEND_H_
