#include "server/pool/registry.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/bytes.h"
#include "server/access/caller.h"
#include "spdlog/spdlog.h"

namespace kvhost {

namespace {
constexpr char kRegionFilePrefix[] = "kvhost.";

absl::Status GroupNameTaken(const std::string& name) {
  return absl::AlreadyExistsError(
      absl::StrCat("'", name, "' is a pool group's name; pools and groups share names"));
}
// PageAllocator's bookkeeping at its worst (the bound and its measurement are
// in server/pool/allocator.h).
constexpr uint64_t kPageTableBytesPerPage = PageAllocator::kMaxBookkeepingBytesPerPage;
// How long a create short of memory waits for deleted pools being unmapped
// (seconds for a pool of hundreds of GiB).
constexpr absl::Duration kReleaseWait = absl::Seconds(30);
// How long it also waits for a deleted pool not yet handed to the releaser:
// the last reference of a just-deleted pool may still be dropping on another
// RPC thread (a status or metrics read that took it), which takes
// microseconds; a pool held by a page stream or a transfer stays held, and a
// create must not wait the stream out.
constexpr absl::Duration kUnreferencedWait = absl::Seconds(2);
// Pools unmapped at once: at shutdown each of several pools' teardown is
// mostly serial in the kernel (its file's pages are freed under its inode).
constexpr int kReleaserThreads = 2;

absl::StatusOr<std::shared_ptr<const DirFd>> OpenShmDir(const std::string& path) {
  absl::StatusOr<DirFd> dir = DirFd::Open(path, "shm dir");
  if (!dir.ok()) return dir.status();
  return std::make_shared<const DirFd>(*std::move(dir));
}

}  // namespace

PoolRegistry::PoolRegistry(RegistryOptions options)
    : options_(std::move(options)),
      region_prefix_(absl::StrCat(options_.shm_dir, "/", kRegionFilePrefix, ::getpid(), ".")),
      shm_dir_fd_(OpenShmDir(options_.shm_dir)),
      releaser_(std::make_shared<Releaser>(kReleaserThreads)) {}

PoolRegistry::~PoolRegistry() {
  CancelCreations();
  ReleaseAll();
}

void PoolRegistry::CreateInBackground(
    const std::string& name, const PoolSpec& spec, std::function<bool()> abandoned,
    const std::string& owner_token, std::optional<std::string> follows_token,
    std::function<void(absl::StatusOr<std::shared_ptr<Pool>>)> done) {
  absl::MutexLock lock(&builders_mu_);
  // Threads that have finished are joined now (at once), so they do not pile up.
  for (auto it = builders_.begin(); it != builders_.end();) {
    if (*it->finished) {
      it->thread.join();
      it = builders_.erase(it);
    } else {
      ++it;
    }
  }
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([this, name, spec, abandoned = std::move(abandoned), owner_token,
                      follows_token = std::move(follows_token), done = std::move(done), finished] {
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Create(name, spec, abandoned, owner_token, follows_token ? &*follows_token : nullptr);
    done(std::move(pool));
    *finished = true;
  });
  builders_.push_back({std::move(thread), std::move(finished)});
}

void PoolRegistry::CancelCreations() {
  cancelling_ = true;
  std::vector<Builder> builders;
  {
    absl::MutexLock lock(&builders_mu_);
    builders.swap(builders_);
  }
  for (Builder& b : builders) b.thread.join();
}

void PoolRegistry::ReleaseAll() {
  std::map<std::string, std::shared_ptr<Pool>> pools;
  std::map<std::string, std::shared_ptr<PoolGroup>> groups;
  {
    absl::MutexLock lock(&mu_);
    pools.swap(pools_);
    groups.swap(groups_);
    used_bytes_ = 0;
  }
  // Groups hold their entries' pools; then each pool's deleter posts it to
  // the releaser, whose threads unmap several at once.
  groups.clear();
  pools.clear();
  releaser_->Stop();
}

absl::Status PoolRegistry::StillCreating(const std::string& name, const Creation& c) {
  return absl::FailedPreconditionError(absl::StrCat("pool '", name, "' is still being created (",
                                                    FormatBytes(c.populated), " of ",
                                                    FormatBytes(c.bytes), ")"));
}

std::vector<CreatingPool> PoolRegistry::ListCreating() const {
  absl::MutexLock lock(&mu_);
  std::vector<CreatingPool> out;
  for (const auto& [name, c] : creating_)
    out.push_back({name, c->spec, c->size_tokens, c->bytes, c->populated});
  return out;
}

std::optional<CreatingPool> PoolRegistry::GetCreating(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = creating_.find(name);
  if (it == creating_.end()) return std::nullopt;
  const Creation& c = *it->second;
  return CreatingPool{name, c.spec, c.size_tokens, c.bytes, c.populated};
}

namespace {

// A follower's page size and size come from the pool it follows; values the
// spec gives must agree with them.
absl::Status InheritFromFollowed(const Pool& followed, PoolSpec* spec) {
  if (spec->page_size != 0 && spec->page_size != followed.page_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.page_size ", spec->page_size, " differs from page_size ",
                     followed.page_size(), " of pool '", followed.name(), "' that ",
                     PoolKindName(spec->kind), " follows; leave it 0 or equal"));
  }
  spec->page_size = static_cast<uint32_t>(followed.page_size());
  return absl::OkStatus();
}

