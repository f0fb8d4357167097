// cpus.hpp: the cores this process may run on (its affinity mask), for the thread counts of the
// tools and the trainer's default share (train/rank_setup.hpp).
#pragma once

#include <sched.h>

namespace tessera {

inline int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

}  // namespace tessera
