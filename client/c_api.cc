// The C ABI (kvhost/kvhost_c.h): the library calls, the conversion helpers
// of c_api_internal.h, client options, connection, session and daemon
// status. Pools and pages are in c_api_pools.cc, attachments and transfers
// in c_api_transfer.cc, the CUDA worker helpers in c_api_cuda.cc.
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "c_api_internal.h"
#include "google/protobuf/util/json_util.h"

namespace kvhost::c_api {

void WriteError(absl::string_view message, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) return;
  const size_t n = std::min(message.size(), err_len - 1);
  if (n > 0) std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

absl::Status NotNull(const void* p, const char* what) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, " is NULL"));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Str(const char* s, const char* what) {
  if (s == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, " is NULL"));
  return std::string(s);
}

absl::Status WriteString(absl::string_view s, char* out, size_t out_len, size_t* needed,
                         const char* what) {
  if (needed != nullptr) *needed = s.size() + 1;
  if (out == nullptr || out_len < s.size() + 1) {
    return absl::OutOfRangeError(absl::StrCat(what, " needs ", s.size() + 1,
                                              " bytes with its NUL; the buffer has ",
                                              out == nullptr ? 0 : out_len));
  }
  if (!s.empty()) std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return absl::OkStatus();
}

absl::Status WriteBytes(absl::string_view bytes, void* out, size_t out_len, size_t* size,
                        const char* what) {
  if (size != nullptr) *size = bytes.size();
  if (bytes.empty()) return absl::OkStatus();
  if (out == nullptr || out_len < bytes.size()) {
    return absl::OutOfRangeError(absl::StrCat(
        what, " needs ", bytes.size(), " bytes; the buffer has ", out == nullptr ? 0 : out_len));
  }
  std::memcpy(out, bytes.data(), bytes.size());
  return absl::OkStatus();
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("cannot print ", message.GetTypeName(),
                                            " as JSON: ", std::string(status.message())));
  }
  return out;
}

absl::Status WriteJson(const google::protobuf::Message& message, char* out, size_t out_len,
                       size_t* needed, const char* what) {
  absl::StatusOr<std::string> json = ToJson(message);
  if (!json.ok()) return json.status();
  return WriteString(*json, out, out_len, needed, what);
}

absl::Status FromJson(const char* json, google::protobuf::Message* message, const char* what,
                      bool optional) {
  if (json == nullptr || *json == '\0') {
    if (optional) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", json == nullptr ? "NULL" : "empty"));
  }
  google::protobuf::util::JsonParseOptions options;  // unknown fields are errors
  auto status = google::protobuf::util::JsonStringToMessage(json, message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a valid ", message->GetTypeName(),
                                                   " in JSON: ", std::string(status.message())));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> Timeout(int64_t ms, absl::Duration fallback, const char* what) {
  if (ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", ms, " ms is negative"));
  }
  return ms == 0 ? fallback : absl::Milliseconds(ms);
}

absl::StatusOr<absl::Span<const int64_t>> Indices(const int64_t* p, size_t n, const char* what) {
  if (p == nullptr && n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is NULL with a count of ", n));
  }
  return absl::Span<const int64_t>(p, n);
}

absl::StatusOr<Client*> ClientOf(kvhost_client* client) {
  if (client == nullptr || client->client == nullptr) {
    return absl::InvalidArgumentError("client is NULL");
  }
  return client->client.get();
}

absl::StatusOr<std::vector<std::string>> Keys(const void* const* keys, const size_t* key_lens,
                                              size_t n) {
  std::vector<std::string> out;
  if (n == 0) return out;
  if (keys == nullptr || key_lens == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys == nullptr ? "keys" : "key_lens", " is NULL with ", n, " keys"));
  }
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr && key_lens[i] > 0) {
      return absl::InvalidArgumentError(absl::StrCat("keys[", i, "] is NULL"));
    }
    out.emplace_back(static_cast<const char*>(keys[i]), key_lens[i]);
  }
  return out;
}

namespace {

// A path ("/run/kvhost/kvhost.sock") names a unix socket; anything else is
// a gRPC address as ClientOptions takes it.
std::string AddressOf(const std::string& address) {
  return !address.empty() && address[0] == '/' ? "unix://" + address : address;
}

absl::StatusOr<bool> ParseBool(const std::string& key, const std::string& value) {
  bool b = false;
  if (!absl::SimpleAtob(value, &b)) {
    return absl::InvalidArgumentError(
        absl::StrCat("client option ", key, " = '", value, "' is not a boolean (1/0, true/false)"));
  }
  return b;
}

absl::StatusOr<int64_t> ParseMs(const std::string& key, const std::string& value) {
  int64_t ms = 0;
  if (!absl::SimpleAtoi(value, &ms) || ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("client option ", key, " = '", value,
                                                   "' is not a positive number of milliseconds"));
  }
  return ms;
}

