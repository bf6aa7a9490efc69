// PoolRegistry: the daemon's pools by name, and the host-memory budget they
// draw on.
//
// Creating a pool checks its bytes against the memory the host can spare
// (MemAvailable and the cgroup limit, each less the reserve; tokenspeed's
// rule) and against the operator's --memory-limit for all pools together, then
// creates its shared-memory file. The check and the reservation of the bytes
// are serialised, so two concurrent creations cannot both pass against the
// same free memory; touching the pages happens outside that lock.
//
// A deleted pool's bytes are "releasing" until its memory is really unmapped
// (a page stream or transfer may still hold it): they count against
// --memory-limit until then (releasing_bytes()). Page streams reserve their
// chunk buffers against --memory-limit too (ReserveTransient).
//
// Thread safety: all methods may be called concurrently.
#ifndef KVHOST_SERVER_POOL_REGISTRY_H_
#define KVHOST_SERVER_POOL_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/pool/host_memory.h"
#include "server/pool/names.h"  // ValidatePoolName: what CreatePool accepts
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/releaser.h"

namespace kvhost {

struct RegistryOptions {
  // Directory of the pools' shared-memory files.
  std::string shm_dir = "/dev/shm";
  // Bytes all pools together may use; 0 = no limit beyond the host's.
  uint64_t memory_limit = 0;
  // Bytes of host memory never given to pools.
  uint64_t memory_reserve = 0;
  // Mode and group of the pools' region files (gid -1 = the process's).
  uint32_t region_mode = 0600;
  int64_t region_gid = -1;
  // The inodes of the pools' region files while they live (the transfer
  // engine refuses them as device buffers: give it the same set).
  std::shared_ptr<RegionInodes> region_inodes = std::make_shared<RegionInodes>();
  // Where memory figures come from (tests replace it).
  std::function<absl::StatusOr<MemorySnapshot>()> read_memory = [] {
    return ReadMemorySnapshot("/");
  };
  // Free bytes of shm_dir's file system, which the region files fill (tests
  // replace it).
  std::function<absl::StatusOr<uint64_t>(const DirFd&)> read_fs_free = [](const DirFd& dir) {
    return dir.FreeBytes();
  };
};

// Bytes counted against --memory-limit beside the registered pools'. Shared
// (by shared_ptr) with the deleted pools and the reservations that give them
// back, so those may outlive the registry.
struct MemoryLedger {
  // Deleted pools still mapped.
  std::atomic<uint64_t> releasing{0};
  // Page streams' chunk buffers (TransientReservation).
  std::atomic<uint64_t> transient{0};
};

// Bytes reserved by PoolRegistry::ReserveTransient, given back when this is
// destroyed (safe after the registry is gone). Movable; empty when
// default-constructed.
class TransientReservation {
 public:
  TransientReservation() = default;
  TransientReservation(std::weak_ptr<MemoryLedger> ledger, uint64_t bytes)
      : ledger_(std::move(ledger)), bytes_(bytes) {}
  TransientReservation(TransientReservation&& other) noexcept
      : ledger_(std::move(other.ledger_)), bytes_(other.bytes_) {
    other.bytes_ = 0;
  }
  TransientReservation& operator=(TransientReservation&& other) noexcept {
    if (this != &other) {
      Release();
      ledger_ = std::move(other.ledger_);
      bytes_ = other.bytes_;
      other.bytes_ = 0;
    }
    return *this;
  }
  ~TransientReservation() { Release(); }
  uint64_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (bytes_ == 0) return;
    if (std::shared_ptr<MemoryLedger> ledger = ledger_.lock()) ledger->transient -= bytes_;
    bytes_ = 0;
  }
  std::weak_ptr<MemoryLedger> ledger_;
  uint64_t bytes_ = 0;
};

// A pool being created (PoolRegistry::ListCreating): its resolved spec, its
// bytes and how many of them are reserved and mapped so far.
struct CreatingPool {
  std::string name;
  PoolSpec spec;
  uint64_t size_tokens = 0;
  uint64_t bytes = 0;
  uint64_t populated_bytes = 0;
};

// What a name resolves to (PoolRegistry::Resolve): a pool, or a pool group
// and its anchor pool. The calls that act on a pool (Alloc, Free, the page
// calls) act on `pool`; AttachDevice attaches the group when there is one.
struct PoolTarget {
  std::shared_ptr<Pool> pool;        // the pool; a group's anchor entry's pool
  std::shared_ptr<PoolGroup> group;  // null for a pool's name
};

class PoolRegistry {
 public:
  explicit PoolRegistry(RegistryOptions options);
  ~PoolRegistry();

