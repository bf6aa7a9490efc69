#include "server/storage/page_record.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/storage/crc32c.h"

namespace kvhost {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'L', '3'};
// Version 2: the MAC (version 1 records, CRCs only, are refused).
constexpr uint16_t kVersion = 2;
constexpr size_t kMacOffset = 68;
constexpr size_t kHeaderCrcOffset = kMacOffset + kL3MacBytes;
static_assert(kHeaderCrcOffset + 4 == kPartHeaderBytes);

void Put16(uint8_t* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t Get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

absl::Span<const uint8_t> AsBytes(absl::string_view s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// FNV-1a, 64 bits: a fingerprint of the shape's text, not a security
// measure (the MAC authenticates a record, l3_secret.h).
uint64_t Fnv1a64(absl::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string DescribeStored(const PartHeader& h) {
  PageShapeTag tag;
  tag.fingerprint = h.fingerprint;
  tag.kind = h.kind;
  tag.layout = h.layout;
  tag.dtype = h.dtype;
  tag.page_size = h.page_size;
  tag.layer_num = h.layer_num;
  tag.page_bytes = h.page_bytes;
  return tag.Describe();
}

void EncodeHeader(const PartHeader& h, uint8_t* out) {
  std::memset(out, 0, kPartHeaderBytes);
  std::memcpy(out, kMagic, 4);
  Put16(out + 4, kVersion);
  Put16(out + 6, static_cast<uint16_t>(kPartHeaderBytes));
  Put64(out + 8, h.fingerprint);
  Put64(out + 16, h.store_id);
  Put64(out + 24, h.page_bytes);
  Put64(out + 32, h.offset);
  Put32(out + 40, h.index);
  Put32(out + 44, h.count);
  Put32(out + 48, h.part_crc);
  Put32(out + 52, h.page_crc);
  out[56] = h.kind;
  out[57] = h.layout;
  out[58] = h.dtype;
  Put32(out + 60, h.page_size);
  Put32(out + 64, h.layer_num);
  std::memcpy(out + kMacOffset, h.mac.data(), kL3MacBytes);
  Put32(out + kHeaderCrcOffset, Crc32c(absl::MakeConstSpan(out, kHeaderCrcOffset)));
}

PageResult Corrupt(std::string detail) { return {PageOutcome::kCorrupt, std::move(detail)}; }

// The MAC of a page: what its header says of it (all but where each part
// sits, which the bytes' order fixes) and its bytes, for its scope.
L3Mac PageMac(const RecordScope& scope, const PartHeader& h,
              absl::Span<const absl::string_view> bodies) {
  L3Secret::Mac mac(*scope.secret);
  mac.Update(absl::string_view("kvhost l3 page v2"));
  mac.Update(scope.ns);
  mac.UpdateU64(scope.key.size());
  mac.Update(scope.key);
  mac.UpdateU64(h.fingerprint);
  mac.UpdateU64(h.store_id);
  mac.UpdateU64(h.page_bytes);
  mac.UpdateU64(h.count);
  mac.UpdateU64(uint64_t{h.kind} | uint64_t{h.layout} << 8 | uint64_t{h.dtype} << 16);
  mac.UpdateU64(uint64_t{h.page_size} | uint64_t{h.layer_num} << 32);
  for (const absl::string_view body : bodies) mac.Update(body);
  return mac.Final();
}

}  // namespace

const char* PageOutcomeName(PageOutcome outcome) {
  switch (outcome) {
    case PageOutcome::kStored:
      return "stored";
    case PageOutcome::kHit:
      return "hit";
    case PageOutcome::kMiss:
      return "miss";
    case PageOutcome::kCorrupt:
      return "corrupt";
    case PageOutcome::kShapeMismatch:
      return "shape_mismatch";
    case PageOutcome::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

std::string PageShapeTag::Describe() const {
  return absl::StrCat(
      PoolKindName(static_cast<PoolKind>(kind)), "/", LayoutName(static_cast<LayoutKind>(layout)),
      " ", DTypeName(static_cast<DType>(dtype)), " ps=", page_size, " L=", layer_num, ", ",
      page_bytes, "-byte pages (shape ", absl::Hex(fingerprint, absl::kZeroPad16), ")");
}

absl::StatusOr<PageShapeTag> ShapeTagOf(const Pool& pool) {
  absl::StatusOr<std::vector<PagePart>> parts = pool.PageShape();
  if (!parts.ok()) return parts.status();
  const PoolSpec& spec = pool.spec();
  std::string text = absl::StrCat(DescribeSpec(spec), " start_layer=", spec.start_layer,
                                  " page_bytes=", pool.flat_page_bytes());
  for (const PagePart& part : *parts) {
    absl::StrAppend(&text, " [", part.component, " ", DTypeName(part.dtype), " ", part.bytes);
    for (const uint64_t d : part.dims) absl::StrAppend(&text, " ", d);
    absl::StrAppend(&text, "]");
  }
  PageShapeTag tag;
  tag.fingerprint = Fnv1a64(text);
  tag.kind = static_cast<uint8_t>(spec.kind);
  tag.layout = static_cast<uint8_t>(spec.layout);
  tag.dtype = static_cast<uint8_t>(spec.dtype);
  tag.page_size = spec.page_size;
  tag.layer_num = spec.layer_num;
  tag.page_bytes = pool.flat_page_bytes();
  return tag;
}

std::string PartKey(absl::string_view base, uint32_t part) {
  std::string out(base);
  if (part > 0) absl::StrAppend(&out, ".", part);
  return out;
}

absl::Status CheckStorageKey(absl::string_view key, const std::string& what) {
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (key.size() > kMaxStorageKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", key.size(), " bytes, over the limit of ", kMaxStorageKeyBytes));
  }
  return absl::OkStatus();
}

uint32_t PartCount(uint64_t page_bytes, uint64_t max_item_bytes) {
  const uint64_t payload = max_item_bytes - kPartHeaderBytes;
  return page_bytes == 0 ? 1 : static_cast<uint32_t>((page_bytes + payload - 1) / payload);
}

absl::StatusOr<std::vector<std::string>> EncodePage(const Pool& pool, int64_t first_slot,
                                                    const PageShapeTag& tag,
                                                    const RecordScope& scope, uint64_t store_id,
                                                    uint64_t max_item_bytes) {
  const uint64_t payload = max_item_bytes - kPartHeaderBytes;
  const uint32_t count = PartCount(tag.page_bytes, max_item_bytes);
  std::vector<std::string> items(count);
  std::vector<PartHeader> headers(count);
  uint32_t page_crc = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t offset = uint64_t{i} * payload;
    const uint64_t n = std::min(payload, tag.page_bytes - offset);
    items[i].resize(kPartHeaderBytes + n);
    auto* body = reinterpret_cast<uint8_t*>(items[i].data()) + kPartHeaderBytes;
    if (absl::Status s = pool.ReadPageRange(first_slot, offset, absl::MakeSpan(body, n)); !s.ok()) {
      return s;
    }
    PartHeader& h = headers[i];
    h.part_crc = Crc32c(absl::MakeConstSpan(body, n));
    page_crc = Crc32cExtend(page_crc, absl::MakeConstSpan(body, n));
    h.offset = offset;
    h.index = i;
  }
  std::vector<absl::string_view> bodies;
  bodies.reserve(count);
  for (const std::string& item : items) {
    bodies.push_back(absl::string_view(item).substr(kPartHeaderBytes));
  }
  for (uint32_t i = 0; i < count; ++i) {
    PartHeader& h = headers[i];
    h.fingerprint = tag.fingerprint;
    h.store_id = store_id;
    h.page_bytes = tag.page_bytes;
    h.count = count;
    h.page_crc = page_crc;
    h.kind = tag.kind;
    h.layout = tag.layout;
    h.dtype = tag.dtype;
    h.page_size = tag.page_size;
    h.layer_num = tag.layer_num;
    h.mac = i == 0 ? PageMac(scope, h, bodies) : headers[0].mac;
  }
  // Headers last: `bodies` looks into the items.
  for (uint32_t i = 0; i < count; ++i) {
    EncodeHeader(headers[i], reinterpret_cast<uint8_t*>(items[i].data()));
  }
  return items;
}

absl::StatusOr<PartHeader> DecodePartHeader(absl::string_view item) {
  if (item.size() < kPartHeaderBytes) {
    return absl::DataLossError(absl::StrCat("an item of ", item.size(), " bytes, shorter than the ",
                                            kPartHeaderBytes, "-byte header"));
  }
  const auto* p = reinterpret_cast<const uint8_t*>(item.data());
  if (std::memcmp(p, kMagic, 4) != 0) return absl::DataLossError("not a kvhost page (magic)");
  if (Get16(p + 4) != kVersion || Get16(p + 6) != kPartHeaderBytes) {
    return absl::DataLossError(absl::StrCat("page format version ", Get16(p + 4), ", header of ",
                                            Get16(p + 6), " bytes; this kvhostd reads version ",
                                            kVersion));
  }
  if (Get32(p + kHeaderCrcOffset) != Crc32c(absl::MakeConstSpan(p, kHeaderCrcOffset))) {
    return absl::DataLossError("header checksum mismatch");
  }
  if (p[59] != 0) return absl::DataLossError("reserved header byte 59 is not 0");
  PartHeader h;
  h.fingerprint = Get64(p + 8);
  h.store_id = Get64(p + 16);
  h.page_bytes = Get64(p + 24);
  h.offset = Get64(p + 32);
  h.index = Get32(p + 40);
  h.count = Get32(p + 44);
  h.part_crc = Get32(p + 48);
  h.page_crc = Get32(p + 52);
  h.kind = p[56];
  h.layout = p[57];
  h.dtype = p[58];
  h.page_size = Get32(p + 60);
  h.layer_num = Get32(p + 64);
  std::memcpy(h.mac.data(), p + kMacOffset, kL3MacBytes);
  return h;
}

bool PlausibleFirstPart(const PartHeader& first, const PageShapeTag& want,
                        uint64_t max_item_bytes) {
  return first.index == 0 && first.fingerprint == want.fingerprint &&
         first.page_bytes == want.page_bytes &&
         first.count == PartCount(want.page_bytes, max_item_bytes);
}

PageResult CheckPage(const PageShapeTag& want, const RecordScope& scope, uint64_t max_item_bytes,
                     absl::Span<const std::optional<std::string>> parts) {
  if (parts.empty() || !parts[0].has_value()) return {PageOutcome::kMiss, "not stored"};
  absl::StatusOr<PartHeader> first = DecodePartHeader(*parts[0]);
  if (!first.ok()) return Corrupt(absl::StrCat("part 0: ", first.status().message()));
  if (first->fingerprint != want.fingerprint || first->page_bytes != want.page_bytes) {
    return {PageOutcome::kShapeMismatch, absl::StrCat("the stored page is ", DescribeStored(*first),
                                                      ", the pool's pages are ", want.Describe())};
  }
  const uint32_t count = PartCount(want.page_bytes, max_item_bytes);
  if (!PlausibleFirstPart(*first, want, max_item_bytes) || parts.size() != count) {
    return Corrupt(absl::StrCat(
        "part 0 says it is part ", first->index, " of ", first->count, "; ", want.page_bytes,
        "-byte pages in items of ", max_item_bytes, " bytes have ", count,
        " parts (is --l3-item-bytes the same on every node?), ", parts.size(), " were read"));
  }
  uint64_t offset = 0;
  uint32_t page_crc = 0;
  std::vector<absl::string_view> bodies;
  bodies.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string where = absl::StrCat("part ", i, " of ", parts.size());
    if (!parts[i].has_value()) {
      // Evicted, or on a server that died or was restarted: lost, as a page
      // whose part 0 is gone is, so a miss rather than bad bytes.
      return {PageOutcome::kMiss, absl::StrCat(where, " is missing (torn page)")};
    }
    absl::StatusOr<PartHeader> h = DecodePartHeader(*parts[i]);
    if (!h.ok()) return Corrupt(absl::StrCat(where, ": ", h.status().message()));
    // Every page-wide field as part 0 says (which the MAC covers), so no
    // header field goes unchecked.
    if (h->store_id != first->store_id || h->index != i || h->count != first->count ||
        h->fingerprint != first->fingerprint || h->page_crc != first->page_crc ||
        h->page_bytes != first->page_bytes || h->kind != first->kind ||
        h->layout != first->layout || h->dtype != first->dtype ||
        h->page_size != first->page_size || h->layer_num != first->layer_num ||
        !L3Secret::MacEquals(h->mac, first->mac)) {
      return Corrupt(absl::StrCat(where, " belongs to another store of the key (torn page)"));
    }
    const absl::string_view text = absl::string_view(*parts[i]).substr(kPartHeaderBytes);
    const absl::Span<const uint8_t> body = AsBytes(text);
    if (h->offset != offset || body.size() > want.page_bytes - offset) {
      return Corrupt(absl::StrCat(where, " holds bytes [", h->offset, ", +", body.size(),
                                  "), expected from ", offset, " within ", want.page_bytes));
    }
    if (Crc32c(body) != h->part_crc) return Corrupt(absl::StrCat(where, ": checksum mismatch"));
    page_crc = Crc32cExtend(page_crc, body);
    offset += body.size();
    bodies.push_back(text);
  }
  if (offset != want.page_bytes) {
    return Corrupt(absl::StrCat("the parts hold ", offset, " of ", want.page_bytes, " bytes"));
  }
  if (page_crc != first->page_crc) return Corrupt("page checksum mismatch");
  if (!L3Secret::MacEquals(PageMac(scope, *first, bodies), first->mac)) {
    PageResult forged{PageOutcome::kMiss,
                      "the stored page is not authenticated (its MAC fails: forged, or stored "
                      "under another --l3-secret-file or for another namespace)"};
    forged.unauthenticated = true;
    return forged;
  }
  return {PageOutcome::kHit, ""};
}

absl::Status WriteCheckedPage(Pool& pool, int64_t first_slot,
                              absl::Span<const std::optional<std::string>> parts) {
  uint64_t offset = 0;
  for (const std::optional<std::string>& part : parts) {
    const absl::Span<const uint8_t> body =
        AsBytes(absl::string_view(*part).substr(kPartHeaderBytes));
    if (absl::Status s = pool.WritePageRange(first_slot, offset, body); !s.ok()) return s;
    offset += body.size();
  }
  return absl::OkStatus();
}

}  // namespace kvhost
