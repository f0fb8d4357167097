// engine.hpp: GPT inference with a KV cache on one rank's shard (any TP x PP layout): the new
// tokens of several sequences go through this stage's layers in one batch, each attending to its
// own cached keys and values; the last stage returns the logits of each sequence's last new token
// over the whole (true) vocabulary, gathered across tensor-parallel ranks. The forward is the
// model's own (GPTModel::forward with an InferenceContext: the same embedding, block and head as
// training); the engine owns the caches, stages each step's inputs and exchanges the hidden
// states between pipeline stages. Weights, activations and the KV cache are in the model's compute
// dtype (f32, bf16 or f16); the logits come back in f32.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <vector>

#include "comm/communicator.hpp"
#include "model/gpt.hpp"

namespace tessera {

// New tokens of one sequence: `count` tokens at positions [pos0, pos0 + count) of cache slot
// `slot`.
struct TokenSegment {
  int slot = 0;
  int64_t pos0 = 0, count = 0;
};

class InferenceEngine {
 public:
  // Caches for `max_sequences` sequences of up to `max_positions` tokens.
  InferenceEngine(GPTModel& model, const ParallelContext& ctx, int max_sequences,
                  int64_t max_positions);
  int64_t max_positions() const { return max_positions_; }

  // Collective over the model-parallel group. `tokens` holds the new tokens of all segments in
  // order (every rank passes the same segments and tokens). On the last stage, `logits` becomes
  // (segments, vocab_size): the next-token logits after each segment's last token; with
  // `all_rows`, (tokens, vocab_size): the next-token logits after every token (for the
  // log-probabilities of prompts).
  void forward(const std::vector<TokenSegment>& segments, const std::vector<int32_t>& tokens,
               std::vector<float>& logits, bool all_rows = false);

  // forward() for each segment's last token, then its next token chosen by how[i] (one rule per
  // segment, as cpu::sample_token chooses) where the logits are: on the GPU only the ids come
  // back. Returns the ids on the last stage, nothing elsewhere. Collective like forward.
  std::vector<int32_t> forward_sample(const std::vector<TokenSegment>& segments,
                                      const std::vector<int32_t>& tokens,
                                      const std::vector<TokenSampling>& how);

  // Collective like forward (every rank passes the same `src`): cache slot i becomes a copy of
  // slot src[i] as it was before the call, for i < src.size() (beam search: each beam continues
  // its parent's keys and values). Takes a second cache of the same size on first use.
  void reorder_slots(const std::vector<int>& src);
  // Allocates reorder_slots' second cache now (so an allocation failure comes here).
  void reserve_reorder();
  int max_sequences() const { return max_sequences_; }
  int64_t vocab_size() const { return model_.config().vocab_size; }

  // Decode steps (one new token per sequence) on a backend with graphs (CUDA), at one rank
  // (TP 1, PP 1): the first step of a batch size runs as usual, the second is captured as a graph,
  // and later steps of that size replay it. TESSERA_CUDA_GRAPHS=0 in the environment, or
  // set_graphs(false), runs every step op by op. A capture that fails turns graphs off for this
  // engine (one warning line) and the step runs op by op. The engine holds its graphs on the
  // backend: destroy it before the backend; it cannot be copied.
  void set_graphs(bool on) { graphs_wanted_ = on; }
  int64_t graph_replays() const { return graph_replays_; }
  ~InferenceEngine();
  InferenceEngine(const InferenceEngine&) = delete;
  InferenceEngine& operator=(const InferenceEngine&) = delete;

 private:
  // One forward's buffers for n rows and S output rows (the model's activations and the
  // context), built in the arena; a decode step's are kept per row count, a prefill's rebuilt.
  struct Step {
    Activations acts;
    InferenceContext ctx;
  };
  class Arena;
  // Room in the arena for up to n rows and S output rows (a larger arena drops the built steps
  // and the graphs, which point into the old one).
  void ensure_rows(int64_t n, int64_t S);
  Step& step_for(int64_t n, int64_t S, bool decode);
  // The forward pass; on the last stage the logits of the output rows as the head leaves them
  // ((tp, rows, vocab_local) f32 on the backend), elsewhere an undefined tensor.
  Tensor forward_logits(const std::vector<TokenSegment>& segments,
                        const std::vector<int32_t>& tokens, bool all_rows);
  // The device work of a step whose inputs are staged: the model's forward between the stages'
  // hidden-state exchanges.
  Tensor run(Step& s);
  void release_graphs();

  struct Graph {
    int64_t handle = -1;
    Tensor logits;  // what run returned when it was captured
  };

  GPTModel& model_;
  ParallelContext ctx_;
  Backend& be_;
  int64_t max_positions_;
  int max_sequences_;
  bool moe_ = false;                       // a MoE layer here: routing on the host, no graphs
  std::vector<Tensor> k_cache_, v_cache_;  // per local layer (slots, heads_local, Tmax, head_dim)
  std::vector<Tensor> k_spare_, v_spare_;  // reorder_slots' destination, swapped in
  Tensor slot_ids_;
  int64_t rows_ = 0, segs_ = 0;  // the arena's room
  std::unique_ptr<Arena> arena_;
  std::map<int64_t, std::unique_ptr<Step>> decode_steps_;  // by number of rows
  std::unique_ptr<Step> prefill_;                          // the last prefill's
  std::vector<int32_t> host_pos_;   // positions / last rows / row table, staged for the backend
  std::vector<float> host_logits_;  // the gathered logits, back on the host
  bool graphs_wanted_ = true, graphs_failed_ = false;
  std::map<int64_t, Graph> graphs_;  // by number of rows
  std::set<int64_t> warmed_;         // row counts that ran a decode step op by op
  int64_t graph_replays_ = 0;
};

}  // namespace tessera