  // INVALID_ARGUMENT (bad name or spec), ALREADY_EXISTS (a pool's or a
  // group's name), RESOURCE_EXHAUSTED.
  // A follower (spec.follows): NOT_FOUND when that pool does not exist,
  // INVALID_ARGUMENT when its kind cannot be followed by spec.kind or a given
  // page_size / sizing disagrees with it; it takes its size_tokens and
  // page_size (the stored spec has the page_size filled in).
  // Creating a large pool takes seconds (its memory is reserved and touched);
  // other calls, other creations included, proceed meanwhile. If `abandoned`
  // returns true once the memory is ready, the pool is dropped and CANCELLED
  // returned, so a caller whose deadline passed is not left with a pool it was
  // told does not exist.
  // `owner_token` (at most kMaxOwnerTokenBytes, ValidateOwnerToken, else
  // INVALID_ARGUMENT) protects the pool: see Resolve. A follower of a
  // protected pool needs the followed pool's token as `follows_token`
  // (PERMISSION_DENIED) and is protected by that token from then on
  // (Pool::token_owner); its own `owner_token` must be empty or that token
  // (INVALID_ARGUMENT otherwise, a follower of an unprotected pool included).
  absl::StatusOr<std::shared_ptr<Pool>> Create(const std::string& name, const PoolSpec& spec,
                                               const std::function<bool()>& abandoned = {},
                                               const std::string& owner_token = "",
                                               const std::string* follows_token = nullptr);
  // Create on a thread of its own; `done` gets its result there. `abandoned`
  // is asked between chunks of the populate (a caller that gives up stops
  // the work within a chunk) and once at the end, as in Create. After
  // CancelCreations has begun, `done` gets UNAVAILABLE.
  void CreateInBackground(const std::string& name, const PoolSpec& spec,
                          std::function<bool()> abandoned, const std::string& owner_token,
                          std::optional<std::string> follows_token,
                          std::function<void(absl::StatusOr<std::shared_ptr<Pool>>)> done);
  // Makes every creation in progress fail with UNAVAILABLE (within a chunk of
  // its populate) and every later one at once, and waits for the background
  // ones to have called their `done`. For the daemon's shutdown.
  void CancelCreations();
  // Drops every pool and group and waits until their memory is unmapped and
  // their files removed, several pools at once. REQUIRES: after
  // CancelCreations, with no other caller left.
  void ReleaseAll();
  // The pools being created, by name; the one named `name`, if it is.
  std::vector<CreatingPool> ListCreating() const;
  std::optional<CreatingPool> GetCreating(const std::string& name) const;
  // NOT_FOUND naming the pool; FAILED_PRECONDITION while it is being created.
  absl::StatusOr<std::shared_ptr<Pool>> Get(const std::string& name) const;
  // Every pool, by name.
  std::vector<std::shared_ptr<Pool>> List() const;
  // (Create: short of memory while deleted pools are being unmapped, it
  // waits for those releases, up to 30 s, before RESOURCE_EXHAUSTED.)
  // Removes the pool; its memory goes when the last user drops it, and until
  // then its bytes are releasing_bytes() (still counted against
  // --memory-limit). Returns its bytes. NOT_FOUND, or FAILED_PRECONDITION
  // while it has attachments or followers or is in a group. `resolved`, if
  // given, is the pool the caller resolved and checked (Resolve): only that
  // object is removed, and a different pool under the name now is NOT_FOUND.
  absl::StatusOr<uint64_t> Delete(const std::string& name, const Pool* resolved = nullptr);

  // Pool groups (server/pool/pool_group.h). Groups share the pools' name
  // space. CreateGroup: INVALID_ARGUMENT, NOT_FOUND (an entry's pool),
  // ALREADY_EXISTS, FAILED_PRECONDITION (a pool already in a group),
  // RESOURCE_EXHAUSTED when the group's layer maps (layer_num per entry,
  // PoolGroup::LayerMapValues) exceed `max_layer_map_values`, the most its
  // replies can carry. Checked before the registry lock is taken; a failed
  // call leaves no group. `token` (the caller's kvhost-token, null for none)
  // must open every entry's pool (CheckPoolOwner, PERMISSION_DENIED naming
  // the entry), checked on the pools resolved under the lock that joins them.
  // DeleteGroup: NOT_FOUND, FAILED_PRECONDITION while attached; `resolved`,
  // if given, as Delete's. Delete of a pool in a group is
  // FAILED_PRECONDITION naming the group.
  absl::StatusOr<std::shared_ptr<PoolGroup>> CreateGroup(const std::string& name,
                                                         uint32_t layer_num,
                                                         const std::vector<GroupEntrySpec>& entries,
                                                         uint64_t max_layer_map_values = UINT64_MAX,
                                                         const std::string* token = nullptr);
  absl::StatusOr<std::shared_ptr<PoolGroup>> GetGroup(const std::string& name) const;
  std::vector<std::shared_ptr<PoolGroup>> ListGroups() const;
  absl::Status DeleteGroup(const std::string& name, const PoolGroup* resolved = nullptr);
  // The pool named `name`, or the anchor pool of the group named `name`, for
  // the calls that check no owner (GetPageShape, IsStridePageAligned).
  // FAILED_PRECONDITION while the pool is being created; NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Pool>> GetPoolOrAnchor(const std::string& name) const;

