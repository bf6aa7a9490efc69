// kvhostctl: the operator's command line for kvhostd. It shows the daemon's
// health and pools, creates and deletes pools of every kind, allocates, frees
// and locates token slots, reads and writes flat pages, refreshes a live view of pools and
// transfers (watch), and runs a self-checking demo workload: backup / load cycles between an
// emulated device pool in shared memory and a host pool, verified byte for byte (host backend).
//
// Output is for people unless --json is given; then every command prints one
// JSON object on one line (watch: one per frame): the daemon's message with
// field names as in the .proto and every integer a JSON number
// (cli_output.h MessageJson), an object of the same naming style otherwise. Exit codes: 0 done; 1
// an RPC failed ("error: CODE: message" on stderr); 2 a usage error; 3 the demo read back other
// bytes than it had written.
//
// Single-threaded: every daemon call is one blocking kvhost::Client call
// under --timeout.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/cli_flags.h"
#include "cli_output.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "google/protobuf/util/json_util.h"
#include "kvhost/client.h"

// Global.
ABSL_FLAG(std::string, server, kvhost::kDefaultAddress,
          "kvhostd address: 'unix:///path.sock' or 'host:port'.");
ABSL_FLAG(bool, json, false, "Print one JSON object per command instead of text.");
ABSL_FLAG(double, timeout, 30, "Deadline of each RPC, in seconds.");
ABSL_FLAG(std::string, token, "",
          "Owner token sent as gRPC metadata 'kvhost-token' on every call (create-pool protects "
          "the new pool with it); default: the environment variable KVHOST_TOKEN.");
ABSL_FLAG(std::string, tls_ca, "",
          "TCP --server: PEM CA that signed kvhostd's certificate ('' = the system roots).");
ABSL_FLAG(std::string, tls_cert, "",
          "TCP --server: PEM client certificate, for a kvhostd with --tls-client-ca.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_server_name, "",
          "TCP --server: the name to check kvhostd's certificate against (default: its host).");
ABSL_FLAG(bool, insecure, false,
          "TCP --server: plaintext, for a kvhostd started with --insecure-tcp.");

// create-pool.
ABSL_FLAG(std::string, kind, "mha",
          "create-pool: what a token stores: mha, mla, mha_asymmetric, k_only, dsa, dsa_indexer, "
          "mamba, v4_paged, v4_state or logical.");
ABSL_FLAG(std::string, layout, "page_first",
          "create-pool: layer_first, page_first, page_first_direct or page_head (MHA only).");
ABSL_FLAG(std::string, dtype, "bf16",
          "create-pool: element type: bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 or uint8 (dsa_indexer, "
          "v4_paged, v4_state and logical default to uint8).");
ABSL_FLAG(uint32_t, page_size, 16,
          "create-pool: token slots per page (mamba: 1; a follower takes its pool's).");
ABSL_FLAG(uint32_t, layers, 0,
          "create-pool: layers held on the host; create-group: model layers (both required).");
ABSL_FLAG(std::string, entry, "",
          "create-group: one entry NAME:POOL[:anchor][:map=L0,L1,...] (a device layer of POOL "
          "or -1 per model layer; no map: the identity); repeat the flag per entry.");
ABSL_FLAG(uint32_t, heads, 0, "create-pool: MHA KV heads (required for mha).");
ABSL_FLAG(uint32_t, head_dim, 0, "create-pool: MHA head dimension (required for mha).");
ABSL_FLAG(uint32_t, kv_lora_rank, 0, "create-pool: MLA latent rank.");
ABSL_FLAG(uint32_t, qk_rope_head_dim, 0, "create-pool: MLA rotary dimension.");
ABSL_FLAG(uint64_t, size_tokens, 0, "create-pool: pool size in tokens (first sizing rule).");
ABSL_FLAG(std::string, size_bytes, "0",
          "create-pool: pool size in host bytes, e.g. 10G; K/M/G/T are powers of 1024 (second "
          "sizing rule).");
ABSL_FLAG(double, ratio, 0,
          "create-pool: host slots per device slot, with --device-size-tokens (third sizing "
          "rule).");
ABSL_FLAG(uint64_t, device_size_tokens, 0, "create-pool: the device pool's size in tokens.");
ABSL_FLAG(std::string, spec, "",
          "create-pool: a whole kvhost.v1.PoolSpec in protobuf JSON, e.g. "
          "'{\"kind\":\"MLA\",\"layout\":\"LAYER_FIRST\",...}'; flags given override its fields.");
ABSL_FLAG(uint32_t, v_head_dim, 0, "create-pool: mha_asymmetric V head dimension.");
ABSL_FLAG(std::string, follows, "",
          "create-pool: the pool whose page space this one shares (k_only, dsa_indexer, "
          "v4_state).");
ABSL_FLAG(uint32_t, start_layer, 0, "create-pool: first device layer held (layer sharding).");
ABSL_FLAG(uint32_t, index_head_dim, 0, "create-pool: dsa, dsa_indexer index head dimension.");
ABSL_FLAG(uint32_t, index_quant_block, 0, "create-pool: dsa, dsa_indexer elements per fp32 scale.");
ABSL_FLAG(uint32_t, index_row_bytes, 0, "create-pool: dsa index-K bytes per token, if explicit.");
ABSL_FLAG(uint32_t, kv_cache_dim, 0,
          "create-pool: mla, dsa latent elements when not kv_lora_rank + qk_rope_head_dim.");
ABSL_FLAG(uint64_t, item_bytes, 0, "create-pool: v4_paged bytes per slot page and layer.");
ABSL_FLAG(uint32_t, ring_size, 0, "create-pool: v4_state ring slots per page.");
ABSL_FLAG(uint64_t, state_slot_bytes, 0, "create-pool: v4_state bytes per ring slot.");
ABSL_FLAG(std::string, mamba_temporal, "",
          "create-pool: mamba temporal state shape and optional dtype, e.g. 8x64x128:fp32.");
ABSL_FLAG(std::string, mamba_conv, "",
          "create-pool: mamba conv state shapes, comma separated, e.g. 2x4x1024,2x4x256.");

// page commands.
ABSL_FLAG(std::string, out, "", "page-get: file to write the page's bytes to.");
ABSL_FLAG(std::string, in, "", "page-set: file holding exactly one flat page.");
ABSL_FLAG(uint32_t, chunk_bytes, 0, "page-get, page-set: bytes per streamed message (0: 4 MiB).");
ABSL_FLAG(uint32_t, split_factor, 0, "split-meta: head groups per page (divides head_num).");
ABSL_FLAG(uint64_t, alignment, 0, "stride: the alignment to check, a power of two (0: 4096).");

// demo.
ABSL_FLAG(std::string, shm_dir, "",
          "demo: directory of the emulated device pool's file; must be kvhostd's --shm-dir. "
          "'' = the daemon's, as GetStatus reports it.");
ABSL_FLAG(std::string, demo_pool, "demo", "demo: name of the pool it creates (and deletes).");
ABSL_FLAG(std::string, demo_kind, "mha",
          "demo: mha (8 heads x 128 dims) or mla (512 + 64 dims); bf16, page size 16.");
ABSL_FLAG(std::string, demo_layout, "page_first", "demo: host layout, as --layout.");
ABSL_FLAG(uint32_t, demo_layers, 8, "demo: layers.");
ABSL_FLAG(uint64_t, demo_tokens, 65536, "demo: host pool size in tokens.");
ABSL_FLAG(uint64_t, demo_device_tokens, 8192, "demo: rows per layer of the device pool.");
ABSL_FLAG(uint64_t, demo_batch_tokens, 2048,
          "demo: tokens moved each way per cycle, a multiple of the page size.");
ABSL_FLAG(int, demo_cycles, 20, "demo: backup / load / verify cycles.");
ABSL_FLAG(uint64_t, demo_seed, 1, "demo: seed of the device bytes and the rows chosen.");

// watch.
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1),
          "watch: time between frames, e.g. 1s, 500ms (at least 100ms).");
ABSL_FLAG(int64_t, count, 0, "watch: stop after this many frames (0: until Ctrl-C).");

namespace {

using kvhost::Client;
using kvhost::ShmDevicePool;
namespace v1 = kvhost::v1;

constexpr char kUsage[] =
    "kvhostctl: command line for kvhostd, the host KV-cache daemon.\n"
    "Usage: kvhostctl [--server=ADDR] [--json] [--timeout=SECONDS] COMMAND [ARGS]\n"
    "\n"
    "Commands:\n"
    "  status              health, backend, pools and how full they are\n"
    "  health [SERVICE]    grpc.health.v1 status, overall or of one service (e.g.\n"
    "                      kvhost.v1.TransferService); exit 0 only when SERVING, 1\n"
    "                      otherwise (starting, draining, unreachable): for probes\n"
    "  pools               table of pools\n"
    "  pool NAME           one pool: its components, follows / followers, layers,\n"
    "                      replicas\n"
    "  create-pool NAME    create a pool: --kind, --layout, --dtype, --page-size, --layers,\n"
    "                      the kind's dimensions (mha, k_only: --heads --head-dim;\n"
    "                      mha_asymmetric: also --v-head-dim; mla: --kv-lora-rank\n"
    "                      --qk-rope-head-dim or --kv-cache-dim; dsa: mla's plus\n"
    "                      --index-head-dim --index-quant-block or --index-row-bytes;\n"
    "                      dsa_indexer: --index-head-dim --index-quant-block; mamba:\n"
    "                      --mamba-temporal --mamba-conv; v4_paged: --item-bytes;\n"
    "                      v4_state: --ring-size --state-slot-bytes), --follows (k_only,\n"
    "                      dsa_indexer, v4_state: required, and then no size),\n"
    "                      --start-layer, and a size: --size-tokens, --size-bytes, or\n"
    "                      --ratio with --device-size-tokens. --spec=JSON gives a whole\n"
    "                      kvhost.v1.PoolSpec (protobuf JSON); flags given override it\n"
    "  delete-pool NAME    delete a pool that has no attachments and is in no group\n"
    "  groups              table of pool groups\n"
    "  group NAME          one pool group: its entries, layer maps and anchor\n"
    "  create-group NAME   create a pool group: --layers=N model layers and one\n"
    "                      --entry=NAME:POOL[:anchor][:map=0,-1,1,...] per pool; alloc,\n"
    "                      free, meta and the page commands take a group's name for\n"
    "                      its anchor pool\n"
    "  delete-group NAME   delete a pool group that has no attachments\n"
    "  alloc POOL N        allocate N token slots (whole pages); prints them as runs\n"
    "                      of slots, e.g. 0-15,32-47\n"
    "  free POOL INDICES   free slots, written as runs (0-15,32-47) or a comma list\n"
    "  meta POOL INDICES   region files and byte ranges of whole pages\n"
    "  page-get POOL INDEX one flat page (streamed): --out=FILE writes its bytes,\n"
    "                      else a hex dump of its start\n"
    "  page-set POOL INDEX write one flat page from --in=FILE (exactly a page's bytes)\n"
    "  page-shape POOL     the seeds' dummy flat page: parts, dims, dtype, bytes\n"
    "  split-meta POOL INDICES\n"
    "                      byte ranges per page and head group (--split-factor=F;\n"
    "                      PAGE_HEAD pools)\n"
    "  stride POOL         whether page blocks start on --alignment bytes (default 4096)\n"
    "  bufinfo POOL        contiguous range per component and layer (LAYER_FIRST pools)\n"
    "  watch               a live view of pools, tickets and GB/s per direction,\n"
    "                      refreshed every --interval; --count=N stops after N frames\n"
    "                      (exit 1 if the last one failed); not on a terminal, frames\n"
    "                      are printed one after another, separated by a blank line\n"
    "  demo                create a pool and a shared-memory device pool, run backup /\n"
    "                      load cycles verified byte for byte, report GB/s and RPC\n"
    "                      latency, clean up (--demo-*, --shm-dir)\n"
    "\n"
    "Exit codes: 0 ok; 1 an RPC failed (stderr: error: CODE: message); 2 usage error;\n"
    "3 the demo read back different bytes.";

// Statuses made here rather than by the daemon carry one of these payloads, so
// that the exit code tells a script what went wrong.
constexpr char kUsagePayload[] = "kvhostctl/usage";
constexpr char kMismatchPayload[] = "kvhostctl/mismatch";

constexpr int kExitRpc = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMismatch = 3;

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord());
  return status;
}

