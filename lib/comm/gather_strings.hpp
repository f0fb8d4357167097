// gather_strings.hpp: this rank's host name, and small host strings of every rank on every rank
// (host names, one-line findings), over the Communicator's double all-reduce: for start-up and rare
// paths, not per step.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/communicator.hpp"

namespace tessera {

// This rank's host name (Megatron's os.uname()[1]); "unknown" when it cannot be read.
inline std::string host_name() {
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

// Collective: every rank's `mine`, in rank order, on every rank.
inline std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const size_t n = static_cast<size_t>(comm.size()), me = static_cast<size_t>(comm.rank());
  std::vector<double> len(n, 0.0);
  len[me] = static_cast<double>(mine.size());
  comm.all_reduce_f64(len.data(), static_cast<int64_t>(n), ReduceOp::Sum);
  size_t total = 0, at = 0;
  for (size_t r = 0; r < n; ++r) {
    if (r == me) at = total;
    total += static_cast<size_t>(len[r]);
  }
  std::vector<double> buf(std::max<size_t>(total, 1), 0.0);
  for (size_t i = 0; i < mine.size(); ++i) buf[at + i] = static_cast<unsigned char>(mine[i]);
  comm.all_reduce_f64(buf.data(), static_cast<int64_t>(buf.size()), ReduceOp::Sum);
  std::vector<std::string> out(n);
  size_t pos = 0;
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < static_cast<size_t>(len[r]); ++i)
      out[r].push_back(static_cast<char>(static_cast<int>(buf[pos + i])));
    pos += static_cast<size_t>(len[r]);
  }
  return out;
}

}  // namespace tessera
