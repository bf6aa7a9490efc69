#include "server/transfer/attach.h"

#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvhost {
namespace {

// Kinds whose component 0 may come as k_layers, and component 1 as v_layers.
bool TakesKLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMla || kind == PoolKind::kMhaAsymmetric ||
         kind == PoolKind::kKOnly || kind == PoolKind::kDsa;
}
bool TakesVLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMhaAsymmetric;
}

// `request`'s layer range into `out`: 0 / 0 becomes the pool's; any other
// must not be empty.
absl::Status ResolveLayerRange(const Pool& pool, const std::string& what,
                               const AttachRequest& request, ResolvedAttach* out) {
  if (request.start_layer == 0 && request.end_layer == 0) {
    out->start_layer = pool.start_layer();
    out->end_layer = pool.end_layer();
    return absl::OkStatus();
  }
  if (request.start_layer >= request.end_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start_layer ", request.start_layer, " must be below end_layer ", request.end_layer,
        " (both 0: the layers of ", what, ", [", pool.start_layer(), ", ", pool.end_layer(), "))"));
  }
  out->start_layer = request.start_layer;
  out->end_layer = request.end_layer;
  return absl::OkStatus();
}

// Each component's buffers, from whichever field of `request` names it
// (k_layers, v_layers or components by name); a component given twice, or
// a field the pool's kind does not take, is INVALID_ARGUMENT. Moves the
// buffers out of `request`.
absl::StatusOr<std::vector<std::optional<ComponentBuffers>>> GatherBuffers(const Pool& pool,
                                                                           const std::string& what,
                                                                           AttachRequest* request) {
  const PoolKind kind = pool.spec().kind;
  const std::vector<Component>& components = pool.components();
  if (components.empty() &&
      (!request->k_layers.empty() || !request->v_layers.empty() || !request->named.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has no components and takes no device buffers"));
  }
  std::vector<std::optional<ComponentBuffers>> given(components.size());
  auto put = [&](size_t c, ComponentBuffers buffers) -> absl::Status {
    if (given[c].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("component '", components[c].name, "' of ",
                                                     what, " is given twice: in ", given[c]->field,
                                                     " and in ", buffers.field));
    }
    given[c] = std::move(buffers);
    return absl::OkStatus();
  };
  if (!request->k_layers.empty()) {
    if (!TakesKLayers(kind)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "k_layers has ", request->k_layers.size(), " buffers, but ", what,
          " takes its buffers in components, by name (k_layers names component 0 of MHA, MLA, "
          "MHA_ASYMMETRIC, K_ONLY and DSA)"));
    }
    if (absl::Status s = put(0, {components[0].name, "k_layers", std::move(request->k_layers)});
        !s.ok()) {
      return s;
    }
  }
  if (!request->v_layers.empty()) {
    if (!TakesVLayers(kind)) {
      return absl::InvalidArgumentError(
          absl::StrCat("v_layers has ", request->v_layers.size(), " buffers but ", what,
                       " needs 0 (v_layers names the V component of MHA and MHA_ASYMMETRIC)"));
    }
    if (absl::Status s = put(1, {components[1].name, "v_layers", std::move(request->v_layers)});
        !s.ok()) {
      return s;
    }
  }
  for (size_t i = 0; i < request->named.size(); ++i) {
    ComponentBuffers& named = request->named[i];
    size_t c = 0;
    while (c < components.size() && components[c].name != named.name) ++c;
    if (c == components.size()) {
      std::vector<std::string> names;
      for (const Component& component : components) names.push_back(component.name);
      return absl::InvalidArgumentError(
          absl::StrCat("components[", i, "] names component '", named.name, "', but ", what,
                       " has components ", absl::StrJoin(names, ", ")));
    }
    if (named.field.empty()) named.field = absl::StrCat("components[", i, "].layers");
    if (absl::Status s = put(c, std::move(named)); !s.ok()) return s;
  }
  return given;
}

