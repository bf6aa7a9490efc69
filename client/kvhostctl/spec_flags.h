// create-pool's flags and the kvhost.v1.PoolSpec they stand for: --spec's
// protobuf JSON, then every flag given (with --spec) or every flag with its
// default (without it), and which flags each kind needs.
//
// Reads the flags; call after they are parsed, from the main thread.
#ifndef KVHOST_CLIENT_KVHOSTCTL_SPEC_FLAGS_H_
#define KVHOST_CLIENT_KVHOSTCTL_SPEC_FLAGS_H_

#include <cstdint>
#include <set>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvhost/v1/pool.pb.h"

// Also create-group's model layers.
ABSL_DECLARE_FLAG(uint32_t, layers);

namespace kvhost::ctl {

// The spec of create-pool. `given` holds the flags given on the command line
// (underscored names): with --spec only they override its fields.
absl::StatusOr<v1::PoolSpec> SpecFromFlags(const std::set<std::string>& given);

// Whether `spec` has what its kind needs besides the values: layers, the
// kind's dimensions, a size. Only presence is checked here, so that the
// message can name the flag; kvhostd judges the values.
absl::Status CheckSpecComplete(const v1::PoolSpec& spec);

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_SPEC_FLAGS_H_
