// spec_fuzz: kvhost.v1.PoolSpec -> FromProto -> ValidateSpec ->
// ResolveSizeTokens -> MakeComponents, the path every CreatePool takes.
//
// The input fills the proto's fields through FuzzedDataProvider (each value
// drawn from a size class: small, page-like, a power of two or any, so
// accepted specs are common and the overflow edges are reached). Checked:
//   * every refusal is INVALID_ARGUMENT with a message;
//   * an accepted spec's sizes computed again in 128 bits equal the code's:
//     bytes per page == the sum of its components' page rows, the pool's
//     bytes == pages x bytes per page and fit in 64 bits, each component's
//     bytes == its layout's dimensions multiplied out, components of one
//     region follow each other from offset 0 (offset + bytes within the
//     region), token rows below 2^32 bytes;
//   * MHA / MLA / K_ONLY: the one-region layout is the components' planes;
//   * ToProto then FromProto gives the same spec back.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "kvhost/v1/pool.pb.h"
#include "server/pool/pool_spec.h"
#include "server/service/convert.h"

namespace kvhost::fuzz {
namespace {

using u128 = unsigned __int128;

std::string U128(u128 v) {
  std::string s;
  do {
    s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v != 0);
  return s;
}

// A value of one of four size classes.
uint64_t Draw(FuzzedDataProvider& in, uint64_t max) {
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
    case 0:
      return 0;
    case 1:
      return in.ConsumeIntegralInRange<uint64_t>(1, std::min<uint64_t>(8, max));
    case 2:
      return in.ConsumeIntegralInRange<uint64_t>(1, std::min<uint64_t>(4096, max));
    case 3: {
      const int bits = max == UINT32_MAX ? 32 : 64;
      const uint64_t p = uint64_t{1} << in.ConsumeIntegralInRange<int>(0, bits - 1);
      return p - in.ConsumeIntegralInRange<uint64_t>(0, 1);  // 2^k or 2^k - 1
    }
    default:
      return in.ConsumeIntegralInRange<uint64_t>(0, max);
  }
}

uint32_t Draw32(FuzzedDataProvider& in) { return static_cast<uint32_t>(Draw(in, UINT32_MAX)); }

void FillShape(FuzzedDataProvider& in, v1::Shape* shape) {
  const int dims = in.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < dims; ++i) shape->add_dims(Draw32(in));
}

void FillSpec(FuzzedDataProvider& in, v1::PoolSpec* s) {
  // One past each enum's range on both sides, to reach the refusals.
  s->set_kind(static_cast<v1::PoolKind>(in.ConsumeIntegralInRange<int>(-1, 11)));
  s->set_layout(static_cast<v1::Layout>(in.ConsumeIntegralInRange<int>(-1, 5)));
  s->set_dtype(static_cast<v1::DType>(in.ConsumeIntegralInRange<int>(-1, 7)));
  // A bitmask says which optional fields are set, so most specs leave the
  // fields their kind does not read at 0.
  const uint32_t set = in.ConsumeIntegral<uint32_t>();
  auto has = [&](int bit) { return (set >> bit) & 1; };
  if (has(0)) s->set_page_size(Draw32(in));
  if (has(1)) s->set_layer_num(Draw32(in));
  if (has(2)) s->set_head_num(Draw32(in));
  if (has(3)) s->set_head_dim(Draw32(in));
  if (has(4)) s->set_v_head_dim(Draw32(in));
  if (has(5)) s->set_kv_lora_rank(Draw32(in));
  if (has(6)) s->set_qk_rope_head_dim(Draw32(in));
  if (has(7)) s->set_size_tokens(Draw(in, UINT64_MAX));
  if (has(8)) s->set_size_bytes(Draw(in, UINT64_MAX));
  if (has(9)) {
    const double ratios[] = {0.5, 1.0, 2.0, 3.7, -1.0, 1e300, 0.0};
    s->set_host_to_device_ratio(in.ConsumeBool() ? ratios[in.ConsumeIntegralInRange<int>(0, 6)]
                                                 : in.ConsumeFloatingPoint<double>());
  }
  if (has(10)) s->set_device_size_tokens(Draw(in, UINT64_MAX));
  if (has(11)) {
    // Pool names are ASCII; a proto3 string is valid UTF-8 on the wire anyway.
    std::string follows = in.ConsumeBool() ? "anchor" : in.ConsumeRandomLengthString(8);
    for (char& c : follows) c = static_cast<char>(' ' + static_cast<unsigned char>(c) % 95);
    s->set_follows(follows);
  }
  if (has(12)) s->set_start_layer(Draw32(in));
  if (has(13)) s->set_index_head_dim(Draw32(in));
  if (has(14)) s->set_index_quant_block_size(Draw32(in));
  if (has(15)) s->set_index_row_bytes(Draw32(in));
  if (has(16)) s->set_kv_cache_dim(Draw32(in));
  if (has(17)) {
    v1::MambaStates* m = s->mutable_mamba();
    FillShape(in, m->mutable_temporal());
    if (in.ConsumeBool()) {
      m->set_temporal_dtype(static_cast<v1::DType>(in.ConsumeIntegralInRange<int>(-1, 7)));
    }
    const int convs = in.ConsumeIntegralInRange<int>(0, 9);
    for (int j = 0; j < convs; ++j) FillShape(in, m->add_conv());
  }
  if (has(18)) s->set_item_bytes(Draw(in, UINT64_MAX));
  if (has(19)) s->set_ring_size(Draw32(in));
  if (has(20)) s->set_state_slot_bytes(Draw(in, UINT64_MAX));
}

