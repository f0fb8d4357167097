// sample_layout.cpp: the rules of run/sample_layout.hpp.
#include "run/sample_layout.hpp"

#include <string>

#include "core/error.hpp"

namespace tessera {

void ltor_layout(const int32_t* input, const uint8_t* flags, int64_t T, const LtorOptions& o,
                 int32_t* positions, int32_t* key_begin, int32_t* targets) {
  TESSERA_CHECK(!o.packed || flags, "packed samples without their flags");
  int64_t start = 0;  // the first token of the current document
  for (int64_t t = 0; t < T; ++t) {
    if (o.packed && (flags[t] & kDocumentStart)) start = t;
    if (positions) positions[t] = static_cast<int32_t>(o.reset_position_ids ? t - start : t);
    if (key_begin) key_begin[t] = static_cast<int32_t>(o.reset_attention_mask ? start : 0);
    const bool eod = input[t] == o.eod;
    if (eod && o.eod_mask_loss && targets) targets[t] = -1;
    if (eod && !o.packed) start = t + 1;  // the next token starts a document
  }
}

void loss_counts(const int32_t* sample, const uint8_t* mask, int64_t T, const LtorOptions& o,
                 uint8_t* counts) {
  for (int64_t t = 0; t < T; ++t)
    counts[t] = sample[t + 1] >= 0 &&
                (!mask || ((mask[t + 1] & kLossTarget) && !(mask[t + 1] & kDocumentStart))) &&
                !(o.eod_mask_loss && sample[t] == o.eod);
}

std::string documents_problem(const LtorOptions& o, const std::string& device, bool alibi) {
  const bool mask = o.reset_attention_mask || o.packed;
  if (device == "cuda" && !mask && o.reset_position_ids && alibi)
    return "--reset-position-ids with ALiBi and without --reset-attention-mask on --device cuda: "
           "the CUDA attention kernels take ALiBi's distances by row (give --reset-attention-mask "
           "too, or --device cpu)";
  return "";
}

}  // namespace tessera