absl::Status CheckFollowerSize(const Pool& followed, const PoolSpec& spec) {
  if (!CanFollow(spec.kind, followed.spec().kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.follows '", followed.name(), "' is a ",
                     PoolKindName(followed.spec().kind), " pool; ", PoolKindName(spec.kind), "/",
                     LayoutName(spec.layout), " follows ", FollowableKinds(spec.kind), " pools"));
  }
  const bool sized = spec.size_tokens > 0 || spec.size_bytes > 0 ||
                     (spec.host_to_device_ratio > 0 && spec.device_size_tokens > 0);
  if (!sized) return absl::OkStatus();
  absl::StatusOr<uint64_t> tokens = ResolveSizeTokens(spec);
  if (!tokens.ok()) return tokens.status();
  if (*tokens != followed.size_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec sizing gives ", *tokens, " tokens but pool '", followed.name(), "' that ",
        PoolKindName(spec.kind), " follows has ", followed.size_tokens(),
        "; a follower takes the followed pool's size (leave the sizing fields unset)"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The size in tokens of a new pool of `spec`: a follower's is the followed
// pool's (which `spec`'s sizing must match), any other's from its sizing
// fields.
absl::StatusOr<uint64_t> NewPoolTokens(const std::string& name, const PoolSpec& spec,
                                       const Pool* followed) {
  if (followed == nullptr) {
    absl::StatusOr<uint64_t> resolved = ResolveSizeTokens(spec);
    if (!resolved.ok()) return WithPool(name, resolved.status());
    return *resolved;
  }
  if (absl::Status s = CheckFollowerSize(*followed, spec); !s.ok()) return WithPool(name, s);
  const uint64_t tokens = followed->size_tokens();
  const uint64_t page_bytes = BytesPerPage(spec);
  if (page_bytes > 0 && tokens / spec.page_size > UINT64_MAX / page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("pool '", name, "': ", tokens / spec.page_size,
                                                   " pages of '", followed->name(), "' x ",
                                                   page_bytes, " bytes per page overflow"));
  }
  return tokens;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::Create(const std::string& name,
                                                           const PoolSpec& given,
                                                           const std::function<bool()>& abandoned,
                                                           const std::string& owner_token,
                                                           const std::string* follows_token) {
  if (absl::Status s = ValidatePoolName(name); !s.ok()) return s;
  if (cancelling_) {
    return absl::UnavailableError(
        absl::StrCat("pool '", name, "' was not created: the daemon is shutting down"));
  }
  if (absl::Status s = ValidateOwnerToken(owner_token); !s.ok()) return WithPool(name, s);
  PoolSpec spec = given;
  absl::StatusOr<std::shared_ptr<Pool>> found =
      ResolveFollowed(name, owner_token, follows_token, &spec);
  if (!found.ok()) return found.status();
  const std::shared_ptr<Pool> followed = *std::move(found);
  if (absl::Status s = ValidateSpec(spec); !s.ok()) return WithPool(name, s);
  absl::StatusOr<uint64_t> size_tokens = NewPoolTokens(name, spec, followed.get());
  if (!size_tokens.ok()) return size_tokens.status();
  const uint64_t tokens = *size_tokens;
  auto creation = std::make_shared<Creation>();
  creation->spec = spec;
  creation->size_tokens = tokens;
  creation->bytes = tokens / spec.page_size * BytesPerPage(spec);
  const uint64_t bytes = creation->bytes;
  if (absl::Status s = Admit(name, creation, followed != nullptr, abandoned); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Pool>> pool = Fill(name, creation.get(), followed, abandoned);
  absl::MutexLock lock(&mu_);
  creating_.erase(name);
  creating_bytes_ -= bytes;
  if (pool.ok() && followed) {
    // The followed pool may have been deleted meanwhile; then so is this one.
    auto it = pools_.find(followed->name());
    absl::Status s = it != pools_.end() && it->second == followed
                         ? followed->AddFollower(name)
                         : absl::FailedPreconditionError(
                               absl::StrCat("pool '", followed->name(), "' was deleted while '",
                                            name, "' that follows it was being created"));
    if (!s.ok()) pool = s;
  }
  if (!pool.ok()) return pool.status();
  // sglang's warning (tokenspeed's inverts it, see docs/SEEDS.md): a host tier
  // no larger than the device pool it backs can hold nothing the device lacks.
  if (spec.device_size_tokens > 0 && tokens <= spec.device_size_tokens) {
    spdlog::warn(
        "pool '{}' has {} tokens, not more than the device pool's {}; the host tier "
        "adds no capacity",
        name, tokens, spec.device_size_tokens);
  }
  if (!followed) (*pool)->SetOwnerToken(owner_token);
  pools_[name] = *pool;
  used_bytes_ += bytes;
  return *pool;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::ResolveFollowed(
    const std::string& name, const std::string& owner_token, const std::string* follows_token,
    PoolSpec* spec_out) {
  PoolSpec& spec = *spec_out;
  std::shared_ptr<Pool> followed;
  if (!spec.follows.empty() && NeedsFollows(spec.kind)) {
    absl::StatusOr<std::shared_ptr<Pool>> f = Get(spec.follows);
    if (absl::IsFailedPrecondition(f.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat("pool '", name, "': spec.follows: ", f.status().message()));
    }
    if (!f.ok()) {
      return absl::NotFoundError(
          absl::StrCat("pool '", name, "': spec.follows: pool '", spec.follows, "' not found"));
    }
    followed = *std::move(f);
    if (followed->spec().node_cache) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pool '", name, "': spec.follows: pool '", spec.follows,
          "' is a node cache, whose pages the cache allocates by key; it cannot be followed"));
    }
    // A follower shares the followed pool's slots and blocks its deletion.
    if (absl::Status s = CheckPoolOwner(*followed, follows_token); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat(s.message(), " (creating pool '", name, "' that follows it)"));
    }
    // A follower is protected by the followed pool's token (Pool::token_owner);
    // a token of its own would protect nothing, so only that one is taken.
    // The caller proved it holds it (follows_token above) before it is
    // compared here, so the answer is no oracle.
    if (!owner_token.empty() &&
        !(followed->owner_protected() && CheckPoolOwner(*followed, &owner_token).ok())) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool '", name,
                       "': owner_token is given, but a follower is protected by the token of "
                       "the pool it follows ('",
                       followed->name(), "'", followed->owner_protected() ? "" : ", which has none",
                       "); leave owner_token empty or give that pool's"));
    }
    if (absl::Status s = InheritFromFollowed(*followed, &spec); !s.ok()) return WithPool(name, s);
  }
  return followed;
}

