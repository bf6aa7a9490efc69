#include "server/storage/l3_secret.h"

#include <fcntl.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvhost {
namespace {

// HMAC, fetched once: fetching takes OpenSSL's provider lock.
EVP_MAC* Hmac() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (mac == nullptr) std::abort();  // libcrypto without HMAC: nothing works
  return mac;
}

EVP_MAC_CTX* NewContext(absl::Span<const uint8_t> key) {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(Hmac());
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_END};
  if (ctx == nullptr || EVP_MAC_init(ctx, key.data(), key.size(), params) != 1) std::abort();
  return ctx;
}

L3Mac Digest(EVP_MAC_CTX* ctx) {
  L3Mac out{};
  size_t n = 0;
  if (EVP_MAC_final(ctx, out.data(), &n, out.size()) != 1 || n != out.size()) std::abort();
  return out;
}

// HMAC-SHA256(key, label || data).
L3Mac Derive(absl::Span<const uint8_t> key, absl::string_view label, absl::string_view data) {
  EVP_MAC_CTX* ctx = NewContext(key);
  EVP_MAC_update(ctx, reinterpret_cast<const uint8_t*>(label.data()), label.size());
  EVP_MAC_update(ctx, reinterpret_cast<const uint8_t*>(data.data()), data.size());
  const L3Mac out = Digest(ctx);
  EVP_MAC_CTX_free(ctx);
  return out;
}

absl::Span<const uint8_t> Bytes(absl::string_view s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("--l3-secret-file '", path, "': ", what, "; ", L3Secret::HowToMake()));
}

}  // namespace

L3Secret::Mac::Mac(const L3Secret& secret) : ctx_(NewContext(secret.record_key_)) {}

L3Secret::Mac::~Mac() { EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_)); }

void L3Secret::Mac::Update(absl::Span<const uint8_t> bytes) {
  EVP_MAC_update(static_cast<EVP_MAC_CTX*>(ctx_), bytes.data(), bytes.size());
}

void L3Secret::Mac::Update(absl::string_view bytes) { Update(Bytes(bytes)); }

void L3Secret::Mac::UpdateU64(uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  Update(absl::MakeConstSpan(b, 8));
}

L3Mac L3Secret::Mac::Final() { return Digest(static_cast<EVP_MAC_CTX*>(ctx_)); }

const char* L3Secret::HowToMake() {
  return "make one (the same file on every node of the fleet) with: "
         "install -m 0600 /dev/null FILE && openssl rand -hex 32 > FILE";
}

absl::StatusOr<L3Secret> L3Secret::Load(const std::string& path) {
  if (path.empty()) return Bad(path, "no file named");
  // O_NOFOLLOW: a symlink is refused, not followed; O_NONBLOCK: a FIFO
  // planted there does not hang the start (fstat refuses it below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return Bad(path, std::strerror(errno));
  struct stat st {};
  std::string text;
  absl::Status status = absl::OkStatus();
  if (::fstat(fd, &st) != 0) {
    status = Bad(path, std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    status = Bad(path, "not a regular file");
  } else if ((st.st_mode & 077) != 0) {
    status = Bad(path, absl::StrFormat("mode 0%03o lets the group or others at it; chmod 600 it",
                                       st.st_mode & 0777));
  } else if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    status = Bad(path, absl::StrCat("owned by uid ", st.st_uid, ", not kvhostd's (", ::geteuid(),
                                    ") or root"));
  } else if (st.st_size > static_cast<off_t>(kMaxL3SecretFileBytes)) {
    status = Bad(path, absl::StrCat(st.st_size, " bytes, over ", kMaxL3SecretFileBytes));
  } else {
    text.resize(kMaxL3SecretFileBytes + 1);
    const ssize_t n = ::read(fd, text.data(), text.size());
    if (n < 0) {
      status = Bad(path, std::strerror(errno));
    } else {
      text.resize(static_cast<size_t>(n));
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  const absl::string_view secret = absl::StripTrailingAsciiWhitespace(text);
  if (secret.size() < kMinL3SecretBytes || text.size() > kMaxL3SecretFileBytes) {
    return Bad(path, absl::StrCat(secret.size(), " bytes of secret; it needs ", kMinL3SecretBytes,
                                  " to ", kMaxL3SecretFileBytes));
  }
  L3Secret out = FromBytes(secret);
  OPENSSL_cleanse(text.data(), text.size());
  return out;
}

L3Secret L3Secret::FromBytes(absl::string_view secret) {
  L3Secret out;
  out.record_key_ = Derive(Bytes(secret), "kvhost l3 record mac v1", "");
  out.namespace_key_ = Derive(Bytes(secret), "kvhost l3 namespace v1", "");
  out.cache_key_key_ = Derive(Bytes(secret), "kvhost l3 cache key v1", "");
  return out;
}

std::string L3Secret::PublicNamespace() const {
  const L3Mac d = Derive(namespace_key_, "p", "");
  return std::string(reinterpret_cast<const char*>(d.data()), kL3NamespaceBytes);
}

std::string L3Secret::TokenNamespace(absl::string_view owner_token) const {
  const L3Mac d = Derive(namespace_key_, "t", owner_token);
  return std::string(reinterpret_cast<const char*>(d.data()), kL3NamespaceBytes);
}

std::string L3Secret::CacheKey(absl::string_view ns, absl::string_view key) const {
  // The namespace has a fixed length, so (ns, key) splits one way only.
  const L3Mac d = Derive(cache_key_key_, ns, key);
  return absl::StrCat("kvh3:", absl::BytesToHexString(absl::string_view(
                                   reinterpret_cast<const char*>(d.data()), d.size())));
}

bool L3Secret::MacEquals(const L3Mac& a, const L3Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace kvhost