absl::Status MismatchError(absl::string_view message) {
  absl::Status status = absl::DataLossError(message);
  status.SetPayload(kMismatchPayload, absl::Cord());
  return status;
}

// Prints why `status` failed and returns the exit code it stands for.
int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  if (status.GetPayload(kUsagePayload).has_value()) {
    absl::FPrintF(stderr, "usage error: %s\n(kvhostctl --help lists commands and flags)\n",
                  status.message());
    return kExitUsage;
  }
  if (status.GetPayload(kMismatchPayload).has_value()) {
    absl::FPrintF(stderr, "error: verification failed: %s\n", status.message());
    return kExitMismatch;
  }
  absl::FPrintF(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()),
                status.message());
  return kExitRpc;
}

// kvhostctl's own flags given on the command line (underscored names), as
// CheckFlags found them.
std::set<std::string> g_given_flags;
// Every --entry given, in order (create-group).
std::vector<std::string> g_entries;

// Abseil exits with 1 on an unknown flag or a bad flag value, and 1 means a
// failed RPC here; so kvhostctl's own flags are checked first, the way Abseil
// would read them, and reported as usage errors.
absl::Status CheckFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional
    const bool double_dash = absl::StartsWith(arg, "--");
    absl::string_view body = arg.substr(double_dash ? 2 : 1);
    const size_t eq = body.find('=');
    std::string name(body.substr(0, eq));
    // cli_flags.cc turns --foo-bar into --foo_bar, but only with two dashes.
    if (double_dash) name = absl::StrReplaceAll(name, {{"-", "_"}});
    if (name == "help" || name == "h") continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no") && eq == absl::string_view::npos) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) {
      return UsageError(
          absl::StrCat("unknown flag ", double_dash ? "--" : "-", body.substr(0, eq)));
    }
    // Abseil's own flags (--flagfile, ...) are left to Abseil.
    if (!absl::EndsWith(flag->Filename(), "client/kvhostctl.cc")) continue;
    g_given_flags.insert(std::string(flag->Name()));
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(body.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return UsageError(absl::StrCat("flag --", flag->Name(), " needs a value"));
    }
    if (flag->Name() == "entry") g_entries.push_back(value);  // repeatable; Abseil keeps the last
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return UsageError(absl::StrCat("--", absl::StrReplaceAll(flag->Name(), {{"_", "-"}}), "='",
                                     value, "': ", error));
    }
  }
  return absl::OkStatus();
}

std::string FlagName(absl::string_view underscored) {
  return absl::StrCat("--", absl::StrReplaceAll(underscored, {{"_", "-"}}));
}

// ---------------------------------------------------------------------------
// Parsing of command-line values.

// An enum value written the way flags are: "page_first" or "page-first" for
// PAGE_FIRST, any case; the *_UNSPECIFIED value is refused.
absl::StatusOr<int> ParseEnumFlag(absl::string_view flag, const std::string& text,
                                  const google::protobuf::EnumDescriptor* type) {
  const std::string name = absl::AsciiStrToUpper(absl::StrReplaceAll(text, {{"-", "_"}}));
  const google::protobuf::EnumValueDescriptor* value = type->FindValueByName(name);
  if (value != nullptr && value->number() != 0) return value->number();
  std::vector<std::string> names;
  for (int i = 0; i < type->value_count(); ++i) {
    if (type->value(i)->number() != 0)
      names.push_back(absl::AsciiStrToLower(type->value(i)->name()));
  }
  return UsageError(
      absl::StrCat(FlagName(flag), " '", text, "' is not one of ", absl::StrJoin(names, ", ")));
}

// "10G", "512M", "1.5T", "4096", "64KiB": bytes; K, M, G and T are powers of
// 1024 as in kvhostd's --memory-limit.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view flag, absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return UsageError(absl::StrCat(FlagName(flag), " '", text, "' ", why,
                                   " (expected a number with an optional K, M, G or T suffix, "
                                   "e.g. 10G)"));
  };
  absl::string_view number = absl::StripAsciiWhitespace(text);
  if (absl::EndsWithIgnoreCase(number, "ib")) {
    number.remove_suffix(2);
  } else if (absl::EndsWithIgnoreCase(number, "b")) {
    number.remove_suffix(1);
  }
  // K, M, G, T: the unit's position in kUnits, times ten, is its power of two.
  constexpr absl::string_view kUnits = "KMGT";
  const size_t unit =
      number.empty() ? absl::string_view::npos : kUnits.find(absl::ascii_toupper(number.back()));
  int shift = 0;
  if (unit != absl::string_view::npos) {
    shift = 10 * static_cast<int>(unit + 1);
    number.remove_suffix(1);
  }
  if (number.empty() || number[0] == '-' || number[0] == '+') return bad("is not a size");
  if (absl::StrContains(number, '.')) {
    double value = 0;
    if (!absl::SimpleAtod(number, &value) || !std::isfinite(value)) return bad("is not a size");
    const double bytes = std::floor(std::ldexp(value, shift));
    // 2^64 is exactly representable; anything at or past it does not fit.
    if (bytes >= 18446744073709551616.0) return bad("is too large");
    return static_cast<uint64_t>(bytes);
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(number, &value)) return bad("is not a size");
  if (value > (std::numeric_limits<uint64_t>::max() >> shift)) return bad("is too large");
  return value << shift;
}

// Index lists past this many entries would exceed the client's 64 MiB message
// limit anyway; refusing them here keeps a typo ("0-99999999999") from
// exhausting memory first.
constexpr uint64_t kMaxListedSlots = uint64_t{1} << 26;

// Token slots written as runs of consecutive slots ("0-15,32-47") and single
// slots ("5"), comma separated, in list order.
absl::StatusOr<std::vector<int64_t>> ParseRuns(absl::string_view text) {
  std::vector<int64_t> slots;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    auto bad = [&](absl::string_view why) {
      return UsageError(absl::StrCat("INDICES '", text, "': '", item, "' ", why,
                                     " (write runs and slots like 0-15,32-47,64)"));
    };
    if (item.empty()) return bad("is empty");
    const std::vector<absl::string_view> ends = absl::StrSplit(item, absl::MaxSplits('-', 1));
    int64_t first = 0;
    int64_t last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || first < 0 || ends[0][0] == '+') {
      return bad("is not a slot or a run");
    }
    last = first;
    if (ends.size() == 2 && (!absl::SimpleAtoi(ends[1], &last) || ends[1].empty() ||
                             ends[1][0] == '+' || ends[1][0] == '-')) {
      return bad("is not a slot or a run");
    }
    if (last < first) return bad("runs backwards");
    if (slots.size() + static_cast<uint64_t>(last - first) + 1 > kMaxListedSlots) {
      return bad(absl::StrCat("makes the list longer than ", kMaxListedSlots, " slots"));
    }
    for (int64_t slot = first; slot <= last; ++slot) slots.push_back(slot);
  }
  return slots;
}