absl::Status PoolRegistry::Admit(const std::string& name, const std::shared_ptr<Creation>& creation,
                                 bool follower, const std::function<bool()>& abandoned) {
  const PoolSpec& spec = creation->spec;
  const uint64_t bytes = creation->bytes;
  const uint64_t pages = creation->size_tokens / spec.page_size;
  // The allocator's page table is host memory too. A LOGICAL pool has no
  // other bytes, so without it a request for 2^40 tokens passed every check
  // and the daemon then failed to allocate 8 TiB (found by fuzz/service_fuzz).
  const uint64_t table_bytes = follower ? 0 : pages * kPageTableBytesPerPage;
  // The check and the reservation happen together, so two creations cannot
  // both pass against the same free memory; the slow part (reserving and
  // touching the pages) runs after, without the lock.
  absl::MutexLock create_lock(&create_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (pools_.count(name) != 0 || creating_.count(name) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("pool '", name, "' already exists"));
    }
    if (groups_.count(name) != 0) {
      return GroupNameTaken(name);
    }
  }
  std::string why;
  absl::StatusOr<uint64_t> budget = Available(&why);
  if (!budget.ok()) return budget.status();
  // Deleted pools are unmapped on the releaser's threads, and their bytes
  // count until then: a create right after a delete waits for those
  // releases, and briefly for a deleted pool whose last reference is still
  // being dropped (not for pools a stream still holds), before it gives up.
  const absl::Time release_deadline = absl::Now() + kReleaseWait;
  const absl::Time unreferenced_deadline = absl::Now() + kUnreferencedWait;
  auto releases_pending = [&] {
    const absl::Time now = absl::Now();
    if (now >= release_deadline) return false;
    return releaser_->pending() > 0 || (ledger_->releasing > 0 && now < unreferenced_deadline);
  };
  while (bytes + table_bytes > *budget && releases_pending() && !(abandoned && abandoned())) {
    absl::SleepFor(absl::Milliseconds(5));
    budget = Available(&why);
    if (!budget.ok()) return budget.status();
  }
  const uint64_t available = *budget;
  if (bytes + table_bytes > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "not enough host memory for pool '", name, "': it needs ", FormatBytes(bytes), " (", bytes,
        " bytes: ", pages, " pages x ", BytesPerPage(spec), " bytes)", table_bytes > 0 ? " + " : "",
        table_bytes > 0 ? FormatBytesExact(table_bytes) : "",
        table_bytes > 0 ? " of page table" : "", " = ", FormatBytesExact(bytes + table_bytes),
        ", but only ", FormatBytesExact(available), " available (", why, ")"));
  }
  absl::MutexLock lock(&mu_);
  // Again under the lock that registers the name: CreateGroup does not take
  // create_mu_, so a group of this name may have been made since the check
  // above (CI's ASan run caught a pool and a group both named "g").
  if (groups_.count(name) != 0) {
    return GroupNameTaken(name);
  }
  creating_[name] = creation;
  creating_bytes_ += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::Fill(const std::string& name,
                                                         Creation* creation,
                                                         const std::shared_ptr<Pool>& followed,
                                                         const std::function<bool()>& abandoned) {
  const PoolSpec& spec = creation->spec;
  RegionFiles files;
  files.dir = shm_dir_fd_.value_or(nullptr);  // Available failed above without it
  files.name_prefix = absl::StrCat(kRegionFilePrefix, ::getpid(), ".");
  files.file.mode = options_.region_mode;
  files.file.gid = options_.region_gid;
  files.file.inodes = options_.region_inodes;
  files.file.on_progress = [creation](uint64_t n) { creation->populated += n; };
  files.file.cancelled = [this, &abandoned] { return cancelling_ || (abandoned && abandoned()); };
  files.releaser = releaser_;
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      Pool::Create(name, spec, creation->size_tokens, files, followed);
  if (cancelling_ && (pool.ok() || absl::IsCancelled(pool.status()))) {
    pool = absl::UnavailableError(
        absl::StrCat("pool '", name, "' was not created: the daemon is shutting down"));
  }
  // A caller that gave up (deadline, cancellation) was told the call failed;
  // the pool must then not exist. Dropping it removes its file.
  if ((pool.ok() || absl::IsCancelled(pool.status())) && abandoned && abandoned()) {
    pool = absl::CancelledError(absl::StrCat("pool '", name,
                                             "' was not created: the caller gave up while its ",
                                             FormatBytes(creation->bytes), " were being reserved"));
  }
  return pool;
}

