// kvhost::Client: the C++ client of kvhostd, for schedulers (pools, alloc,
// free, page metadata) and workers (attach, backup, load, wait).
//
// Every call is a blocking gRPC call with a deadline (ClientOptions::timeout
// unless the call takes its own) and returns absl::Status / absl::StatusOr
// with the daemon's canonical code and message; nothing throws. A Client is
// cheap to share: all methods are thread-safe and reuse one channel.
//
// ShmDevicePool is the host backend's stand-in for a GPU worker's device KV
// pool: per-layer row buffers in a shared-memory file that kvhostd maps.
//
//   kvhost::ClientOptions options;  // address defaults to kDefaultAddress
//   auto client = kvhost::Client::Connect(options);
//   auto pool = (*client)->CreatePool("llama", spec);
//   auto slots = (*client)->Alloc("llama", 64);
#ifndef KVHOST_CLIENT_CLIENT_H_
#define KVHOST_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/defaults.h"
#include "kvhost/v1/cache.grpc.pb.h"
#include "kvhost/v1/daemon.grpc.pb.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "kvhost/v1/storage.grpc.pb.h"
#include "kvhost/v1/transfer.grpc.pb.h"

namespace grpc {
class Channel;
}

namespace kvhost {

// Descriptors per deposit on the handoff socket (kvhost/defaults.h).
inline constexpr size_t kMaxDepositDescriptors = KVHOST_MAX_DEPOSIT_DESCRIPTORS;

// The daemon's default address.
inline constexpr char kDefaultAddress[] = KVHOST_DEFAULT_ADDRESS;

struct ClientOptions {
  // "unix:///path.sock" or "host:port".
  std::string address = kDefaultAddress;
  // Deadline of each call unless the call gives its own.
  absl::Duration timeout = absl::Seconds(30);
  // Largest message either way (Alloc of many tokens returns many indices).
  int max_message_bytes = 64 << 20;

  // --- Access control (docs/RELIABILITY.md) ---
  // Sent as gRPC metadata `kvhost-token` on every call when not empty: the
  // owner token of the pools this client creates and changes
  // (CreatePoolRequest.owner_token is set from it too).
  std::string owner_token;
  // TCP addresses: TLS unless `insecure` is set. PEM files: the CA that
  // signed the daemon's certificate (empty: the system roots), and this
  // client's certificate and key for a daemon that requires client
  // certificates (--tls-client-ca). `tls_server_name` overrides the name
  // checked against the daemon's certificate (default: the address's host).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Plaintext TCP, for a daemon started with --insecure-tcp. Unix sockets
  // are always plaintext (their file mode and group are the control).
  bool insecure = false;

  // --- Worker session (DaemonService.OpenSession) ---
  // AttachDevice opens the client's session first (once; it is kept open
  // and reconnected by a background thread for the client's lifetime) and
  // attaches within it, so a worker that dies has its attachments closed by
  // the daemon within --session-timeout. False: attachments without a
  // session (tools such as kvhostctl), which live until DetachDevice.
  // Every TransferService call carries the client's session ids in gRPC
  // metadata `kvhost-session` (the daemon serves a session's attachments and
  // tickets to no one else): the open session's, the last few it held
  // before, and any a caller put in AttachDeviceRequest.session_id itself.
  bool worker_session = true;
  // Worker name for the daemon's logs and status; default "<host>:<pid>".
  std::string worker_name;
  // Most time between reconnection attempts after the daemon went away;
  // attempts start at 50 ms and double up to this.
  absl::Duration reconnect_max_backoff = absl::Seconds(5);

