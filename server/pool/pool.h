// Pool: one host index space of token slots with its memory, layout and
// allocator (the seeds' HostKVCache).
//
// The bytes live in shared-memory regions (one file per distinct component
// suffix, none for LOGICAL) created with the pool and removed with it;
// `components()` say where each buffer's rows lie. `layout()` is the single
// region's math of MHA, MLA and K_ONLY pools (and only the index space of the
// other kinds). A follower (spec.follows) shares the page space and allocator
// of the pool it follows, and that pool cannot be deleted while it exists.
// The pool counts the device attachments that use it, and the TP ranks they
// serve, so it is never deleted under a transfer.
//
// Thread safety: all methods may be called concurrently. Spec, layout,
// components and regions are fixed at creation; the allocator carries its own
// lock; attachments and followers are guarded by the pool's mutex. Page reads
// and writes are not serialised against transfers of the same page.
//
// Ownership (ClaimPool): a pool's allocation belongs to one sglang instance
// at a time, recorded as its holder (instance id, generation, the worker
// session that claimed it). A claim while no live session holds the pool
// takes it over: generation + 1 and every allocated slot freed in the same
// step. While the holder's session is open, every change of its slots or
// pages from any other session is refused (ChangeAllocation): Alloc, Free,
// AllocBatch, AllocBackup, a Backup into it, SetFromFlatDataPage,
// WritePages and an L3 fetch into it. The session's end releases the
// pool without freeing anything; liveness is asked of the caller's
// SessionOpen each time, so nothing has to tell the pool a session ended.
//
// Lifetime: the registry retires a pool on DeletePool (retired() turns true,
// the region files go) but its memory stays mapped until the last reference
// (a page stream, a transfer) drops it; OnUnmapped tells the registry when.
#ifndef KVHOST_SERVER_POOL_POOL_H_
#define KVHOST_SERVER_POOL_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvhost/layout.h"
#include "server/pool/allocator.h"
#include "server/pool/pool_spec.h"
#include "server/pool/releaser.h"
#include "server/pool/shm_region.h"

