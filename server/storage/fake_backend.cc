#include "server/storage/fake_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {

std::vector<absl::Status> FakeBackend::Set(absl::Span<const StorageItem> items) {
  absl::MutexLock lock(&mu_);
  std::vector<absl::Status> out;
  for (const StorageItem& item : items) {
    if (down_) {
      out.push_back(absl::UnavailableError("fake backend is down"));
    } else if (item.value.size() > max_item_bytes_) {
      out.push_back(absl::ResourceExhaustedError(absl::StrCat(
          "an item of ", item.value.size(), " bytes, over the ", max_item_bytes_, "-byte limit")));
    } else {
      items_[item.key] = item.value;
      out.push_back(absl::OkStatus());
    }
  }
  return out;
}

std::vector<FetchedItem> FakeBackend::Get(absl::Span<const std::string> keys) {
  absl::MutexLock lock(&mu_);
  std::vector<FetchedItem> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (down_) {
      out[i].error = "fake backend is down";
      continue;
    }
    auto it = items_.find(keys[i]);
    if (it == items_.end()) continue;
    out[i].found = true;
    out[i].value = it->second;
  }
  return out;
}

std::vector<bool> FakeBackend::ExistPrefix(absl::Span<const std::string> keys) {
  absl::MutexLock lock(&mu_);
  std::vector<bool> out;
  for (const std::string& key : keys) {
    out.push_back(!down_ && items_.count(key) > 0);
    if (!out.back()) break;
  }
  return out;
}

bool FakeBackend::Erase(const std::string& key) {
  absl::MutexLock lock(&mu_);
  return items_.erase(key) > 0;
}

bool FakeBackend::Flip(const std::string& key, uint64_t at) {
  absl::MutexLock lock(&mu_);
  auto it = items_.find(key);
  if (it == items_.end() || at >= it->second.size()) return false;
  it->second[at] = static_cast<char>(it->second[at] ^ 0xFF);
  return true;
}

void FakeBackend::Down(bool down) {
  absl::MutexLock lock(&mu_);
  down_ = down;
}

void FakeBackend::Put(const std::string& key, std::string value) {
  absl::MutexLock lock(&mu_);
  items_[key] = std::move(value);
}

bool FakeBackend::Has(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  return items_.count(key) > 0;
}

std::string FakeBackend::Value(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = items_.find(key);
  return it == items_.end() ? "" : it->second;
}

size_t FakeBackend::size() const {
  absl::MutexLock lock(&mu_);
  return items_.size();
}

}  // namespace kvhost