  // --- Fast path (proto/kvhost/v1/fast_path.proto) ---
  // Alloc, Free, AllocBatch, SubmitBackup / SubmitLoad (and Backup / Load
  // without a wait), AllocBackup, WaitTransfer, PollTransfer, CacheLookup,
  // CacheStore and CacheRestore go through a shared-memory mailbox kvhostd
  // serves beside gRPC, when the address is
  // a unix socket and the daemon offers one: the same validation, codes
  // and messages, without gRPC's per-call cost. One mailbox per Client: a
  // call made while another thread's call holds it goes over gRPC, so give
  // each hot thread its own Client. A request larger than the mailbox
  // (about 1 MiB) goes over gRPC too. Opened at the first such call;
  // when it cannot be (the daemon refuses, or is too old), gRPC serves and
  // it is tried again 5 s later. False: gRPC only.
  bool fast_path = true;
  // The handoff socket as this process sees it, where the mailbox is asked
  // for; "" = the path kvhostd reports (DaemonStatus.handoff_socket). Set
  // it where the client sees the daemon's files at another path (a sidecar
  // mounting the socket directory elsewhere).
  std::string handoff_socket;
};

// What a worker lost when its session broke and was opened again
// (Client::session_losses, ClientOptions-independent): the daemon
// restarted (its instance changed) or only the connection broke (the same
// daemon closed the session's attachments after --session-timeout).
struct SessionLoss {
  absl::Time when;
  bool daemon_restarted = false;
  std::string old_instance;
  std::string new_instance;
  // Attachment ids the session owned; all are gone and must be attached
  // again (with their new ids).
  std::vector<std::string> attachments;
  // Of the pools those attachments were on: the ones that no longer exist,
  // and the ones that exist again but empty (declared in the daemon's
  // config, so recreated at its start; every slot free, no data).
  std::vector<std::string> pools_gone;
  std::vector<std::string> pools_recreated_empty;
  // One line for logs saying all of the above.
  std::string Describe() const;
};

// The client's session as it stands (Client::session_state).
struct SessionState {
  bool open = false;       // a session stream is up now
  std::string session_id;  // "" until the first open
  std::string daemon_instance;
  uint64_t reconnects = 0;  // sessions opened after the first
};

// A load's ticket and the load event set it records (cuda backend; see
// Attachment.load_event_handles), -1 where there is none to wait on; on an
// attachment with layer_progress, the load's base in that set's layer
// counter (TransferTicket.layer_base; kvhost/layer_progress.h). A backup's
// (BackupWithEvents) is the same: with layer_progress it records a set too,
// and a wait on its last layer waits for the whole backup.
struct LoadTicket {
  uint64_t ticket_id = 0;
  int32_t event_set = -1;
  uint64_t layer_base = 0;
};

class Client {
 public:
  // Creates the channel; connecting happens on the first call (or WaitForReady).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Waits until the daemon answers a health check with SERVING.
  absl::Status WaitForReady(absl::Duration timeout);
  // grpc.health.v1 status of `service` ("" = the whole server): "SERVING", ...
  absl::StatusOr<std::string> Health(const std::string& service = "");

  // DaemonService: engine, memory budget, attachments, ticket counters.
  absl::StatusOr<v1::DaemonStatus> GetStatus();

