// The page commands: where pages lie (meta, split-meta, stride, bufinfo),
// their flat form (page-shape) and their bytes (page-get, page-set).
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/parse.h"

ABSL_FLAG(std::string, out, "", "page-get: file to write the page's bytes to.");
ABSL_FLAG(std::string, in, "", "page-set: file holding exactly one flat page.");
ABSL_FLAG(uint32_t, chunk_bytes, 0, "page-get, page-set: bytes per streamed message (0: 4 MiB).");
ABSL_FLAG(uint32_t, split_factor, 0, "split-meta: head groups per page (divides head_num).");
ABSL_FLAG(uint64_t, alignment, 0, "stride: the alignment to check, a power of two (0: 4096).");

namespace kvhost::ctl {
namespace {

// Up to this many bytes of a page are dumped as hex when no --out is given.
constexpr size_t kHexDumpBytes = 256;

// What range `i` (PageBufferMeta.segments[i]) covers, in the order pool.proto gives
// (per page, per layer for LAYER_FIRST, per component; PAGE_UNIFIED per head
// group); empty when the answer does not have the shape that order implies.
std::string RangeLabel(const v1::Pool& pool, absl::Span<const int64_t> slots, int segments, int i) {
  const v1::PoolSpec& spec = pool.spec();
  if (spec.layout() == v1::PAGE_UNIFIED) {
    const uint64_t groups = std::max<uint32_t>(spec.head_groups(), 1);
    const uint64_t page_size = spec.page_size();
    if (page_size == 0 || static_cast<uint64_t>(segments) != slots.size() / page_size * groups) {
      return "";
    }
    const uint64_t page_index = static_cast<uint64_t>(i) / groups;
    return absl::StrCat("page ", static_cast<uint64_t>(slots[page_index * page_size]) / page_size,
                        groups > 1 ? absl::StrCat(" head group ", i % groups) : std::string(),
                        " all layers", spec.kind() == v1::MHA ? " K and V" : "");
  }
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

// page-get without --json: a line about the page, then a hex dump of its
// start unless it went to --out.
void PrintPage(const std::string& pool, int64_t index, const std::string& page,
               const std::string& out) {
  PrintLine(absl::StrFormat("pool '%s' page at slot %d: %d bytes%s", pool, index, page.size(),
                            out.empty() ? "" : absl::StrCat(", written to ", out)));
  if (!out.empty()) return;
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
}

void PrintPageJson(const std::string& pool, int64_t index, const std::string& page,
                   const std::string& out) {
  if (out.empty()) {
    v1::PageData data;
    data.set_index(index);
    data.set_data(page);
    data.set_page_bytes(page.size());
    PrintLine(MessageJson(data));
  } else {
    PrintLine(JsonObject()
                  .Str("pool", pool)
                  .Int("index", index)
                  .Uint("page_bytes", page.size())
                  .Str("out", out)
                  .str());
  }
}

}  // namespace

absl::Status RunMeta(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<int64_t>> slots = IndicesArg(args);
  if (!slots.ok()) return slots.status();
  absl::StatusOr<v1::PageBufferMeta> meta = ctx.client->GetPageBufferMeta(args[0], *slots);
  if (!meta.ok()) return meta.status();
  if (ctx.json) {
    PrintLine(MessageJson(*meta));
    return absl::OkStatus();
  }
  // The pool's shape names each range; the ranges are worth printing
  // without it (the pool may have gone meanwhile).
  absl::StatusOr<v1::Pool> pool = ctx.client->GetPool(args[0]);
  PrintLine(absl::StrFormat("pool '%s': %d segment(s)", args[0], meta->segments_size()));
  PrintRegions(meta->region_paths());
  std::vector<std::vector<std::string>> rows = {{"REGION", "OFFSET", "LENGTH", "COVERS"}};
  for (int i = 0; i < meta->segments_size(); ++i) {
    const v1::RegionRange& s = meta->segments(i);
    rows.push_back({absl::StrCat(s.region_index()), absl::StrCat(s.offset()),
                    absl::StrCat(s.length()),
                    pool.ok() ? RangeLabel(*pool, *slots, meta->segments_size(), i) : ""});
  }
  PrintTable(rows, "rrrl", "  ");
  return absl::OkStatus();
}

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
    PrintPageJson(args[0], *index, page, out);
  } else {
    PrintPage(args[0], *index, page, out);
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
  for (const v1::RegionRange& s : meta->segments()) {
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

}  // namespace kvhost::ctl