absl::StatusOr<uint64_t> PoolRegistry::Available(std::string* why) const {
  uint64_t used = 0;
  uint64_t pending = 0;
  {
    absl::MutexLock lock(&mu_);
    used = used_bytes_;
    pending = creating_bytes_;
  }
  absl::StatusOr<MemorySnapshot> mem = options_.read_memory();
  if (!mem.ok()) return mem.status();
  uint64_t available = AvailableForPools(*mem, options_.memory_reserve);
  std::string text = absl::StrCat("MemAvailable ", FormatBytes(mem->mem_available));
  if (mem->cgroup_limit) {
    absl::StrAppend(&text, ", cgroup ", mem->cgroup_source, " limit ",
                    FormatBytes(*mem->cgroup_limit), " with ", FormatBytes(mem->cgroup_usage),
                    " used");
  }
  absl::StrAppend(&text, ", reserve ", FormatBytes(options_.memory_reserve));
  // Pools still being created are not in MemAvailable yet.
  if (pending > 0) {
    available = available > pending ? available - pending : 0;
    absl::StrAppend(&text, ", ", FormatBytes(pending), " for pools being created");
  }
  if (options_.memory_limit > 0) {
    // Deleted pools still mapped and stream buffers hold memory too.
    const uint64_t releasing = ledger_->releasing, transient = ledger_->transient;
    const uint64_t committed = used + pending + releasing + transient;
    const uint64_t left = options_.memory_limit > committed ? options_.memory_limit - committed : 0;
    if (left < available) available = left;
    absl::StrAppend(&text, ", --memory-limit ", FormatBytes(options_.memory_limit), " with ",
                    FormatBytes(used + pending), " in pools");
    if (releasing > 0) {
      absl::StrAppend(
          &text, ", ", FormatBytes(releasing),
          " of deleted pools still mapped (being unmapped, or held by a stream or transfer)");
    }
    if (transient > 0) absl::StrAppend(&text, ", ", FormatBytes(transient), " in stream buffers");
  }
  // The region files live on the shm dir's file system: a tmpfs smaller than
  // the memory (a container's 64 MiB /dev/shm) holds only what it has free.
  // Pools being created have not taken all of theirs yet.
  if (!shm_dir_fd_.ok()) return shm_dir_fd_.status();
  absl::StatusOr<uint64_t> fs_free = options_.read_fs_free(**shm_dir_fd_);
  if (!fs_free.ok()) return fs_free.status();
  const uint64_t fs_left = *fs_free > pending ? *fs_free - pending : 0;
  if (fs_left < available) available = fs_left;
  absl::StrAppend(&text, ", shm filesystem ", EscapedPath((*shm_dir_fd_)->path()), " has ",
                  FormatBytes(*fs_free), " free");
  if (why != nullptr) *why = std::move(text);
  return available;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) {
    if (auto c = creating_.find(name); c != creating_.end()) return StillCreating(name, *c->second);
    return absl::NotFoundError(absl::StrCat("pool '", name, "' not found"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Pool>> PoolRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Pool>> out;
  out.reserve(pools_.size());
  for (const auto& [name, pool] : pools_) out.push_back(pool);
  return out;
}

absl::StatusOr<uint64_t> PoolRegistry::Delete(const std::string& name, const Pool* resolved) {
  // Dropped after the lock; its deleter hands the unmapping to the releaser.
  std::shared_ptr<Pool> deleted;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = pools_.find(name);
    if (it != pools_.end() && resolved != nullptr && it->second.get() != resolved) {
      // Deleted and created again since the caller resolved it: not the pool
      // its owner check opened.
      return absl::NotFoundError(absl::StrCat("pool '", name, "' not found (deleted meanwhile)"));
    }
    if (it == pools_.end()) {
      if (auto c = creating_.find(name); c != creating_.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat(StillCreating(name, *c->second).message(),
                         "; cancel its CreatePool call, or wait and delete it then"));
      }
      return absl::NotFoundError(absl::StrCat("pool '", name, "' not found"));
    }
    if (absl::Status s = it->second->TryRetire(); !s.ok()) return s;
    if (const std::shared_ptr<Pool>& followed = it->second->follows()) {
      followed->RemoveFollower(name);
    }
    deleted = std::move(it->second);
    pools_.erase(it);
    bytes = deleted->bytes();
    // The bytes move from used to releasing, and leave that only once the
    // pool's memory is unmapped (its last reference dropped).
    used_bytes_ -= bytes;
    ledger_->releasing += bytes;
    deleted->OnUnmapped([ledger = std::weak_ptr<MemoryLedger>(ledger_), bytes] {
      if (std::shared_ptr<MemoryLedger> l = ledger.lock()) l->releasing -= bytes;
    });
  }
  return bytes;
}

