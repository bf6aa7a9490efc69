#include "server/transfer/segments.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/transfer/engine.h"

namespace kvhost {
namespace {

// Tokens per segment stay well inside CopySegment::tokens.
constexpr uint64_t kMaxSegmentTokens = uint64_t{1} << 30;

uint16_t HeadsPerItem(const KvLayout& layout) {
  return layout.RowContiguous() ? 1 : static_cast<uint16_t>(layout.heads);
}

// Fills a StagedPlan chunk by chunk.
class ChunkBuilder {
 public:
  ChunkBuilder(const KvLayout& layout, uint64_t chunk_bytes, uint64_t host_split, StagedPlan* plan)
      : layout_(layout), chunk_bytes_(chunk_bytes), host_split_(host_split), plan_(plan) {}

  // Adds `units` units of `unit_tokens` tokens and `unit_bytes` host bytes
  // each, starting at `seg`'s tokens (its `tokens` is ignored). The units'
  // host bytes are one contiguous block starting at the offset of the first
  // (token, layer0, head0). REQUIRES: unit_bytes <= chunk_bytes.
  void Add(CopySegment seg, uint64_t units, uint64_t unit_tokens, uint64_t unit_bytes) {
    while (units > 0) {
      uint64_t fit = (chunk_bytes_ - used_) / unit_bytes;
      if (fit == 0) {
        Flush();
        continue;
      }
      fit = std::min({fit, units, kMaxSegmentTokens / unit_tokens});
      CopySegment s = seg;
      s.tokens = static_cast<uint32_t>(fit * unit_tokens);
      const uint64_t host_offset = layout_.Offset(s.plane, s.host_token, s.layer0, s.head0);
      const uint64_t bytes = fit * unit_bytes;
      s.bias = static_cast<int64_t>(host_offset - used_);
      s.first_item = items_;
      plan_->segments.push_back(s);
      items_ += SegmentItems(s);
      AddCopy(host_offset, used_, bytes);
      used_ += bytes;
      seg.host_token += s.tokens;
      seg.device_token += s.tokens;
      units -= fit;
    }
  }

  void Flush() {
    if (used_ == 0) return;
    StagedChunk chunk;
    chunk.segment_begin = segment_begin_;
    chunk.segment_end = plan_->segments.size();
    chunk.copy_begin = copy_begin_;
    chunk.copy_end = plan_->copies.size();
    chunk.items = items_;
    chunk.bytes = used_;
    plan_->chunks.push_back(chunk);
    segment_begin_ = plan_->segments.size();
    copy_begin_ = plan_->copies.size();
    items_ = 0;
    used_ = 0;
  }

 private:
  void AddCopy(uint64_t host, uint64_t staging, uint64_t bytes) {
    while (bytes > 0) {
      const uint64_t n = std::min(bytes, (host / host_split_ + 1) * host_split_ - host);
      std::vector<StagedCopy>& copies = plan_->copies;
      if (copies.size() > copy_begin_ && host % host_split_ != 0 &&
          copies.back().host_offset + copies.back().bytes == host &&
          copies.back().staging_offset + copies.back().bytes == staging) {
        copies.back().bytes += n;
      } else {
        copies.push_back(StagedCopy{host, staging, n});
      }
      host += n;
      staging += n;
      bytes -= n;
    }
  }

  const KvLayout& layout_;
  const uint64_t chunk_bytes_;
  const uint64_t host_split_;
  StagedPlan* const plan_;
  size_t segment_begin_ = 0;
  size_t copy_begin_ = 0;
  uint64_t items_ = 0;
  uint64_t used_ = 0;
};

CopySegment Segment(uint64_t plane, uint64_t host_token, uint64_t device_token, uint64_t layer0,
                    uint64_t layers, uint64_t head0, uint64_t heads) {
  CopySegment s;
  s.plane = static_cast<uint16_t>(plane);
  s.host_token = host_token;
  s.device_token = device_token;
  s.layer0 = static_cast<uint32_t>(layer0);
  s.layers = static_cast<uint32_t>(layers);
  s.head0 = static_cast<uint16_t>(head0);
  s.heads = static_cast<uint16_t>(heads);
  return s;
}

// Tokens [host, host + count) of a page-major layout that lie in one page
// but do not fill it, as blocks that are complete: per layer for
// PAGE_FIRST_DIRECT, per head for PAGE_HEAD (a head's tokens of one page are
// adjacent there, all layers each).
void AddPartialPage(const KvLayout& layout, uint64_t plane, uint64_t host, uint64_t device,
                    uint64_t count, ChunkBuilder* builder) {
  if (layout.kind == LayoutKind::kPageFirstDirect) {
    for (uint64_t l = 0; l < layout.layers; ++l) {
      builder->Add(Segment(plane, host, device, l, 1, 0, 1), count, 1, layout.token_bytes);
    }
    return;
  }
  // PAGE_HEAD.
  if (layout.RowContiguous()) {
    builder->Add(Segment(plane, host, device, 0, layout.layers, 0, 1), count, 1,
                 layout.layers * layout.token_bytes);
    return;
  }
  for (uint64_t h = 0; h < layout.heads; ++h) {
    builder->Add(Segment(plane, host, device, 0, layout.layers, h, 1), count, 1,
                 layout.layers * layout.head_bytes);
  }
}

}  // namespace

DirectPlan PlanDirect(const KvLayout& layout, const std::vector<IndexRun>& runs) {
  DirectPlan plan;
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (const IndexRun& run : runs) {
      for (uint64_t t = 0; t < run.count; t += kMaxSegmentTokens) {
        CopySegment s = Segment(plane, run.host + t, run.device + t, 0, 1, 0, HeadsPerItem(layout));
        s.tokens = static_cast<uint32_t>(std::min(kMaxSegmentTokens, run.count - t));
        s.first_item = plan.items_per_layer;
        plan.items_per_layer += SegmentItems(s);
        plan.segments.push_back(s);
      }
    }
  }
  return plan;
}