  // PoolService.
  absl::StatusOr<v1::Pool> CreatePool(const std::string& name, const v1::PoolSpec& spec);
  absl::StatusOr<v1::Pool> GetPool(const std::string& name);
  absl::StatusOr<std::vector<v1::Pool>> ListPools();
  // Returns the bytes released.
  absl::StatusOr<uint64_t> DeletePool(const std::string& name);
  absl::StatusOr<std::vector<int64_t>> Alloc(const std::string& pool, uint64_t num_tokens);
  // Returns the slots freed.
  absl::StatusOr<uint64_t> Free(const std::string& pool, absl::Span<const int64_t> indices);
  // Several allocations in one call, all or nothing: one index run per
  // entry of `num_tokens`, in order (PoolService.AllocBatch).
  absl::StatusOr<std::vector<std::vector<int64_t>>> AllocBatch(
      const std::string& pool, absl::Span<const uint64_t> num_tokens);
  absl::StatusOr<v1::PageBufferMeta> GetPageBufferMeta(const std::string& pool,
                                                       absl::Span<const int64_t> indices);
  // Page APIs. `index` / `indices` are first slots of pages. A flat page is
  // the seeds' get_data_page(flat=True) bytes (kvhost.v1.PageData).
  absl::StatusOr<std::string> GetDataPage(const std::string& pool, int64_t index);
  absl::Status SetFromFlatDataPage(const std::string& pool, int64_t index, absl::string_view data);
  // Streams the pages in chunks of at most `chunk_bytes` (0: the daemon's
  // default) and returns them whole, in the order of `indices`.
  absl::StatusOr<std::vector<std::string>> ReadPages(const std::string& pool,
                                                     absl::Span<const int64_t> indices,
                                                     uint32_t chunk_bytes = 0);
  // Streams pages[i] to page indices[i] in chunks of at most `chunk_bytes`
  // (0: 4 MiB). Returns the pages written; on an error the pages before the
  // failing one stay written and the message says how many.
  absl::StatusOr<uint64_t> WritePages(const std::string& pool, absl::Span<const int64_t> indices,
                                      absl::Span<const std::string> pages,
                                      uint32_t chunk_bytes = 0);
  absl::StatusOr<v1::PageShape> GetPageShape(const std::string& pool);
  absl::StatusOr<v1::PageBufferMeta> GetSplitHeadsPageBufferMeta(const std::string& pool,
                                                                 absl::Span<const int64_t> indices,
                                                                 uint32_t split_factor);
  // `alignment` 0 means 4096.
  absl::StatusOr<v1::StrideAlignment> IsStridePageAligned(const std::string& pool,
                                                          uint64_t alignment = 0);
  absl::StatusOr<v1::ContiguousBufferInfos> GetContiguousBufferInfos(const std::string& pool);
  // Makes sglang instance `instance_id` the pool's one owner
  // (PoolService.ClaimPool) within this client's worker session, which it
  // opens first (FAILED_PRECONDITION without options().worker_session).
  // Another live owner is FAILED_PRECONDITION; a takeover frees the
  // previous owner's slots (PoolClaim.reclaimed_tokens).
  absl::StatusOr<v1::PoolClaim> ClaimPool(const std::string& pool, const std::string& instance_id);
  // Pool groups (kvhost.v1.PoolGroup): pools a worker moves together, e.g. a
  // hybrid model's attention KV pool and its Mamba state pool. Alloc, Free
  // and the page calls above take a group's name for its anchor pool.
  absl::StatusOr<v1::PoolGroup> CreatePoolGroup(const std::string& name, uint32_t layer_num,
                                                const std::vector<v1::PoolEntry>& entries);
  absl::StatusOr<v1::PoolGroup> GetPoolGroup(const std::string& name);
  absl::StatusOr<std::vector<v1::PoolGroup>> ListPoolGroups();
  absl::Status DeletePoolGroup(const std::string& name);

  // StorageService: the L3 tier (kvhostd --l3-memcached). Pages of a pool
  // stored under keys (one per index), fetched back into allocated pages
  // with a result per page (a miss is a result, not an error), and the
  // longest stored prefix of a key list.
  absl::StatusOr<v1::StorePagesResponse> StorePages(const std::string& pool,
                                                    absl::Span<const int64_t> indices,
                                                    const std::vector<std::string>& keys);
  absl::StatusOr<v1::FetchPagesResponse> FetchPages(const std::string& pool,
                                                    const std::vector<std::string>& keys,
                                                    absl::Span<const int64_t> indices);
  // Looks in `pool`'s namespace (its owner token's, or the public one).
  absl::StatusOr<uint64_t> ExistPages(const std::string& pool,
                                      const std::vector<std::string>& keys);
  // Detached StorePages / FetchPages: return the ticket at once;
  // WaitStorage(pool, ticket) returns the results (StorageTicketStatus's
  // store or fetch), again if asked again; with `poll` it returns
  // done = false while the pages are in flight.
  absl::StatusOr<uint64_t> StartStorePages(const std::string& pool,
                                           absl::Span<const int64_t> indices,
                                           const std::vector<std::string>& keys);
  absl::StatusOr<uint64_t> StartFetchPages(const std::string& pool,
                                           const std::vector<std::string>& keys,
                                           absl::Span<const int64_t> indices);
  absl::StatusOr<v1::StorageTicketStatus> WaitStorage(const std::string& pool, uint64_t ticket,
                                                      bool poll = false);

