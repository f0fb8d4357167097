// pipeline_split.hpp: which transformer layers each pipeline stage holds (docs/parallelism.md,
// "Stage splits"), with Megatron-LM's options and meaning: an even split, uneven first and last
// stages (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers), the
// embedding and the loss counted as layers (--account-for-embedding-in-pipeline-split /
// --account-for-loss-in-pipeline-split), or a layout string (--pipeline-model-parallel-layout,
// Megatron-Core's PipelineParallelLayerLayout: "Et*3|(tt|)*29,m|L").
//
// A virtual stage s = chunk * PP + pipeline rank holds consecutive decoder layers; the stages hold
// them in order of s (Megatron's order with and without the interleaved schedule). Every refusal
// is a ConfigError naming the option and the count; nothing is ever dropped silently.
#pragma once

#include <string>
#include <vector>

namespace tessera {

struct PipelineSplitOptions {
  int first = 0, last = 0;  // decoder layers of the first / last pipeline rank (0: not given)
  bool account_embedding = false, account_loss = false;
  std::string layout;  // empty: none
  bool uneven() const {
    return first > 0 || last > 0 || account_embedding || account_loss || !layout.empty();
  }
};

// What one virtual stage holds: decoder layers [begin, end), the embedding (the first stage), the
// loss with the final norm and the output layer (the last stage), and multi-token prediction's
// layers (`mtp` of them; all of them in one stage).
struct StageSpan {
  int begin = 0, end = 0;
  bool embedding = false, loss = false;
  int mtp = 0;
  int layers() const { return end - begin; }
};

// The stages of a layout string, each a string of its layers' letters (E, t, m, L), after
// Megatron's expansion: commas dropped, "(...)*N" then "x*N" unrolled. Throws ConfigError on an
// unknown character.
std::vector<std::string> parse_pipeline_layout(const std::string& layout);

// The virtual stages per pipeline rank a layout string makes at `pp` ranks (its stages / PP).
int layout_virtual_stages(const std::string& layout, int pp);

// Every virtual stage's span, PP x V of them in order of s = chunk * PP + rank, for a model of
// `num_layers` decoder layers and `mtp_layers` multi-token prediction layers. `vp` is the virtual
// stages per rank (1: none); with a layout it must be the layout's (or 0, take it from the
// layout). Refuses what Megatron-LM refuses, and first/last at PP 1.
std::vector<StageSpan> split_stages(const PipelineSplitOptions& o, int num_layers, int mtp_layers,
                                    int pp, int vp);

// The pipeline rank whose last virtual stage runs multi-token prediction without the loss (a
// layout's "m|L", Megatron's mtp_standalone); -1 when the MTP layers (if any) are with the loss.
int standalone_mtp_rank(const std::vector<StageSpan>& spans, int pp);

// The spans as a layout string, every layer written out ("Ett|tt|ttmL"): what a checkpoint
// records of the split it was saved at (split_stages of it gives the spans back).
std::string layout_string(const std::vector<StageSpan>& spans);

// A stage as Megatron's pretty_repr prints it: "embedding,decoder*3", or "(empty stage)".
std::string describe_stage(const StageSpan& s);

}  // namespace tessera