uint64_t StagedUnitBytes(const KvLayout& layout) {
  switch (layout.kind) {
    case LayoutKind::kLayerFirst:
      return layout.token_bytes;
    case LayoutKind::kPageFirst:
      return layout.layers * layout.token_bytes;
    case LayoutKind::kPageFirstDirect:
    case LayoutKind::kPageHead:
      return layout.layers * layout.page_bytes;
  }
  return layout.layers * layout.page_bytes;
}

absl::Status PlanStaged(const KvLayout& layout, const std::vector<IndexRun>& runs,
                        uint64_t chunk_bytes, uint64_t host_split, StagedPlan* plan) {
  const uint64_t unit = StagedUnitBytes(layout);
  if (unit > chunk_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the staged path moves whole blocks of ", unit, " bytes for this pool (",
        layout.kind == LayoutKind::kLayerFirst  ? "a token's row"
        : layout.kind == LayoutKind::kPageFirst ? "a token's rows of all layers"
                                                : "a page of all layers",
        ") but a staging chunk has ", chunk_bytes, " bytes; raise --staging-bytes to at least ",
        2 * unit, " or use another path"));
  }
  plan->segments.clear();
  plan->copies.clear();
  plan->chunks.clear();
  ChunkBuilder builder(layout, chunk_bytes, host_split, plan);
  const uint64_t tb = layout.token_bytes;
  const uint64_t ps = layout.page_size;
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    switch (layout.kind) {
      case LayoutKind::kLayerFirst:
        // Layer by layer, so that runs adjacent in the pool share one copy.
        for (uint64_t l = 0; l < layout.layers; ++l) {
          for (const IndexRun& run : runs) {
            builder.Add(Segment(plane, run.host, run.device, l, 1, 0, 1), run.count, 1, tb);
          }
        }
        break;
      case LayoutKind::kPageFirst:
        for (const IndexRun& run : runs) {
          builder.Add(Segment(plane, run.host, run.device, 0, layout.layers, 0, 1), run.count, 1,
                      layout.layers * tb);
        }
        break;
      case LayoutKind::kPageFirstDirect:
      case LayoutKind::kPageHead:
        for (const IndexRun& run : runs) {
          uint64_t t = run.host;
          const uint64_t end = run.host + run.count;
          while (t < end) {
            const uint64_t device = run.device + (t - run.host);
            const uint64_t page_end = t - t % ps + ps;
            if (t % ps != 0 || end < page_end) {
              const uint64_t to = std::min(end, page_end);
              AddPartialPage(layout, plane, t, device, to - t, &builder);
              t = to;
              continue;
            }
            const uint64_t pages = (end - t) / ps;
            builder.Add(Segment(plane, t, device, 0, layout.layers, 0, HeadsPerItem(layout)), pages,
                        ps, layout.layers * layout.page_bytes);
            t += pages * ps;
          }
        }
        break;
    }
  }
  builder.Flush();
  return absl::OkStatus();
}

uint64_t CopyEnginePiecesPerLayer(const KvLayout& layout, const std::vector<IndexRun>& runs) {
  uint64_t pieces = 0;
  for (const IndexRun& run : runs) {
    ForEachPiece(layout, 0, 0, run, 0, run.count, [&](uint64_t, uint64_t, uint64_t) { ++pieces; });
  }
  return pieces;
}

}  // namespace kvhost