absl::StatusOr<TransientReservation> PoolRegistry::ReserveTransient(uint64_t bytes,
                                                                    const std::string& what) {
  if (bytes == 0) return TransientReservation();
  // With create_mu_, so a pool creation's check and this one cannot both
  // pass against the same budget.
  absl::MutexLock create_lock(&create_mu_);
  if (options_.memory_limit > 0) {
    uint64_t committed = 0;
    {
      absl::MutexLock lock(&mu_);
      committed = used_bytes_ + creating_bytes_;
    }
    const uint64_t releasing = ledger_->releasing, transient = ledger_->transient;
    committed += releasing + transient;
    const uint64_t left = options_.memory_limit > committed ? options_.memory_limit - committed : 0;
    if (bytes > left) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": a buffer of ", bytes, " bytes does not fit in --memory-limit ",
          FormatBytes(options_.memory_limit), " (", FormatBytes(committed - releasing - transient),
          " in pools, ", FormatBytes(releasing), " of deleted pools still mapped, ",
          FormatBytes(transient), " in stream buffers); use smaller chunks or retry later"));
    }
  }
  ledger_->transient += bytes;
  return TransientReservation(ledger_, bytes);
}

absl::StatusOr<std::shared_ptr<PoolGroup>> PoolRegistry::CreateGroup(
    const std::string& name, uint32_t layer_num, const std::vector<GroupEntrySpec>& entries,
    uint64_t max_layer_map_values, const std::string* token) {
  // Both before the lock: CheckShape caps layer_num (kMaxLayers), and a group
  // whose replies could not be sent is never registered (GetPoolGroup and
  // ListPoolGroups would fail for everyone).
  if (absl::Status s = PoolGroup::CheckShape(name, layer_num, entries); !s.ok()) return s;
  if (const uint64_t values = PoolGroup::LayerMapValues(layer_num, entries.size());
      values > max_layer_map_values) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group '", name, "': ", entries.size(), " entries x layer_num ", layer_num, " = ", values,
        " layer-map values, over the ", max_layer_map_values,
        " that one reply can carry (--max-message-bytes); use fewer layers or entries"));
  }
  // Resolving, creating and joining happen under one lock, so no entry's pool
  // can be deleted (or join another group) in between.
  absl::MutexLock lock(&mu_);
  if (pools_.count(name) != 0 || creating_.count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("'", name, "' is a pool's name; pools and groups share names"));
  }
  if (groups_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("group '", name, "' already exists"));
  }
  std::vector<std::shared_ptr<Pool>> pools;
  for (size_t i = 0; i < entries.size(); ++i) {
    auto it = pools_.find(entries[i].pool);
    if (auto c = creating_.find(entries[i].pool); c != creating_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", name, "': entries[", i, "] '", entries[i].name,
                       "': ", StillCreating(entries[i].pool, *c->second).message()));
    }
    if (it == pools_.end()) {
      return absl::NotFoundError(absl::StrCat("group '", name, "': entries[", i, "] '",
                                              entries[i].name, "': pool '", entries[i].pool,
                                              "' not found"));
    }
    // The caller's token, checked on the pool that joins (a name checked
    // before the lock could name another pool by now).
    if (absl::Status s = CheckPoolOwner(*it->second, token); !s.ok()) {
      return absl::PermissionDeniedError(absl::StrCat("group '", name, "': entries[", i, "] '",
                                                      entries[i].name, "': ", s.message()));
    }
    if (it->second->spec().node_cache) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", name, "': entries[", i, "] '", entries[i].name, "': pool '", entries[i].pool,
          "' is a node cache (its pages are addressed by key); it cannot join a group"));
    }
    const std::string in_group = it->second->group();
    if (!in_group.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group '", name, "': entries[", i, "] '", entries[i].name, "': pool '", entries[i].pool,
          "' is in group '", in_group, "' already; a pool is in one group at most"));
    }
    pools.push_back(it->second);
  }
  absl::StatusOr<std::shared_ptr<PoolGroup>> group =
      PoolGroup::Create(name, layer_num, entries, pools);
  if (!group.ok()) return group.status();
  for (size_t i = 0; i < pools.size(); ++i) {
    // Cannot fail: each pool is registered (not retired) and in no group, and
    // both change only under mu_.
    if (absl::Status s = pools[i]->JoinGroup(name); !s.ok()) {
      for (size_t j = 0; j < i; ++j) pools[j]->LeaveGroup();
      return s;
    }
  }
  groups_[name] = *group;
  return *group;
}

