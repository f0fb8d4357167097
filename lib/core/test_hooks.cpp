// test_hooks.cpp: the fault and test hooks' environment reads (tests only; see test_hooks.hpp).
#include "core/test_hooks.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "core/error.hpp"

namespace tessera::test_hooks {

namespace {
// True when `name` is set to exactly `value`.
bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, value) == 0;
}
}  // namespace

bool cp_no_lse_merge() {
  static const bool on = env_is("TESSERA_FAULT_CP", "no-lse-merge");
  return on;
}

bool doc_mask_leak() {
  return env_is("TESSERA_FAULT_DOC_MASK", "leak");
}

bool cp_contiguous_split() {
  static const bool on = env_is("TESSERA_FAULT_CP", "contiguous-split");
  return on;
}

bool dropout_ignore_tp_offset() {
  static const bool on = env_is("TESSERA_FAULT_DROPOUT_KEY", "ignore-tp-offset");
  return on;
}

bool fp8_no_tp_amax() {
  return env_is("TESSERA_FAULT_FP8", "no-tp-amax");
}

float perturb_init() {
  static const float p = [] {
    const char* v = std::getenv("TESSERA_TEST_PERTURB_INIT");
    return v ? std::strtof(v, nullptr) : 0.f;
  }();
  return p;
}

namespace {
int env_us(const char* name) {
  const char* v = std::getenv(name);
  const long us = v ? std::strtol(v, nullptr, 10) : 0;
  return us > 0 && us < 10000000 ? static_cast<int>(us) : 0;
}
}  // namespace

int delay_comm_us() {
  static const int us = env_us("TESSERA_TEST_DELAY_COMM_US");
  return us;
}

int delay_compute_us() {
  static const int us = env_us("TESSERA_TEST_DELAY_COMPUTE_US");
  return us;
}

bool moe_dispatch_wrong_rank() {
  return env_is("TESSERA_FAULT_MOE_DISPATCH", "wrong-rank");
}

bool router_bias_in_weights() {
  return env_is("TESSERA_FAULT_ROUTER", "bias-in-weights");
}

bool router_no_group_limit() {
  return env_is("TESSERA_FAULT_ROUTER", "no-group-limit");
}

std::vector<std::pair<int, float>> moe_logit_bias(int num_experts) {
  std::vector<std::pair<int, float>> bias;
  const char* v = std::getenv("TESSERA_TEST_MOE_LOGIT_BIAS");
  if (!v) return bias;
  std::stringstream in(v);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t colon = item.find(':');
    TESSERA_CHECK(colon != std::string::npos, "TESSERA_TEST_MOE_LOGIT_BIAS: 'e:v' items");
    const int e = std::stoi(item.substr(0, colon));
    TESSERA_CHECK(e >= 0 && e < num_experts, "TESSERA_TEST_MOE_LOGIT_BIAS: expert ", e);
    bias.push_back({e, std::stof(item.substr(colon + 1))});
  }
  return bias;
}

int save_fault_after(int world_rank, int64_t iteration) {
  const char* fault = std::getenv("TESSERA_FAULT_SAVE_RANK");
  int fault_rank = -1;
  long long fault_iter = 0;
  if (fault) std::sscanf(fault, "%d:%lld", &fault_rank, &fault_iter);  // "RANK[:FROM_ITERATION]"
  return fault_rank == world_rank && iteration >= fault_iter ? 3 : -1;
}

long slow_save_ms() {
  static const long ms = [] {
    const char* v = std::getenv("TESSERA_SLOW_SAVE_MS");
    return v ? std::atol(v) : 0L;
  }();
  return ms;
}

namespace {
const char* nvtx_log_prefix() {
  static const char* prefix = [] {
    const char* v = std::getenv("TESSERA_TEST_NVTX_LOG");
    return v && *v ? v : nullptr;
  }();
  return prefix;
}
}  // namespace

bool nvtx_log_on() {
  static const bool on = nvtx_log_prefix() != nullptr;
  return on;
}

void nvtx_log(const char* name) {
  static std::FILE* f = [] {
    const char* rank = nullptr;
    for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
      if (!rank) rank = std::getenv(v);
    const std::string path = std::string(nvtx_log_prefix()) + ".rank" + (rank ? rank : "0");
    return std::fopen(path.c_str(), "w");
  }();
  if (!f) return;
  std::fputs(name, f);
  std::fputc('\n', f);
  std::fflush(f);
}

const char* collective_log_prefix() {
  static const char* prefix = [] {
    const char* v = std::getenv("TESSERA_TEST_COLLECTIVE_LOG");
    return v && *v ? v : nullptr;
  }();
  return prefix;
}

}  // namespace tessera::test_hooks