// The inverse of ParseRuns: maximal runs of consecutive slots, in list order.
std::string FormatRuns(absl::Span<const int64_t> slots) {
  std::string out;
  for (size_t i = 0; i < slots.size();) {
    size_t j = i + 1;
    while (j < slots.size() && slots[j] == slots[j - 1] + 1) ++j;
    if (!out.empty()) out += ',';
    absl::StrAppend(&out, slots[i]);
    if (j - i > 1) absl::StrAppend(&out, "-", slots[j - 1]);
    i = j;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Output.

using kvhost::cli::JsonObject;
using kvhost::cli::MessageJson;
using kvhost::cli::PrintLine;
using kvhost::cli::PrintTable;

// Decimal gigabytes, as kvhostd's logs and messages print them.
// Sizes in GiB, the unit the size flags take (--size-bytes=64G is 64 GiB).
// Rates stay in decimal GB/s, as link bandwidths are quoted.
std::string Gib(uint64_t bytes) {
  return absl::StrFormat("%.2f", static_cast<double>(bytes) / (uint64_t{1} << 30));
}

std::string ShapeOf(const v1::PoolSpec& spec) {
  return absl::StrCat(v1::PoolKind_Name(spec.kind()), "/", v1::Layout_Name(spec.layout()), "/",
                      v1::DType_Name(spec.dtype()));
}

std::string ShapeText(const v1::Shape& shape) { return absl::StrJoin(shape.dims(), "x"); }

// The kind's dimensions in words.
std::string DimsOf(const v1::PoolSpec& spec) {
  const std::string latent =
      spec.kv_cache_dim() != 0
          ? absl::StrCat(spec.kv_cache_dim(), " latent dims")
          : absl::StrCat(spec.kv_lora_rank(), " + ", spec.qk_rope_head_dim(), " latent dims");
  const std::string index = spec.index_row_bytes() != 0
                                ? absl::StrCat("index row ", spec.index_row_bytes(), " bytes")
                                : absl::StrCat("index dim ", spec.index_head_dim(), " / block ",
                                               spec.index_quant_block_size());
  switch (spec.kind()) {
    case v1::MLA:
      return latent;
    case v1::MHA_ASYMMETRIC:
      return absl::StrCat(spec.head_num(), " heads x ", spec.head_dim(), " (K) / ",
                          spec.v_head_dim(), " (V) dims");
    case v1::DSA:
      return absl::StrCat(latent, ", ", index);
    case v1::DSA_INDEXER:
      return index;
    case v1::MAMBA: {
      std::vector<std::string> conv;
      for (const v1::Shape& c : spec.mamba().conv()) conv.push_back(ShapeText(c));
      const v1::DType temporal_dtype = spec.mamba().temporal_dtype() == v1::DTYPE_UNSPECIFIED
                                           ? spec.dtype()
                                           : spec.mamba().temporal_dtype();
      return absl::StrCat("temporal ", ShapeText(spec.mamba().temporal()), " ",
                          absl::AsciiStrToLower(v1::DType_Name(temporal_dtype)), ", conv ",
                          absl::StrJoin(conv, ", "));
    }
    case v1::V4_PAGED:
      return absl::StrCat("item ", spec.item_bytes(), " bytes");
    case v1::V4_STATE:
      return absl::StrCat("ring ", spec.ring_size(), " x ", spec.state_slot_bytes(), " bytes");
    case v1::LOGICAL:
      return "no buffers";
    default:
      return absl::StrCat(spec.head_num(), " heads x ", spec.head_dim(), " dims");
  }
}

// Device layers held, "[2,5)" when sharded, else the layer count.
std::string LayersOf(const v1::Pool& pool) {
  if (pool.spec().start_layer() == 0) return absl::StrCat(pool.spec().layer_num());
  return absl::StrCat("[", pool.spec().start_layer(), ",",
                      pool.spec().start_layer() + pool.spec().layer_num(), ")");
}

uint64_t UsedTokens(const v1::Pool& pool) {
  return pool.size_tokens() > pool.available_tokens() ? pool.size_tokens() - pool.available_tokens()
                                                      : 0;
}

double UsedPercent(const v1::Pool& pool) {
  return pool.size_tokens() == 0 ? 0.0 : 100.0 * UsedTokens(pool) / pool.size_tokens();
}

// ---------------------------------------------------------------------------
// Commands.

struct Context {
  Client* client = nullptr;
  bool json = false;
  std::string server;
  absl::Duration timeout;
  kvhost::ClientOptions options;  // what `client` was made with
};

// The client's options from the global flags (--server, --timeout, access).
kvhost::ClientOptions ClientOptionsFromFlags(const std::string& server, absl::Duration timeout) {
  kvhost::ClientOptions options;
  options.address = server;
  options.timeout = timeout;
  options.owner_token = absl::GetFlag(FLAGS_token);
  if (options.owner_token.empty()) {
    if (const char* env = std::getenv("KVHOST_TOKEN"); env != nullptr) options.owner_token = env;
  }
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.insecure = absl::GetFlag(FLAGS_insecure);
  return options;
}

using Args = std::vector<std::string>;  // after the command name

// How full a pool is, for status --json and watch --json.
JsonObject PoolUsageJson(const v1::Pool& pool) {
  JsonObject usage;
  usage.Str("name", pool.name())
      .Uint("size_tokens", pool.size_tokens())
      .Uint("used_tokens", UsedTokens(pool))
      .Uint("available_tokens", pool.available_tokens())
      .Num("used_percent", UsedPercent(pool), 2)
      .Uint("bytes", pool.bytes())
      .Uint("attachments", pool.attachments());
  return usage;
}

absl::Status RunHealth(Context& ctx, const Args& args) {
  const std::string service = args.empty() ? "" : args[0];
  absl::StatusOr<std::string> health = ctx.client->Health(service);
  if (!health.ok()) return health.status();
  if (ctx.json) {
    PrintLine(JsonObject()
                  .Str("server", ctx.server)
                  .Str("service", service)
                  .Str("health", *health)
                  .str());
  } else {
    PrintLine(*health);
  }
  if (*health != "SERVING") {
    return absl::UnavailableError(
        absl::StrCat("kvhostd at ", ctx.server, " is ", *health,
                     service.empty() ? "" : absl::StrCat(" for ", service)));
  }
  return absl::OkStatus();
}

absl::Status RunStatus(Context& ctx, const Args&) {
  absl::StatusOr<std::string> health = ctx.client->Health();
  if (!health.ok()) return health.status();
  absl::StatusOr<v1::DaemonStatus> daemon = ctx.client->GetStatus();
  if (!daemon.ok()) return daemon.status();
  absl::StatusOr<std::vector<v1::Pool>> pools = ctx.client->ListPools();
  if (!pools.ok()) return pools.status();
  const uint64_t total_bytes = daemon->pool_bytes();
  if (ctx.json) {
    std::vector<std::string> usage;
    for (const v1::Pool& pool : *pools) usage.push_back(PoolUsageJson(pool).str());
    PrintLine(JsonObject()
                  .Str("server", ctx.server)
                  .Str("health", *health)
                  .Str("backend", daemon->backend())
                  .Uint("pools", pools->size())
                  .Uint("total_bytes", total_bytes)
                  .Raw("daemon", MessageJson(*daemon))
                  .Raw("pool_usage", absl::StrCat("[", absl::StrJoin(usage, ","), "]"))
                  .str());
  } else {
    PrintLine(absl::StrFormat("kvhostd %s at %s: %s (pid %d, up %ds)", daemon->version(),
                              ctx.server, *health, daemon->pid(), daemon->uptime_s()));
    PrintLine(absl::StrCat("backend: ", daemon->backend(), " (", daemon->backend_detail(), ")"));
    PrintLine(absl::StrFormat(
        "memory:  %s GiB in pools, %s GiB more available (limit %s, reserve %s GiB)",
        Gib(total_bytes), Gib(daemon->memory_available_bytes()),
        daemon->memory_limit_bytes() > 0 ? absl::StrCat(Gib(daemon->memory_limit_bytes()), " GiB")
                                         : std::string("none"),
        Gib(daemon->memory_reserve_bytes())));
    PrintLine(absl::StrFormat(
        "transfers: %d attachment(s), %d ticket(s) in flight, %d done, %d "
        "failed; %s GiB backed up, %s GiB loaded",
        daemon->attachments(), daemon->tickets_in_flight(), daemon->tickets_done(),
        daemon->tickets_failed(), Gib(daemon->backup_bytes()), Gib(daemon->load_bytes())));
    PrintLine(absl::StrFormat(
        "instance: %s%s", daemon->instance_id(),
        daemon->declared_pools().empty()
            ? ""
            : absl::StrCat(" (declared pools: ", absl::StrJoin(daemon->declared_pools(), ", "),
                           ")")));
    for (const v1::PoolProgress& p : daemon->pools_creating()) {
      PrintLine(absl::StrFormat(
          "filling: pool '%s', %s of %s GiB (%d %%)", p.name(), Gib(p.populated_bytes()),
          Gib(p.bytes()),
          p.bytes() ? static_cast<int>(100.0 * p.populated_bytes() / p.bytes()) : 0));
    }
    PrintLine(absl::StrFormat("sessions: %d", daemon->sessions_size()));
    for (const v1::SessionInfo& session : daemon->sessions()) {
      PrintLine(absl::StrFormat("  worker '%s' pid %d (%s), %d attachment(s), %ds old",
                                session.worker(), session.pid(), session.peer(),
                                session.attachment_count(), session.age_s()));
    }
    PrintLine(absl::StrFormat("pools:   %d", pools->size()));
    if (!pools->empty()) {
      std::vector<std::vector<std::string>> rows = {
          {"POOL", "USED", "AVAILABLE", "TOKENS", "USED%", "ATTACH"}};
      for (const v1::Pool& pool : *pools) {
        rows.push_back({pool.name(), absl::StrCat(UsedTokens(pool)),
                        absl::StrCat(pool.available_tokens()), absl::StrCat(pool.size_tokens()),
                        absl::StrFormat("%.1f", UsedPercent(pool)),
                        absl::StrCat(pool.attachments())});
      }
      PrintTable(rows, "lrrrrr", "  ");
    }
  }
  if (*health != "SERVING") {
    // Scripts wait for a usable daemon with `until kvhostctl status; ...`.
    return absl::UnavailableError(absl::StrCat("kvhostd at ", ctx.server, " reports ", *health));
  }
  return absl::OkStatus();
}

absl::Status RunPools(Context& ctx, const Args&) {
  absl::StatusOr<std::vector<v1::Pool>> pools = ctx.client->ListPools();
  if (!pools.ok()) return pools.status();
  if (ctx.json) {
    v1::ListPoolsResponse response;
    for (const v1::Pool& pool : *pools) *response.add_pools() = pool;
    PrintLine(MessageJson(response));
    return absl::OkStatus();
  }
  if (pools->empty()) {
    PrintLine("no pools");
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {{"NAME", "KIND/LAYOUT/DTYPE", "PAGE", "LAYERS",
                                                 "TOKENS", "USED%", "GIB", "ATTACH", "GROUP",
                                                 "FOLLOWS"}};
  for (const v1::Pool& pool : *pools) {
    rows.push_back({pool.name(), ShapeOf(pool.spec()), absl::StrCat(pool.spec().page_size()),
                    LayersOf(pool), absl::StrCat(pool.size_tokens()),
                    absl::StrFormat("%.1f", UsedPercent(pool)), Gib(pool.bytes()),
                    absl::StrCat(pool.attachments()),
                    pool.group().empty() ? std::string("-") : pool.group(),
                    pool.follows().empty() ? std::string("-") : pool.follows()});
  }
  PrintTable(rows, "llrrrrrrll");
  return absl::OkStatus();
}

void PrintPool(const v1::Pool& pool) {
  const v1::PoolSpec& spec = pool.spec();
  PrintLine(absl::StrFormat("pool '%s': %s, page %d, %d layers, %s", pool.name(), ShapeOf(spec),
                            spec.page_size(), spec.layer_num(), DimsOf(spec)));
  PrintLine(absl::StrFormat(
      "  %d tokens (%d pages), %d available, %d bytes per token, %d bytes per page, %s GiB",
      pool.size_tokens(), pool.page_num(), pool.available_tokens(), pool.bytes_per_token(),
      pool.bytes_per_page(), Gib(pool.bytes())));
  if (pool.end_layer() > pool.start_layer() && pool.start_layer() != 0) {
    PrintLine(absl::StrFormat("  device layers [%d,%d)", pool.start_layer(), pool.end_layer()));
  }
  if (!pool.follows().empty()) {
    PrintLine(absl::StrFormat("  follows '%s' (its page space; no allocator of its own)",
                              pool.follows()));
  } else if (spec.kind() == v1::V4_STATE) {
    PrintLine("  no allocator");
  }
  if (!pool.followers().empty()) {
    PrintLine(absl::StrCat("  followed by ", absl::StrJoin(pool.followers(), ", ")));
  }
  if (!pool.group().empty()) {
    PrintLine(absl::StrFormat("  in group '%s' (delete the group before the pool)", pool.group()));
  }
  if (pool.owner_protected()) {
    PrintLine("  owner-protected (changes and data reads need its token: --token / KVHOST_TOKEN)");
  }
  if (pool.replica_ranks() > 0) {
    PrintLine(absl::StrFormat("  replicas %d (TP ranks attached), %s GiB saved",
                              pool.replica_ranks(), Gib(pool.bytes_saved())));
  }
  for (const std::string& path : pool.region_paths()) PrintLine(absl::StrCat("  region: ", path));
  if (pool.components_size() > 0) {
    std::vector<std::vector<std::string>> rows = {
        {"COMPONENT", "REGION", "OFFSET", "BYTES", "ROW", "PER"}};
    for (const v1::PoolComponent& c : pool.components()) {
      rows.push_back({c.name(), absl::StrCat(c.region_index()), absl::StrCat(c.offset()),
                      absl::StrCat(c.bytes()), absl::StrCat(c.row_bytes()),
                      c.row_tokens() > 1 ? absl::StrCat("page (", c.row_tokens(), " slots)")
                                         : std::string("token")});
    }
    PrintTable(rows, "lrrrrl", "  ");
  }
  PrintLine(absl::StrFormat("  backend: %s, %d attachment(s)", pool.backend(), pool.attachments()));
}

absl::Status RunPool(Context& ctx, const Args& args) {
  absl::StatusOr<v1::Pool> pool = ctx.client->GetPool(args[0]);
  if (!pool.ok()) return pool.status();
  if (ctx.json) {
    PrintLine(MessageJson(*pool));
  } else {
    PrintPool(*pool);
  }
  return absl::OkStatus();
}

// Whether --NAME was given (for --spec, whose fields only given flags override).
bool Given(absl::string_view name) { return g_given_flags.count(std::string(name)) > 0; }

// "8x64x128" -> dims; "8x64x128:fp32" also sets *dtype.
absl::Status ParseShape(absl::string_view flag, absl::string_view text, v1::Shape* shape,
                        v1::DType* dtype) {
  const size_t colon = text.find(':');
  if (colon != absl::string_view::npos) {
    if (dtype == nullptr) {
      return UsageError(absl::StrCat(FlagName(flag), " '", text, "' takes no dtype"));
    }
    absl::StatusOr<int> parsed =
        ParseEnumFlag(flag, std::string(text.substr(colon + 1)), v1::DType_descriptor());
    if (!parsed.ok()) return parsed.status();
    *dtype = static_cast<v1::DType>(*parsed);
    text = text.substr(0, colon);
  }
  shape->clear_dims();
  for (absl::string_view part : absl::StrSplit(text, 'x')) {
    uint32_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim) || dim == 0) {
      return UsageError(absl::StrCat(FlagName(flag), " '", text,
                                     "' is not a shape like 8x64x128 (positive dims)"));
    }
    shape->add_dims(dim);
  }
  return absl::OkStatus();
}

// What each kind needs besides layers and a size: a flag given or a spec
// field set; kvhostd judges the values.
struct Requirement {
  v1::PoolKind kind;
  const char* flags;  // for the message
  bool (*present)(const v1::PoolSpec&);
};

constexpr Requirement kRequirements[] = {
    {v1::MHA, "--heads and --head-dim",
     [](const v1::PoolSpec& s) { return s.head_num() != 0 && s.head_dim() != 0; }},
    {v1::MHA_ASYMMETRIC, "--heads, --head-dim and --v-head-dim",
     [](const v1::PoolSpec& s) {
       return s.head_num() != 0 && s.head_dim() != 0 && s.v_head_dim() != 0;
     }},
    {v1::K_ONLY, "--heads, --head-dim and --follows",
     [](const v1::PoolSpec& s) {
       return s.head_num() != 0 && s.head_dim() != 0 && !s.follows().empty();
     }},
    {v1::MLA, "--kv-lora-rank and/or --qk-rope-head-dim (or --kv-cache-dim)",
     [](const v1::PoolSpec& s) {
       return s.kv_lora_rank() + s.qk_rope_head_dim() + s.kv_cache_dim() != 0;
     }},
    {v1::DSA,
     "--kv-lora-rank and/or --qk-rope-head-dim (or --kv-cache-dim), and --index-head-dim with "
     "--index-quant-block (or --index-row-bytes)",
     [](const v1::PoolSpec& s) {
       return s.kv_lora_rank() + s.qk_rope_head_dim() + s.kv_cache_dim() != 0 &&
              (s.index_row_bytes() != 0 ||
               (s.index_head_dim() != 0 && s.index_quant_block_size() != 0));
     }},
    {v1::DSA_INDEXER, "--index-head-dim, --index-quant-block and --follows",
     [](const v1::PoolSpec& s) {
       return s.index_head_dim() != 0 && s.index_quant_block_size() != 0 && !s.follows().empty();
     }},
    {v1::MAMBA, "--mamba-temporal and --mamba-conv",
     [](const v1::PoolSpec& s) {
       return s.mamba().temporal().dims_size() > 0 && s.mamba().conv_size() > 0;
     }},
    {v1::V4_PAGED, "--item-bytes", [](const v1::PoolSpec& s) { return s.item_bytes() != 0; }},
    {v1::V4_STATE, "--ring-size, --state-slot-bytes and --follows",
     [](const v1::PoolSpec& s) {
       return s.ring_size() != 0 && s.state_slot_bytes() != 0 && !s.follows().empty();
     }},
};

// The spec of create-pool: --spec's JSON, then every flag given (with
// --spec) or every flag with its default (without it).
absl::StatusOr<v1::PoolSpec> SpecFromFlags() {
  v1::PoolSpec spec;
  const std::string json = absl::GetFlag(FLAGS_spec);
  const bool from_json = !json.empty();
  if (from_json) {
    if (auto s = google::protobuf::util::JsonStringToMessage(json, &spec); !s.ok()) {
      return UsageError(absl::StrCat("--spec is not a kvhost.v1.PoolSpec in protobuf JSON: ",
                                     std::string(s.message())));
    }
  }
  const auto use = [&](absl::string_view name) { return !from_json || Given(name); };
  if (use("kind")) {
    absl::StatusOr<int> kind =
        ParseEnumFlag("kind", absl::GetFlag(FLAGS_kind), v1::PoolKind_descriptor());
    if (!kind.ok()) return kind.status();
    spec.set_kind(static_cast<v1::PoolKind>(*kind));
  }
  if (use("layout")) {
    absl::StatusOr<int> layout =
        ParseEnumFlag("layout", absl::GetFlag(FLAGS_layout), v1::Layout_descriptor());
    if (!layout.ok()) return layout.status();
    spec.set_layout(static_cast<v1::Layout>(*layout));
  }
  if (Given("dtype")) {
    absl::StatusOr<int> dtype =
        ParseEnumFlag("dtype", absl::GetFlag(FLAGS_dtype), v1::DType_descriptor());
    if (!dtype.ok()) return dtype.status();
    spec.set_dtype(static_cast<v1::DType>(*dtype));
  } else if (!from_json) {
    // Kinds whose rows are plain bytes default to uint8.
    const bool bytes = spec.kind() == v1::DSA_INDEXER || spec.kind() == v1::V4_PAGED ||
                       spec.kind() == v1::V4_STATE || spec.kind() == v1::LOGICAL;
    absl::StatusOr<int> dtype = ParseEnumFlag(
        "dtype", bytes ? std::string("uint8") : absl::GetFlag(FLAGS_dtype), v1::DType_descriptor());
    if (!dtype.ok()) return dtype.status();
    spec.set_dtype(static_cast<v1::DType>(*dtype));
  }
  if (use("size_bytes")) {
    absl::StatusOr<uint64_t> size_bytes =
        ParseByteSize("size_bytes", absl::GetFlag(FLAGS_size_bytes));
    if (!size_bytes.ok()) return size_bytes.status();
    spec.set_size_bytes(*size_bytes);
  }
  if (use("follows")) spec.set_follows(absl::GetFlag(FLAGS_follows));
  if (Given("page_size")) {
    spec.set_page_size(absl::GetFlag(FLAGS_page_size));
  } else if (!from_json && spec.follows().empty()) {
    // A follower takes its pool's page size; mamba's is 1.
    spec.set_page_size(spec.kind() == v1::MAMBA ? 1 : absl::GetFlag(FLAGS_page_size));
  }
#define KVHOST_FLAG_FIELD(flag, setter) \
  if (use(#flag)) spec.setter(absl::GetFlag(FLAGS_##flag))
  KVHOST_FLAG_FIELD(layers, set_layer_num);
  KVHOST_FLAG_FIELD(heads, set_head_num);
  KVHOST_FLAG_FIELD(head_dim, set_head_dim);
  KVHOST_FLAG_FIELD(v_head_dim, set_v_head_dim);
  KVHOST_FLAG_FIELD(kv_lora_rank, set_kv_lora_rank);
  KVHOST_FLAG_FIELD(qk_rope_head_dim, set_qk_rope_head_dim);
  KVHOST_FLAG_FIELD(size_tokens, set_size_tokens);
  KVHOST_FLAG_FIELD(ratio, set_host_to_device_ratio);
  KVHOST_FLAG_FIELD(device_size_tokens, set_device_size_tokens);
  KVHOST_FLAG_FIELD(start_layer, set_start_layer);
  KVHOST_FLAG_FIELD(index_head_dim, set_index_head_dim);
  KVHOST_FLAG_FIELD(index_quant_block, set_index_quant_block_size);
  KVHOST_FLAG_FIELD(index_row_bytes, set_index_row_bytes);
  KVHOST_FLAG_FIELD(kv_cache_dim, set_kv_cache_dim);
  KVHOST_FLAG_FIELD(item_bytes, set_item_bytes);
  KVHOST_FLAG_FIELD(ring_size, set_ring_size);
  KVHOST_FLAG_FIELD(state_slot_bytes, set_state_slot_bytes);
#undef KVHOST_FLAG_FIELD
  if (const std::string temporal = absl::GetFlag(FLAGS_mamba_temporal); !temporal.empty()) {
    v1::DType dtype = spec.mamba().temporal_dtype();
    if (absl::Status s = ParseShape("mamba_temporal", temporal,
                                    spec.mutable_mamba()->mutable_temporal(), &dtype);
        !s.ok()) {
      return s;
    }
    spec.mutable_mamba()->set_temporal_dtype(dtype);
  }
  if (const std::string conv = absl::GetFlag(FLAGS_mamba_conv); !conv.empty()) {
    spec.mutable_mamba()->clear_conv();
    for (absl::string_view shape : absl::StrSplit(conv, ',')) {
      if (absl::Status s =
              ParseShape("mamba_conv", shape, spec.mutable_mamba()->add_conv(), nullptr);
          !s.ok()) {
        return s;
      }
    }
  }
  return spec;
}

// While `running` is true, redraws "<verb> pool 'x': 1.50 of 4.00 GiB (37 %)"
// on stderr every 200 ms from what `poll` returns (done, total bytes); only
// on a terminal. The line is cleared when it stops.
class ProgressLine {
 public:
  using Poll = std::function<std::optional<std::pair<uint64_t, uint64_t>>()>;
  ProgressLine(std::string label, Poll poll) {
    if (!::isatty(2)) return;
    thread_ = std::thread([this, label = std::move(label), poll = std::move(poll)] {
      bool drawn = false;
      while (!stop_.load()) {
        for (int i = 0; i < 20 && !stop_.load(); ++i) absl::SleepFor(absl::Milliseconds(10));
        if (stop_.load()) break;
        if (std::optional<std::pair<uint64_t, uint64_t>> p = poll(); p && p->second > 0) {
          std::fprintf(stderr, "\r%s: %s of %s GiB (%d %%)   ", label.c_str(),
                       Gib(p->first).c_str(), Gib(p->second).c_str(),
                       static_cast<int>(100.0 * p->first / p->second));
          std::fflush(stderr);
          drawn = true;
        }
      }
      if (drawn) std::fprintf(stderr, "\r\033[K");
    });
  }
  ~ProgressLine() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

absl::Status RunCreatePool(Context& ctx, const Args& args) {
  absl::StatusOr<v1::PoolSpec> parsed = SpecFromFlags();
  if (!parsed.ok()) return parsed.status();
  const v1::PoolSpec& spec = *parsed;

  // Only whether a required flag was given is checked here, so the message
  // can name the flag; kvhostd judges the values.
  const std::string kind = absl::AsciiStrToLower(v1::PoolKind_Name(spec.kind()));
  if (spec.layer_num() == 0 && spec.kind() != v1::LOGICAL) {
    return UsageError("create-pool needs --layers");
  }
  for (const Requirement& r : kRequirements) {
    if (r.kind == spec.kind() && !r.present(spec)) {
      return UsageError(absl::StrCat("create-pool --kind=", kind, " needs ", r.flags));
    }
  }
  if (spec.follows().empty() && spec.size_tokens() == 0 && spec.size_bytes() == 0 &&
      (spec.host_to_device_ratio() <= 0 || spec.device_size_tokens() == 0)) {
    return UsageError(
        "create-pool needs a size: --size-tokens, --size-bytes, or --ratio with "
        "--device-size-tokens");
  }

  absl::StatusOr<v1::Pool> pool;
  {
    // GetPool shows the pool CREATING with its populated bytes meanwhile;
    // polled on a client of its own, the CreatePool call runs on this one.
    absl::StatusOr<std::unique_ptr<Client>> poller = Client::Connect(ctx.options);
    ProgressLine line(absl::StrCat("creating pool '", args[0], "'"),
                      [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
                        if (!poller.ok()) return std::nullopt;
                        absl::StatusOr<v1::Pool> p = (*poller)->GetPool(args[0]);
                        if (!p.ok() || p->state() != v1::CREATING) return std::nullopt;
                        return std::make_pair(p->populated_bytes(), p->bytes());
                      });
    pool = ctx.client->CreatePool(args[0], spec);
  }
  if (pool.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // kvhostd stops populating within a chunk once the call is given up, and
    // the pool is then not created.
    return absl::DeadlineExceededError(
        absl::StrCat(pool.status().message(), "; pool '", args[0],
                     "' was not created (large pools need a longer --timeout)"));
  }
  if (!pool.ok()) return pool.status();
  if (ctx.json) {
    PrintLine(MessageJson(*pool));
  } else {
    PrintPool(*pool);
  }
  return absl::OkStatus();
}

absl::Status RunDeletePool(Context& ctx, const Args& args) {
  absl::StatusOr<uint64_t> released = ctx.client->DeletePool(args[0]);
  if (!released.ok()) return released.status();
  if (ctx.json) {
    v1::DeletePoolResponse response;
    response.set_bytes_released(*released);
    PrintLine(MessageJson(response));
  } else {
    PrintLine(absl::StrFormat("deleted pool '%s' (%s GiB released)", args[0], Gib(*released)));
  }
  // The name is free at once; the memory is unmapped in the background. On
  // a terminal, show it go (GetStatus pool_bytes_releasing), for at most the
  // call timeout.
  if (::isatty(2) && *released > 0) {
    const absl::Time until = absl::Now() + ctx.timeout;
    ProgressLine line(absl::StrCat("releasing pool '", args[0], "'"),
                      [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
                        absl::StatusOr<v1::DaemonStatus> d = ctx.client->GetStatus();
                        if (!d.ok()) return std::nullopt;
                        const uint64_t left = std::min(d->pool_bytes_releasing(), *released);
                        return std::make_pair(*released - left, *released);
                      });
    for (;;) {
      absl::StatusOr<v1::DaemonStatus> d = ctx.client->GetStatus();
      if (!d.ok() || d->pool_bytes_releasing() == 0 || absl::Now() > until) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  return absl::OkStatus();
}

absl::Status RunAlloc(Context& ctx, const Args& args) {
  uint64_t tokens = 0;
  if (!absl::SimpleAtoi(args[1], &tokens) || tokens == 0) {
    return UsageError(absl::StrCat("alloc: N '", args[1], "' is not a positive number of tokens"));
  }
  absl::StatusOr<std::vector<int64_t>> slots = ctx.client->Alloc(args[0], tokens);
  if (!slots.ok()) return slots.status();
  if (ctx.json) {
    PrintLine(JsonObject()
                  .Str("pool", args[0])
                  .Raw("indices", absl::StrCat("[", absl::StrJoin(*slots, ","), "]"))
                  .Str("runs", FormatRuns(*slots))
                  .str());
  } else {
    // Just the runs, so that `free POOL "$(kvhostctl alloc POOL N)"` works.
    PrintLine(FormatRuns(*slots));
  }
  return absl::OkStatus();
}

// INDICES may be split over several arguments ("0-15 32-47").
absl::StatusOr<std::vector<int64_t>> IndicesArg(const Args& args) {
  return ParseRuns(absl::StrJoin(args.begin() + 1, args.end(), ","));
}

absl::Status RunFree(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<int64_t>> slots = IndicesArg(args);
  if (!slots.ok()) return slots.status();
  absl::StatusOr<uint64_t> freed = ctx.client->Free(args[0], *slots);
  if (!freed.ok()) return freed.status();
  if (ctx.json) {
    PrintLine(JsonObject().Str("pool", args[0]).Uint("freed", *freed).str());
  } else {
    PrintLine(absl::StrFormat("freed %d token slot(s) of pool '%s'", *freed, args[0]));
  }
  return absl::OkStatus();
}

// What segment `i` of a PageBufferMeta covers, in the order pool.proto gives
// (per page, per layer for LAYER_FIRST, per component); empty when the answer
// does not have the shape that order implies.
std::string SegmentLabel(const v1::Pool& pool, absl::Span<const int64_t> slots, int segments,
                         int i) {
  const v1::PoolSpec& spec = pool.spec();
  std::vector<std::string> names;
  for (const v1::PoolComponent& c : pool.components()) {
    names.push_back(c.name() == "k" ? "K" : c.name() == "v" ? "V" : c.name());
  }
  if (names.empty()) {  // a daemon that does not list its components
    names =
        spec.kind() == v1::MHA ? std::vector<std::string>{"K", "V"} : std::vector<std::string>{""};
  }
  const int per_component = static_cast<int>(names.size());
  const bool per_layer = spec.layout() == v1::LAYER_FIRST;
  const int per_page = (per_layer ? static_cast<int>(spec.layer_num()) : 1) * per_component;
  const uint64_t page_size = spec.page_size();
  if (page_size == 0 || per_page == 0 ||
      static_cast<uint64_t>(segments) != slots.size() / page_size * per_page) {
    return "";
  }
  const int page_index = i / per_page;
  const int within = i % per_page;
  std::string label = absl::StrCat(
      "page ", static_cast<uint64_t>(slots[page_index * page_size]) / page_size,
      per_layer ? absl::StrCat(" layer ", within / per_component) : std::string(" all layers"));
  const std::string& name = names[within % per_component];
  if (!name.empty() && !(per_component == 1 && name == "latent"))
    absl::StrAppend(&label, " ", name);
  return label;
}

// The region files, numbered as region_index counts them.
void PrintRegions(const google::protobuf::RepeatedPtrField<std::string>& paths) {
  for (int r = 0; r < paths.size(); ++r) PrintLine(absl::StrFormat("  region %d: %s", r, paths[r]));
}

absl::Status RunMeta(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<int64_t>> slots = IndicesArg(args);
  if (!slots.ok()) return slots.status();
  absl::StatusOr<v1::PageBufferMeta> meta = ctx.client->GetPageBufferMeta(args[0], *slots);
  if (!meta.ok()) return meta.status();
  if (ctx.json) {
    PrintLine(MessageJson(*meta));
    return absl::OkStatus();
  }
  // The pool's shape names each segment; the segments are worth printing
  // without it (the pool may have gone meanwhile).
  absl::StatusOr<v1::Pool> pool = ctx.client->GetPool(args[0]);
  PrintLine(absl::StrFormat("pool '%s': %d segment(s)", args[0], meta->segments_size()));
  PrintRegions(meta->region_paths());
  std::vector<std::vector<std::string>> rows = {{"REGION", "OFFSET", "LENGTH", "COVERS"}};
  for (int i = 0; i < meta->segments_size(); ++i) {
    const v1::Segment& s = meta->segments(i);
    rows.push_back({absl::StrCat(s.region_index()), absl::StrCat(s.offset()),
                    absl::StrCat(s.length()),
                    pool.ok() ? SegmentLabel(*pool, *slots, meta->segments_size(), i) : ""});
  }
  PrintTable(rows, "rrrl", "  ");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> IndexArg(const std::string& text) {
  int64_t index = 0;
  if (!absl::SimpleAtoi(text, &index) || index < 0) {
    return UsageError(absl::StrCat("INDEX '", text, "' is not a slot (the first slot of a page)"));
  }
  return index;
}

// Up to this many bytes of a page are dumped as hex when no --out is given.
constexpr size_t kHexDumpBytes = 256;

absl::Status RunPageGet(Context& ctx, const Args& args) {
  absl::StatusOr<int64_t> index = IndexArg(args[1]);
  if (!index.ok()) return index.status();
  const int64_t indices[] = {*index};
  absl::StatusOr<std::vector<std::string>> pages =
      ctx.client->ReadPages(args[0], indices, absl::GetFlag(FLAGS_chunk_bytes));
  if (!pages.ok()) return pages.status();
  const std::string& page = (*pages)[0];
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::ofstream file(out, std::ios::binary | std::ios::trunc);
    file.write(page.data(), static_cast<std::streamsize>(page.size()));
    file.close();
    if (!file) return absl::UnavailableError(absl::StrCat("cannot write ", out));
  }
  if (ctx.json) {
    if (out.empty()) {
      v1::PageData data;
      data.set_index(*index);
      data.set_data(page);
      data.set_page_bytes(page.size());
      PrintLine(MessageJson(data));
    } else {
      PrintLine(JsonObject()
                    .Str("pool", args[0])
                    .Int("index", *index)
                    .Uint("page_bytes", page.size())
                    .Str("out", out)
                    .str());
    }
    return absl::OkStatus();
  }
  PrintLine(absl::StrFormat("pool '%s' page at slot %d: %d bytes%s", args[0], *index, page.size(),
                            out.empty() ? "" : absl::StrCat(", written to ", out)));
  if (!out.empty()) return absl::OkStatus();
  const size_t shown = std::min(page.size(), kHexDumpBytes);
  for (size_t row = 0; row < shown; row += 16) {
    std::string line = absl::StrFormat("  %08x ", row);
    for (size_t k = row; k < std::min(shown, row + 16); ++k) {
      absl::StrAppendFormat(&line, " %02x", static_cast<uint8_t>(page[k]));
    }
    PrintLine(line);
  }
  if (shown < page.size()) {
    PrintLine(
        absl::StrFormat("  ... %d more bytes (--out=FILE writes them all)", page.size() - shown));
  }
  return absl::OkStatus();
}

absl::Status RunPageSet(Context& ctx, const Args& args) {
  absl::StatusOr<int64_t> index = IndexArg(args[1]);
  if (!index.ok()) return index.status();
  const std::string in = absl::GetFlag(FLAGS_in);
  if (in.empty()) return UsageError("page-set needs --in=FILE (one flat page)");
  std::ifstream file(in, std::ios::binary);
  if (!file) return UsageError(absl::StrCat("page-set: cannot read ", in));
  std::vector<std::string> pages(1);
  pages[0].assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  const int64_t indices[] = {*index};
  absl::StatusOr<uint64_t> written =
      ctx.client->WritePages(args[0], indices, pages, absl::GetFlag(FLAGS_chunk_bytes));
  if (!written.ok()) return written.status();
  if (ctx.json) {
    v1::WritePagesResponse response;
    response.set_pages_written(*written);
    PrintLine(MessageJson(response));
  } else {
    PrintLine(absl::StrFormat("wrote page at slot %d of pool '%s' (%d bytes from %s)", *index,
                              args[0], pages[0].size(), in));
  }
  return absl::OkStatus();
}

absl::Status RunPageShape(Context& ctx, const Args& args) {
  absl::StatusOr<v1::PageShape> shape = ctx.client->GetPageShape(args[0]);
  if (!shape.ok()) return shape.status();
  if (ctx.json) {
    PrintLine(MessageJson(*shape));
    return absl::OkStatus();
  }
  PrintLine(absl::StrFormat("pool '%s': a flat page has %d bytes", args[0], shape->bytes()));
  std::vector<std::vector<std::string>> rows = {{"PART", "DIMS", "DTYPE", "BYTES"}};
  for (const v1::PageShape::Part& part : shape->parts()) {
    rows.push_back({part.component(), absl::StrCat("(", absl::StrJoin(part.dims(), ","), ")"),
                    absl::AsciiStrToLower(v1::DType_Name(part.dtype())),
                    absl::StrCat(part.bytes())});
  }
  PrintTable(rows, "lllr", "  ");
  return absl::OkStatus();
}

absl::Status RunSplitMeta(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<int64_t>> slots = IndicesArg(args);
  if (!slots.ok()) return slots.status();
  const uint32_t factor = absl::GetFlag(FLAGS_split_factor);
  if (factor == 0) return UsageError("split-meta needs --split-factor=F (head groups per page)");
  absl::StatusOr<v1::PageBufferMeta> meta =
      ctx.client->GetSplitHeadsPageBufferMeta(args[0], *slots, factor);
  if (!meta.ok()) return meta.status();
  if (ctx.json) {
    PrintLine(MessageJson(*meta));
    return absl::OkStatus();
  }
  PrintLine(absl::StrFormat("pool '%s': %d segment(s), %d head group(s) per page", args[0],
                            meta->segments_size(), factor));
  PrintRegions(meta->region_paths());
  std::vector<std::vector<std::string>> rows = {{"REGION", "OFFSET", "LENGTH"}};
  for (const v1::Segment& s : meta->segments()) {
    rows.push_back(
        {absl::StrCat(s.region_index()), absl::StrCat(s.offset()), absl::StrCat(s.length())});
  }
  PrintTable(rows, "rrr", "  ");
  return absl::OkStatus();
}

absl::Status RunStride(Context& ctx, const Args& args) {
  const uint64_t alignment = absl::GetFlag(FLAGS_alignment);
  absl::StatusOr<v1::StrideAlignment> stride = ctx.client->IsStridePageAligned(args[0], alignment);
  if (!stride.ok()) return stride.status();
  if (ctx.json) {
    PrintLine(MessageJson(*stride));
    return absl::OkStatus();
  }
  PrintLine(absl::StrFormat("pool '%s': page blocks %s on %d bytes; strides %s", args[0],
                            stride->aligned() ? "start" : "do not all start",
                            alignment == 0 ? 4096 : alignment,
                            absl::StrJoin(stride->page_strides(), ", ")));
  return absl::OkStatus();
}

absl::Status RunBufInfo(Context& ctx, const Args& args) {
  absl::StatusOr<v1::ContiguousBufferInfos> infos = ctx.client->GetContiguousBufferInfos(args[0]);
  if (!infos.ok()) return infos.status();
  if (ctx.json) {
    PrintLine(MessageJson(*infos));
    return absl::OkStatus();
  }
  PrintLine(absl::StrFormat("pool '%s': %d range(s)", args[0], infos->infos_size()));
  PrintRegions(infos->region_paths());
  std::vector<std::vector<std::string>> rows = {
      {"COMPONENT", "LAYER", "REGION", "OFFSET", "LENGTH", "ITEM"}};
  for (const v1::ContiguousBufferInfo& i : infos->infos()) {
    rows.push_back({i.component(), absl::StrCat(i.layer()), absl::StrCat(i.region_index()),
                    absl::StrCat(i.offset()), absl::StrCat(i.length()),
                    absl::StrCat(i.item_bytes())});
  }
  PrintTable(rows, "lrrrrr", "  ");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// demo.

std::atomic<bool> g_interrupted{false};

void OnInterrupt(int) { g_interrupted.store(true); }

// Client-side latencies of one kind of call, in microseconds.
class LatencyLog {
 public:
  void Add(std::chrono::steady_clock::duration d) {
    samples_.push_back(std::chrono::duration<double, std::micro>(d).count());
  }
  // Nearest-rank percentile, q in (0, 1]; 0 when empty.
  double Percentile(double q) const {
    if (samples_.empty()) return 0;
    std::vector<double> sorted = samples_;
    std::sort(sorted.begin(), sorted.end());
    const size_t rank = static_cast<size_t>(std::ceil(q * sorted.size()));
    return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
  }
  size_t count() const { return samples_.size(); }

 private:
  std::vector<double> samples_;
};

struct DirectionTotals {
  uint64_t bytes = 0;
  // Sum over tickets of submit -> WaitTransfer return, client side.
  double seconds = 0;
  double GbPerS() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

struct DemoOptions {
  std::string pool;
  v1::PoolSpec spec;
  uint64_t device_tokens = 0;
  uint64_t batch_tokens = 0;
  int cycles = 0;
  uint64_t seed = 0;
  std::string shm_dir;
};

struct DemoReport {
  int cycles_done = 0;
  DirectionTotals backup, load;
  LatencyLog alloc, free, backup_submit, load_submit, wait;
};

// Page size of the demo pools: the common inference-engine page.
constexpr uint32_t kDemoPageSize = 16;

absl::StatusOr<DemoOptions> DemoOptionsFromFlags() {
  DemoOptions o;
  o.pool = absl::GetFlag(FLAGS_demo_pool);
  absl::StatusOr<int> kind =
      ParseEnumFlag("demo_kind", absl::GetFlag(FLAGS_demo_kind), v1::PoolKind_descriptor());
  if (!kind.ok()) return kind.status();
  absl::StatusOr<int> layout =
      ParseEnumFlag("demo_layout", absl::GetFlag(FLAGS_demo_layout), v1::Layout_descriptor());
  if (!layout.ok()) return layout.status();
  o.spec.set_kind(static_cast<v1::PoolKind>(*kind));
  o.spec.set_layout(static_cast<v1::Layout>(*layout));
  o.spec.set_dtype(v1::BF16);
  o.spec.set_page_size(kDemoPageSize);
  o.spec.set_layer_num(absl::GetFlag(FLAGS_demo_layers));
  if (o.spec.kind() == v1::MLA) {
    // DeepSeek-V3's latent: 512 + 64 rotary.
    o.spec.set_kv_lora_rank(512);
    o.spec.set_qk_rope_head_dim(64);
  } else {
    o.spec.set_head_num(8);
    o.spec.set_head_dim(128);
  }
  o.spec.set_size_tokens(absl::GetFlag(FLAGS_demo_tokens));
  o.device_tokens = absl::GetFlag(FLAGS_demo_device_tokens);
  o.batch_tokens = absl::GetFlag(FLAGS_demo_batch_tokens);
  o.cycles = absl::GetFlag(FLAGS_demo_cycles);
  o.seed = absl::GetFlag(FLAGS_demo_seed);
  o.shm_dir = absl::GetFlag(FLAGS_shm_dir);
  if (o.cycles < 1) return UsageError("--demo-cycles must be >= 1");
  if (o.batch_tokens == 0 || o.batch_tokens % kDemoPageSize != 0) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " must be a positive multiple of the page size ",
                                   kDemoPageSize));
  }
  if (o.batch_tokens > o.device_tokens / kDemoPageSize * kDemoPageSize) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " needs that many page-aligned rows in --demo-device-tokens ",
                                   o.device_tokens));
  }
  if (o.batch_tokens > o.spec.size_tokens()) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " exceeds --demo-tokens ", o.spec.size_tokens()));
  }
  return o;
}

