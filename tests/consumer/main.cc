// Connects to the kvhostd at argv[1], lists its pools and prints how many
// there are. Exit status 0 on success, 1 on any error.
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvhost/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ADDRESS (e.g. unix:///run/kvhost/kvhost.sock)\n", argv[0]);
    return 1;
  }
  kvhost::ClientOptions options;
  options.address = argv[1];
  options.timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::vector<kvhost::v1::Pool>> pools = (*client)->ListPools();
  if (!pools.ok()) {
    std::fprintf(stderr, "ListPools: %s\n", pools.status().ToString().c_str());
    return 1;
  }
  std::printf("pools: %zu\n", pools->size());
  return 0;
}
