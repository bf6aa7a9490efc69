// allocator_fuzz: a sequence of Alloc / Free / CheckAllocated / Clear calls
// on a PageAllocator, against a shadow model of its documented behaviour
// (server/pool/allocator.h: best fit among the free extents, else the fewest
// runs): alloc_model::ExtentModel of tests/allocator_models.h, which finds the
// extents by scanning a bitmap of the pool on every call.
//
// Free goes through ParsePages, as Pool::Free does, with slot lists that are
// valid or broken on purpose (repeated page, out of range, negative, not a
// page start, a broken run, a length that is not a multiple of page_size).
// Checked after every call:
//   * Alloc hands out exactly the pages the model predicts (so no page is
//     handed out twice, the extents stay maximal, and a failed call changed
//     nothing);
//   * errors have the documented code and a message, and leave the output
//     vector untouched;
//   * free + allocated == page_num, and each page's allocated state matches
//     the model (probed with CheckAllocated);
//   * at the end, draining the allocator one page at a time returns the
//     model's pages in order.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "absl/strings/str_join.h"
#include "fuzz/fuzz_check.h"
#include "server/pool/allocator.h"
#include "tests/allocator_models.h"

namespace kvhost::fuzz {
namespace {

constexpr int kMaxOps = 256;

struct Model {
  uint64_t page_num = 0;
  uint64_t page_size = 1;
  alloc_model::ExtentModel pages{0};
  bool allocated(uint64_t page) const { return pages.allocated(page); }
};

// ParsePages' contract restated: the page ids, or nothing when invalid.
bool ModelParse(const std::vector<int64_t>& slots, const Model& m, std::vector<uint64_t>* pages) {
  const uint64_t ps = m.page_size;
  const uint64_t size = m.page_num * ps;
  if (slots.empty() || slots.size() % ps != 0) return false;
  std::set<uint64_t> seen;
  for (size_t i = 0; i < slots.size(); i += ps) {
    const int64_t first = slots[i];
    if (first < 0 || static_cast<uint64_t>(first) >= size || first % static_cast<int64_t>(ps)) {
      return false;
    }
    for (uint64_t j = 1; j < ps; ++j) {
      if (slots[i + j] != first + static_cast<int64_t>(j)) return false;
    }
    if (!seen.insert(static_cast<uint64_t>(first) / ps).second) return false;
    pages->push_back(static_cast<uint64_t>(first) / ps);
  }
  return true;
}

void CheckState(const PageAllocator& a, const Model& m) {
  FUZZ_CHECK(a.free_pages() == m.pages.free_pages(), "free_pages ", a.free_pages(), " model ",
             m.pages.free_pages());
  uint64_t allocated = 0;
  for (uint64_t p = 0; p < m.page_num; ++p) {
    // Any slot of the page tells; use its last one.
    const int64_t slot[1] = {static_cast<int64_t>((p + 1) * m.page_size - 1)};
    const absl::Status s = a.CheckAllocated(slot);
    FUZZ_CHECK(s.ok() == m.allocated(p), "page ", p, " allocated in model ", m.allocated(p),
               " but CheckAllocated says ", s.ToString());
    if (!s.ok()) {
      FUZZ_CHECK(IsErrorOf(s, {absl::StatusCode::kFailedPrecondition}), s.ToString());
    }
    allocated += m.allocated(p);
  }
  FUZZ_CHECK(a.free_pages() + allocated == m.page_num, "free ", a.free_pages(), " + allocated ",
             allocated, " != ", m.page_num);
}

uint64_t DrawTokens(FuzzedDataProvider& in, const Model& m) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return in.ConsumeIntegralInRange<uint64_t>(0, 4) * m.page_size;
    case 1:
      return in.ConsumeIntegralInRange<uint64_t>(0, m.page_num + 1) * m.page_size;
    case 2:
      return in.ConsumeIntegralInRange<uint64_t>(0, 3 * m.page_size);
    default:
      return in.ConsumeIntegral<uint64_t>();
  }
}

