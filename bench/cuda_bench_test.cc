// kvhost_cuda_transfer_bench's flag checks, time estimate and report, on the
// CPU: what can be checked without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"

ABSL_DECLARE_FLAG(std::vector<std::string>, paths);
ABSL_DECLARE_FLAG(std::vector<std::string>, workers);
ABSL_DECLARE_FLAG(std::vector<std::string>, duty);
ABSL_DECLARE_FLAG(std::vector<std::string>, anchor_quotas);
ABSL_DECLARE_FLAG(std::vector<std::string>, ttfl_page_sizes);
ABSL_DECLARE_FLAG(std::string, host_slots);
ABSL_DECLARE_FLAG(uint64_t, tokens);
ABSL_DECLARE_FLAG(uint32_t, gemm_n);
ABSL_DECLARE_FLAG(bool, quick);
ABSL_DECLARE_FLAG(std::vector<std::string>, layouts);
ABSL_DECLARE_FLAG(uint32_t, head_groups);

namespace kvhost::bench {
namespace {

// The default run must fit the H200 budget of the issue (~9 minutes) by the
// estimate's own model; --quick is a CI smoke.
constexpr double kFullRunBudgetS = 9 * 60;
constexpr double kQuickBudgetS = 30;

TEST(CudaBenchOptionsTest, DefaultsMeasureEveryTarget) {
  absl::FlagSaver saver;
  absl::StatusOr<Options> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->paths, std::vector<std::string>({"auto", "ce", "staged"}));
  EXPECT_EQ(o->workers, std::vector<std::string>({"gemm", "fma"}));
  EXPECT_FALSE(o->workers_from_quick);
  EXPECT_EQ(o->duties, std::vector<double>({1, 0.25}));
  EXPECT_EQ(o->anchor_quotas, std::vector<uint32_t>({2, 8}));
  EXPECT_EQ(o->ttfl_page_sizes, std::vector<uint32_t>({1, 16, 64}));
  EXPECT_EQ(o->host_slots, HostSlots::kChurned);
  EXPECT_EQ(o->tokens, 8192u);
  EXPECT_EQ(o->shapes.size(), 7u);  // MHA x 4 layouts, MLA x 3 (no PAGE_HEAD)
  EXPECT_EQ(MakeCases(*o).size(), 21u);
  EXPECT_EQ(TransferBytes(*o, v1::MHA), uint64_t{1} << 30);
  EXPECT_LT(EstimateSeconds(*o), kFullRunBudgetS);
}

TEST(CudaBenchOptionsTest, TheWorkerPathIsOneToAskFor) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_paths, std::vector<std::string>({"staged", "worker"}));
  absl::StatusOr<Options> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->paths, std::vector<std::string>({"staged", "worker"}));
  absl::SetFlag(&FLAGS_paths, std::vector<std::string>({"workers"}));
  o = OptionsFromFlags();
  ASSERT_FALSE(o.ok());
  EXPECT_TRUE(absl::StrContains(o.status().message(), "sm, worker")) << o.status();
}

TEST(CudaBenchOptionsTest, QuickIsASmoke) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_quick, true);
  absl::StatusOr<Options> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->paths, std::vector<std::string>({"ce", "staged", "sm"}));
  EXPECT_TRUE(o->workers_from_quick);
  EXPECT_EQ(o->tokens, 256u);
  EXPECT_EQ(MakeCases(*o).size(), 2u);
  EXPECT_LT(EstimateSeconds(*o), kQuickBudgetS);
}

TEST(CudaBenchOptionsTest, PageUnifiedIsSelectableWithHeadGroups) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_layouts, std::vector<std::string>({"page_unified"}));
  absl::SetFlag(&FLAGS_head_groups, 4u);
  absl::StatusOr<Options> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->shapes.size(), 2u);  // MHA and MLA
  const v1::PoolSpec mha = SpecFor(*o, v1::MHA, v1::PAGE_UNIFIED, 16, o->tokens);
  EXPECT_EQ(mha.layout(), v1::PAGE_UNIFIED);
  EXPECT_EQ(mha.head_groups(), 4u);
  EXPECT_EQ(SpecFor(*o, v1::MLA, v1::PAGE_UNIFIED, 16, o->tokens).head_groups(), 0u);
  EXPECT_EQ(SpecFor(*o, v1::MHA, v1::PAGE_FIRST, 16, o->tokens).head_groups(), 0u);
  absl::SetFlag(&FLAGS_head_groups, 3u);
  o = OptionsFromFlags();
  ASSERT_FALSE(o.ok());
  EXPECT_TRUE(absl::StrContains(o.status().message(), "--head-groups: 3")) << o.status();
}

