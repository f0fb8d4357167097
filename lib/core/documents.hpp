// documents.hpp: documents inside one sample that do not see each other (Megatron's
// --reset-attention-mask) and the position ids they restart (--reset-position-ids), as the
// attention kernels take them. The rules that fill these tables are run/sample_layout.hpp's
// (docs/data.md, "Documents inside a sample").
#pragma once

#include "core/tensor.hpp"

namespace tessera {

// Tables of one micro-batch, int32 (B*T) on the backend, row b*T + t. Either may be null. With
// context parallelism each CP rank holds the tables of its samples whole, (B, cp*T) indexed by
// global position (b*cp*T + p), as the ring's blocks take them (RingBlockSpec::docs); every key
// row index and position below is then a global one.
struct AttentionDocuments {
  // The first key row (b, t) may see: the first token of its document. Keys before it are masked
  // like the future ones (row t sees keys key_begin[t] .. t). Null: 0 (the whole causal prefix).
  const Tensor* key_begin = nullptr;
  // The position id of each row, for ALiBi's distance slope * (pos_j - pos_i). Null: the index t.
  const Tensor* positions = nullptr;
  bool active() const { return key_begin != nullptr || positions != nullptr; }
};

}  // namespace tessera