absl::StatusOr<std::shared_ptr<PoolGroup>> PoolRegistry::GetGroup(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(name);
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("group '", name, "' not found"));
  }
  return it->second;
}

std::vector<std::shared_ptr<PoolGroup>> PoolRegistry::ListGroups() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<PoolGroup>> out;
  out.reserve(groups_.size());
  for (const auto& [name, group] : groups_) out.push_back(group);
  return out;
}

absl::Status PoolRegistry::DeleteGroup(const std::string& name, const PoolGroup* resolved) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(name);
  if (it == groups_.end() || (resolved != nullptr && it->second.get() != resolved)) {
    return absl::NotFoundError(absl::StrCat("group '", name, "' not found"));
  }
  if (absl::Status s = it->second->TryRetire(); !s.ok()) return s;
  for (const GroupEntry& e : it->second->entries()) e.pool->LeaveGroup();
  groups_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<PoolTarget> PoolRegistry::FindLocked(const std::string& name) const {
  if (auto it = pools_.find(name); it != pools_.end()) return PoolTarget{it->second, nullptr};
  if (auto it = groups_.find(name); it != groups_.end()) {
    return PoolTarget{it->second->anchor().pool, it->second};
  }
  if (auto c = creating_.find(name); c != creating_.end()) return StillCreating(name, *c->second);
  return absl::NotFoundError(
      absl::StrCat("pool '", name, "' not found (no pool or group has that name)"));
}

