// Links kvhost::cuda_client from an installed package and calls it without
// a GPU: LoadEvents::Open refuses an attachment with no load events before
// any CUDA call. Prints the message; exit 0 when it is FAILED_PRECONDITION.
#include <cstdio>

#include "kvhost/cuda_export.h"

int main() {
  kvhost::v1::Attachment attachment;
  attachment.set_id("none");
  attachment.set_backend("host");
  auto events = kvhost::LoadEvents::Open(attachment);
  std::printf("cuda client: %s\n", events.status().ToString().c_str());
  return events.status().code() == absl::StatusCode::kFailedPrecondition ? 0 : 1;
}
