// reshard.hpp: writing a whole checkpoint at any TP x PP layout from a source of global-tensor
// slices (another checkpoint: resharding; a Hugging Face model: import). Streams tensor by tensor:
// memory stays near the largest slice.
#pragma once

#include <functional>
#include <string>

#include "checkpoint/checkpoint.hpp"

namespace tessera {

// Fills `out` (spec.local_shape) with the slice of `group`'s tensor `spec.name` that `spec`
// describes; group is "model", "optimizer/exp_avg" or "optimizer/exp_avg_sq".
using SliceSource =
    std::function<void(const std::string& group, const ParamSpec& spec, float* out)>;

// Writes DIR/iter_N/ (atomically, latest file last) for meta.tp_size x meta.pp_size. Validates the
// layout against the model (ConfigError naming the numbers) and refuses a DIR that already holds a
// checkpoint (refuse_save_over_checkpoint). `progress` gets one line per file.
// `carry`, when given (tessera-reshard), is the checkpoint being resharded: the per-layer state
// beside the parameters (FP8's, group "fp8", and the routers' expert biases, group "router"; the
// same on every TP rank) goes into the files of the stage that holds each layer. `layer_state`,
// when given (an import), supplies such state for a layer instead (none: an empty vector).
using LayerStateSource = std::function<std::vector<ExtraTensor>(int layer)>;
void write_checkpoint(const std::string& save_dir, const CheckpointMeta& meta,
                      const SliceSource& source,
                      const std::function<void(const std::string&)>& progress,
                      const CheckpointReader* carry = nullptr,
                      const LayerStateSource& layer_state = {});

// Checks that the model can be split TP x PP (heads and ffn by TP, layers by PP).
void validate_model_layout(const GPTConfig& cfg, int tp, int pp);

}  // namespace tessera
