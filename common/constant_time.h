// SecretEquals: the one comparison of a secret kvhostd holds (a pool's owner
// token, a worker session id) with what a caller presents, in time that
// depends only on the length of what is presented, never on where the two
// differ or on the secret's length; so that timing a wrong guess teaches
// nothing about the secret.
//
// Thread safety: a pure function.
#ifndef KVHOST_COMMON_CONSTANT_TIME_H_
#define KVHOST_COMMON_CONSTANT_TIME_H_

#include "absl/strings/string_view.h"

namespace kvhost {

// Whether `given` equals `secret`. Every byte of `given` is compared (with
// the secret's, repeated), however early a difference shows. An empty
// secret equals only an empty `given` (callers decide what "no secret"
// means before asking).
bool SecretEquals(absl::string_view given, absl::string_view secret);

}  // namespace kvhost

#endif  // KVHOST_COMMON_CONSTANT_TIME_H_