  // CacheService: the node cache (kvhost/v1/cache.proto), a pool created
  // with PoolSpec.node_cache whose pages are addressed by key (an engine's
  // block hash, 1 to 256 bytes; at most 4096 keys a call). Every call
  // presents options().owner_token, which the cache's token must match; a
  // pinning lookup, a store and a restore are made within this client's
  // worker session (opened first; FAILED_PRECONDITION without
  // options().worker_session), so that its pins and its stores in flight end
  // with it. `device_indices` holds page_size device rows per key, of
  // `attachment_id` (AttachDevice of the cache's pool); WaitTransfer waits
  // for a store's or a restore's ticket like any other.
  //
  // Which keys are present and the present prefix's length; with `pin`, the
  // prefix is pinned (CacheLookupReply.pin_id) until CacheReleasePin or the
  // session's end. With `fetch_missing`, the absent keys from the first on
  // are fetched from kvhostd's L3 tier (they read PENDING, then PRESENT or
  // ABSENT; CacheLookupRequest.fetch_missing).
  absl::StatusOr<v1::CacheLookupReply> CacheLookup(const std::string& cache,
                                                   const std::vector<std::string>& keys,
                                                   bool pin = false, bool fetch_missing = false);
  // Backs up the keys not present yet; they become present when the ticket
  // (CacheStoreReply.ticket, unset when every key was skipped) ends well.
  // `ready_event_handle` as Backup's wait_event_handle. With
  // `write_through`, each published key is then stored to kvhostd's L3 tier
  // (CacheStoreRequest.write_through).
  absl::StatusOr<v1::CacheStoreReply> CacheStore(const std::string& cache,
                                                 const std::string& attachment_id,
                                                 const std::vector<std::string>& keys,
                                                 absl::Span<const int64_t> device_indices,
                                                 const std::string& ready_event_handle = "",
                                                 bool write_through = false);
  // Loads every key's page (all must be present) into the device rows.
  absl::StatusOr<v1::TransferTicket> CacheRestore(const std::string& cache,
                                                  const std::string& attachment_id,
                                                  const std::vector<std::string>& keys,
                                                  absl::Span<const int64_t> device_indices,
                                                  const std::string& wait_event_handle = "");
  // CacheStore and CacheRestore with an index-addressed pool's slots as the
  // source / destination instead of an attachment (CachePoolSlots): copied
  // inside kvhostd, host memory to host memory, on either backend.
  // `host_indices`: page_size slots per key, whole allocated pages of `pool`.
  absl::StatusOr<v1::CacheStoreReply> CacheStoreFromPool(const std::string& cache,
                                                         const std::string& pool,
                                                         const std::vector<std::string>& keys,
                                                         absl::Span<const int64_t> host_indices,
                                                         bool write_through = false);
  absl::StatusOr<v1::TransferTicket> CacheRestoreToPool(const std::string& cache,
                                                        const std::string& pool,
                                                        const std::vector<std::string>& keys,
                                                        absl::Span<const int64_t> host_indices);
  absl::Status CacheReleasePin(const std::string& cache, uint64_t pin_id);
  absl::StatusOr<v1::CacheEvictReply> CacheEvict(const std::string& cache,
                                                 const std::vector<std::string>& keys);
  absl::StatusOr<v1::CacheStats> GetCacheStats(const std::string& cache);
  // Stored and evicted keys after `after_seq` (at most `max_events`, 0: the
  // daemon's bound); resume with the batch's next_after.
  absl::StatusOr<v1::CacheEventBatch> ReadCacheEvents(const std::string& cache,
                                                      uint64_t after_seq = 0,
                                                      uint32_t max_events = 0);