void CheckAccepted(const PoolSpec& spec, uint64_t tokens) {
  const std::string what = DescribeSpec(spec);
  const uint64_t ps = spec.page_size;
  FUZZ_CHECK(tokens > 0 && tokens % ps == 0, what, " resolved to ", tokens, " tokens");
  const uint64_t pages = tokens / ps;
  const std::vector<Component> comps = MakeComponents(spec, tokens);
  const std::vector<std::string> suffixes = RegionSuffixes(spec);
  FUZZ_CHECK(comps.empty() == (spec.kind == PoolKind::kLogical), what);

  u128 page_bytes = 0;
  u128 pool_bytes = 0;
  std::vector<u128> region_end(suffixes.size(), 0);    // the components' bytes
  std::vector<u128> region_next(suffixes.size(), 0);   // where the next one starts
  std::vector<u128> region_reach(suffixes.size(), 0);  // the last byte any one covers
  for (const Component& c : comps) {
    const KvLayout& l = c.layout;
    FUZZ_CHECK(c.region < suffixes.size(), what, " component ", c.name, " region ", c.region);
    FUZZ_CHECK(l.planes == 1 && l.layers == spec.layer_num && l.heads >= 1 && l.head_bytes >= 1,
               what, " component ", c.name);
    const bool page_row = c.row_tokens != 1;
    FUZZ_CHECK(page_row ? c.row_tokens == ps && l.tokens == pages && l.page_size == 1
                        : l.tokens == tokens && l.page_size == ps,
               what, " component ", c.name, " rows");
    FUZZ_CHECK(page_row || c.row_bytes() < (uint64_t{1} << 32), what, " token row of ",
               c.row_bytes(), " bytes");
    const u128 row = u128{l.heads} * l.head_bytes;
    FUZZ_CHECK(row == l.token_bytes, what, " component ", c.name, " row bytes wrapped");
    const u128 bytes = u128{l.layers} * l.tokens * row;
    FUZZ_CHECK(bytes == c.bytes(), what, " component ", c.name, " has ", c.bytes(),
               " bytes, its dimensions give ", U128(bytes));
    // Components of one region follow each other; PAGE_UNIFIED's planes
    // interleave, each one plane chunk after the last, inside the
    // region's total bytes.
    const bool unified = spec.layout == LayoutKind::kPageUnified;
    FUZZ_CHECK(c.region_offset == region_next[c.region], what, " component ", c.name, " at offset ",
               c.region_offset, " of region ", c.region, " whose next one is at ",
               U128(region_next[c.region]));
    FUZZ_CHECK(c.extent_bytes() >= c.bytes() && (unified || c.extent_bytes() == c.bytes()), what,
               " component ", c.name, " extent ", c.extent_bytes());
    region_next[c.region] += unified ? u128{l.plane_stride} : bytes;
    region_end[c.region] += bytes;
    region_reach[c.region] =
        std::max(region_reach[c.region], u128{c.region_offset} + c.extent_bytes());
    FUZZ_CHECK(region_end[c.region] <= UINT64_MAX, what, " region ", c.region, " overflows");
    page_bytes += row * l.layers * (page_row ? 1 : ps);
    pool_bytes += bytes;
  }
  for (size_t r = 0; r < suffixes.size(); ++r) {
    FUZZ_CHECK(region_reach[r] == region_end[r], what, " region ", r, " holds ",
               U128(region_end[r]), " bytes but its components reach byte ", U128(region_reach[r]));
  }
  FUZZ_CHECK(page_bytes == BytesPerPage(spec), what, " BytesPerPage ", BytesPerPage(spec),
             " but the components' page rows sum to ", U128(page_bytes));
  FUZZ_CHECK(pool_bytes == page_bytes * pages && pool_bytes <= UINT64_MAX, what, " pool bytes ",
             U128(pool_bytes), " != ", pages, " pages x ", U128(page_bytes));
  FUZZ_CHECK(BytesPerToken(spec) == BytesPerPage(spec) / ps, what);

  const KvLayout kv = MakeKvLayout(spec, tokens);
  FUZZ_CHECK(kv.tokens == tokens && kv.page_size == ps && kv.layers == spec.layer_num, what);
  if (PlaneCount(spec) != 0) {
    FUZZ_CHECK(kv.planes == PlaneCount(spec) && comps.size() == kv.planes && suffixes.size() == 1,
               what, " planes ", kv.planes);
    FUZZ_CHECK(kv.token_bytes == RowBytes(spec), what);
    for (uint64_t p = 0; p < kv.planes; ++p) {
      FUZZ_CHECK(
          comps[p].region_offset == p * kv.plane_stride && comps[p].row_bytes() == kv.token_bytes,
          what, " plane ", p);
    }
    FUZZ_CHECK(kv.total_bytes() == pool_bytes, what, " layout bytes ", kv.total_bytes());
  } else {
    FUZZ_CHECK(kv.planes == 0 && kv.total_bytes() == 0, what);
  }
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  v1::PoolSpec proto;
  FillSpec(in, &proto);

  absl::StatusOr<PoolSpec> spec = FromProto(proto);
  if (!spec.ok()) {
    FUZZ_CHECK(IsErrorOf(spec.status(), {absl::StatusCode::kInvalidArgument}),
               spec.status().ToString());
    return;
  }
  const absl::Status valid = ValidateSpec(*spec);
  if (!valid.ok()) {
    FUZZ_CHECK(IsErrorOf(valid, {absl::StatusCode::kInvalidArgument}), valid.ToString());
    return;
  }
  // The round trip the API shows clients (Pool.spec) gives the same spec.
  v1::PoolSpec again;
  ToProto(*spec, &again);
  absl::StatusOr<PoolSpec> back = FromProto(again);
  FUZZ_CHECK(back.ok(), back.status().ToString());
  v1::PoolSpec twice;
  ToProto(*back, &twice);
  FUZZ_CHECK(again.SerializeAsString() == twice.SerializeAsString(), DescribeSpec(*spec),
             " changes in ToProto / FromProto");

  absl::StatusOr<uint64_t> tokens = ResolveSizeTokens(*spec);
  if (!tokens.ok()) {
    FUZZ_CHECK(IsErrorOf(tokens.status(), {absl::StatusCode::kInvalidArgument,
                                           absl::StatusCode::kResourceExhausted}),
               tokens.status().ToString());
    return;
  }
  CheckAccepted(*spec, *tokens);
}

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvhost::fuzz::Run(data, size);
  return 0;
}
