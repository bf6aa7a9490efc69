// How kvhostctl shows pools to people and scripts: sizes in GiB, a pool's
// kind/layout/dtype and dimensions in words, how full it is, and the region
// files of a metadata answer. The generic writers (JSON objects, protobuf
// messages as JSON, aligned tables) are client/cli_output.h's, shared with
// the benchmarks.
//
// Stateless functions; output lines are written whole.
#ifndef KVHOST_CLIENT_KVHOSTCTL_OUTPUT_H_
#define KVHOST_CLIENT_KVHOSTCTL_OUTPUT_H_

#include <cstdint>
#include <string>

#include "client/cli_output.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "kvhost/v1/daemon.pb.h"
#include "kvhost/v1/pool.pb.h"

namespace kvhost::ctl {

using cli::JsonObject;
using cli::MessageJson;
using cli::PrintLine;
using cli::PrintTable;

// Sizes in GiB, the unit the size flags take (--size-bytes=64G is 64 GiB):
// "1.50". Rates stay in decimal GB/s, as link bandwidths are quoted.
std::string Gib(uint64_t bytes);

// "MHA/PAGE_FIRST/BF16".
std::string ShapeOf(const v1::PoolSpec& spec);

// The kind's dimensions in words: "8 heads x 128 dims".
std::string DimsOf(const v1::PoolSpec& spec);

// Device layers held, "[2,5)" when sharded, else the layer count.
std::string LayersOf(const v1::Pool& pool);

// The pool's state for the STATE column: "READY", or "CREATING 37%" (of its
// bytes reserved and mapped so far). A pool still being created has no
// allocator yet: its used tokens are 0 and its USED% "-".
std::string StateOf(const v1::Pool& pool);
uint64_t UsedTokens(const v1::Pool& pool);
double UsedPercent(const v1::Pool& pool);
// UsedPercent as the tables show it: "12.5", or "-" while CREATING.
std::string UsedPercentText(const v1::Pool& pool);

// How full a pool is, for status --json and watch --json.
JsonObject PoolUsageJson(const v1::Pool& pool);

// The region files, numbered as region_index counts them.
void PrintRegions(const google::protobuf::RepeatedPtrField<std::string>& paths);

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_OUTPUT_H_
