// context_parallel.cpp (train): context parallelism's option checks, token slicing and the ring's
// traffic.
#include "run/context_parallel.hpp"

#include <cstring>

#include "core/context_parallel.hpp"
#include "core/error.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

void validate_context_parallel(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp) {
  using detail::concat;
  if (cp < 1)
    throw ConfigError(concat("--context-parallel-size=", cp, " is out of range (allowed: >= 1)"));
  if (cp == 1) return;
  if (cfg.seq_length % (2 * cp) != 0)
    throw ConfigError(
        concat("--seq-length=", cfg.seq_length,
               " is not divisible by 2 x --context-parallel-size=", cp, " = ", 2 * cp,
               " (each context-parallel rank holds two of the sequence's 2 x CP "
               "chunks",
               t.documents.packed ? ", and --sft's packed samples are cut the same way" : "",
               "; allowed: a multiple of ", 2 * cp, ")"));
  if (cfg.moe() && !cfg.moe_dropless())
    throw ConfigError(concat(
        "--context-parallel-size=", cp,
        " with --moe-expert-capacity-factor=", cfg.moe_expert_capacity_factor,
        ": which tokens an expert drops depends on the whole micro-batch's order, which no CP "
        "rank holds; use dropless MoE (no capacity factor) with context parallelism, or CP 1"));
  if (t.sequence_parallel && (cfg.seq_length / cp) % tp != 0)
    throw ConfigError(concat("--seq-length=", cfg.seq_length, " / --context-parallel-size=", cp,
                             " = ", cfg.seq_length / cp,
                             " tokens per CP rank is not divisible by "
                             "--tensor-model-parallel-size=",
                             tp,
                             " as --sequence-parallel needs (it splits each CP rank's tokens "
                             "over TP; allowed: a --seq-length multiple of ",
                             cp * tp, " and of ", 2 * cp, ")"));
}

void cp_sample_tokens(const int32_t* sample, int T, int rank, int cp, int32_t* ids,
                      int32_t* targets) {
  const bool contiguous = test_hooks::cp_contiguous_split();  // testing: a mutation
  const int c = T / 2;
  for (int half = 0; half < 2; ++half) {
    const int64_t p0 =
        contiguous ? int64_t(rank) * T + half * c : cp_position(rank, cp, c, half * c);
    std::memcpy(ids + half * c, sample + p0, sizeof(int32_t) * c);
    std::memcpy(targets + half * c, sample + p0 + 1, sizeof(int32_t) * c);
  }
}

RingTraffic cp_ring_traffic(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp) {
  RingTraffic r;
  if (cp <= 1) return r;
  r.block = double(t.micro_batch_size) * (cfg.seq_length / cp) * 2.0 * (cfg.kv_heads() / tp) *
            cfg.head_dim() * dtype_size(t.compute_dtype);
  r.forward = (cp - 1) * r.block;
  r.backward = (cp - 1) * r.block + cp * r.block;
  r.recompute = t.recompute.granularity == RecomputeGranularity::None ? 0.0 : r.forward;
  return r;
}

}  // namespace tessera
