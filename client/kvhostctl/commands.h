// kvhostctl's commands: the context every command handler gets, and the one
// table of commands (name, arguments, help, handler) from which main.cc
// dispatches and writes --help. A handler prints its answer (text, or one
// JSON object on one line with --json) and returns what failed; errors.h
// turns that into the exit code.
//
// Single-threaded: every daemon call is one blocking kvhost::Client call
// under --timeout. The handlers live in *_commands.cc, demo.cc and watch.cc.
#ifndef KVHOST_CLIENT_KVHOSTCTL_COMMANDS_H_
#define KVHOST_CLIENT_KVHOSTCTL_COMMANDS_H_

#include <cstddef>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvhost/client.h"

namespace kvhost::ctl {

// What the command line said beyond the flags' values (main.cc CheckFlags).
struct GivenFlags {
  // kvhostctl's own flags given on the command line, underscored names.
  std::set<std::string> names;
  // Every --entry given, in order (create-group): the flag is repeatable,
  // and Abseil keeps only the last.
  std::vector<std::string> entries;
};

// What every command gets. `client` is connected with `options`; a command
// that needs a second channel (a poller, a reconnect) makes it from them.
struct Context {
  Client* client = nullptr;
  bool json = false;
  std::string server;
  absl::Duration timeout;
  ClientOptions options;
  GivenFlags given;
};

using Args = std::vector<std::string>;  // after the command name

using Handler = absl::Status (*)(Context&, const Args&);

// status_commands.cc
absl::Status RunStatus(Context& ctx, const Args& args);
absl::Status RunHealth(Context& ctx, const Args& args);
// pool_commands.cc
absl::Status RunPools(Context& ctx, const Args& args);
absl::Status RunPool(Context& ctx, const Args& args);
absl::Status RunCreatePool(Context& ctx, const Args& args);
absl::Status RunDeletePool(Context& ctx, const Args& args);
// group_commands.cc
absl::Status RunGroups(Context& ctx, const Args& args);
absl::Status RunGroup(Context& ctx, const Args& args);
absl::Status RunCreateGroup(Context& ctx, const Args& args);
absl::Status RunDeleteGroup(Context& ctx, const Args& args);
// slot_commands.cc
absl::Status RunAlloc(Context& ctx, const Args& args);
absl::Status RunFree(Context& ctx, const Args& args);
// page_commands.cc
absl::Status RunMeta(Context& ctx, const Args& args);
absl::Status RunPageGet(Context& ctx, const Args& args);
absl::Status RunPageSet(Context& ctx, const Args& args);
absl::Status RunPageShape(Context& ctx, const Args& args);
absl::Status RunSplitMeta(Context& ctx, const Args& args);
absl::Status RunStride(Context& ctx, const Args& args);
absl::Status RunBufInfo(Context& ctx, const Args& args);
// storage_commands.cc
absl::Status RunL3Store(Context& ctx, const Args& args);
absl::Status RunL3Fetch(Context& ctx, const Args& args);
absl::Status RunL3Exist(Context& ctx, const Args& args);
// cache_commands.cc
absl::Status RunCacheStats(Context& ctx, const Args& args);
absl::Status RunCacheLookup(Context& ctx, const Args& args);
absl::Status RunCacheEvict(Context& ctx, const Args& args);
absl::Status RunCacheEvents(Context& ctx, const Args& args);
// watch.cc
absl::Status RunWatch(Context& ctx, const Args& args);
// demo.cc
absl::Status RunDemo(Context& ctx, const Args& args);

constexpr size_t kAnyNumber = std::numeric_limits<size_t>::max();

struct Command {
  const char* name;
  const char* args;  // for --help and messages
  size_t min_args;
  size_t max_args;
  // For --help: its lines, as they are wrapped there.
  const char* help;
  Handler run;
};

// In --help's order.
inline constexpr Command kCommands[] = {
    {"status", "", 0, 0, "health, backend, pools and how full they are", RunStatus},
    {"health", "[SERVICE]", 0, 1,
     "grpc.health.v1 status, overall or of one service (e.g.\n"
     "kvhost.v1.TransferService); exit 0 only when SERVING, 1\n"
     "otherwise (starting, draining, unreachable): for probes",
     RunHealth},
    {"pools", "", 0, 0, "table of pools", RunPools},
    {"pool", "NAME", 1, 1,
     "one pool: its components, follows / followers, layers,\n"
     "replicas",
     RunPool},
    {"create-pool", "NAME", 1, 1,
     "create a pool: --kind, --layout, --dtype, --page-size, --layers,\n"
     "the kind's dimensions (mha, k_only: --heads --head-dim;\n"
     "mha_asymmetric: also --v-head-dim; mla: --kv-lora-rank\n"
     "--qk-rope-head-dim or --kv-cache-dim; dsa: mla's plus\n"
     "--index-head-dim --index-quant-block or --index-row-bytes;\n"
     "dsa_indexer: --index-head-dim --index-quant-block; mamba:\n"
     "--mamba-temporal --mamba-conv; v4_paged: --item-bytes;\n"
     "v4_state: --ring-size --state-slot-bytes), --follows (k_only,\n"
     "dsa_indexer, v4_state: required, and then no size),\n"
     "--start-layer, and a size: --size-tokens, --size-bytes, or\n"
     "--ratio with --device-size-tokens. --spec=JSON gives a whole\n"
     "kvhost.v1.PoolSpec (protobuf JSON); flags given override it",
     RunCreatePool},
    {"delete-pool", "NAME", 1, 1, "delete a pool that has no attachments and is in no group",
     RunDeletePool},
    {"groups", "", 0, 0, "table of pool groups", RunGroups},
    {"group", "NAME", 1, 1, "one pool group: its entries, layer maps and anchor", RunGroup},
    {"create-group", "NAME", 1, 1,
     "create a pool group: --layers=N model layers and one\n"
     "--entry=NAME:POOL[:anchor][:map=0,-1,1,...] per pool; alloc,\n"
     "free, meta and the page commands take a group's name for\n"
     "its anchor pool",
     RunCreateGroup},
    {"delete-group", "NAME", 1, 1, "delete a pool group that has no attachments", RunDeleteGroup},
    {"alloc", "POOL N", 2, 2,
     "allocate N token slots (whole pages); prints them as runs\n"
     "of slots, e.g. 0-15,32-47",
     RunAlloc},
    {"free", "POOL INDICES", 2, kAnyNumber,
     "free slots, written as runs (0-15,32-47) or a comma list", RunFree},
    {"meta", "POOL INDICES", 2, kAnyNumber, "region files and byte ranges of whole pages", RunMeta},
    {"page-get", "POOL INDEX", 2, 2,
     "one flat page (streamed): --out=FILE writes its bytes,\n"
     "else a hex dump of its start",
     RunPageGet},
    {"page-set", "POOL INDEX", 2, 2, "write one flat page from --in=FILE (exactly a page's bytes)",
     RunPageSet},
    {"page-shape", "POOL", 1, 1, "the seeds' dummy flat page: parts, dims, dtype, bytes",
     RunPageShape},
    {"split-meta", "POOL INDICES", 2, kAnyNumber,
     "byte ranges per page and head group (--split-factor=F;\n"
     "PAGE_HEAD pools; meta gives PAGE_UNIFIED's)",
     RunSplitMeta},
    {"stride", "POOL", 1, 1, "whether page blocks start on --alignment bytes (default 4096)",
     RunStride},
    {"bufinfo", "POOL", 1, 1, "contiguous range per component and layer (LAYER_FIRST pools)",
     RunBufInfo},
    {"l3-store", "POOL INDEX=KEY...", 2, kAnyNumber,
     "store pages (INDEX: a page's first slot) in the L3 tier under\n"
     "their keys (kvhostd --l3-memcached); prints each page's outcome;\n"
     "exit 4 unless every page was stored",
     RunL3Store},
    {"l3-fetch", "POOL INDEX=KEY...", 2, kAnyNumber,
     "fetch the pages stored under the keys into the pages at the\n"
     "indices; each page: PAGE_HIT, or why not; exit 4 unless every\n"
     "page was a hit",
     RunL3Fetch},
    {"l3-exist", "POOL KEY...", 2, kAnyNumber,
     "how many of the keys, from the first, are stored in L3 in\n"
     "the pool's namespace",
     RunL3Exist},
    {"cache-stats", "CACHE", 1, 1,
     "a node cache's pages and keys now, and its hits, misses,\n"
     "stores and evictions since it was created",
     RunCacheStats},
    {"cache-lookup", "CACHE KEY...", 2, kAnyNumber,
     "whether each key is present in the node cache, and how many\n"
     "are from the first (--hex-keys: keys in hex)",
     RunCacheLookup},
    {"cache-evict", "CACHE KEY...", 2, kAnyNumber,
     "evict keys from the node cache (pinned or being stored: kept)", RunCacheEvict},
    {"cache-events", "CACHE", 1, 1,
     "the keys stored and evicted, after --after=SEQ; --follow\n"
     "keeps reading every --interval until Ctrl-C; ends with the\n"
     "--after to resume from",
     RunCacheEvents},
    {"watch", "", 0, 0,
     "a live view of pools, tickets and GB/s per direction,\n"
     "refreshed every --interval; --count=N stops after N frames\n"
     "(exit 1 if the last one failed); not on a terminal, frames\n"
     "are printed one after another, separated by a blank line",
     RunWatch},
    {"demo", "", 0, 0,
     "create a pool and a shared-memory device pool, run backup /\n"
     "load cycles verified byte for byte, report GB/s and RPC\n"
     "latency, clean up (--demo-*, --shm-dir)",
     RunDemo},
};

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_COMMANDS_H_