namespace kvhost {

// A byte range of one of a pool's regions (Pool::region_paths()).
struct RegionRange {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One part of the seeds' dummy flat page (kvhost.v1.PageShape.Part).
struct PagePart {
  std::string component;
  std::vector<uint64_t> dims;
  DType dtype = DType::kUint8;
  uint64_t bytes = 0;
};

// PagePart::dims has at most this many values (PAGE_UNIFIED MHA's
// (G, L, 2, ps, H / G, D)).
inline constexpr size_t kMaxPagePartDims = 6;

// The seeds' is_stride_page_aligned (kvhost.v1.StrideAlignment).
struct StrideCheck {
  bool aligned = false;
  std::vector<uint64_t> page_strides;  // per component
};

// One layer's contiguous range of one component (kvhost.v1.ContiguousBufferInfo).
struct BufferInfo {
  std::string component;
  uint32_t layer = 0;
  RegionRange range;
  uint64_t item_bytes = 0;
};

// Pool::StrideAlignment's alignment when none is given: a host page.
inline constexpr uint64_t kDefaultStrideAlignment = 4096;

// The sglang instance that owns a pool's allocation (kvhost.v1.PoolHolder).
struct PoolHolder {
  std::string instance_id;  // "" before the first claim
  uint64_t generation = 0;  // takeovers so far
  // The claiming worker session: a capability, never shown to anyone.
  std::string session_id;
};

// What Pool::Claim did (kvhost.v1.PoolClaim).
struct PoolClaimResult {
  uint64_t generation = 0;
  uint64_t reclaimed_tokens = 0;
  bool renewed = false;
};

// Whether a worker session is open now (TransferManager::IsSessionOpen).
using SessionOpen = std::function<bool(const std::string& session_id)>;

// Where and how a pool's region files are made.
struct RegionFiles {
  std::shared_ptr<const DirFd> dir;
  // Each file is named name_prefix + 16 random hex digits + "." + pool name
  // + region suffix ("kvhost.<pid>.<hex>.llama.kv"): the random part keeps
  // anyone who may write `dir` from creating (squatting) a future pool's file
  // name. Without random_names: name_prefix + pool name + suffix.
  std::string name_prefix;
  bool random_names = true;
  RegionFileOptions file;
  // Where the pool is destroyed (its regions unmapped, its files removed)
  // when its last reference drops; null: on the dropping thread.
  std::shared_ptr<Releaser> releaser;
};

class Pool {
 public:
  // Creates the pool's region files as `files` says and maps them. REQUIRES:
  // ValidateSpec(spec).ok(), size_tokens a positive multiple of
  // spec.page_size. A name taken already (by anyone) is tried again with new
  // random digits a few times; the pool's name is never the problem, so that
  // is never ALREADY_EXISTS.
  // A follower is given the pool it follows (`follows`, whose size_tokens and
  // page_size it has); others get null.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const std::string& name, const PoolSpec& spec,
                                                      uint64_t size_tokens,
                                                      const RegionFiles& files,
                                                      std::shared_ptr<Pool> follows = nullptr);
  // For tests and tools: files named `region_prefix` + pool name + suffix
  // ("<dir>/x."), no random part, mode 0600, the directory opened by name.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const std::string& name, const PoolSpec& spec,
                                                      uint64_t size_tokens,
                                                      const std::string& region_prefix,
                                                      std::shared_ptr<Pool> follows = nullptr);

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const std::string& name() const { return name_; }
  // "pool 'x' (MHA/PAGE_FIRST)" for messages.
  std::string Label() const;
  const PoolSpec& spec() const { return spec_; }
  const KvLayout& layout() const { return layout_; }
  uint64_t size_tokens() const { return layout_.tokens; }
  uint64_t page_num() const { return layout_.page_num(); }
  uint64_t page_size() const { return layout_.page_size; }
  // Host bytes of all regions together.
  uint64_t bytes() const { return bytes_; }
  // Host bytes of one page over all layers and components (the flat page).
  uint64_t bytes_per_page() const { return BytesPerPage(spec_); }
  // Region 0's first byte (MHA, MLA, K_ONLY: the layout() buffer); null for
  // LOGICAL, which has no region.
  uint8_t* base() const { return regions_.empty() ? nullptr : regions_[0]->data(); }
  std::vector<std::string> region_paths() const;
  size_t region_count() const { return regions_.size(); }
  uint8_t* region_base(size_t r) const { return regions_[r]->data(); }
  uint64_t region_bytes(size_t r) const { return regions_[r]->size(); }
  // A new read-write descriptor of region r's file (ShmRegion::Reopen), for
  // a worker that maps the pool itself (worker copies).
  absl::StatusOr<UniqueFd> OpenRegion(size_t r) const { return regions_[r]->Reopen(); }
  // The allocator of allocator_owner(): a follower's slots are the followed
  // pool's.
  PageAllocator& allocator() { return allocator_owner()->allocator_; }
  const PageAllocator& allocator() const { return allocator_owner()->allocator_; }

  // The host buffers in flat-page / metadata order (empty for LOGICAL).
  const std::vector<Component>& components() const { return components_; }
  // Host address of byte 0 of component i's layout.
  uint8_t* component_base(size_t i) const {
    return regions_[components_[i].region]->data() + components_[i].region_offset;
  }
  // Device layers held: [start_layer(), end_layer()); host layer = device
  // layer - start_layer().
  uint32_t start_layer() const { return spec_.start_layer; }
  uint32_t end_layer() const { return spec_.start_layer + spec_.layer_num; }
  // Transfers and page calls must cover whole pages (a page-row component,
  // or a kind that requires it).
  bool whole_pages() const { return whole_pages_; }
  // The pool whose page space and allocator this one shares (spec.follows),
  // or null. Host slots of a transfer must be allocated in
  // allocator_owner()->allocator().
  const std::shared_ptr<Pool>& follows() const { return follows_; }
  Pool* allocator_owner() { return follows_ ? follows_->allocator_owner() : this; }
  const Pool* allocator_owner() const { return follows_ ? follows_->allocator_owner() : this; }

