// sample_layout.hpp: documents inside a sample, Megatron's _get_ltor_masks_and_position_ids
// (docs/data.md, "Documents inside a sample"). A sample holds seq_length + 1 tokens; its input is
// the first seq_length, its targets the last seq_length. For the input's tokens x_0 .. x_{T-1}:
//  - --reset-position-ids: the position of x_t is t - s, s being the index after the last end of
//    document (EOD) token before t (0 when none): positions restart after every EOD;
//  - --reset-attention-mask: x_t attends to x_s .. x_t only (s as above): never to a token at or
//    before an earlier EOD of the sample;
//  - --eod-mask-loss: the position whose input token is EOD carries no loss (its target, the
//    next document's first token, is not predicted from the previous document).
// The EOD token itself belongs to the document it ends (it attends to it and keeps counting its
// positions).
#pragma once

#include <cstdint>
#include <string>

#include "data/dataset.hpp"

namespace tessera {

struct LtorOptions {
  bool reset_position_ids = false, reset_attention_mask = false, eod_mask_loss = false;
  int64_t eod = -1;  // the end-of-document token (the shards' eod_id; set when the data opens)
  // --sft: the documents are the packed ones the samples' flags mark (kDocumentStart), not the
  // stretches between EOD tokens; positions and attention reset at each.
  bool packed = false;
  bool no_truncate = false;  // --sft-no-truncate: a document longer than a sample is an error
  bool active() const { return reset_position_ids || reset_attention_mask || eod_mask_loss; }
};

// One sample's layout from its T input tokens (and its flags, data/dataset.hpp; may be null
// unless packed). positions (T) and key_begin (T) are written when not null (plain 0..T-1 and 0
// where the option is off); with eod_mask_loss, targets (T) is set to -1 (no loss) where the
// input token is EOD.
void ltor_layout(const int32_t* input, const uint8_t* flags, int64_t T, const LtorOptions& o,
                 int32_t* positions, int32_t* key_begin, int32_t* targets);

// Which positions' losses count, for a sample of T + 1 tokens and its loss mask (null: all 1):
// counts[t] (0 <= t < T) is 1 when the target of position t, token t + 1, is a token (>= 0)
// flagged kLossTarget and not kDocumentStart (a packed document's first token is no target) and,
// with eod_mask_loss, the input token t is not EOD.
void loss_counts(const int32_t* sample, const uint8_t* mask, int64_t T, const LtorOptions& o,
                 uint8_t* counts);

// Why these options cannot run on `device` ("cpu" | "cuda") with or without ALiBi, as one line
// naming what to change; empty when they can. Every parallel layout takes them (the ring of
// context parallelism included); CUDA masks documents in its tensor-core kernels (bf16/fp16, head
// dims 64 and 128: checked when the attention runs) and takes ALiBi's distances by row.
std::string documents_problem(const LtorOptions& o, const std::string& device, bool alibi);

}  // namespace tessera
