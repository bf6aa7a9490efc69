// FakeBackend: a StorageBackend in memory, for unit tests, with the faults
// the tier must survive: an item lost (eviction, a server down), an item's
// bytes changed, every call failing (the whole cluster down).
//
// Thread safety: all methods may be called concurrently (one mutex).
#ifndef KVHOST_SERVER_STORAGE_FAKE_BACKEND_H_
#define KVHOST_SERVER_STORAGE_FAKE_BACKEND_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/storage/backend.h"

namespace kvhost {

class FakeBackend final : public StorageBackend {
 public:
  explicit FakeBackend(uint64_t max_item_bytes) : max_item_bytes_(max_item_bytes) {}

  uint64_t max_item_bytes() const override { return max_item_bytes_; }
  std::vector<absl::Status> Set(absl::Span<const StorageItem> items) override;
  std::vector<FetchedItem> Get(absl::Span<const std::string> keys) override;
  std::vector<bool> ExistPrefix(absl::Span<const std::string> keys) override;
  std::string Describe() const override { return "in-memory fake"; }

  // Faults. Erase: false when the key was not there. Flip: XORs 0xFF into
  // byte `at` of the item (false when absent or too short). Down: every call
  // fails until Down(false).
  bool Erase(const std::string& key);
  bool Flip(const std::string& key, uint64_t at);
  void Down(bool down);
  // Puts `value` under `key` as is (a stranger's item, another store's part).
  void Put(const std::string& key, std::string value);
  // Inspection.
  bool Has(const std::string& key) const;
  std::string Value(const std::string& key) const;
  size_t size() const;

 private:
  const uint64_t max_item_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> items_ ABSL_GUARDED_BY(mu_);
  bool down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_FAKE_BACKEND_H_