  // Names of the pools that follow this one, by name.
  std::vector<std::string> followers() const;
  // Registry bookkeeping: FAILED_PRECONDITION once the pool is being deleted.
  absl::Status AddFollower(const std::string& name);
  void RemoveFollower(const std::string& name);
  // The pool group this pool is an entry of, or "" (kvhost.v1.Pool.group).
  std::string group() const;
  // Registry bookkeeping: FAILED_PRECONDITION naming the group when the pool
  // is in one already, or once it is being deleted.
  absl::Status JoinGroup(const std::string& group);
  void LeaveGroup();

  // Alloc / Free in token slots, with messages naming the pool.
  // FAILED_PRECONDITION on a follower (it has no allocator of its own).
  absl::StatusOr<std::vector<uint64_t>> AllocPages(uint64_t num_tokens);
  absl::StatusOr<uint64_t> Free(absl::Span<const int64_t> slots);

  // Ownership (see the header). Claim: `session_id` (open, the caller's)
  // claims the pool for `instance_id` (REQUIRES: validated by the caller).
  // FAILED_PRECONDITION on a follower, and when a live session other than
  // `session_id` holds the pool, or `session_id` holds it for another
  // instance (naming the holder's instance id and generation); renewed when
  // `session_id` holds it for `instance_id`; otherwise the takeover, unless
  // jobs use the slots (UseSlots): UNAVAILABLE naming their count. A
  // failed claim changes nothing. Transfers submitted after the takeover
  // are not checked against it (only the holder's AllocBackup is).
  absl::StatusOr<PoolClaimResult> Claim(const std::string& instance_id,
                                        const std::string& session_id, const SessionOpen& open);
  // Runs `change` (an Alloc or Free of the allocator owner's slots, a write
  // of its pages, or the check before a job that writes them later) unless
  // a live session not among `sessions` holds the allocator owner:
  // FAILED_PRECONDITION naming `what`, the pool and the holder then, and
  // `change` does not run. No Claim interleaves with `change`. `change` may
  // call this again (AllocBackup's submitted backup checks too): the same
  // pool's check then runs under the lock this thread holds already.
  absl::Status ChangeAllocation(absl::Span<const std::string> sessions, const SessionOpen& open,
                                const char* what, absl::FunctionRef<absl::Status()> change);
  // The allocator owner's holder now (its session may have ended: ask
  // SessionOpen).
  PoolHolder holder() const;
  // A job that reads or writes slots outside a call (a transfer, an L3
  // job) holds this while it runs: a claim frees no slot such a job uses.
  std::shared_ptr<void> UseSlots();

  // The seeds' get_page_buffer_meta: region ranges of whole pages, in the
  // seeds' order (see PageBufferMeta in proto/kvhost/v1/pool.proto).
  absl::StatusOr<std::vector<RegionRange>> PageBufferMeta(absl::Span<const int64_t> slots) const;

  // Reply bounds, from the pool's shape alone, so a caller can refuse a
  // reply before building it: at least as many entries as PageBufferMeta /
  // SplitHeadsMeta return for `slots` slot indices (whatever they are), and
  // exactly as many as ContiguousBufferInfos returns.
  uint64_t PageBufferMetaEntries(uint64_t slots) const;
  uint64_t SplitHeadsMetaEntries(uint64_t slots, uint32_t split_factor) const;
  uint64_t ContiguousBufferInfoEntries() const;