// Undoes what the demo set up in the daemon, newest first, however the run
// ends, so that a failed or interrupted demo leaves no attachment or pool.
class DemoCleanup {
 public:
  explicit DemoCleanup(Client* client) : client_(client) {}
  DemoCleanup(const DemoCleanup&) = delete;
  DemoCleanup& operator=(const DemoCleanup&) = delete;
  ~DemoCleanup() {
    if (!attachment_.empty()) {
      Warn(client_->DetachDevice(attachment_), absl::StrCat("detach ", attachment_));
    }
    if (!pool_.empty()) {
      Warn(client_->DeletePool(pool_).status(), absl::StrCat("delete pool '", pool_, "'"));
    }
  }
  void set_pool(const std::string& pool) { pool_ = pool; }
  void set_attachment(const std::string& id) { attachment_ = id; }

 private:
  static void Warn(const absl::Status& status, const std::string& what) {
    if (status.ok()) return;
    absl::FPrintF(stderr, "warning: cleanup could not %s: %s\n", what, status.ToString());
  }
  Client* const client_;
  std::string pool_;
  std::string attachment_;
};

// Fills every device row with random bytes that are never zero, so that a row
// the load failed to write (left zeroed) can never pass verification.
void FillNonZero(const ShmDevicePool& device, std::mt19937_64& rng) {
  const uint64_t layer_bytes = device.rows() * device.row_bytes();
  for (uint32_t plane = 0; plane < device.planes(); ++plane) {
    for (uint32_t layer = 0; layer < device.layers(); ++layer) {
      uint8_t* p = device.layer(plane, layer);
      for (uint64_t off = 0; off < layer_bytes; off += 8) {
        const uint64_t word = rng() | 0x0101010101010101ULL;
        std::memcpy(p + off, &word, std::min<uint64_t>(8, layer_bytes - off));
      }
    }
  }
}