TEST(CudaBenchOptionsTest, ListsAreParsed) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_workers, std::vector<std::string>({"FMA"}));
  absl::SetFlag(&FLAGS_duty, std::vector<std::string>({"0.5", "0.5", "1"}));
  absl::SetFlag(&FLAGS_anchor_quotas, std::vector<std::string>({"none"}));
  absl::SetFlag(&FLAGS_host_slots, std::string("Fresh"));
  absl::StatusOr<Options> o = OptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->workers, std::vector<std::string>({"fma"}));
  EXPECT_EQ(o->duties, std::vector<double>({0.5, 1}));
  EXPECT_TRUE(o->anchor_quotas.empty());
  EXPECT_EQ(o->host_slots, HostSlots::kFresh);
}

struct BadFlag {
  std::string name;
  std::function<void()> set;
  std::string message;  // a part of the error
};

TEST(CudaBenchOptionsTest, BadFlagsAreNamed) {
  const std::vector<BadFlag> bad = {
      {"duty 0", [] { absl::SetFlag(&FLAGS_duty, std::vector<std::string>({"0"})); },
       "--duty: '0' is not a duty cycle in (0, 1]"},
      {"duty 2", [] { absl::SetFlag(&FLAGS_duty, std::vector<std::string>({"2"})); },
       "--duty: '2'"},
      {"worker", [] { absl::SetFlag(&FLAGS_workers, std::vector<std::string>({"gpu"})); },
       "--workers: 'gpu' is not gemm or fma"},
      {"no worker", [] { absl::SetFlag(&FLAGS_workers, std::vector<std::string>()); },
       "--workers is empty"},
      {"path", [] { absl::SetFlag(&FLAGS_paths, std::vector<std::string>({"dma"})); },
       "--paths: 'dma'"},
      {"slots", [] { absl::SetFlag(&FLAGS_host_slots, std::string("sorted")); },
       "--host-slots: 'sorted' is not churned, random or fresh"},
      {"quota", [] { absl::SetFlag(&FLAGS_anchor_quotas, std::vector<std::string>({"0"})); },
       "--anchor-quotas: '0' is not a positive integer"},
      {"tokens", [] { absl::SetFlag(&FLAGS_tokens, uint64_t{8200}); },
       "--tokens 8200 is not a multiple of page size 16"},
      {"ttfl", [] { absl::SetFlag(&FLAGS_ttfl_page_sizes, std::vector<std::string>({"3"})); },
       "--tokens 8192 is not a multiple of page size 3"},
      {"gemm", [] { absl::SetFlag(&FLAGS_gemm_n, uint32_t{100}); },
       "--gemm-n 100 is not a positive multiple of 8"},
  };
  for (const BadFlag& b : bad) {
    absl::FlagSaver saver;
    b.set();
    absl::StatusOr<Options> o = OptionsFromFlags();
    ASSERT_FALSE(o.ok()) << b.name;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << b.name;
    EXPECT_TRUE(absl::StrContains(o.status().message(), b.message))
        << b.name << ": " << o.status().message();
  }
}