  // The owner check of every call that changes or reads a pool's data: the
  // name resolved once, and `token` (the call's kvhost-token, null when it
  // carried none) checked on the very object returned, which the call then
  // uses instead of the name. So a pool that appears under the name after
  // this (one still being created, or deleted and created again) is never
  // acted on without its own token. A group's name checks every entry's
  // pool: one token per call, matching every protected pool touched.
  // PERMISSION_DENIED naming the first protected pool the token does not
  // open; FAILED_PRECONDITION while a pool of that name is being created
  // (StillCreating: resolved as what it is, never a pass); NOT_FOUND.
  absl::StatusOr<PoolTarget> Resolve(const std::string& name, const std::string* token) const;

  uint64_t used_bytes() const;
  // Bytes of deleted pools still mapped (see Delete).
  uint64_t releasing_bytes() const { return ledger_->releasing; }
  // Bytes of page-stream buffers reserved now (ReserveTransient).
  uint64_t transient_bytes() const { return ledger_->transient; }
  // Reserves `bytes` of a stream's buffer against --memory-limit (with the
  // pools', pools being created and releasing bytes) until the reservation
  // is destroyed. RESOURCE_EXHAUSTED naming `what`, the bytes and the budget.
  // Without --memory-limit it only counts.
  absl::StatusOr<TransientReservation> ReserveTransient(uint64_t bytes, const std::string& what);
  // Bytes a new pool could take now; `why`, if given, spells out the inputs
  // (MemAvailable, cgroup, reserve, the shm file system's free space,
  // --memory-limit and what counts against it: pools, pools being created,
  // deleted pools still mapped, stream buffers) for messages.
  absl::StatusOr<uint64_t> Available(std::string* why = nullptr) const;
  const RegistryOptions& options() const { return options_; }
  // "<shm_dir>/kvhost.<pid>." — the prefix of this daemon's region files.
  const std::string& region_prefix() const { return region_prefix_; }

  // Removes region files left in shm_dir by kvhostd processes that no longer
  // run (no process holds the file's lock, and its pid is not a running
  // process other than this one); returns how many. Names are
  // kvhost.<pid>.<hex>.<pool><suffix>, or kvhost.<pid>.<pool><suffix> from
  // older daemons. Symbolic links are never followed.
  int RemoveStaleRegions() const;

 private:
  const RegistryOptions options_;
  const std::string region_prefix_;
  // shm_dir, opened once: every region file is created and removed beneath it.
  const absl::StatusOr<std::shared_ptr<const DirFd>> shm_dir_fd_;
  absl::Mutex create_mu_;  // serialises Create's memory check and reservation
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  // Groups share the pools' name space: a name is in at most one of pools_,
  // creating_ and groups_.
  std::map<std::string, std::shared_ptr<PoolGroup>> groups_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // A pool whose memory is being reserved: its name is taken, its bytes
  // counted against the budget; populated grows as chunks are done.
  struct Creation {
    PoolSpec spec;
    uint64_t size_tokens = 0;
    uint64_t bytes = 0;
    std::atomic<uint64_t> populated{0};
  };
  std::map<std::string, std::shared_ptr<Creation>> creating_ ABSL_GUARDED_BY(mu_);
  uint64_t creating_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // FAILED_PRECONDITION "pool 'x' is still being created (n of m bytes)".
  static absl::Status StillCreating(const std::string& name, const Creation& c);
  // What `name` names now (Resolve and GetPoolOrAnchor, without a check).
  absl::StatusOr<PoolTarget> FindLocked(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Create's steps. ResolveFollowed: the pool `spec` follows (null when it
  // follows none), its token checked, what a follower inherits filled in.
  absl::StatusOr<std::shared_ptr<Pool>> ResolveFollowed(const std::string& name,
                                                        const std::string& owner_token,
                                                        const std::string* follows_token,
                                                        PoolSpec* spec);
  // Takes the name and counts the creation's bytes against the budget, in
  // one step under create_mu_ (waiting a while for deleted pools' releases
  // when short).
  absl::Status Admit(const std::string& name, const std::shared_ptr<Creation>& creation,
                     bool follower, const std::function<bool()>& abandoned);
  // Reserves and touches the pool's memory (Pool::Create), without a lock;
  // UNAVAILABLE once shutting down, CANCELLED when the caller gave up.
  absl::StatusOr<std::shared_ptr<Pool>> Fill(const std::string& name, Creation* creation,
                                             const std::shared_ptr<Pool>& followed,
                                             const std::function<bool()>& abandoned);
  const std::shared_ptr<MemoryLedger> ledger_ = std::make_shared<MemoryLedger>();
  // Where pools are destroyed; RegionFiles::releaser of every pool.
  const std::shared_ptr<Releaser> releaser_;
  std::atomic<bool> cancelling_{false};
  // CreateInBackground's threads; `finished` is set as a thread's last act,
  // so a later call can join it without waiting.
  struct Builder {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  absl::Mutex builders_mu_;
  std::vector<Builder> builders_ ABSL_GUARDED_BY(builders_mu_);
};

// (Owner tokens: CheckPoolOwner, CheckGroupOwner, ValidateOwnerToken,
// server/access/caller.h.)

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_REGISTRY_H_
