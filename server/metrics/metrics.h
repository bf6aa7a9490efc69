// MetricsRegistry: counters, histograms and scrape-time gauges, rendered in
// the Prometheus text exposition format, version 0.0.4.
//
// A family is one metric name with its HELP text, its type and its label
// names; a series is the family at one tuple of label values. Counter and
// histogram series are created at 0 on first use (or ahead of it, so that
// they exist before their first event) and live until RetainSeries removes
// them (e.g. a deleted pool's). Computed families (gauges, and counters kept
// elsewhere such as the process's CPU time) are not stored: a callback
// computes every sample of the family at scrape time, so they never go stale.
//
// Ownership: the registry owns its families and series. A pointer WithLabels
// returns stays valid at least kRetiredSeriesGrace after its series is
// removed (callers use it at once: one RPC, one finished ticket). Callbacks
// must stay callable until the last Render() returns.
//
// Thread safety: every method may be called concurrently. A counter update is
// one relaxed atomic add; a histogram observation takes its series' mutex (so
// a scrape sees buckets, _sum and _count of the same observations); creating
// or removing series and Render take the family's mutex.
#ifndef KVHOST_SERVER_METRICS_METRICS_H_
#define KVHOST_SERVER_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvhost {

// Label values of one series, in the order of the family's label names.
using LabelValues = std::vector<std::string>;

class Counter {
 public:
  void Increment(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class Histogram {
 public:
  // REQUIRES: `bounds` strictly increasing and finite; it outlives this.
  explicit Histogram(const std::vector<double>* bounds);

  void Observe(double value);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double>& bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; last = +Inf
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

// A metric family: the common part of counters, histograms and gauges.
class MetricFamily {
 public:
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {}
  virtual ~MetricFamily() = default;
  MetricFamily(const MetricFamily&) = delete;
  MetricFamily& operator=(const MetricFamily&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Appends HELP, TYPE and every sample of the family.
  virtual void Render(std::string* out) const = 0;

 protected:
  // "# HELP ...\n# TYPE name type\n".
  void RenderHeader(const char* type, std::string* out) const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

// How long a removed series' object outlives its removal. WithLabels'
// callers use the pointer within microseconds; a minute is far beyond that,
// and bounds the memory of removed series by what is removed in a minute.
inline constexpr absl::Duration kRetiredSeriesGrace = absl::Minutes(1);

// Which series to keep, by label values.
using SeriesFilter = std::function<bool(const LabelValues&)>;

namespace metrics_internal {

// The series of one counter or histogram family, by label values.
template <typename T>
class SeriesMap {
 public:
  // The series at `values`, made by `make` if missing.
  template <typename Make>
  T* Get(const LabelValues& values, Make make) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<T>& series = live_[values];
    if (series == nullptr) series = make();
    return series.get();
  }
  // Removes the series `keep` refuses; their objects are freed once
  // kRetiredSeriesGrace has passed.
  void Retain(const SeriesFilter& keep) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    for (auto it = live_.begin(); it != live_.end();) {
      if (keep(it->first)) {
        ++it;
      } else {
        retired_.emplace_back(now, std::move(it->second));
        it = live_.erase(it);
      }
    }
    while (!retired_.empty() && now - retired_.front().first > kRetiredSeriesGrace) {
      retired_.pop_front();
    }
  }
  std::vector<LabelValues> Labels() const {
    absl::MutexLock lock(&mu_);
    std::vector<LabelValues> out;
    out.reserve(live_.size());
    for (const auto& entry : live_) out.push_back(entry.first);
    return out;
  }
  // fn(values, series) for every live series, in label order, under the lock.
  template <typename Fn>
  void ForEach(Fn fn) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [values, series] : live_) fn(values, *series);
  }

 private:
  mutable absl::Mutex mu_;
  std::map<LabelValues, std::unique_ptr<T>> live_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, std::unique_ptr<T>>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace metrics_internal

class CounterFamily final : public MetricFamily {
 public:
  // `unit`: what one increment is worth in the family's base unit (1e-6 for
  // a counter kept in microseconds and named in seconds); rendered as
  // value * unit.
  CounterFamily(std::string name, std::string help, std::vector<std::string> label_names,
                double unit = 1)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)), unit_(unit) {}
  // The series at `values`, created at 0 on first use.
  // REQUIRES: values.size() == label_names().size().
  Counter* WithLabels(const LabelValues& values);
  // Removes every series `keep` refuses.
  void RetainSeries(const SeriesFilter& keep) { series_.Retain(keep); }
  std::vector<LabelValues> SeriesLabels() const { return series_.Labels(); }
  void Render(std::string* out) const override;

 private:
  const double unit_;
  metrics_internal::SeriesMap<Counter> series_;
};

class HistogramFamily final : public MetricFamily {
 public:
  HistogramFamily(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bounds)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
        bounds_(std::move(bounds)) {}
  // REQUIRES: values.size() == label_names().size().
  Histogram* WithLabels(const LabelValues& values);
  void RetainSeries(const SeriesFilter& keep) { series_.Retain(keep); }
  std::vector<LabelValues> SeriesLabels() const { return series_.Labels(); }
  void Render(std::string* out) const override;

