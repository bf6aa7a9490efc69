// l3_record_fuzz: the L3 tier's record decoding (server/storage/page_record.h)
// against what a hostile memcached may hold.
//
// Two kinds of input, by the first byte:
//   * raw: up to 8 items of any bytes as the parts fetched for a key, checked
//     against a pool shape drawn from the input and an item size: DecodePartHeader,
//     PlausibleFirstPart and CheckPage never crash, never read out of bounds,
//     and never say kHit (that would be a forged MAC); a result other than a
//     hit carries a detail.
//   * mutated: a genuine page (EncodePage of a real pool's page under the
//     test secret, 3 parts) edited by the input (bytes flipped, parts cut,
//     dropped, swapped or duplicated, a field rewritten with the header CRC
//     fixed as an attacker would): CheckPage says kHit exactly when the parts
//     are the genuine ones, and then WriteCheckedPage writes the page's
//     bytes; anything else is not a hit and leaves the destination page as
//     it was. PlausibleFirstPart bounds what a fetch would ask for: a part 0
//     it accepts names exactly PartCount parts.
#include <fuzzer/FuzzedDataProvider.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "server/pool/pool.h"
#include "server/storage/crc32c.h"
#include "server/storage/l3_secret.h"
#include "server/storage/page_record.h"

namespace kvhost::fuzz {
namespace {

constexpr size_t kMaxParts = 8;
constexpr uint64_t kItemBytes = kPartHeaderBytes + 300;  // 768-byte pages: 3 parts

const L3Secret& Secret() {
  static const L3Secret secret = L3Secret::FromBytes("l3_record_fuzz secret, 32 bytes long");
  return secret;
}

// A pool of 768-byte pages with page 0 (source, random bytes) and page 1
// (destination) allocated, and page 0 encoded as a record under key "k".
struct Genuine {
  std::shared_ptr<Pool> pool;
  PageShapeTag tag;
  std::string ns;
  std::vector<std::string> items;
  std::vector<uint8_t> page;
  int64_t src = 0, dst = 0;
};

const Genuine& MakeGenuine() {
  static const Genuine* genuine = [] {
    char dir[] = "/dev/shm/kvhost-l3-fuzz.XXXXXX";
    if (mkdtemp(dir) == nullptr) Fail(__FILE__, __LINE__, "mkdtemp in /dev/shm failed");
    static std::string keep = dir;
    atexit([] { rmdir(keep.c_str()); });
    PoolSpec spec;
    spec.kind = PoolKind::kMha;
    spec.layout = LayoutKind::kPageFirst;
    spec.dtype = DType::kBf16;
    spec.page_size = 4;
    spec.layer_num = 3;
    spec.head_num = 2;
    spec.head_dim = 8;
    auto* g = new Genuine();
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create("fuzz", spec, 16, absl::StrCat(dir, "/kvhost.", getpid(), "."));
    FUZZ_CHECK(pool.ok(), pool.status().ToString());
    g->pool = *pool;
    absl::StatusOr<std::vector<uint64_t>> pages = g->pool->AllocPages(8);
    FUZZ_CHECK(pages.ok() && pages->size() == 2, "two pages");
    g->src = static_cast<int64_t>((*pages)[0] * spec.page_size);
    g->dst = static_cast<int64_t>((*pages)[1] * spec.page_size);
    g->page.resize(g->pool->flat_page_bytes());
    for (size_t i = 0; i < g->page.size(); ++i) g->page[i] = static_cast<uint8_t>(i * 7 + 1);
    FUZZ_CHECK(g->pool->WritePage(g->src, g->page).ok(), "write");
    g->tag = *ShapeTagOf(*g->pool);
    g->ns = Secret().PublicNamespace();
    absl::StatusOr<std::vector<std::string>> items =
        EncodePage(*g->pool, g->src, g->tag, RecordScope{&Secret(), g->ns, "k"}, 42, kItemBytes);
    FUZZ_CHECK(items.ok() && items->size() == 3, "encode");
    g->items = *items;
    return g;
  }();
  return *genuine;
}

void PutU32(std::string& item, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) item[at + i] = static_cast<char>(v >> (8 * i));
}

void FixHeaderCrc(std::string& item) {
  const size_t at = kPartHeaderBytes - 4;
  if (item.size() < kPartHeaderBytes) return;
  PutU32(item, at, Crc32c(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(item.data()), at)));
}

void CheckPlausible(const std::optional<std::string>& first, const PageShapeTag& want,
                    uint64_t item_bytes) {
  if (!first.has_value()) return;
  absl::StatusOr<PartHeader> h = DecodePartHeader(*first);
  if (h.ok() && PlausibleFirstPart(*h, want, item_bytes)) {
    FUZZ_CHECK(h->count == PartCount(want.page_bytes, item_bytes), "a believed count of ",
               h->count);
  }
}