absl::StatusOr<std::shared_ptr<Pool>> PoolRegistry::GetPoolOrAnchor(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<PoolTarget> found = FindLocked(name);
  if (!found.ok()) return found.status();
  return found->pool;
}

absl::StatusOr<PoolTarget> PoolRegistry::Resolve(const std::string& name,
                                                 const std::string* token) const {
  absl::StatusOr<PoolTarget> found;
  {
    absl::MutexLock lock(&mu_);
    found = FindLocked(name);
  }
  if (!found.ok()) return found.status();
  // On the objects found, not the name: a pool's token is set before it is
  // registered and never changes, and a group's entries are fixed.
  absl::Status owner =
      found->group ? CheckGroupOwner(*found->group, token) : CheckPoolOwner(*found->pool, token);
  if (!owner.ok()) return owner;
  return found;
}

uint64_t PoolRegistry::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

int PoolRegistry::RemoveStaleRegions() const {
  if (!shm_dir_fd_.ok()) return 0;
  const DirFd& shm_dir = **shm_dir_fd_;
  // A description of its own for the listing (readdir moves its offset).
  absl::StatusOr<UniqueFd> listing = shm_dir.OpenBeneath(".", O_RDONLY | O_DIRECTORY);
  if (!listing.ok()) return 0;
  DIR* dir = ::fdopendir(listing->get());
  if (dir == nullptr) return 0;
  listing->Release();  // closedir closes it
  int removed = 0;
  while (dirent* entry = ::readdir(dir)) {
    const std::string file = entry->d_name;
    // kvhost.<pid>.<hex>.<pool>.<region>, or kvhost.<pid>.<pool>.<region>
    // from daemons before the random part: only the pid counts here.
    std::vector<std::string> parts = absl::StrSplit(file, absl::MaxSplits('.', 2));
    int pid = 0;
    if (parts.size() != 3 || parts[0] != "kvhost" || !absl::SimpleAtoi(parts[1], &pid) ||
        pid <= 0) {
      continue;
    }
    // A live daemon holds a lock on each of its files; that is what counts,
    // since a pid means nothing across pid namespaces (daemons in containers
    // sharing /dev/shm). A file named with this process's pid is a
    // predecessor's (in a container kvhostd is always pid 1). A file of
    // another running pid without a lock is kept, in case an older kvhostd
    // that took no locks still uses it.
    if (IsRegionFileHeld(shm_dir, file)) continue;
    if (pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM)) continue;
    // unlinkat removes the name itself: a symbolic link goes, not its target.
    if (::unlinkat(shm_dir.fd(), file.c_str(), 0) == 0) {
      spdlog::warn("removed stale region {} left by kvhostd pid {}",
                   EscapedPath(shm_dir.Join(file)), pid);
      ++removed;
    }
  }
  ::closedir(dir);
  return removed;
}

}  // namespace kvhost