 private:
  const std::vector<double> bounds_;
  metrics_internal::SeriesMap<Histogram> series_;
};

struct GaugeSample {
  LabelValues labels;
  double value = 0;
};

// A family whose samples a callback computes at scrape time: a gauge, or a
// counter kept elsewhere (the kernel's CPU time of the process).
class ComputedFamily final : public MetricFamily {
 public:
  ComputedFamily(const char* type, std::string name, std::string help,
                 std::vector<std::string> label_names,
                 std::function<std::vector<GaugeSample>()> collect)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
        type_(type),
        collect_(std::move(collect)) {}
  void Render(std::string* out) const override;

 private:
  const char* const type_;  // "gauge" or "counter"
  const std::function<std::vector<GaugeSample>()> collect_;
};

class MetricsRegistry {
 public:
  // Families render in the order they were added. REQUIRES: `name` a valid
  // metric name and each label a valid label name ("le" not among a
  // histogram's), all unique; aborts otherwise (a programming error).
  // `unit`: as CounterFamily's (Prometheus names counters in base units:
  // seconds, bytes).
  CounterFamily* AddCounter(std::string name, std::string help,
                            std::vector<std::string> label_names = {}, double unit = 1);
  // `bounds`: the buckets' upper bounds, strictly increasing and finite; +Inf
  // is added.
  HistogramFamily* AddHistogram(std::string name, std::string help,
                                std::vector<std::string> label_names, std::vector<double> bounds);
  // `collect` returns the family's samples at scrape time, each with
  // label_names.size() label values.
  void AddGauge(std::string name, std::string help, std::vector<std::string> label_names,
                std::function<std::vector<GaugeSample>()> collect);
  // A counter whose value is kept elsewhere and read at scrape time; it must
  // never decrease (but for a restart of what it reads).
  void AddComputedCounter(std::string name, std::string help, std::vector<std::string> label_names,
                          std::function<std::vector<GaugeSample>()> collect);

  // The text exposition format 0.0.4 of every family.
  std::string Render() const;

 private:
  void Add(std::unique_ptr<MetricFamily> family);
  void AddComputed(const char* type, std::string name, std::string help,
                   std::vector<std::string> label_names,
                   std::function<std::vector<GaugeSample>()> collect);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<MetricFamily>> families_ ABSL_GUARDED_BY(mu_);
};

// The content type of Render()'s output.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Exposition helpers, exposed for tests.
// A label value with backslash, double quote and newline escaped.
std::string EscapeLabelValue(const std::string& value);
// A sample value: shortest round-trip decimal, or +Inf, -Inf, NaN.
std::string FormatMetricValue(double value);

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_METRICS_H_
