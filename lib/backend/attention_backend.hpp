// attention_backend.hpp: Megatron's --attention-backend, which attention kernels a backend runs.
// On --device cuda: `fused` is cuDNN's fused flash attention (backend/cuda/cudnn_attention.*),
// `flash` Tessera's tensor-core flash kernels (backend/cuda/flash_attention_tc.*), `unfused` and
// `local` Tessera's generic kernels (no tensor cores; what runs in f32 anyway), and `auto` cuDNN
// where it runs the call (bf16/f16, no attention dropout or ALiBi, a plan cuDNN builds) and the
// flash kernels otherwise. The CPU backend has one attention, its reference: it takes `auto`,
// `unfused` and `local`. docs/kernels.md "Attention backends".
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace tessera {

enum class AttentionBackend { Auto, Fused, Flash, Unfused, Local };

inline const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::Auto:
      return "auto";
    case AttentionBackend::Fused:
      return "fused";
    case AttentionBackend::Flash:
      return "flash";
    case AttentionBackend::Unfused:
      return "unfused";
    case AttentionBackend::Local:
      return "local";
  }
  return "?";
}

inline AttentionBackend parse_attention_backend(const std::string& s) {
  for (AttentionBackend b :
       {AttentionBackend::Auto, AttentionBackend::Fused, AttentionBackend::Flash,
        AttentionBackend::Unfused, AttentionBackend::Local})
    if (s == attention_backend_name(b)) return b;
  throw ConfigError("--attention-backend=" + s +
                    " is not one of auto, fused (cuDNN), flash (Tessera's tensor-core kernels), "
                    "unfused, local");
}

// One attention call's shape (per rank: heads after tensor parallelism), for the start-up line.
struct AttentionCall {
  DType dtype = DType::F32;
  int64_t batch = 1, seq = 1, heads = 1, kv_heads = 1, head_dim = 1;
  bool dropout = false, alibi = false;
  bool documents = false;  // a first visible key per row (--reset-attention-mask, --sft)
};

}  // namespace tessera