void Raw(FuzzedDataProvider& in) {
  PageShapeTag want;
  want.fingerprint = in.ConsumeIntegral<uint64_t>();
  want.page_bytes = in.ConsumeIntegralInRange<uint64_t>(1, 1 << 14);
  const uint64_t item_bytes = in.ConsumeIntegralInRange<uint64_t>(kPartHeaderBytes + 1, 1 << 13);
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, kMaxParts);
  std::vector<std::optional<std::string>> parts;
  for (size_t i = 0; i < n; ++i) {
    if (in.ConsumeBool()) {
      parts.emplace_back(std::nullopt);
    } else {
      parts.emplace_back(in.ConsumeRandomLengthString(2 * kPartHeaderBytes + 64));
    }
  }
  for (const auto& p : parts) {
    if (p.has_value()) (void)DecodePartHeader(*p);
  }
  if (!parts.empty()) CheckPlausible(parts[0], want, item_bytes);
  const PageResult r =
      CheckPage(want, RecordScope{&Secret(), Secret().PublicNamespace(), "k"}, item_bytes, parts);
  FUZZ_CHECK(r.outcome != PageOutcome::kHit, "random bytes passed as a page");
  FUZZ_CHECK(!r.detail.empty(), "a ", PageOutcomeName(r.outcome), " without a detail");
}

void Mutated(FuzzedDataProvider& in) {
  const Genuine& g = MakeGenuine();
  std::vector<std::optional<std::string>> parts(g.items.begin(), g.items.end());
  const int edits = in.ConsumeIntegralInRange<int>(0, 6);
  for (int e = 0; e < edits && !parts.empty(); ++e) {
    const size_t p = in.ConsumeIntegralInRange<size_t>(0, parts.size() - 1);
    switch (in.ConsumeIntegralInRange<int>(0, 6)) {
      case 0:  // flip a byte
        if (parts[p].has_value() && !parts[p]->empty()) {
          const size_t at = in.ConsumeIntegralInRange<size_t>(0, parts[p]->size() - 1);
          (*parts[p])[at] = static_cast<char>((*parts[p])[at] ^ in.ConsumeIntegral<uint8_t>());
        }
        break;
      case 1:  // cut short
        if (parts[p].has_value()) {
          parts[p]->resize(in.ConsumeIntegralInRange<size_t>(0, parts[p]->size()));
        }
        break;
      case 2:  // evicted
        parts[p].reset();
        break;
      case 3:  // drop the last part
        parts.pop_back();
        break;
      case 4:  // swap with another part
        std::swap(parts[p], parts[in.ConsumeIntegralInRange<size_t>(0, parts.size() - 1)]);
        break;
      case 5:  // one more part
        if (parts.size() < kMaxParts) parts.push_back(parts[p]);
        break;
      case 6:  // a header field rewritten, its CRC fixed (as anyone can)
        if (parts[p].has_value() && parts[p]->size() >= kPartHeaderBytes) {
          const size_t at = 4 * in.ConsumeIntegralInRange<size_t>(2, (kPartHeaderBytes - 8) / 4);
          PutU32(*parts[p], at, in.ConsumeIntegral<uint32_t>());
          FixHeaderCrc(*parts[p]);
        }
        break;
    }
  }
  const bool genuine = parts.size() == g.items.size() &&
                       std::equal(parts.begin(), parts.end(), g.items.begin(),
                                  [](const std::optional<std::string>& a, const std::string& b) {
                                    return a.has_value() && *a == b;
                                  });
  const std::string key = in.ConsumeBool() ? "k" : in.ConsumeRandomLengthString(16);
  CheckPlausible(parts.empty() ? std::nullopt : parts[0], g.tag, kItemBytes);
  const PageResult r = CheckPage(g.tag, RecordScope{&Secret(), g.ns, key}, kItemBytes, parts);
  std::vector<uint8_t> before(g.page.size());
  FUZZ_CHECK(g.pool->ReadPage(g.dst, absl::MakeSpan(before)).ok(), "read");
  if (genuine && key == "k") {
    FUZZ_CHECK(r.outcome == PageOutcome::kHit, "the genuine page is ", PageOutcomeName(r.outcome),
               ": ", r.detail);
    FUZZ_CHECK(WriteCheckedPage(*g.pool, g.dst, parts).ok(), "write");
    std::vector<uint8_t> after(g.page.size());
    FUZZ_CHECK(g.pool->ReadPage(g.dst, absl::MakeSpan(after)).ok(), "read");
    FUZZ_CHECK(after == g.page, "the hit wrote other bytes");
    return;
  }
  FUZZ_CHECK(r.outcome != PageOutcome::kHit,
             "an edited page (or another key) passed: ", parts.size(), " parts");
  FUZZ_CHECK(!r.detail.empty(), "a ", PageOutcomeName(r.outcome), " without a detail");
}

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    kvhost::fuzz::Raw(in);
  } else {
    kvhost::fuzz::Mutated(in);
  }
  return 0;
}
