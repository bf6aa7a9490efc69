// The node cache's commands (kvhost.v1.CacheService; a pool created with
// PoolSpec.node_cache): cache-stats, cache-lookup and cache-evict by key, and
// cache-events, the stored / evicted keys a cache-aware router follows
// (--after resumes, --follow keeps reading until Ctrl-C). Keys are given and
// shown as text, or as hex with --hex-keys (engines' block hashes are bytes).
// The cache's token is --token, as for any protected pool.
#include <csignal>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/interrupt.h"
#include "client/kvhostctl/output.h"

ABSL_FLAG(bool, hex_keys, false,
          "cache-*: keys are given and shown as hex (engines' block hashes are bytes).");
ABSL_FLAG(uint64_t, after, 0,
          "cache-events: the sequence number to read after (0: from the oldest kept).");
ABSL_FLAG(bool, follow, false,
          "cache-events: keep reading new events every --interval until Ctrl-C.");
ABSL_DECLARE_FLAG(absl::Duration, interval);

namespace kvhost::ctl {
namespace {

// The keys of args[1..], hex-decoded with --hex-keys.
absl::StatusOr<std::vector<std::string>> KeysArg(const char* command, const Args& args) {
  std::vector<std::string> keys;
  for (size_t i = 1; i < args.size(); ++i) {
    if (!absl::GetFlag(FLAGS_hex_keys)) {
      keys.push_back(args[i]);
      continue;
    }
    const std::string& hex = args[i];
    bool digits = !hex.empty() && hex.size() % 2 == 0;
    for (char c : hex) digits = digits && absl::ascii_isxdigit(static_cast<unsigned char>(c));
    if (!digits) {
      return UsageError(absl::StrCat(command, ": '", args[i],
                                     "' is not a key in hex (--hex-keys: an even number of "
                                     "digits 0-9a-f)"));
    }
    keys.push_back(absl::HexStringToBytes(hex));
  }
  return keys;
}

// A key as shown: hex with --hex-keys, else its text with C escapes for
// anything unprintable.
std::string ShowKey(const std::string& key) {
  if (absl::GetFlag(FLAGS_hex_keys)) return absl::BytesToHexString(key);
  return absl::CHexEscape(key);
}

const char* StateName(v1::CacheKeyState state) {
  switch (state) {
    case v1::CACHE_KEY_PRESENT:
      return "present";
    case v1::CACHE_KEY_PENDING:
      return "pending (being stored)";
    default:
      return "absent";
  }
}

// Prints one batch of events; returns where the next read resumes.
uint64_t PrintEvents(const Context& ctx, const std::string& cache, const v1::CacheEventBatch& b,
                     uint64_t asked_after) {
  if (b.gap()) {
    const std::string why = absl::StrCat(
        "events after ", asked_after,
        " were dropped before this read (the reader fell behind, or kvhostd restarted): "
        "resynchronise with cache-lookup");
    if (ctx.json) {
      PrintLine(JsonObject().Str("cache", cache).Bool("gap", true).Str("detail", why).str());
    } else {
      PrintLine(absl::StrCat("gap: ", why));
    }
  }
  for (const v1::CacheEvent& e : b.events()) {
    const char* kind = e.kind() == v1::CacheEvent::STORED ? "STORED" : "EVICTED";
    if (ctx.json) {
      PrintLine(JsonObject()
                    .Str("cache", cache)
                    .Uint("seq", e.seq())
                    .Str("kind", kind)
                    .Str("key", ShowKey(e.key()))
                    .str());
    } else {
      PrintLine(absl::StrFormat("%d %s %s", e.seq(), kind, ShowKey(e.key())));
    }
  }
  return b.next_after();
}

}  // namespace

absl::Status RunCacheStats(Context& ctx, const Args& args) {
  absl::StatusOr<v1::CacheStats> s = ctx.client->GetCacheStats(args[0]);
  if (!s.ok()) return s.status();
  if (ctx.json) {
    PrintLine(MessageJson(*s));
    return absl::OkStatus();
  }
  const uint64_t lookups = s->hits() + s->misses();
  PrintLine(
      absl::StrFormat("cache '%s': %d pages, %d free", args[0], s->page_num(), s->free_pages()));
  PrintLine(absl::StrFormat("keys now: %d published, %d being stored, %d pinned", s->published(),
                            s->writing(), s->pinned()));
  PrintLine(absl::StrFormat(
      "since created: %d hits, %d misses%s; %d stored, %d skipped, %d evicted, %d aborted",
      s->hits(), s->misses(),
      lookups == 0 ? ""
                   : absl::StrFormat(" (hit rate %.1f%%)", 100.0 * static_cast<double>(s->hits()) /
                                                               static_cast<double>(lookups)),
      s->stored(), s->skipped(), s->evicted(), s->aborted()));
  return absl::OkStatus();
}

absl::Status RunCacheLookup(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<std::string>> keys = KeysArg("cache-lookup", args);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<v1::CacheLookupReply> found = ctx.client->CacheLookup(args[0], *keys);
  if (!found.ok()) return found.status();
  if (ctx.json) {
    std::vector<std::string> items;
    for (int i = 0; i < found->states_size(); ++i) {
      items.push_back(JsonObject()
                          .Str("key", ShowKey((*keys)[i]))
                          .Str("state", v1::CacheKeyState_Name(found->states(i)))
                          .str());
    }
    PrintLine(JsonObject()
                  .Str("cache", args[0])
                  .Uint("prefix", found->prefix())
                  .Raw("keys", cli::JsonArray(items))
                  .str());
    return absl::OkStatus();
  }
  for (int i = 0; i < found->states_size(); ++i) {
    PrintLine(absl::StrFormat("  %s: %s", ShowKey((*keys)[i]), StateName(found->states(i))));
  }
  PrintLine(absl::StrFormat("%d of %d key(s) present from the first (cache '%s')", found->prefix(),
                            keys->size(), args[0]));
  return absl::OkStatus();
}

absl::Status RunCacheEvict(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<std::string>> keys = KeysArg("cache-evict", args);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<v1::CacheEvictReply> evicted = ctx.client->CacheEvict(args[0], *keys);
  if (!evicted.ok()) return evicted.status();
  int count = 0;
  std::vector<std::string> items;
  for (int i = 0; i < evicted->outcomes_size(); ++i) {
    const v1::CacheEvictReply::Outcome o = evicted->outcomes(i);
    count += o == v1::CacheEvictReply::EVICTED ? 1 : 0;
    if (ctx.json) {
      items.push_back(JsonObject()
                          .Str("key", ShowKey((*keys)[i]))
                          .Str("outcome", v1::CacheEvictReply::Outcome_Name(o))
                          .str());
    } else {
      PrintLine(absl::StrFormat("  %s: %s", ShowKey((*keys)[i]),
                                o == v1::CacheEvictReply::EVICTED ? "evicted"
                                : o == v1::CacheEvictReply::BUSY  ? "kept (pinned or being stored)"
                                                                  : "absent"));
    }
  }
  if (ctx.json) {
    PrintLine(JsonObject()
                  .Str("cache", args[0])
                  .Raw("keys", cli::JsonArray(items))
                  .Uint("evicted", count)
                  .str());
  } else {
    PrintLine(
        absl::StrFormat("%d of %d key(s) evicted (cache '%s')", count, keys->size(), args[0]));
  }
  return absl::OkStatus();
}

absl::Status RunCacheEvents(Context& ctx, const Args& args) {
  const std::string& cache = args[0];
  uint64_t after = absl::GetFlag(FLAGS_after);
  const bool follow = absl::GetFlag(FLAGS_follow);
  const absl::Duration interval = std::max(absl::GetFlag(FLAGS_interval), absl::Milliseconds(100));
  if (follow) {
    StopOn(SIGINT);
    StopOn(SIGTERM);
  }
  do {
    // Read whatever is there, batch after batch, then wait (with --follow).
    for (;;) {
      absl::StatusOr<v1::CacheEventBatch> batch = ctx.client->ReadCacheEvents(cache, after);
      if (!batch.ok()) return batch.status();
      const uint64_t next = PrintEvents(ctx, cache, *batch, after);
      after = next;
      if (batch->events().empty() || Interrupted()) break;
    }
    if (!follow) break;
    const absl::Time until = absl::Now() + interval;
    while (!Interrupted() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  } while (!Interrupted());
  if (!ctx.json) PrintLine(absl::StrFormat("next: --after=%d", after));
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
