// watch: a live view of the daemon, its pools and GB/s per direction, one
// frame every --interval (drawn over the last on a terminal, one after
// another elsewhere, one JSON object per frame with --json).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/interrupt.h"
#include "client/kvhostctl/output.h"

ABSL_FLAG(absl::Duration, interval, absl::Seconds(1),
          "watch, cache-events --follow: time between frames or reads, e.g. 1s, 500ms (at least "
          "100ms).");
ABSL_FLAG(int64_t, count, 0, "watch: stop after this many frames (0: until Ctrl-C).");

namespace kvhost::ctl {
namespace {

// Each frame is two RPCs; refreshing faster than this is no longer readable
// and only adds load on the daemon.
constexpr absl::Duration kMinWatchInterval = absl::Milliseconds(100);

// The byte counters of one GetStatus answer and when it came, so that the next
// answer's counters become rates.
struct WatchSample {
  int64_t pid = 0;
  uint64_t backup_bytes = 0;
  uint64_t load_bytes = 0;
  std::chrono::steady_clock::time_point at;
};

// GB/s of each direction between two samples; NaN where there is none.
struct WatchRates {
  double backup = std::numeric_limits<double>::quiet_NaN();
  double load = std::numeric_limits<double>::quiet_NaN();
};

// The daemon counts a ticket's bytes when the ticket finishes, so a rate is
// the bytes of the tickets that finished between the two samples over the
// time between them. No rate across a daemon restart (another pid, or
// counters that went down).
WatchRates RatesBetween(const std::optional<WatchSample>& before, const WatchSample& now) {
  WatchRates rates;
  if (!before.has_value() || before->pid != now.pid || now.backup_bytes < before->backup_bytes ||
      now.load_bytes < before->load_bytes) {
    return rates;
  }
  const double seconds = std::chrono::duration<double>(now.at - before->at).count();
  if (!(seconds > 0)) return rates;
  rates.backup = static_cast<double>(now.backup_bytes - before->backup_bytes) / seconds / 1e9;
  rates.load = static_cast<double>(now.load_bytes - before->load_bytes) / seconds / 1e9;
  return rates;
}

struct WatchFrame {
  absl::Time time;
  // The first call that failed; the parts fetched before it are shown.
  absl::Status status;
  std::optional<v1::DaemonStatus> daemon;
  std::optional<std::vector<v1::Pool>> pools;
  WatchRates rates;
};

// One GetStatus and one ListPools; `previous` is the last sample taken and
// becomes this one's.
WatchFrame TakeWatchFrame(Client& client, std::optional<WatchSample>* previous) {
  WatchFrame frame;
  frame.time = absl::Now();
  absl::StatusOr<v1::DaemonStatus> daemon = client.GetStatus();
  if (!daemon.ok()) {
    frame.status = daemon.status();
    return frame;
  }
  const WatchSample sample{daemon->pid(), daemon->backup_bytes(), daemon->load_bytes(),
                           std::chrono::steady_clock::now()};
  frame.rates = RatesBetween(*previous, sample);
  *previous = sample;
  frame.daemon = *std::move(daemon);
  absl::StatusOr<std::vector<v1::Pool>> pools = client.ListPools();
  if (!pools.ok()) {
    frame.status = pools.status();
    return frame;
  }
  frame.pools = *std::move(pools);
  return frame;
}

std::string ErrorText(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

// "1.23", or "—" where there is no rate.
std::string RateText(double gb_per_s) {
  return std::isfinite(gb_per_s) ? absl::StrFormat("%.2f", gb_per_s) : std::string("—");
}

// "0s", "42s", "1h2m3s".
std::string UptimeText(uint64_t seconds) {
  return seconds == 0 ? std::string("0s")
                      : absl::FormatDuration(absl::Seconds(static_cast<int64_t>(seconds)));
}

void AppendPoolTable(const std::vector<v1::Pool>& pools, std::vector<std::string>* lines) {
  if (pools.empty()) {
    lines->push_back("no pools");
    return;
  }
  std::vector<std::vector<std::string>> rows = {
      {"POOL", "STATE", "KIND", "LAYOUT", "PAGE", "TOKENS", "USED", "USED%", "GIB"}};
  for (const v1::Pool& pool : pools) {
    rows.push_back({pool.name(), StateOf(pool), v1::PoolKind_Name(pool.spec().kind()),
                    v1::Layout_Name(pool.spec().layout()), absl::StrCat(pool.spec().page_size()),
                    absl::StrCat(pool.size_tokens()), absl::StrCat(UsedTokens(pool)),
                    UsedPercentText(pool), Gib(pool.bytes())});
  }
  for (std::string& line : cli::TableLines(rows, "llllrrrrr")) lines->push_back(std::move(line));
}

std::vector<std::string> WatchFrameLines(const Context& ctx, const WatchFrame& frame) {
  std::vector<std::string> lines;
  const std::string time = absl::FormatTime("%Y-%m-%d %H:%M:%S", frame.time, absl::LocalTimeZone());
  if (frame.daemon.has_value()) {
    const v1::DaemonStatus& d = *frame.daemon;
    lines.push_back(absl::StrFormat("kvhostd %s at %s: %s backend, pid %d, up %s — %s", d.version(),
                                    ctx.server, d.backend(), d.pid(), UptimeText(d.uptime_s()),
                                    time));
  } else {
    lines.push_back(absl::StrFormat("kvhostd at %s — %s", ctx.server, time));
  }
  if (!frame.status.ok()) lines.push_back(absl::StrCat("error: ", ErrorText(frame.status)));
  if (frame.pools.has_value()) AppendPoolTable(*frame.pools, &lines);
  if (frame.daemon.has_value()) {
    const v1::DaemonStatus& d = *frame.daemon;
    // Why this reads lower than `kvhostctl demo`: the demo divides by the
    // tickets' own time, this by the time between two frames.
    lines.push_back(
        "(GB/s below: bytes finished between two frames over the wall-clock time between "
        "them, idle time included; `kvhostctl demo` divides by the transfers' own time)");
    lines.push_back(absl::StrFormat(
        "transfers: %d attachment(s), %d in flight, %d done, %d failed; GB/s: backup %s, load %s",
        d.attachments(), d.tickets_in_flight(), d.tickets_done(), d.tickets_failed(),
        RateText(frame.rates.backup), RateText(frame.rates.load)));
  }
  return lines;
}

std::string WatchFrameJson(const Context& ctx, const WatchFrame& frame) {
  JsonObject out;
  out.Str("time", absl::FormatTime(absl::RFC3339_sec, frame.time, absl::LocalTimeZone()))
      .Str("server", ctx.server)
      .Bool("ok", frame.status.ok());
  if (!frame.status.ok()) out.Str("error", ErrorText(frame.status));
  if (frame.daemon.has_value()) out.Raw("daemon", MessageJson(*frame.daemon));
  if (frame.pools.has_value()) {
    std::vector<std::string> pools;
    for (const v1::Pool& pool : *frame.pools) {
      pools.push_back(PoolUsageJson(pool)
                          .Str("kind", v1::PoolKind_Name(pool.spec().kind()))
                          .Str("layout", v1::Layout_Name(pool.spec().layout()))
                          .Uint("page_size", pool.spec().page_size())
                          .str());
    }
    out.Raw("pools", cli::JsonArray(pools));
  }
  // null where there is no rate (first frame, daemon restarted).
  out.Num("backup_gb_per_s", frame.rates.backup).Num("load_gb_per_s", frame.rates.load);
  return out.str();
}

// ANSI sequences of the terminal view: each frame is drawn over the last.
constexpr char kHideCursor[] = "\x1b[?25l";
constexpr char kShowCursor[] = "\x1b[?25h";
constexpr char kClearScreen[] = "\x1b[2J";
constexpr char kCursorHome[] = "\x1b[H";
constexpr char kClearToLineEnd[] = "\x1b[K";
constexpr char kClearBelow[] = "\x1b[J";

// Frame `n` (from 0) as it is written to stdout.
std::string RenderFrame(const Context& ctx, const WatchFrame& frame, int64_t n, bool terminal) {
  std::string out;
  if (ctx.json) {
    out = absl::StrCat(WatchFrameJson(ctx, frame), "\n");
  } else if (terminal) {
    out = n == 0 ? absl::StrCat(kHideCursor, kClearScreen, kCursorHome) : kCursorHome;
    for (const std::string& line : WatchFrameLines(ctx, frame)) {
      absl::StrAppend(&out, line, kClearToLineEnd, "\n");
    }
    out += kClearBelow;
  } else {
    out = n == 0 ? "" : "\n";
    for (const std::string& line : WatchFrameLines(ctx, frame)) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

// Sleeps until `deadline` in short steps; false if interrupted meanwhile.
bool SleepUntil(std::chrono::steady_clock::time_point deadline) {
  constexpr auto kStep = std::chrono::milliseconds(20);
  while (!Interrupted()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return true;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(kStep, deadline - now));
  }
  return false;
}

}  // namespace

absl::Status RunWatch(Context& ctx, const Args&) {
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  const int64_t count = absl::GetFlag(FLAGS_count);
  if (interval < kMinWatchInterval) {
    return UsageError(absl::StrCat("--interval ", absl::FormatDuration(interval),
                                   " is shorter than ", absl::FormatDuration(kMinWatchInterval)));
  }
  if (count < 0) return UsageError(absl::StrCat("--count ", count, " must be >= 0"));
  // Redrawn in place on a terminal; elsewhere every frame is kept, for scripts.
  const bool terminal = !ctx.json && isatty(STDOUT_FILENO) == 1;
  StopOn(SIGINT);
  StopOn(SIGTERM);

  // After a failed frame the next one starts on a fresh channel: the old one
  // would keep failing without trying until its reconnect backoff ends, which
  // held a restarted daemon's frames back by about 4 s.
  std::unique_ptr<Client> fresh;
  Client* client = ctx.client;
  std::optional<WatchSample> previous;
  absl::Status last;
  auto next = std::chrono::steady_clock::now();
  for (int64_t n = 0; count == 0 || n < count; ++n) {
    if (n > 0 && !SleepUntil(next)) break;
    next = std::max(next + absl::ToChronoNanoseconds(interval), std::chrono::steady_clock::now());
    if (!last.ok()) {
      absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(ctx.options);
      // Connect refuses an empty address or unreadable TLS files, which
      // Dispatch has refused already; were it to fail, the old client stays
      // in use.
      if (connected.ok()) {
        fresh = *std::move(connected);
        client = fresh.get();
      }
    }
    const WatchFrame frame = TakeWatchFrame(*client, &previous);
    last = frame.status;
    std::fputs(RenderFrame(ctx, frame, n, terminal).c_str(), stdout);
    std::fflush(stdout);
    if (Interrupted()) break;
  }
  if (terminal) {
    std::fputs(kShowCursor, stdout);
    std::fflush(stdout);
  }
  // Without --count the watch ends only when stopped, which is no failure;
  // with it, a script learns whether the last frame reached the daemon.
  return count > 0 ? last : absl::OkStatus();
}

}  // namespace kvhost::ctl