// Runs one ticket to its end; adds its bytes and its submit -> done time.
absl::Status Transfer(Client& client, const Context& ctx, bool backup,
                      const std::string& attachment, const std::vector<int64_t>& host,
                      const std::vector<int64_t>& device, uint64_t expected_bytes,
                      DemoReport* report) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  absl::StatusOr<uint64_t> ticket =
      backup ? client.Backup(attachment, host, device) : client.Load(attachment, host, device);
  const Clock::time_point submitted = Clock::now();
  if (!ticket.ok()) return ticket.status();
  (backup ? report->backup_submit : report->load_submit).Add(submitted - start);
  absl::StatusOr<v1::TransferStatus> status = client.WaitTransfer(*ticket, ctx.timeout);
  const Clock::time_point done = Clock::now();
  if (!status.ok()) return status.status();
  report->wait.Add(done - submitted);
  if (status->bytes() != expected_bytes) {
    return MismatchError(absl::StrCat(backup ? "backup" : "load", " ticket ", *ticket, " reports ",
                                      status->bytes(), " bytes copied, expected ", expected_bytes));
  }
  DirectionTotals& totals = backup ? report->backup : report->load;
  totals.bytes += status->bytes();
  totals.seconds += std::chrono::duration<double>(done - start).count();
  return absl::OkStatus();
}

