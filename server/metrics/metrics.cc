#include "server/metrics/metrics.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {
namespace {

bool ValidName(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Families are declared once at start-up by the daemon's own code, so a bad
// name is a bug to stop at, not an error to report.
void CheckFamily(const MetricFamily& family, bool histogram) {
  std::set<std::string> seen;
  bool ok = ValidName(family.name(), /*allow_colon=*/true);
  for (const std::string& label : family.label_names()) {
    ok = ok && ValidName(label, /*allow_colon=*/false) && label.rfind("__", 0) != 0 &&
         !(histogram && label == "le") && seen.insert(label).second;
  }
  if (!ok) {
    std::fprintf(stderr, "kvhost metrics: invalid metric family '%s'\n", family.name().c_str());
    std::abort();
  }
}

// HELP text escapes backslash and newline only.
std::string EscapeHelp(const std::string& help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}`, with `extra` (already formatted, e.g. `le="0.5"`) last;
// nothing when there are no labels at all.
void AppendLabels(const std::vector<std::string>& names, const LabelValues& values,
                  const std::string& extra, std::string* out) {
  if (names.empty() && extra.empty()) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, names[i], "=\"", EscapeLabelValue(i < values.size() ? values[i] : ""),
                    "\"");
  }
  if (!extra.empty()) {
    if (!names.empty()) out->push_back(',');
    out->append(extra);
  }
  out->push_back('}');
}

}  // namespace

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Shortest round-trip digits; plain notation where it reads best (bucket
  // bounds such as 0.0005, byte counts), exponent notation beyond.
  const double magnitude = std::fabs(value);
  const bool plain = magnitude == 0 || (magnitude >= 1e-4 && magnitude < 1e15);
  char buf[400];
  const std::to_chars_result r =
      plain ? std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::fixed)
            : std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(*bounds), counts_(bounds->size() + 1, 0) {}

void Histogram::Observe(double value) {
  // The first bucket whose upper bound is >= value (le is inclusive).
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  absl::MutexLock lock(&mu_);
  ++counts_[i];
  sum_ += value;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  absl::MutexLock lock(&mu_);
  s.cumulative.reserve(counts_.size());
  for (const uint64_t n : counts_) {
    s.count += n;
    s.cumulative.push_back(s.count);
  }
  s.sum = sum_;
  return s;
}

void MetricFamily::RenderHeader(const char* type, std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n# TYPE ", name_, " ", type,
                  "\n");
}

Counter* CounterFamily::WithLabels(const LabelValues& values) {
  return series_.Get(values, [] { return std::make_unique<Counter>(); });
}

void CounterFamily::Render(std::string* out) const {
  RenderHeader("counter", out);
  series_.ForEach([&](const LabelValues& values, const Counter& counter) {
    out->append(name());
    AppendLabels(label_names(), values, "", out);
    if (unit_ == 1) {
      absl::StrAppend(out, " ", counter.value(), "\n");
    } else {
      absl::StrAppend(out, " ", FormatMetricValue(static_cast<double>(counter.value()) * unit_),
                      "\n");
    }
  });
}

Histogram* HistogramFamily::WithLabels(const LabelValues& values) {
  return series_.Get(values, [this] { return std::make_unique<Histogram>(&bounds_); });
}

void HistogramFamily::Render(std::string* out) const {
  RenderHeader("histogram", out);
  series_.ForEach([&](const LabelValues& values, const Histogram& histogram) {
    const Histogram::Snapshot s = histogram.Read();
    for (size_t i = 0; i < s.cumulative.size(); ++i) {
      const std::string le = i < bounds_.size() ? FormatMetricValue(bounds_[i]) : "+Inf";
      absl::StrAppend(out, name(), "_bucket");
      AppendLabels(label_names(), values, absl::StrCat("le=\"", le, "\""), out);
      absl::StrAppend(out, " ", s.cumulative[i], "\n");
    }
    absl::StrAppend(out, name(), "_sum");
    AppendLabels(label_names(), values, "", out);
    absl::StrAppend(out, " ", FormatMetricValue(s.sum), "\n");
    absl::StrAppend(out, name(), "_count");
    AppendLabels(label_names(), values, "", out);
    absl::StrAppend(out, " ", s.count, "\n");
  });
}

void ComputedFamily::Render(std::string* out) const {
  RenderHeader(type_, out);
  for (const GaugeSample& sample : collect_()) {
    out->append(name());
    AppendLabels(label_names(), sample.labels, "", out);
    absl::StrAppend(out, " ", FormatMetricValue(sample.value), "\n");
  }
}

CounterFamily* MetricsRegistry::AddCounter(std::string name, std::string help,
                                           std::vector<std::string> label_names, double unit) {
  auto family = std::make_unique<CounterFamily>(std::move(name), std::move(help),
                                                std::move(label_names), unit);
  CheckFamily(*family, /*histogram=*/false);
  CounterFamily* out = family.get();
  Add(std::move(family));
  return out;
}

HistogramFamily* MetricsRegistry::AddHistogram(std::string name, std::string help,
                                               std::vector<std::string> label_names,
                                               std::vector<double> bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) {
      std::fprintf(stderr, "kvhost metrics: histogram '%s' bounds not increasing and finite\n",
                   name.c_str());
      std::abort();
    }
  }
  auto family = std::make_unique<HistogramFamily>(std::move(name), std::move(help),
                                                  std::move(label_names), std::move(bounds));
  CheckFamily(*family, /*histogram=*/true);
  HistogramFamily* out = family.get();
  Add(std::move(family));
  return out;
}

void MetricsRegistry::AddGauge(std::string name, std::string help,
                               std::vector<std::string> label_names,
                               std::function<std::vector<GaugeSample>()> collect) {
  AddComputed("gauge", std::move(name), std::move(help), std::move(label_names),
              std::move(collect));
}

void MetricsRegistry::AddComputedCounter(std::string name, std::string help,
                                         std::vector<std::string> label_names,
                                         std::function<std::vector<GaugeSample>()> collect) {
  AddComputed("counter", std::move(name), std::move(help), std::move(label_names),
              std::move(collect));
}

void MetricsRegistry::AddComputed(const char* type, std::string name, std::string help,
                                  std::vector<std::string> label_names,
                                  std::function<std::vector<GaugeSample>()> collect) {
  auto family = std::make_unique<ComputedFamily>(type, std::move(name), std::move(help),
                                                 std::move(label_names), std::move(collect));
  CheckFamily(*family, /*histogram=*/false);
  Add(std::move(family));
}

void MetricsRegistry::Add(std::unique_ptr<MetricFamily> family) {
  absl::MutexLock lock(&mu_);
  for (const std::unique_ptr<MetricFamily>& f : families_) {
    if (f->name() == family->name()) {
      std::fprintf(stderr, "kvhost metrics: family '%s' added twice\n", f->name().c_str());
      std::abort();
    }
  }
  families_.push_back(std::move(family));
}

std::string MetricsRegistry::Render() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const std::unique_ptr<MetricFamily>& family : families_) family->Render(&out);
  return out;
}

}  // namespace kvhost
