// MetricsRegistry: counters, histograms and scrape-time gauges, rendered in
// the Prometheus text exposition format, version 0.0.4.
//
// A family is one metric name with its HELP text, its type and its label
// names; a series is the family at one tuple of label values. Counter and
// histogram series are created on first use and live as long as the registry,
// so the pointers WithLabels returns stay valid and callers may keep them.
// Gauges are not stored: a callback computes every sample of the family at
// scrape time, so a gauge never goes stale (a deleted pool simply stops being
// reported).
//
// Ownership: the registry owns its families and series. Gauge callbacks must
// stay callable until the last Render() returns.
//
// Thread safety: every method may be called concurrently. A counter update is
// one relaxed atomic add; a histogram observation takes its series' mutex (so
// a scrape sees buckets, _sum and _count of the same observations); creating a
// series and Render take the family's mutex.
#ifndef KVHOST_SERVER_METRICS_METRICS_H_
#define KVHOST_SERVER_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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

class CounterFamily final : public MetricFamily {
 public:
  using MetricFamily::MetricFamily;
  // The series at `values`, created at 0 on first use.
  // REQUIRES: values.size() == label_names().size().
  Counter* WithLabels(const LabelValues& values);
  void Render(std::string* out) const override;

 private:
  mutable absl::Mutex mu_;
  std::map<LabelValues, std::unique_ptr<Counter>> series_ ABSL_GUARDED_BY(mu_);
};

class HistogramFamily final : public MetricFamily {
 public:
  HistogramFamily(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bounds)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
        bounds_(std::move(bounds)) {}
  // REQUIRES: values.size() == label_names().size().
  Histogram* WithLabels(const LabelValues& values);
  void Render(std::string* out) const override;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::map<LabelValues, std::unique_ptr<Histogram>> series_ ABSL_GUARDED_BY(mu_);
};

struct GaugeSample {
  LabelValues labels;
  double value = 0;
};

class GaugeFamily final : public MetricFamily {
 public:
  GaugeFamily(std::string name, std::string help, std::vector<std::string> label_names,
              std::function<std::vector<GaugeSample>()> collect)
      : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
        collect_(std::move(collect)) {}
  void Render(std::string* out) const override;

 private:
  const std::function<std::vector<GaugeSample>()> collect_;
};

class MetricsRegistry {
 public:
  // Families render in the order they were added. REQUIRES: `name` a valid
  // metric name and each label a valid label name ("le" not among a
  // histogram's), all unique; aborts otherwise (a programming error).
  CounterFamily* AddCounter(std::string name, std::string help,
                            std::vector<std::string> label_names = {});
  // `bounds`: the buckets' upper bounds, strictly increasing and finite; +Inf
  // is added.
  HistogramFamily* AddHistogram(std::string name, std::string help,
                                std::vector<std::string> label_names, std::vector<double> bounds);
  // `collect` returns the family's samples at scrape time, each with
  // label_names.size() label values.
  void AddGauge(std::string name, std::string help, std::vector<std::string> label_names,
                std::function<std::vector<GaugeSample>()> collect);

  // The text exposition format 0.0.4 of every family.
  std::string Render() const;

 private:
  void Add(std::unique_ptr<MetricFamily> family);

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