// `given` as out->components, one per pool component in order, each with
// one buffer per attached layer. REQUIRES: out's layer range resolved.
absl::Status PlaceBuffers(const Pool& pool, const std::string& what,
                          std::vector<std::optional<ComponentBuffers>> given, ResolvedAttach* out) {
  const PoolKind kind = pool.spec().kind;
  const std::vector<Component>& components = pool.components();
  const uint32_t layers = out->layer_num();
  const std::string range =
      absl::StrCat("one per attached layer of [", out->start_layer, ", ", out->end_layer, ")");
  for (size_t c = 0; c < components.size(); ++c) {
    if (!given[c].has_value()) {
      const char* field = c == 0 && TakesKLayers(kind)   ? "k_layers"
                          : c == 1 && TakesVLayers(kind) ? "v_layers"
                                                         : "components";
      return absl::InvalidArgumentError(absl::StrCat(field, " has 0 buffers for component '",
                                                     components[c].name, "' but ", what, " needs ",
                                                     layers, " (", range, ")"));
    }
    if (given[c]->layers.size() != layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          given[c]->field, " has ", given[c]->layers.size(), " buffers for component '",
          components[c].name, "' but ", what, " needs ", layers, " (", range, ")"));
    }
    given[c]->name = components[c].name;
    out->components.push_back(*std::move(given[c]));
  }
  return absl::OkStatus();
}

// device_size_tokens: at least 1, at most 2^40, whole device rows of every
// component, and no layer buffer size that wraps.
absl::Status CheckDeviceSize(const Pool& pool, const std::string& what, uint64_t size_tokens) {
  if (size_tokens == 0) return absl::InvalidArgumentError("device_size_tokens must be >= 1");
  if (size_tokens > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_size_tokens ", size_tokens, " is too large"));
  }
  for (const Component& c : pool.components()) {
    if (size_tokens % c.row_tokens != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_size_tokens ", size_tokens, " is not a multiple of ", c.row_tokens,
          ": component '", c.name, "' of ", what, " has a device row per page of that many slots"));
    }
    // A layer buffer's size (rows x row bytes) must not wrap, or the engine's
    // size check passes for any file and device offsets run past its end.
    const uint64_t rows = size_tokens / c.row_tokens;
    if (rows > std::numeric_limits<uint64_t>::max() / c.row_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_size_tokens ", size_tokens, ": ", rows, " rows x ", c.row_bytes(),
                       " bytes of component '", c.name, "' is too large"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string PoolWhat(const Pool& pool) {
  return absl::StrCat("pool '", pool.name(), "' (", PoolKindName(pool.spec().kind), "/",
                      LayoutName(pool.spec().layout), ")");
}

absl::StatusOr<ResolvedAttach> ResolveAttachRequest(const Pool& pool, AttachRequest request) {
  const std::string what = PoolWhat(pool);
  ResolvedAttach resolved;
  if (absl::Status s = ResolveLayerRange(pool, what, request, &resolved); !s.ok()) return s;
  absl::StatusOr<std::vector<std::optional<ComponentBuffers>>> given =
      GatherBuffers(pool, what, &request);
  if (!given.ok()) return given.status();
  if (absl::Status s = PlaceBuffers(pool, what, *std::move(given), &resolved); !s.ok()) return s;
  if (absl::Status s = CheckDeviceSize(pool, what, request.device_size_tokens); !s.ok()) return s;
  resolved.device_size_tokens = request.device_size_tokens;
  absl::StatusOr<uint32_t> sets = ResolveLoadEventSets(request.load_event_sets);
  if (!sets.ok()) return sets.status();
  resolved.load_event_sets = *sets;
  return resolved;
}

absl::StatusOr<uint32_t> ResolveLoadEventSets(uint32_t sets) {
  if (sets > kMaxLoadEventSets) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_event_sets ", sets, " is above the limit of ", kMaxLoadEventSets));
  }
  return sets == 0 ? kDefaultLoadEventSets : sets;
}

}  // namespace kvhost