  // TransferService.
  absl::StatusOr<v1::Attachment> AttachDevice(const v1::AttachDeviceRequest& request);
  absl::Status DetachDevice(const std::string& attachment_id);
  // Return the ticket id.
  absl::StatusOr<uint64_t> Backup(const std::string& attachment_id,
                                  absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices);
  // A backup whose copies wait for the worker's event first (cuda backend;
  // `wait_event_handle` from ExportEvent in kvhost/cuda_export.h, recorded
  // after the rows were written). FAILED_PRECONDITION on the host backend.
  absl::StatusOr<uint64_t> Backup(const std::string& attachment_id,
                                  absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices,
                                  const std::string& wait_event_handle);
  absl::StatusOr<uint64_t> Load(const std::string& attachment_id,
                                absl::Span<const int64_t> host_indices,
                                absl::Span<const int64_t> device_indices);
  // Load, also returning the event set to wait on per layer (LoadEvents).
  // RESOURCE_EXHAUSTED while every set of the attachment is busy.
  absl::StatusOr<LoadTicket> LoadWithEvents(const std::string& attachment_id,
                                            absl::Span<const int64_t> host_indices,
                                            absl::Span<const int64_t> device_indices);
  // Backup, also returning the event set it records, as LoadWithEvents: on
  // an attachment with layer_progress, LoadEvents::WaitLayer(ticket,
  // last layer, stream) makes `stream` wait for the backup's copies (cuda
  // backend) with no host wait for them; event_set -1 without
  // layer_progress. RESOURCE_EXHAUSTED while every set is busy.
  // `pool_transfers` and `wait_event_handle` as Backup's.
  absl::StatusOr<LoadTicket> BackupWithEvents(const std::string& attachment_id,
                                              absl::Span<const int64_t> host_indices,
                                              absl::Span<const int64_t> device_indices,
                                              absl::Span<const v1::PoolTransfer> pool_transfers,
                                              const std::string& wait_event_handle);
  // Group attachments: host_indices / device_indices are the anchor entry's
  // rows (may be empty) and `pool_transfers` the other entries' (see
  // MakePoolTransfer); all are checked before anything is copied.
  absl::StatusOr<uint64_t> Backup(const std::string& attachment_id,
                                  absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices,
                                  absl::Span<const v1::PoolTransfer> pool_transfers,
                                  const std::string& wait_event_handle = "");
  absl::StatusOr<uint64_t> Load(const std::string& attachment_id,
                                absl::Span<const int64_t> host_indices,
                                absl::Span<const int64_t> device_indices,
                                absl::Span<const v1::PoolTransfer> pool_transfers);
  // `wait_event_handle` (cuda backend; ExportEvent's bytes, "" = none): the
  // load's copies wait for that record of the worker's event first, so a
  // load may be asked for while work it must follow (a forward pass still
  // using the destination rows) is queued ahead of it on the worker's stream.
  absl::StatusOr<LoadTicket> LoadWithEvents(const std::string& attachment_id,
                                            absl::Span<const int64_t> host_indices,
                                            absl::Span<const int64_t> device_indices,
                                            absl::Span<const v1::PoolTransfer> pool_transfers,
                                            const std::string& wait_event_handle = "");
  // Worker copies (kvhost::WorkerCopier, kvhost/worker_copy.h, uses these):
  // a Backup / Load request sent as given, and the whole ticket back (with
  // worker_copy set, its plan); FinishWorkerCopy ends such a ticket, OK
  // with an empty `error`, else failed with it.
  absl::StatusOr<v1::TransferTicket> SubmitBackup(const v1::BackupRequest& request);
  absl::StatusOr<v1::TransferTicket> SubmitLoad(const v1::LoadRequest& request);
  // Allocates host slots in the attachment's pool and backs
  // `request.backup()`'s device rows up into them (TransferService.AllocBackup):
  // the slots, the ticket and the pool's free tokens after it.
  absl::StatusOr<v1::AllocBackupResponse> AllocBackup(const v1::AllocBackupRequest& request);
  absl::Status FinishWorkerCopy(uint64_t ticket_id, const std::string& error = "");
  // Blocks until the ticket is done (its error if it failed) or `timeout`
  // passes (DEADLINE_EXCEEDED).
  absl::StatusOr<v1::TransferStatus> WaitTransfer(uint64_t ticket_id,
                                                  absl::Duration timeout = absl::Minutes(10));
  // The ticket's status now, without waiting.
  absl::StatusOr<v1::TransferStatus> PollTransfer(uint64_t ticket_id);

  // Worker session. OpenSession opens it now (AttachDevice does when
  // options().worker_session and it is not open); it blocks until the daemon
  // answered or `timeout` passed (UNAVAILABLE / DEADLINE_EXCEEDED then; a
  // background thread keeps trying). Idempotent.
  absl::Status OpenSession(absl::Duration timeout = absl::Seconds(10));
  SessionState session_state() const;
  // Every loss since the client was made, oldest first; `on_loss` (if set)
  // is called from the session thread with each one as it is found,
  // after the new session is open.
  std::vector<SessionLoss> session_losses() const;
  void OnSessionLoss(std::function<void(const SessionLoss&)> on_loss);