absl::Status SetOption(ClientOptions& o, const std::string& key, const std::string& value) {
  if (key == "address") {
    o.address = AddressOf(value);
    return absl::OkStatus();
  }
  std::string* text = nullptr;
  if (key == "owner_token") text = &o.owner_token;
  if (key == "tls_ca_file") text = &o.tls_ca_file;
  if (key == "tls_cert_file") text = &o.tls_cert_file;
  if (key == "tls_key_file") text = &o.tls_key_file;
  if (key == "tls_server_name") text = &o.tls_server_name;
  if (key == "worker_name") text = &o.worker_name;
  if (text != nullptr) {
    *text = value;
    return absl::OkStatus();
  }
  if (key == "insecure" || key == "worker_session") {
    absl::StatusOr<bool> b = ParseBool(key, value);
    if (!b.ok()) return b.status();
    (key == "insecure" ? o.insecure : o.worker_session) = *b;
    return absl::OkStatus();
  }
  if (key == "timeout_ms" || key == "reconnect_max_backoff_ms") {
    absl::StatusOr<int64_t> ms = ParseMs(key, value);
    if (!ms.ok()) return ms.status();
    (key == "timeout_ms" ? o.timeout : o.reconnect_max_backoff) = absl::Milliseconds(*ms);
    return absl::OkStatus();
  }
  if (key == "max_message_bytes") {
    int bytes = 0;
    if (!absl::SimpleAtoi(value, &bytes) || bytes <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("client option max_message_bytes = '", value, "' is not a positive int"));
    }
    o.max_message_bytes = bytes;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown client option '", key,
      "' (address, timeout_ms, max_message_bytes, owner_token, tls_ca_file, tls_cert_file, "
      "tls_key_file, tls_server_name, insecure, worker_session, worker_name, "
      "reconnect_max_backoff_ms)"));
}

absl::Status Connect(const ClientOptions& options, kvhost_client** out) {
  if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
  *out = nullptr;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return client.status();
  auto handle = std::make_unique<kvhost_client>();
  handle->client = *std::move(client);
  *out = handle.release();
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvhost::c_api

using kvhost::c_api::ClientOf;
using kvhost::c_api::NotNull;
using kvhost::c_api::Run;

extern "C" {

int kvhost_abi_version(void) { return KVHOST_ABI_VERSION; }

int kvhost_built_with_cuda(void) {
#ifdef KVHOST_C_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

const char* kvhost_code_name(int code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(sizeof(kNames) / sizeof(kNames[0]))) {
    return "UNKNOWN_CODE";
  }
  return kNames[code];
}

int kvhost_client_options_create(kvhost_client_options** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = new kvhost_client_options();
    return absl::OkStatus();
  });
}

int kvhost_client_options_set(kvhost_client_options* options, const char* key, const char* value,
                              char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(options, "options"); !s.ok()) return s;
    absl::StatusOr<std::string> k = kvhost::c_api::Str(key, "key");
    if (!k.ok()) return k.status();
    absl::StatusOr<std::string> v = kvhost::c_api::Str(value, "value");
    if (!v.ok()) return v.status();
    return kvhost::c_api::SetOption(options->options, *k, *v);
  });
}

void kvhost_client_options_destroy(kvhost_client_options* options) { delete options; }

int kvhost_client_connect(const kvhost_client_options* options, kvhost_client** out, char* err,
                          size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(options, "options"); !s.ok()) return s;
    return kvhost::c_api::Connect(options->options, out);
  });
}

int kvhost_connect(const char* address, int64_t timeout_ms, int worker_session, kvhost_client** out,
                   char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<std::string> a = kvhost::c_api::Str(address, "address");
    if (!a.ok()) return a.status();
    kvhost::ClientOptions options;
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, options.timeout, "timeout");
    if (!timeout.ok()) return timeout.status();
    options.address = kvhost::c_api::AddressOf(*a);
    options.timeout = *timeout;
    options.worker_session = worker_session != 0;
    return kvhost::c_api::Connect(options, out);
  });
}

void kvhost_client_close(kvhost_client* client) {
  try {
    delete client;
  } catch (...) {  // a destructor that throws ends nothing else here
  }
}

int kvhost_client_wait_ready(kvhost_client* client, int64_t timeout_ms, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, (*c)->options().timeout, "timeout");
    if (!timeout.ok()) return timeout.status();
    return (*c)->WaitForReady(*timeout);
  });
}

int kvhost_client_open_session(kvhost_client* client, int64_t timeout_ms, char* err,
                               size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, absl::Seconds(10), "timeout");
    if (!timeout.ok()) return timeout.status();
    return (*c)->OpenSession(*timeout);
  });
}

int kvhost_client_session_state(kvhost_client* client, int32_t* open, uint64_t* reconnects,
                                char* session_id, size_t session_id_len, size_t* session_id_needed,
                                char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    const kvhost::SessionState state = (*c)->session_state();
    if (open != nullptr) *open = state.open ? 1 : 0;
    if (reconnects != nullptr) *reconnects = state.reconnects;
    if (session_id == nullptr && session_id_len == 0 && session_id_needed == nullptr) {
      return absl::OkStatus();  // the id not asked for
    }
    return kvhost::c_api::WriteString(state.session_id, session_id, session_id_len,
                                      session_id_needed, "the session id");
  });
}

int kvhost_client_session_losses(kvhost_client* client, uint64_t* count, char* last,
                                 size_t last_len, size_t* last_needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    const std::vector<kvhost::SessionLoss> losses = (*c)->session_losses();
    if (count != nullptr) *count = losses.size();
    if (last == nullptr && last_len == 0 && last_needed == nullptr) return absl::OkStatus();
    return kvhost::c_api::WriteString(losses.empty() ? "" : losses.back().Describe(), last,
                                      last_len, last_needed, "the last session loss");
  });
}

int kvhost_daemon_status_json(kvhost_client* client, char* out, size_t out_len, size_t* needed,
                              char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<kvhost::v1::DaemonStatus> status = (*c)->GetStatus();
    if (!status.ok()) return status.status();
    return kvhost::c_api::WriteJson(*status, out, out_len, needed, "the daemon status");
  });
}

}  // extern "C"