std::vector<int64_t> DrawSlots(FuzzedDataProvider& in, const Model& m) {
  const int64_t ps = static_cast<int64_t>(m.page_size);
  std::vector<int64_t> allocated;
  for (uint64_t p = 0; p < m.page_num; ++p) {
    if (m.allocated(p)) allocated.push_back(static_cast<int64_t>(p));
  }
  std::vector<int64_t> slots;
  const int n = in.ConsumeIntegralInRange<int>(0, 8);
  for (int k = 0; k < n; ++k) {
    int64_t page = 0;
    if (!allocated.empty() && in.ConsumeBool()) {
      page = allocated[in.ConsumeIntegralInRange<size_t>(0, allocated.size() - 1)];
    } else {
      page = in.ConsumeIntegralInRange<int64_t>(-1, static_cast<int64_t>(m.page_num));
    }
    for (int64_t j = 0; j < ps; ++j) slots.push_back(page * ps + j);
  }
  // Break the list in one of the ways a client could.
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      if (!slots.empty()) slots.insert(slots.end(), slots.begin(), slots.begin() + ps);
      break;
    case 1:
      if (!slots.empty()) slots.pop_back();
      break;
    case 2:
      if (!slots.empty()) {
        slots[in.ConsumeIntegralInRange<size_t>(0, slots.size() - 1)] +=
            in.ConsumeIntegralInRange<int64_t>(-2, 2);
      }
      break;
    case 3:
      if (!slots.empty()) {
        slots[in.ConsumeIntegralInRange<size_t>(0, slots.size() - 1)] =
            in.ConsumeIntegral<int64_t>();
      }
      break;
    default:
      break;  // as drawn
  }
  return slots;
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Model m;
  m.page_num = in.ConsumeIntegralInRange<uint64_t>(0, 64);
  m.page_size = in.ConsumeIntegralInRange<uint64_t>(1, 8);
  m.pages = alloc_model::ExtentModel(m.page_num);
  PageAllocator a(m.page_num, m.page_size);
  CheckState(a, m);

  for (int op = 0; op < kMaxOps && in.remaining_bytes() > 0; ++op) {
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
      case 0: {  // Alloc
        const uint64_t tokens = DrawTokens(in, m);
        // Alloc appends: a vector that holds something already must keep it.
        std::vector<uint64_t> pages(in.ConsumeIntegralInRange<size_t>(0, 2), 77);
        const std::vector<uint64_t> before = pages;
        const absl::Status s = a.Alloc(tokens, &pages);
        if (tokens == 0 || tokens % m.page_size != 0) {
          FUZZ_CHECK(IsErrorOf(s, {absl::StatusCode::kInvalidArgument}), tokens,
                     " tokens: ", s.ToString());
        } else if (tokens / m.page_size > m.pages.free_pages()) {
          FUZZ_CHECK(IsErrorOf(s, {absl::StatusCode::kResourceExhausted}), tokens,
                     " tokens: ", s.ToString());
        } else {
          FUZZ_CHECK(s.ok(), tokens, " tokens: ", s.ToString());
          std::vector<uint64_t> want = before;
          const std::vector<uint64_t> got = m.pages.Alloc(tokens / m.page_size);
          want.insert(want.end(), got.begin(), got.end());
          FUZZ_CHECK(pages == want, "Alloc ", tokens, " gave [", absl::StrJoin(pages, ","),
                     "], model [", absl::StrJoin(want, ","), "]");
          break;
        }
        FUZZ_CHECK(pages == before, "a failed Alloc changed its output");
        break;
      }
      case 1: {  // Free, as Pool::Free: ParsePages then FreePages
        const std::vector<int64_t> slots = DrawSlots(in, m);
        std::vector<uint64_t> want;
        const bool parses = ModelParse(slots, m, &want);
        absl::StatusOr<std::vector<uint64_t>> pages =
            ParsePages(slots, m.page_size, m.page_num * m.page_size);
        FUZZ_CHECK(pages.ok() == parses, "ParsePages([", absl::StrJoin(slots, ","),
                   "]) = ", pages.status().ToString(), ", model says ", parses);
        if (!pages.ok()) {
          FUZZ_CHECK(IsErrorOf(pages.status(), {absl::StatusCode::kInvalidArgument}),
                     pages.status().ToString());
          break;
        }
        FUZZ_CHECK(*pages == want, "ParsePages gave [", absl::StrJoin(*pages, ","), "]");
        const bool all_allocated =
            std::all_of(want.begin(), want.end(), [&](uint64_t p) { return m.allocated(p); });
        const absl::Status s = a.FreePages(*pages);
        if (all_allocated) {
          FUZZ_CHECK(s.ok(), s.ToString());
          m.pages.Free(want);
        } else {
          FUZZ_CHECK(IsErrorOf(s, {absl::StatusCode::kFailedPrecondition}), s.ToString());
        }
        break;
      }
      case 2: {  // CheckAllocated on in-range slots
        std::vector<int64_t> slots;
        const int n = in.ConsumeIntegralInRange<int>(0, 6);
        bool all = true;
        for (int k = 0; k < n && m.page_num > 0; ++k) {
          const uint64_t slot =
              in.ConsumeIntegralInRange<uint64_t>(0, m.page_num * m.page_size - 1);
          slots.push_back(static_cast<int64_t>(slot));
          all = all && m.allocated(slot / m.page_size);
        }
        const absl::Status s = a.CheckAllocated(slots);
        FUZZ_CHECK(s.ok() == all, "CheckAllocated([", absl::StrJoin(slots, ","),
                   "]) = ", s.ToString());
        break;
      }
      default:  // Clear
        a.Clear();
        m.pages.Clear();
        break;
    }
    CheckState(a, m);
  }

  // The order, in full: drain one page at a time.
  while (m.pages.free_pages() > 0) {
    std::vector<uint64_t> page;
    const absl::Status s = a.Alloc(m.page_size, &page);
    const uint64_t want = m.pages.Alloc(1)[0];
    FUZZ_CHECK(s.ok() && page.size() == 1 && page[0] == want, "draining: got ", s.ToString(), " [",
               absl::StrJoin(page, ","), "], model ", want);
  }
  CheckState(a, m);
}

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvhost::fuzz::Run(data, size);
  return 0;
}