  // Deposits `fds` (descriptors of cuMem allocations, kvhost/cuda_export.h)
  // on the daemon's handoff socket (DaemonStatus.handoff_socket) for a
  // following AttachDevice to name (CudaFdChunk.deposit_id / index): one
  // deposit id per kMaxDepositDescriptors descriptors, in order. The
  // descriptors stay the caller's (the daemon receives copies). A deposit
  // lives until an attachment that names it is made, or expires (kvhostd
  // --help: the handoff socket). Its id is a capability: whoever holds it
  // may attach the memory, so it is shown to no one else. FAILED_PRECONDITION
  // when the daemon has no handoff socket; UNAVAILABLE when it cannot be
  // reached; RESOURCE_EXHAUSTED when the deposits would pass this client's
  // share (its session's when options().worker_session, which opens the
  // session first; else its uid's) or the daemon's bound.
  absl::StatusOr<std::vector<std::string>> DepositDescriptors(absl::Span<const int> fds);

  const ClientOptions& options() const { return options_; }
  // The session ids its TransferService calls carry (kvhost-session): what
  // a handoff request presents along with options().owner_token
  // (kvhost/layer_progress.h).
  std::vector<std::string> session_ids() const { return SessionIds(); }
  // Whether the fast-path mailbox is open now (ClientOptions::fast_path),
  // and how many calls it has served: for tests and benchmarks.
  bool fast_path_open() const;
  uint64_t fast_path_calls() const;

  ~Client();

 private:
  class SessionKeeper;
  struct FastPath;
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // Makes the call `method` of `request` on the fast path when it is on,
  // open (or opens now), free, and the request fits: then true, with the
  // call's status in `*status` and its answer in `response`. False: make
  // the call over gRPC. `transfer`: the call carries the session ids.
  // `wait`: WaitTransfer's wait (its frame's timeout_ms).
  bool TryFastPath(int method, const google::protobuf::MessageLite& request,
                   google::protobuf::MessageLite* response, bool transfer, absl::Duration timeout,
                   absl::Status* status, absl::Duration wait = absl::ZeroDuration());
  // AttachDevice's call as given (session.cc adds the session around it).
  absl::StatusOr<v1::Attachment> AttachOnce(const v1::AttachDeviceRequest& request);
  void ForgetAttachment(const std::string& attachment_id);
  // The session ids a TransferService call names (kvhost-session metadata).
  std::vector<std::string> SessionIds() const;
  // Opens the worker session for `call` (its name in the error), or
  // FAILED_PRECONDITION naming it without options().worker_session.
  absl::Status OpenWorkerSession(absl::string_view call);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DaemonService::Stub> daemon_;
  std::unique_ptr<v1::PoolService::Stub> pools_;
  std::unique_ptr<v1::TransferService::Stub> transfers_;
  std::unique_ptr<v1::StorageService::Stub> storage_;
  std::unique_ptr<v1::CacheService::Stub> cache_;
  std::unique_ptr<SessionKeeper> session_;
  std::unique_ptr<FastPath> fast_path_;
};

// How a ShmDevicePool attaches (kvhost.v1.AttachDeviceRequest fields 9, 10).
struct AttachOptions {
  // The worker's tensor-parallel rank (replicated kinds share one pool).
  std::optional<uint32_t> tp_rank;
  // Loads only: Backup on the attachment is refused.
  bool load_only = false;
  // AttachDeviceRequest.layer_progress: the worker waits on the layer
  // counters (kvhost::LayerProgress) before using a loaded layer.
  bool layer_progress = false;
};

// A device KV pool emulated in one shared-memory file (host backend): one
// buffer per component of the pool (Pool.components: K then V for MHA, the
// latent for MLA, ...) and attached layer, back to back, component-major.
// A token-row component's layer buffer has device_size_tokens rows, a
// page-row component's (row_tokens = page_size) device_size_tokens /
// page_size rows; each row is the component's row_bytes. The file is removed
// when the object is destroyed. Not thread-safe to create or destroy; the
// bytes are the caller's to synchronise with transfers (wait for the ticket).
class ShmDevicePool {
 public:
  // `pool` as CreatePool / GetPool returned it. The file is created inside
  // `shm_dir`, which must be the daemon's --shm-dir. The device layers held
  // are [start_layer, end_layer); 0 / 0 means the pool's own range.
  static absl::StatusOr<std::unique_ptr<ShmDevicePool>> Create(
      const v1::Pool& pool, uint64_t device_size_tokens, const std::string& shm_dir = "/dev/shm",
      uint32_t start_layer = 0, uint32_t end_layer = 0);
  ~ShmDevicePool();
  ShmDevicePool(const ShmDevicePool&) = delete;
  ShmDevicePool& operator=(const ShmDevicePool&) = delete;