  // Page APIs (the seeds' get_data_page / set_from_flat_data_page and
  // friends); see the RPCs of the same names in proto/kvhost/v1/pool.proto
  // for the byte order and the errors. `first_slot` is a page start.
  // Validation only (no bytes touched): INVALID_ARGUMENT / FAILED_PRECONDITION
  // as GetDataPage.
  absl::Status CheckPage(int64_t first_slot) const;
  uint64_t flat_page_bytes() const;
  // Copies the flat page into / out of `out` / `data` (flat_page_bytes()).
  absl::Status ReadPage(int64_t first_slot, absl::Span<uint8_t> out) const;
  absl::Status WritePage(int64_t first_slot, absl::Span<const uint8_t> data);
  // Bytes [offset, offset + size) of the flat page, copied straight between
  // the regions and `out` / `data` (one chunk of a page stream: no page
  // buffer). INVALID_ARGUMENT when the range passes the page's end; other
  // errors as CheckPage. A page read in ranges is consistent per range only.
  absl::Status ReadPageRange(int64_t first_slot, uint64_t offset, absl::Span<uint8_t> out) const;
  absl::Status WritePageRange(int64_t first_slot, uint64_t offset, absl::Span<const uint8_t> data);
  absl::StatusOr<std::vector<PagePart>> PageShape() const;
  absl::StatusOr<std::vector<RegionRange>> SplitHeadsMeta(absl::Span<const int64_t> slots,
                                                          uint32_t split_factor) const;
  // `alignment` 0 means kDefaultStrideAlignment.
  absl::StatusOr<StrideCheck> StrideAlignment(uint64_t alignment) const;
  absl::StatusOr<std::vector<BufferInfo>> ContiguousBufferInfos() const;

  // Attachment accounting. AcquireAttachment fails with FAILED_PRECONDITION
  // once the pool is being deleted, and, for a kind that is not replicated
  // (IsReplicated), when another TP rank is attached already (no tp_rank
  // counts as rank 0). ReleaseAttachment takes the rank it was acquired with.
  // TryRetire succeeds only with no attachments, no followers and no group
  // (FAILED_PRECONDITION naming them), makes every
  // later AcquireAttachment fail and removes the region files (jobs in
  // flight keep their mappings).
  absl::Status AcquireAttachment(std::optional<uint32_t> tp_rank = std::nullopt);
  void ReleaseAttachment(std::optional<uint32_t> tp_rank = std::nullopt);
  uint32_t attachments() const;
  // Distinct TP ranks attached now, and for replicated kinds the bytes one
  // shared pool saves over a pool per rank (bytes() x (ranks - 1); else 0).
  uint32_t replica_ranks() const;
  uint64_t bytes_saved() const;
  absl::Status TryRetire();
  // Whether TryRetire succeeded: the pool is deleted and what is written to
  // it now is lost (page streams end with an error when they see it).
  bool retired() const;
  // Registry bookkeeping: `fn` runs once, after the pool's regions are
  // unmapped (when the last reference is dropped). REQUIRES: called once,
  // after TryRetire succeeded, before the caller drops its reference.
  void OnUnmapped(std::function<void()> fn) { unmapped_.fn = std::move(fn); }

  // Owner token (kvhost.v1.CreatePoolRequest.owner_token). SetOwnerToken is
  // the registry's, before the pool is published; the token is never read
  // back, only compared. OwnerTokenMatches takes time that depends only on
  // `given`'s length, not on where it differs from the owner's (SecretEquals,
  // common/constant_time.h).
  // A follower has no token of its own: it is protected by the token of
  // the pool it follows (token_owner()), whose slots it shares, so
  // owner_protected() is that pool's and the token to check is compared
  // with token_owner().OwnerTokenMatches: CheckPoolOwner
  // (server/access/caller.h) does, the one caller.
  // REQUIRES: SetOwnerToken before any other thread sees the pool; not on a
  // follower.
  void SetOwnerToken(std::string token) { owner_token_ = std::move(token); }
  const Pool& token_owner() const { return follows_ ? follows_->token_owner() : *this; }
  bool owner_protected() const { return !token_owner().owner_token_.empty(); }
  bool OwnerTokenMatches(absl::string_view given) const;