TEST(CudaBenchOptionsTest, ParseBytes) {
  EXPECT_EQ(*ParseBytes("x", "1G"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseBytes("x", "256m"), uint64_t{256} << 20);
  EXPECT_EQ(*ParseBytes("x", "4096"), 4096u);
  EXPECT_EQ(ParseBytes("x", "0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("x", "1Q").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("x", "99999999999T").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaBenchReportTest, RunsOfCountsConsecutivePages) {
  // Page size 2: pages 3, 4, 5, then 9, then 1, 2.
  const std::vector<int64_t> slots = {6, 7, 8, 9, 10, 11, 18, 19, 2, 3, 4, 5};
  const HostRuns r = RunsOf(slots, 2);
  EXPECT_EQ(r.pages, 6u);
  EXPECT_EQ(r.runs, 3u);
  EXPECT_DOUBLE_EQ(r.MeanPages(), 2.0);
  EXPECT_EQ(RunsOf({}, 1).MeanPages(), 0);
}

Cost MakeCost(const std::string& worker, double duty, double pct) {
  Cost c;
  c.worker = worker;
  c.duty = duty;
  c.units = 10;
  c.unit_ms = 2;
  c.cost_pct = pct;
  return c;
}

CaseResult MakeCase(const std::string& path, bool backup, double gbps, double duty_pct,
                    double b2b_pct) {
  CaseResult c;
  c.path = path;
  c.kind = "MHA";
  c.layout = "LAYER_FIRST";
  c.page_size = 1;
  c.backup = backup;
  c.engine_gbps = gbps;
  c.vs_ceiling = gbps / 55;
  c.ticket_path = path == "auto" ? "cuda-ce" : "cuda-" + path;
  c.host = {8192, 1024};
  c.costs = {MakeCost("gemm", 1, b2b_pct), MakeCost("gemm", 0.25, duty_pct),
             MakeCost("fma", 1, 3 * b2b_pct)};
  return c;
}

Results MakeResults() {
  Results r;
  r.ceiling.bytes = 1 << 30;
  r.ceiling.d2h_gbps = r.ceiling.h2d_gbps = 55;
  r.cases = {MakeCase("auto", true, 5, 0, 0), MakeCase("staged", true, 48, 1.5, 3.5),
             MakeCase("sm", true, 50, 20, 78), MakeCase("sm", false, 49, 21, 80),
             MakeCase("ce", false, 3, 0, 0)};
  for (uint32_t quota : {2u, 8u}) {
    AnchorResult a;
    a.kind = "MHA";
    a.quota = quota;
    a.backup = true;
    a.gbps = quota == 2 ? 50.4 : 52.0;
    a.costs = {MakeCost("gemm", 1, quota == 2 ? 6.7 : 151), MakeCost("gemm", 0.25, 1.5)};
    r.anchor.push_back(a);
  }
  return r;
}

Options DefaultOptions() {
  absl::FlagSaver saver;
  return *OptionsFromFlags();
}

TEST(CudaBenchReportTest, HeadlinePrefersThePathWithinTheBounds) {
  const Results r = MakeResults();
  const std::vector<HeadlineRow> rows = Headline(r);
  ASSERT_EQ(rows.size(), 2u);
  // Backup: sm is faster but costs the GEMM +78 %; staged is within both bounds.
  EXPECT_EQ(rows[0].best->path, "staged");
  EXPECT_TRUE(rows[0].best_within_bounds);
  ASSERT_NE(rows[0].automatic, nullptr);
  EXPECT_EQ(rows[0].automatic->ticket_path, "cuda-ce");
  EXPECT_EQ(rows[0].anchors.size(), 2u);
  // Load: ce is within (+0 %), sm is not: ce although slower.
  EXPECT_EQ(rows[1].best->path, "ce");
  EXPECT_TRUE(rows[1].best_within_bounds);
  EXPECT_TRUE(rows[1].anchors.empty());  // no load anchor in these results
}

TEST(CudaBenchReportTest, HeadlineFallsBackToTheFastest) {
  Results r = MakeResults();
  r.cases = {MakeCase("sm", true, 50, 20, 78), MakeCase("staged", true, 40, 5, 9)};
  const std::vector<HeadlineRow> rows = Headline(r);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].best->path, "sm");
  EXPECT_FALSE(rows[0].best_within_bounds);
  const std::vector<std::string> lines = HeadlineTableLines(DefaultOptions(), r);
  ASSERT_EQ(lines.size(), 3u);  // title, header, one row
  EXPECT_TRUE(absl::StrContains(lines[2], "sm (over)")) << lines[2];
}

TEST(CudaBenchReportTest, TablesShowEveryCostAndWhatIsMissing) {
  const Options o = DefaultOptions();
  Results r = MakeResults();
  r.cases[1].costs.pop_back();  // staged: no fma cost
  const std::vector<std::string> staged = CaseTableLines(o, r, "staged", "fma");
  ASSERT_EQ(staged.size(), 3u) << absl::StrJoin(staged, "\n");
  EXPECT_TRUE(absl::StrContains(staged[1], "fma % @1")) << staged[1];
  EXPECT_TRUE(absl::StrContains(staged[1], "fma % @0.25")) << staged[1];
  EXPECT_TRUE(absl::StrContains(staged[2], " - ")) << staged[2];
  EXPECT_TRUE(absl::StrContains(staged[2], "8.0")) << staged[2];  // mean run: 8 pages
  const std::vector<std::string> sm = CaseTableLines(o, r, "sm", "gemm");
  ASSERT_EQ(sm.size(), 4u);
  EXPECT_TRUE(absl::StrContains(sm[2], "+78.0")) << sm[2];
  EXPECT_TRUE(CaseTableLines(o, r, "nowhere", "gemm").empty());
  const std::vector<std::string> anchor = AnchorTableLines(o, r);
  ASSERT_EQ(anchor.size(), 4u);
  EXPECT_TRUE(absl::StrContains(anchor[3], "+151.0")) << anchor[3];
  const std::vector<std::string> headline = HeadlineTableLines(o, r);
  ASSERT_EQ(headline.size(), 4u);
  EXPECT_TRUE(absl::StrContains(headline[1], "ANCHOR q2")) << headline[1];
  EXPECT_TRUE(absl::StrContains(headline[2], "50.4 +1.5/+6.7")) << headline[2];
}

TEST(CudaBenchReportTest, TtflTableJudgesTheTarget) {
  Results r;
  EXPECT_TRUE(TtflTableLines(r).empty());
  TtflResult t;
  t.path = "ce";
  t.page_size = 16;
  t.layers = 32;
  t.first_median_ms = 0.5;
  t.total_median_ms = 20;
  t.target_ms = 20.0 / 32 + kFirstLayerSlackMs;
  t.met = true;
  r.ttfl = {t};
  t.page_size = 1;
  t.first_median_ms = 4;
  t.met = false;
  r.ttfl.push_back(t);
  const std::vector<std::string> lines = TtflTableLines(r);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_TRUE(absl::StrContains(lines[2], "0.725  met")) << lines[2];
  EXPECT_TRUE(absl::StrContains(lines[3], "MISSED")) << lines[3];
}

TEST(CudaBenchReportTest, CacheTableStandsBesideThePoolCase) {
  const Options o = DefaultOptions();
  Results r;
  EXPECT_TRUE(CacheTableLines(o, r).empty());
  CaseResult pool;
  pool.path = "auto";
  pool.kind = "MHA";
  pool.layout = "PAGE_FIRST";
  pool.page_size = 16;
  pool.backup = true;
  pool.vs_ceiling = 0.93;
  r.cases = {pool};
  CaseResult store = pool;
  store.engine_gbps = 40.5;
  store.vs_ceiling = 0.81;
  CaseResult restore = store;
  restore.backup = false;
  r.cache_cases = {store, restore};
  const std::vector<std::string> lines = CacheTableLines(o, r);
  ASSERT_EQ(lines.size(), 4u);  // title, head, two rows
  EXPECT_TRUE(absl::StrContains(lines[2], "store")) << lines[2];
  EXPECT_TRUE(absl::StrContains(lines[2], "0.93")) << lines[2];  // the pool's case beside it
  EXPECT_TRUE(absl::StrContains(lines[3], "restore")) << lines[3];
  EXPECT_TRUE(absl::StrContains(lines[3], " - ")) << lines[3];  // no pool load case in the run
  const std::string json = Json(o, r, absl::OkStatus());
  EXPECT_TRUE(absl::StrContains(json, "\"direction\":\"restore\"")) << json;
}

TEST(CudaBenchReportTest, JsonSaysWhetherTheRunIsComplete) {
  const Options o = DefaultOptions();
  const Results r = MakeResults();
  const std::string partial = Json(o, r, absl::UnavailableError("run still in progress"));
  EXPECT_TRUE(absl::StrContains(partial, "\"complete\":false"));
  EXPECT_TRUE(absl::StrContains(partial, "\"error\":\"run still in progress\""));
  EXPECT_TRUE(absl::StrContains(partial, "\"schema\":2"));
  const std::string done = Json(o, r, absl::OkStatus());
  EXPECT_TRUE(absl::StrContains(done, "\"complete\":true"));
  EXPECT_TRUE(absl::StrContains(done, "\"best_path\":\"staged\""));
  EXPECT_TRUE(absl::StrContains(done, "\"host_run_pages\":8.00"));
  EXPECT_TRUE(absl::StrContains(done, "\"quota\":8"));
}

}  // namespace
}  // namespace kvhost::bench