  // Buffer of component `c` (Pool.components order) for attached layer
  // `layer` (device layer start_layer() + layer).
  uint8_t* layer(uint32_t c, uint32_t layer) const;
  uint8_t* row(uint32_t c, uint32_t l, uint64_t r) const {
    return layer(c, l) + r * buffers_[c].row_bytes;
  }
  uint32_t components() const { return static_cast<uint32_t>(buffers_.size()); }
  // Same as components() (K / V planes for MHA, one for MLA).
  uint32_t planes() const { return components(); }
  const std::string& component_name(uint32_t c) const { return buffers_[c].name; }
  // Rows of each layer buffer of component c, and their size.
  uint64_t rows(uint32_t c) const { return buffers_[c].rows; }
  uint64_t row_bytes(uint32_t c) const { return buffers_[c].row_bytes; }
  // Token slots per row of component c (1, or page_size for a page-row one).
  uint64_t row_tokens(uint32_t c) const { return buffers_[c].row_tokens; }
  // Component 0's rows (device_size_tokens) and row size.
  uint64_t rows() const { return device_size_tokens_; }
  uint64_t row_bytes() const { return buffers_.empty() ? 0 : buffers_[0].row_bytes; }
  uint32_t layers() const { return end_layer_ - start_layer_; }
  uint32_t start_layer() const { return start_layer_; }
  uint32_t end_layer() const { return end_layer_; }
  uint64_t bytes() const { return bytes_; }
  const std::string& path() const { return path_; }

  // The AttachDevice request that attaches this pool to `pool_name`: the
  // K / V / latent buffers in k_layers / v_layers (MHA, MLA, MHA_ASYMMETRIC,
  // K_ONLY, and DSA's latent), every other component in `components`.
  v1::AttachDeviceRequest MakeAttachRequest(const std::string& pool_name,
                                            const AttachOptions& options = {}) const;
  // The same buffers as group entry `entry` (AttachDeviceRequest.entries).
  v1::DeviceEntry MakeDeviceEntry(const std::string& entry) const;

 private:
  struct Buffer {
    std::string name;
    uint64_t rows = 0;
    uint64_t row_bytes = 0;
    uint64_t row_tokens = 1;
    uint64_t offset = 0;  // of its layer 0 in the file
  };

  ShmDevicePool() = default;

  std::string path_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  v1::PoolKind kind_ = v1::POOL_KIND_UNSPECIFIED;
  std::vector<Buffer> buffers_;
  uint64_t device_size_tokens_ = 0;
  uint32_t start_layer_ = 0;
  uint32_t end_layer_ = 0;
  bool explicit_range_ = false;
};

// One group entry's device pool, for MakeGroupAttachRequest.
struct GroupDevice {
  std::string entry;  // PoolEntry.name
  const ShmDevicePool* device = nullptr;
};

// The AttachDevice request that attaches the pool group `group` with one
// device pool per entry (each made with Create from that entry's Pool; its
// device layers must include every layer the entry's layer_map names).
v1::AttachDeviceRequest MakeGroupAttachRequest(const std::string& group,
                                               absl::Span<const GroupDevice> devices,
                                               const AttachOptions& options = {});

// One group entry's rows of a transfer (BackupRequest.pool_transfers).
v1::PoolTransfer MakePoolTransfer(const std::string& entry, absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices);

// Bytes of one device row (one token, one layer) of a pool's first
// component: the K row of MHA, MHA_ASYMMETRIC and K_ONLY, the latent row of
// MLA and DSA (Pool.components gives every component's row_bytes).
uint64_t DeviceRowBytes(const v1::PoolSpec& spec);
// Element size of a dtype in bytes (0 for DTYPE_UNSPECIFIED).
uint32_t DTypeBytes(v1::DType dtype);

}  // namespace kvhost

#endif  // KVHOST_CLIENT_CLIENT_H_