 private:
  Pool(std::string name, const PoolSpec& spec, uint64_t size_tokens,
       std::vector<Component> components, std::vector<std::unique_ptr<ShmRegion>> regions,
       std::shared_ptr<Pool> follows);

  // Region range of component c's bytes of the page starting at
  // `first_slot`: of layer `layer` (LAYER_FIRST), or of all layers.
  RegionRange PageMetaRange(const Component& c, uint64_t first_slot, uint64_t layer) const;
  // A PAGE_UNIFIED pool with buffers (not LOGICAL): a page is one block of
  // every component, planes interleaved.
  bool PageIsOneBlock() const { return layout_.MetaPerHeadGroup() && !components_.empty(); }
  // REQUIRES: PageIsOneBlock(). The region range of the whole page starting
  // at `first_slot`, every head group, layer and plane.
  RegionRange PageBlockRange(uint64_t first_slot) const;
  // Calls fn(range) for each range of the page starting at `first_slot` in
  // flat-page order, until fn returns false.
  template <typename Fn>
  void ForEachFlatRange(uint64_t first_slot, Fn&& fn) const;
  // Calls fn(region bytes, offset in the range, n) for the pieces of flat-page
  // bytes [offset, offset + length), in order. REQUIRES: in the page.
  template <typename Fn>
  void ForEachFlatPiece(uint64_t first_slot, uint64_t offset, uint64_t length, Fn&& fn) const;
  // Checks `first_slot` (CheckPage) and that [offset, offset + length) lies
  // in the flat page.
  absl::Status CheckPageRange(int64_t first_slot, uint64_t offset, uint64_t length,
                              const char* what) const;
  // PageBufferMeta's / SplitHeadsMeta's entries per page (the builders use
  // them too, so the bounds cannot drift from what is built).
  uint64_t MetaRangesPerPage() const;
  uint64_t SplitRangesPerPage(uint32_t split_factor) const;
  // Pages that `slots` slot indices can name at most.
  uint64_t PagesOf(uint64_t slots) const;

  // Runs its function when destroyed. The first member, so it is destroyed
  // last: after regions_ is unmapped.
  struct UnmapNotice {
    std::function<void()> fn;
    UnmapNotice() = default;
    UnmapNotice(const UnmapNotice&) = delete;
    UnmapNotice& operator=(const UnmapNotice&) = delete;
    ~UnmapNotice() {
      if (fn) fn();
    }
  };
  // The page starts of whole-page slot lists (ParsePages with this pool's
  // messages).
  absl::StatusOr<std::vector<uint64_t>> Pages(absl::Span<const int64_t> slots) const;

  UnmapNotice unmapped_;
  const std::string name_;
  const PoolSpec spec_;
  const KvLayout layout_;
  const std::vector<std::unique_ptr<ShmRegion>> regions_;
  const std::vector<Component> components_;
  const bool whole_pages_;
  const std::shared_ptr<Pool> follows_;
  const uint64_t bytes_;
  PageAllocator allocator_;  // unused on a follower (allocator() is the owner's)
  std::string owner_token_;  // "" = not protected; fixed once published
  // Ownership, on the allocator owner only. Taken before the allocator's
  // lock: shared by ChangeAllocation, exclusive by Claim.
  mutable absl::Mutex holder_mu_;
  PoolHolder holder_ ABSL_GUARDED_BY(holder_mu_);
  // Jobs holding UseSlots() now. Each hold keeps the counter itself, so it
  // may be dropped after the pool.
  const std::shared_ptr<std::atomic<uint64_t>> slot_users_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  mutable absl::Mutex mu_;
  uint32_t attachments_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint32_t, uint32_t> ranks_ ABSL_GUARDED_BY(mu_);  // tp_rank -> attachments
  std::vector<std::string> followers_ ABSL_GUARDED_BY(mu_);
  std::string group_ ABSL_GUARDED_BY(mu_);
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
};

// Prefixes a status message with "pool 'name': ", keeping the code.
absl::Status WithPool(const std::string& pool, const absl::Status& status);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POOL_H_
