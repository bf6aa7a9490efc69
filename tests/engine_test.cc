// Tests of the piece iterator every engine uses (ForEachPiece,
// server/transfer/engine.h): for every layout of each kind, the pieces of
// random runs, cut at random points, copy exactly what a naive reference
// moving one (token, head) at a time with KvLayout::Offset copies.
#include "server/transfer/engine.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvhost/layout.h"
#include "server/pool/pool_spec.h"
#include "server/transfer/runs.h"
#include "transfer_test_util.h"

namespace kvhost {

namespace {

using ::kvhost::testing::AllShapes;
using ::kvhost::testing::NaiveCopy;
using ::kvhost::testing::RandomBytes;
using ::kvhost::testing::RandomPairs;
using ::kvhost::testing::SameBytes;
using ::kvhost::testing::Shape;
using ::kvhost::testing::SpecOf;

class ForEachPieceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ForEachPieceTest, MatchesNaivePerHeadCopy) {
  const Shape& shape = GetParam();
  const PoolSpec spec = SpecOf(shape);
  ASSERT_TRUE(ValidateSpec(spec).ok());
  const uint64_t tokens = shape.pages * shape.page_size;
  const KvLayout layout = MakeKvLayout(spec, tokens);
  const uint64_t rows = tokens + 7;  // device pool of a different size
  const uint64_t layer_bytes = rows * layout.token_bytes;
  std::mt19937_64 rng(std::hash<std::string>()(shape.name));

  for (int round = 0; round < 12; ++round) {
    for (bool backup : {true, false}) {
      auto [host_idx, dev_idx] = RandomPairs(rng, tokens, rows, 1 + rng() % tokens);
      std::vector<IndexRun> runs = CoalesceRuns(host_idx, dev_idx);
      std::vector<uint8_t> host = RandomBytes(rng, layout.total_bytes());
      std::vector<uint8_t> dev = RandomBytes(rng, layout.planes * layout.layers * layer_bytes);
      std::vector<uint8_t> want_host = host, want_dev = dev;
      auto dev_layer = [&](std::vector<uint8_t>& buf) {
        return [&buf, &layout, layer_bytes](uint64_t plane, uint64_t layer) {
          return buf.data() + (plane * layout.layers + layer) * layer_bytes;
        };
      };
      NaiveCopy(layout, want_host.data(), dev_layer(want_dev), host_idx, dev_idx, backup);

      uint64_t copied = 0;
      for (uint64_t plane = 0; plane < layout.planes; ++plane) {
        for (uint64_t layer = 0; layer < layout.layers; ++layer) {
          uint8_t* d = dev_layer(dev)(plane, layer);
          for (const IndexRun& run : runs) {
            // Two calls over a random cut: pieces of [0, k) and [k, count).
            const uint64_t k = rng() % (run.count + 1);
            for (auto [from, to] : {std::pair<uint64_t, uint64_t>{0, k}, {k, run.count}}) {
              uint64_t pieces = 0;
              ForEachPiece(layout, plane, layer, run, from, to,
                           [&](uint64_t host_off, uint64_t dev_off, uint64_t bytes) {
                             ASSERT_GT(bytes, 0u);
                             ASSERT_LE(host_off + bytes, host.size());
                             ASSERT_LE(dev_off + bytes, layer_bytes);
                             if (backup) {
                               std::memcpy(host.data() + host_off, d + dev_off, bytes);
                             } else {
                               std::memcpy(d + dev_off, host.data() + host_off, bytes);
                             }
                             copied += bytes;
                             ++pieces;
                           });
              if (to > from && layout.kind == LayoutKind::kLayerFirst) {
                EXPECT_EQ(pieces, 1u) << "LAYER_FIRST rows of a run are one range";
              }
              if (!layout.RowContiguous()) {  // PAGE_HEAD's heads, PAGE_UNIFIED's head groups
                EXPECT_EQ(pieces, (to - from) * layout.RowPieces());
              }
            }
          }
        }
      }
      EXPECT_EQ(copied, host_idx.size() * layout.token_bytes * layout.planes * layout.layers);
      ASSERT_TRUE(SameBytes(host.data(), want_host.data(), host.size()))
          << (backup ? "backup" : "load") << " round " << round;
      ASSERT_TRUE(SameBytes(dev.data(), want_dev.data(), dev.size()))
          << (backup ? "backup" : "load") << " round " << round;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ForEachPieceTest, ::testing::ValuesIn(AllShapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace kvhost