// Compares every chosen device row with its saved copy; names the first
// differing byte.
absl::Status Verify(const ShmDevicePool& device, const std::vector<int64_t>& host,
                    const std::vector<int64_t>& rows, const std::vector<uint8_t>& saved,
                    int cycle) {
  const uint64_t rb = device.row_bytes();
  for (uint32_t plane = 0; plane < device.planes(); ++plane) {
    for (uint32_t layer = 0; layer < device.layers(); ++layer) {
      for (size_t i = 0; i < rows.size(); ++i) {
        const uint8_t* got = device.row(plane, layer, rows[i]);
        const uint8_t* want =
            saved.data() + ((uint64_t{plane} * device.layers() + layer) * rows.size() + i) * rb;
        if (std::memcmp(got, want, rb) == 0) continue;
        uint64_t b = 0;
        while (got[b] == want[b]) ++b;
        return MismatchError(absl::StrFormat(
            "cycle %d: device row %d (host slot %d), %s, layer %d, byte %d of the row: wrote "
            "0x%02x, read back 0x%02x",
            cycle, rows[i], host[i], device.planes() == 2 ? (plane == 0 ? "K" : "V") : "latent",
            layer, b, want[b], got[b]));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DemoCycles(Context& ctx, const DemoOptions& o, const v1::Pool& pool,
                        const ShmDevicePool& device, const std::string& attachment,
                        std::mt19937_64& rng, DemoReport* report) {
  using Clock = std::chrono::steady_clock;
  Client& client = *ctx.client;
  const uint64_t ps = o.spec.page_size();
  const uint64_t batch_pages = o.batch_tokens / ps;
  const uint64_t transfer_bytes = o.batch_tokens * pool.bytes_per_token();
  std::vector<uint64_t> device_pages(device.rows() / ps);
  for (uint64_t p = 0; p < device_pages.size(); ++p) device_pages[p] = p;
  std::vector<uint8_t> saved(o.batch_tokens * device.planes() * device.layers() *
                             device.row_bytes());
  const int every = std::max(1, (o.cycles + 4) / 5);
  FILE* progress = ctx.json ? stderr : stdout;

  for (int cycle = 1; cycle <= o.cycles; ++cycle) {
    if (g_interrupted.load()) return absl::CancelledError("interrupted");
    Clock::time_point t = Clock::now();
    absl::StatusOr<std::vector<int64_t>> host = client.Alloc(o.pool, o.batch_tokens);
    if (!host.ok()) return host.status();
    report->alloc.Add(Clock::now() - t);

    // Random distinct device pages: a partial Fisher-Yates shuffle.
    std::vector<int64_t> rows;
    rows.reserve(o.batch_tokens);
    for (uint64_t i = 0; i < batch_pages; ++i) {
      std::uniform_int_distribution<uint64_t> pick(i, device_pages.size() - 1);
      std::swap(device_pages[i], device_pages[pick(rng)]);
      for (uint64_t j = 0; j < ps; ++j)
        rows.push_back(static_cast<int64_t>(device_pages[i] * ps + j));
    }

    absl::Status s =
        Transfer(client, ctx, /*backup=*/true, attachment, *host, rows, transfer_bytes, report);
    if (!s.ok()) return s;
    const uint64_t rb = device.row_bytes();
    for (uint32_t plane = 0; plane < device.planes(); ++plane) {
      for (uint32_t layer = 0; layer < device.layers(); ++layer) {
        for (size_t i = 0; i < rows.size(); ++i) {
          uint8_t* row = device.row(plane, layer, rows[i]);
          std::memcpy(
              saved.data() + ((uint64_t{plane} * device.layers() + layer) * rows.size() + i) * rb,
              row, rb);
          std::memset(row, 0, rb);
        }
      }
    }
    s = Transfer(client, ctx, /*backup=*/false, attachment, *host, rows, transfer_bytes, report);
    if (!s.ok()) return s;
    s = Verify(device, *host, rows, saved, cycle);
    if (!s.ok()) return s;

    t = Clock::now();
    absl::StatusOr<uint64_t> freed = client.Free(o.pool, *host);
    if (!freed.ok()) return freed.status();
    report->free.Add(Clock::now() - t);
    report->cycles_done = cycle;
    if (cycle % every == 0 || cycle == o.cycles) {
      absl::FPrintF(progress, "cycle %d/%d: backup %.2f GB/s, load %.2f GB/s, %d tokens verified\n",
                    cycle, o.cycles, report->backup.GbPerS(), report->load.GbPerS(),
                    o.batch_tokens * cycle);
      std::fflush(progress);
    }
  }
  return absl::OkStatus();
}

void PrintDemoReport(const Context& ctx, const DemoOptions& o, const v1::Pool& pool,
                     const DemoReport& r, const absl::Status& result) {
  struct Rpc {
    const char* name;
    const LatencyLog* log;
  };
  const Rpc rpcs[] = {{"alloc", &r.alloc},
                      {"free", &r.free},
                      {"backup_submit", &r.backup_submit},
                      {"load_submit", &r.load_submit},
                      {"wait_transfer", &r.wait}};
  if (ctx.json) {
    auto direction = [](const DirectionTotals& d) {
      return JsonObject()
          .Uint("bytes", d.bytes)
          .Num("seconds", d.seconds, 6)
          .Num("gb_per_s", d.GbPerS())
          .str();
    };
    JsonObject latency;
    for (const Rpc& rpc : rpcs) {
      latency.Raw(rpc.name, JsonObject()
                                .Uint("count", rpc.log->count())
                                .Num("p50_us", rpc.log->Percentile(0.50), 1)
                                .Num("p99_us", rpc.log->Percentile(0.99), 1)
                                .str());
    }
    JsonObject out;
    out.Str("pool", o.pool)
        .Str("shape", ShapeOf(o.spec))
        .Uint("layers", o.spec.layer_num())
        .Uint("page_size", o.spec.page_size())
        .Uint("pool_tokens", pool.size_tokens())
        .Uint("device_tokens", o.device_tokens)
        .Uint("batch_tokens", o.batch_tokens)
        .Uint("cycles", o.cycles)
        .Uint("cycles_done", r.cycles_done)
        .Raw("backup", direction(r.backup))
        .Raw("load", direction(r.load))
        .Raw("latency", latency.str())
        .Bool("verified", result.ok());
    if (!result.ok()) out.Str("error", result.message());
    PrintLine(out.str());
    return;
  }
  PrintLine("");
  PrintTable({{"DIRECTION", "GIB MOVED", "GB/S"},
              {"backup", Gib(r.backup.bytes), absl::StrFormat("%.2f", r.backup.GbPerS())},
              {"load", Gib(r.load.bytes), absl::StrFormat("%.2f", r.load.GbPerS())}},
             "lrr");
  PrintLine("(GB/s: bytes over the summed submit-to-WaitTransfer time of the tickets)");
  PrintLine("");
  std::vector<std::vector<std::string>> rows = {{"RPC", "CALLS", "P50 US", "P99 US"}};
  for (const Rpc& rpc : rpcs) {
    rows.push_back({rpc.name, absl::StrCat(rpc.log->count()),
                    absl::StrFormat("%.1f", rpc.log->Percentile(0.50)),
                    absl::StrFormat("%.1f", rpc.log->Percentile(0.99))});
  }
  PrintTable(rows, "lrrr");
  PrintLine("");
  PrintLine(result.ok() ? "verified: OK" : "verified: FAILED");
}

absl::Status RunDemo(Context& ctx, const Args&) {
  absl::StatusOr<DemoOptions> options = DemoOptionsFromFlags();
  if (!options.ok()) return options.status();
  const DemoOptions& o = *options;
  Client& client = *ctx.client;
  std::mt19937_64 rng(o.seed);

  // Declared before the cleanup so that the file outlives the attachment.
  std::unique_ptr<ShmDevicePool> device;
  DemoCleanup cleanup(&client);
  absl::StatusOr<v1::Pool> pool = client.CreatePool(o.pool, o.spec);
  if (!pool.ok()) return pool.status();
  cleanup.set_pool(o.pool);
  // The daemon attaches shm buffers from its own --shm-dir only.
  std::string shm_dir = o.shm_dir;
  if (shm_dir.empty()) {
    absl::StatusOr<v1::DaemonStatus> status = client.GetStatus();
    if (!status.ok()) return status.status();
    shm_dir = status->shm_dir();
  }
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> created =
      ShmDevicePool::Create(*pool, o.device_tokens, shm_dir);
  if (!created.ok()) return created.status();
  device = *std::move(created);
  FillNonZero(*device, rng);
  absl::StatusOr<v1::Attachment> attachment =
      client.AttachDevice(device->MakeAttachRequest(o.pool));
  if (!attachment.ok()) return attachment.status();
  cleanup.set_attachment(attachment->id());

  FILE* progress = ctx.json ? stderr : stdout;
  absl::FPrintF(progress,
                "demo: pool '%s' %s, %d layers, %s, %d tokens (%s GiB); device pool of %d rows "
                "(%s GiB) in %s; %d cycles of %d tokens\n",
                o.pool, ShapeOf(o.spec), o.spec.layer_num(), DimsOf(o.spec), pool->size_tokens(),
                Gib(pool->bytes()), device->rows(), Gib(device->bytes()), device->path(), o.cycles,
                o.batch_tokens);
  std::fflush(progress);

  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  sigaction(SIGINT, &action, nullptr);
  DemoReport report;
  absl::Status result = DemoCycles(ctx, o, *pool, *device, attachment->id(), rng, &report);
  // A failed RPC is reported as an error alone; numbers are shown for a
  // finished run or one that read back wrong bytes.
  if (result.ok() || result.GetPayload(kMismatchPayload).has_value()) {
    PrintDemoReport(ctx, o, *pool, report, result);
  }
  return result;
}

// ---------------------------------------------------------------------------
// watch.

// Each frame is two RPCs; refreshing faster than this is no longer readable
// and only adds load on the daemon.
constexpr absl::Duration kMinWatchInterval = absl::Milliseconds(100);

// The byte counters of one GetStatus answer and when it came, so that the next
// answer's counters become rates.
struct WatchSample {
  int64_t pid = 0;
  uint64_t backup_bytes = 0;
  uint64_t load_bytes = 0;
  std::chrono::steady_clock::time_point at;
};

// GB/s of each direction between two samples; NaN where there is none.
struct WatchRates {
  double backup = std::numeric_limits<double>::quiet_NaN();
  double load = std::numeric_limits<double>::quiet_NaN();
};

// The daemon counts a ticket's bytes when the ticket finishes, so a rate is
// the bytes of the tickets that finished between the two samples over the
// time between them. No rate across a daemon restart (another pid, or
// counters that went down).
WatchRates RatesBetween(const std::optional<WatchSample>& before, const WatchSample& now) {
  WatchRates rates;
  if (!before.has_value() || before->pid != now.pid || now.backup_bytes < before->backup_bytes ||
      now.load_bytes < before->load_bytes) {
    return rates;
  }
  const double seconds = std::chrono::duration<double>(now.at - before->at).count();
  if (!(seconds > 0)) return rates;
  rates.backup = static_cast<double>(now.backup_bytes - before->backup_bytes) / seconds / 1e9;
  rates.load = static_cast<double>(now.load_bytes - before->load_bytes) / seconds / 1e9;
  return rates;
}

struct WatchFrame {
  absl::Time time;
  // The first call that failed; the parts fetched before it are shown.
  absl::Status status;
  std::optional<v1::DaemonStatus> daemon;
  std::optional<std::vector<v1::Pool>> pools;
  WatchRates rates;
};

// One GetStatus and one ListPools; `previous` is the last sample taken and
// becomes this one's.
WatchFrame TakeWatchFrame(Client& client, std::optional<WatchSample>* previous) {
  WatchFrame frame;
  frame.time = absl::Now();
  absl::StatusOr<v1::DaemonStatus> daemon = client.GetStatus();
  if (!daemon.ok()) {
    frame.status = daemon.status();
    return frame;
  }
  const WatchSample sample{daemon->pid(), daemon->backup_bytes(), daemon->load_bytes(),
                           std::chrono::steady_clock::now()};
  frame.rates = RatesBetween(*previous, sample);
  *previous = sample;
  frame.daemon = *std::move(daemon);
  absl::StatusOr<std::vector<v1::Pool>> pools = client.ListPools();
  if (!pools.ok()) {
    frame.status = pools.status();
    return frame;
  }
  frame.pools = *std::move(pools);
  return frame;
}

std::string ErrorText(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

// "1.23", or "—" where there is no rate.
std::string RateText(double gb_per_s) {
  return std::isfinite(gb_per_s) ? absl::StrFormat("%.2f", gb_per_s) : std::string("—");
}

// "0s", "42s", "1h2m3s".
std::string UptimeText(uint64_t seconds) {
  return seconds == 0 ? std::string("0s")
                      : absl::FormatDuration(absl::Seconds(static_cast<int64_t>(seconds)));
}

std::vector<std::string> WatchFrameLines(const Context& ctx, const WatchFrame& frame) {
  std::vector<std::string> lines;
  const std::string time = absl::FormatTime("%Y-%m-%d %H:%M:%S", frame.time, absl::LocalTimeZone());
  if (frame.daemon.has_value()) {
    const v1::DaemonStatus& d = *frame.daemon;
    lines.push_back(absl::StrFormat("kvhostd %s at %s: %s backend, pid %d, up %s — %s", d.version(),
                                    ctx.server, d.backend(), d.pid(), UptimeText(d.uptime_s()),
                                    time));
  } else {
    lines.push_back(absl::StrFormat("kvhostd at %s — %s", ctx.server, time));
  }
  if (!frame.status.ok()) lines.push_back(absl::StrCat("error: ", ErrorText(frame.status)));
  if (frame.pools.has_value()) {
    if (frame.pools->empty()) {
      lines.push_back("no pools");
    } else {
      std::vector<std::vector<std::string>> rows = {
          {"POOL", "KIND", "LAYOUT", "PAGE", "TOKENS", "USED", "USED%", "GIB"}};
      for (const v1::Pool& pool : *frame.pools) {
        rows.push_back({pool.name(), v1::PoolKind_Name(pool.spec().kind()),
                        v1::Layout_Name(pool.spec().layout()),
                        absl::StrCat(pool.spec().page_size()), absl::StrCat(pool.size_tokens()),
                        absl::StrCat(UsedTokens(pool)), absl::StrFormat("%.1f", UsedPercent(pool)),
                        Gib(pool.bytes())});
      }
      for (std::string& line : kvhost::cli::TableLines(rows, "lllrrrrr")) {
        lines.push_back(std::move(line));
      }
    }
  }
  if (frame.daemon.has_value()) {
    const v1::DaemonStatus& d = *frame.daemon;
    // Why this reads lower than `kvhostctl demo`: the demo divides by the
    // tickets' own time, this by the time between two frames.
    lines.push_back(
        "(GB/s below: bytes finished between two frames over the wall-clock time between "
        "them, idle time included; `kvhostctl demo` divides by the transfers' own time)");
    lines.push_back(absl::StrFormat(
        "transfers: %d attachment(s), %d in flight, %d done, %d failed; GB/s: backup %s, load %s",
        d.attachments(), d.tickets_in_flight(), d.tickets_done(), d.tickets_failed(),
        RateText(frame.rates.backup), RateText(frame.rates.load)));
  }
  return lines;
}

std::string WatchFrameJson(const Context& ctx, const WatchFrame& frame) {
  JsonObject out;
  out.Str("time", absl::FormatTime(absl::RFC3339_sec, frame.time, absl::LocalTimeZone()))
      .Str("server", ctx.server)
      .Bool("ok", frame.status.ok());
  if (!frame.status.ok()) out.Str("error", ErrorText(frame.status));
  if (frame.daemon.has_value()) out.Raw("daemon", MessageJson(*frame.daemon));
  if (frame.pools.has_value()) {
    std::vector<std::string> pools;
    for (const v1::Pool& pool : *frame.pools) {
      pools.push_back(PoolUsageJson(pool)
                          .Str("kind", v1::PoolKind_Name(pool.spec().kind()))
                          .Str("layout", v1::Layout_Name(pool.spec().layout()))
                          .Uint("page_size", pool.spec().page_size())
                          .str());
    }
    out.Raw("pools", kvhost::cli::JsonArray(pools));
  }
  // null where there is no rate (first frame, daemon restarted).
  out.Num("backup_gb_per_s", frame.rates.backup).Num("load_gb_per_s", frame.rates.load);
  return out.str();
}

// ANSI sequences of the terminal view: each frame is drawn over the last.
constexpr char kHideCursor[] = "\x1b[?25l";
constexpr char kShowCursor[] = "\x1b[?25h";
constexpr char kClearScreen[] = "\x1b[2J";
constexpr char kCursorHome[] = "\x1b[H";
constexpr char kClearToLineEnd[] = "\x1b[K";
constexpr char kClearBelow[] = "\x1b[J";

// Sleeps until `deadline` in short steps; false if interrupted meanwhile.
bool SleepUntil(std::chrono::steady_clock::time_point deadline) {
  constexpr auto kStep = std::chrono::milliseconds(20);
  while (!g_interrupted.load()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return true;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(kStep, deadline - now));
  }
  return false;
}

absl::Status RunWatch(Context& ctx, const Args&) {
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  const int64_t count = absl::GetFlag(FLAGS_count);
  if (interval < kMinWatchInterval) {
    return UsageError(absl::StrCat("--interval ", absl::FormatDuration(interval),
                                   " is shorter than ", absl::FormatDuration(kMinWatchInterval)));
  }
  if (count < 0) return UsageError(absl::StrCat("--count ", count, " must be >= 0"));
  // Redrawn in place on a terminal; elsewhere every frame is kept, for scripts.
  const bool terminal = !ctx.json && isatty(STDOUT_FILENO) == 1;

  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  // After a failed frame the next one starts on a fresh channel: the old one
  // would keep failing without trying until its reconnect backoff ends, which
  // held a restarted daemon's frames back by about 4 s.
  std::unique_ptr<Client> fresh;
  Client* client = ctx.client;
  std::optional<WatchSample> previous;
  absl::Status last;
  auto next = std::chrono::steady_clock::now();
  for (int64_t n = 0; count == 0 || n < count; ++n) {
    if (n > 0 && !SleepUntil(next)) break;
    next = std::max(next + absl::ToChronoNanoseconds(interval), std::chrono::steady_clock::now());
    if (!last.ok()) {
      absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(ctx.options);
      // Connect refuses an empty address or unreadable TLS files, which
      // Dispatch has refused already; were it to fail, the old client stays
      // in use.
      if (connected.ok()) {
        fresh = *std::move(connected);
        client = fresh.get();
      }
    }
    const WatchFrame frame = TakeWatchFrame(*client, &previous);
    last = frame.status;
    std::string out;
    if (ctx.json) {
      out = absl::StrCat(WatchFrameJson(ctx, frame), "\n");
    } else if (terminal) {
      out = n == 0 ? absl::StrCat(kHideCursor, kClearScreen, kCursorHome) : kCursorHome;
      for (const std::string& line : WatchFrameLines(ctx, frame)) {
        absl::StrAppend(&out, line, kClearToLineEnd, "\n");
      }
      out += kClearBelow;
    } else {
      out = n == 0 ? "" : "\n";
      for (const std::string& line : WatchFrameLines(ctx, frame)) absl::StrAppend(&out, line, "\n");
    }
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
    if (g_interrupted.load()) break;
  }
  if (terminal) {
    std::fputs(kShowCursor, stdout);
    std::fflush(stdout);
  }
  // Without --count the watch ends only when stopped, which is no failure;
  // with it, a script learns whether the last frame reached the daemon.
  return count > 0 ? last : absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Pool groups.

// "0,-1,1" as a layer map.
std::string MapText(const v1::PoolEntry& entry) { return absl::StrJoin(entry.layer_map(), ","); }

absl::Status RunGroups(Context& ctx, const Args&) {
  absl::StatusOr<std::vector<v1::PoolGroup>> groups = ctx.client->ListPoolGroups();
  if (!groups.ok()) return groups.status();
  if (ctx.json) {
    v1::ListPoolGroupsResponse response;
    for (const v1::PoolGroup& g : *groups) *response.add_groups() = g;
    PrintLine(MessageJson(response));
    return absl::OkStatus();
  }
  if (groups->empty()) {
    PrintLine("no pool groups");
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {{"NAME", "LAYERS", "ANCHOR", "ATTACH", "ENTRIES"}};
  for (const v1::PoolGroup& g : *groups) {
    std::vector<std::string> entries;
    for (const v1::PoolEntry& e : g.entries()) entries.push_back(e.name() + "=" + e.pool());
    rows.push_back({g.name(), absl::StrCat(g.layer_num()), g.anchor(),
                    absl::StrCat(g.attachments()), absl::StrJoin(entries, " ")});
  }
  PrintTable(rows, "lrlrl");
  return absl::OkStatus();
}

void PrintGroup(const v1::PoolGroup& g) {
  PrintLine(absl::StrFormat("group '%s': %d model layers, %d entries, anchor '%s'", g.name(),
                            g.layer_num(), g.entries_size(), g.anchor()));
  std::vector<std::vector<std::string>> rows = {{"ENTRY", "POOL", "ANCHOR", "LAYER_MAP"}};
  for (const v1::PoolEntry& e : g.entries()) {
    rows.push_back({e.name(), e.pool(), e.anchor() ? "yes" : "-", MapText(e)});
  }
  PrintTable(rows, "llll", "  ");
  PrintLine(absl::StrFormat("  %d attachment(s)", g.attachments()));
}

absl::Status RunGroup(Context& ctx, const Args& args) {
  absl::StatusOr<v1::PoolGroup> group = ctx.client->GetPoolGroup(args[0]);
  if (!group.ok()) return group.status();
  if (ctx.json) {
    PrintLine(MessageJson(*group));
  } else {
    PrintGroup(*group);
  }
  return absl::OkStatus();
}

// "--entry" NAME:POOL[:anchor][:map=0,-1,1]
absl::StatusOr<v1::PoolEntry> ParseEntry(const std::string& text) {
  const auto bad = [&](absl::string_view why) {
    return UsageError(
        absl::StrCat("--entry '", text, "': ", why, "; write NAME:POOL[:anchor][:map=0,-1,1,...]"));
  };
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2 || parts[0].empty() || parts[1].empty()) {
    return bad("needs an entry name and a pool");
  }
  v1::PoolEntry entry;
  entry.set_name(parts[0]);
  entry.set_pool(parts[1]);
  bool mapped = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    if (part == "anchor" && !entry.anchor()) {
      entry.set_anchor(true);
    } else if (absl::StartsWith(part, "map=") && !mapped) {
      mapped = true;
      for (absl::string_view v : absl::StrSplit(part.substr(4), ',')) {
        int32_t layer = 0;
        if (!absl::SimpleAtoi(v, &layer)) {
          return bad(absl::StrCat("map value '", v, "' is not a layer number or -1"));
        }
        entry.add_layer_map(layer);
      }
    } else {
      return bad(absl::StrCat("'", part, "' is not 'anchor' or 'map=...' (each at most once)"));
    }
  }
  return entry;
}

absl::Status RunCreateGroup(Context& ctx, const Args& args) {
  const uint32_t layers = absl::GetFlag(FLAGS_layers);
  if (layers == 0) return UsageError("create-group needs --layers (the model's layers)");
  if (g_entries.empty()) {
    return UsageError("create-group needs --entry=NAME:POOL[:anchor][:map=...] per pool");
  }
  std::vector<v1::PoolEntry> entries;
  for (const std::string& text : g_entries) {
    absl::StatusOr<v1::PoolEntry> entry = ParseEntry(text);
    if (!entry.ok()) return entry.status();
    entries.push_back(*std::move(entry));
  }
  absl::StatusOr<v1::PoolGroup> group = ctx.client->CreatePoolGroup(args[0], layers, entries);
  if (!group.ok()) return group.status();
  if (ctx.json) {
    PrintLine(MessageJson(*group));
  } else {
    PrintGroup(*group);
  }
  return absl::OkStatus();
}

absl::Status RunDeleteGroup(Context& ctx, const Args& args) {
  if (absl::Status s = ctx.client->DeletePoolGroup(args[0]); !s.ok()) return s;
  if (ctx.json) {
    PrintLine(JsonObject().Str("deleted_group", args[0]).str());
  } else {
    PrintLine(absl::StrFormat("deleted pool group '%s' (its pools stay)", args[0]));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------

struct Command {
  const char* name;
  const char* args;  // for messages
  size_t min_args;
  size_t max_args;
  absl::Status (*run)(Context&, const Args&);
};

constexpr size_t kAnyNumber = std::numeric_limits<size_t>::max();

constexpr Command kCommands[] = {
    {"status", "", 0, 0, RunStatus},
    {"health", "[SERVICE]", 0, 1, RunHealth},
    {"pools", "", 0, 0, RunPools},
    {"pool", "NAME", 1, 1, RunPool},
    {"create-pool", "NAME", 1, 1, RunCreatePool},
    {"delete-pool", "NAME", 1, 1, RunDeletePool},
    {"groups", "", 0, 0, RunGroups},
    {"group", "NAME", 1, 1, RunGroup},
    {"create-group", "NAME", 1, 1, RunCreateGroup},
    {"delete-group", "NAME", 1, 1, RunDeleteGroup},
    {"alloc", "POOL N", 2, 2, RunAlloc},
    {"free", "POOL INDICES", 2, kAnyNumber, RunFree},
    {"meta", "POOL INDICES", 2, kAnyNumber, RunMeta},
    {"page-get", "POOL INDEX", 2, 2, RunPageGet},
    {"page-set", "POOL INDEX", 2, 2, RunPageSet},
    {"page-shape", "POOL", 1, 1, RunPageShape},
    {"split-meta", "POOL INDICES", 2, kAnyNumber, RunSplitMeta},
    {"stride", "POOL", 1, 1, RunStride},
    {"bufinfo", "POOL", 1, 1, RunBufInfo},
    {"demo", "", 0, 0, RunDemo},
    {"watch", "", 0, 0, RunWatch},
};

absl::Status Dispatch(const std::vector<std::string>& positional) {
  if (positional.size() < 2) return UsageError("no command given");
  const std::string& name = positional[1];
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) return UsageError(absl::StrCat("unknown command '", name, "'"));
  const Args args(positional.begin() + 2, positional.end());
  if (args.size() < command->min_args || args.size() > command->max_args) {
    return UsageError(absl::StrCat(command->name, " takes ",
                                   command->min_args == 0 ? "no arguments" : command->args,
                                   "; got ", args.size(), " argument(s)"));
  }

  Context ctx;
  ctx.json = absl::GetFlag(FLAGS_json);
  ctx.server = absl::GetFlag(FLAGS_server);
  const double timeout = absl::GetFlag(FLAGS_timeout);
  if (ctx.server.empty()) return UsageError("--server is empty");
  if (!(timeout > 0) || !std::isfinite(timeout)) {
    return UsageError(absl::StrCat("--timeout ", timeout, " must be a positive number of seconds"));
  }
  ctx.timeout = absl::Seconds(timeout);
  ctx.options = ClientOptionsFromFlags(ctx.server, ctx.timeout);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(ctx.options);
  if (!client.ok()) return client.status();
  ctx.client = client->get();
  return command->run(ctx, args);
}

}  // namespace

int main(int argc, char** argv) {
  if (absl::Status s = CheckFlags(argc, argv); !s.ok()) return Report(s);
  const std::vector<std::string> positional =
      kvhost::ParseFlags(argc, argv, kUsage, "client/kvhostctl.cc");
  return Report(Dispatch(positional));
}
