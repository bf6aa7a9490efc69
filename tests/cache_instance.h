// Test helpers for the node cache through a real kvhostd (cache_calls_test,
// cache_l3_integration_test, fast_path_integration_test): a node cache's spec, key lists, device
// rows by page, and Instance, one engine instance (a client with its worker session, a
// shared-memory device pool and its attachment of the cache's pool) that fills device pages with
// seeded bytes, stores and restores them and checks them byte for byte. Not thread-safe; each test
// owns its instances.
#ifndef KVHOST_TESTS_CACHE_INSTANCE_H_
#define KVHOST_TESTS_CACHE_INSTANCE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api_test_util.h"
#include "kvhost/client.h"

namespace kvhost::testing {

inline constexpr char kCache[] = "cache";
inline constexpr char kToken[] = "model-token";
inline constexpr uint32_t kPageSize = 16;
// The device pools' rows: 16 pages.
inline constexpr uint64_t kDeviceTokens = 256;

// Pages of 16 KiB; `large`: of 2 MiB (32 layers of 8 heads of 128), whose
// copies take long enough to be caught in flight.
inline v1::PoolSpec CacheSpec(uint64_t pages, bool large = false) {
  Dims dims;
  dims.layers = large ? 32 : 4;
  dims.heads = large ? 8 : 2;
  dims.head_dim = large ? 128 : 32;
  v1::PoolSpec spec =
      MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, pages * kPageSize, v1::BF16, dims);
  spec.set_node_cache(true);
  return spec;
}

// Device rows of pages [first_page, first_page + pages).
inline std::vector<int64_t> PageRows(uint64_t first_page, uint64_t pages) {
  std::vector<int64_t> rows(pages * kPageSize);
  for (size_t r = 0; r < rows.size(); ++r)
    rows[r] = static_cast<int64_t>(first_page * kPageSize + r);
  return rows;
}

inline std::vector<std::string> Keys(const std::string& prefix, int first, int n) {
  std::vector<std::string> keys;
  for (int i = first; i < first + n; ++i) keys.push_back(absl::StrCat(prefix, i));
  return keys;
}

// One engine instance: a client with its worker session, a device pool and
// its attachment of the cache's pool.
struct Instance {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmDevicePool> device;
  std::string attachment;

  static absl::StatusOr<std::unique_ptr<Instance>> Start(const std::string& address,
                                                         const std::string& shm_dir,
                                                         bool fast_path = true) {
    auto i = std::make_unique<Instance>();
    ClientOptions options;
    options.address = address;
    options.owner_token = kToken;
    options.fast_path = fast_path;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return client.status();
    i->client = *std::move(client);
    absl::StatusOr<v1::Pool> pool = i->client->GetPool(kCache);
    if (!pool.ok()) return pool.status();
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> device =
        ShmDevicePool::Create(*pool, kDeviceTokens, shm_dir);
    if (!device.ok()) return device.status();
    i->device = *std::move(device);
    absl::StatusOr<v1::Attachment> att =
        i->client->AttachDevice(i->device->MakeAttachRequest(kCache));
    if (!att.ok()) return att.status();
    i->attachment = att->id();
    return i;
  }
  // Device page `page` gets bytes that only `seed` decides.
  void FillPage(uint64_t page, uint8_t seed) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        uint8_t* row = device->row(c, l, page * kPageSize);
        for (uint64_t b = 0; b < kPageSize * device->row_bytes(c); ++b) {
          row[b] = static_cast<uint8_t>(seed * 31 + c * 7 + l * 3 + b);
        }
      }
    }
  }
  // Whether device page `page` holds what FillPage(_, seed) writes.
  bool PageIs(uint64_t page, uint8_t seed) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        const uint8_t* row = device->row(c, l, page * kPageSize);
        for (uint64_t b = 0; b < kPageSize * device->row_bytes(c); ++b) {
          if (row[b] != static_cast<uint8_t>(seed * 31 + c * 7 + l * 3 + b)) return false;
        }
      }
    }
    return true;
  }
  // Stores `keys` from device pages [first_page, +keys) and waits for it.
  absl::StatusOr<v1::CacheStoreReply> Store(const std::vector<std::string>& keys,
                                            uint64_t first_page) const {
    absl::StatusOr<v1::CacheStoreReply> stored =
        client->CacheStore(kCache, attachment, keys, PageRows(first_page, keys.size()));
    if (!stored.ok() || !stored->has_ticket()) return stored;
    absl::StatusOr<v1::TransferStatus> done = client->WaitTransfer(stored->ticket().id());
    if (!done.ok()) return done.status();
    return stored;
  }
  // Restores `keys` into device pages [first_page, +keys) and waits for it.
  absl::Status Restore(const std::vector<std::string>& keys, uint64_t first_page) const {
    absl::StatusOr<v1::TransferTicket> ticket =
        client->CacheRestore(kCache, attachment, keys, PageRows(first_page, keys.size()));
    if (!ticket.ok()) return ticket.status();
    return client->WaitTransfer(ticket->id()).status();
  }
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_CACHE_INSTANCE_H_
