// params.hpp: the global layout of every parameter (DESIGN.md invariant 4) and the flat buffers
// that hold this rank's shards of them.
//
// Each parameter has one global shape; a tensor-parallel shard is one contiguous slice along one
// axis, described by (name, global shape, split axis, offset), like Megatron's ShardedTensor. This
// description drives initialization (by global element index), checkpoints and resharding.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"
#include "model/gpt_config.hpp"
#include "model/pipeline_split.hpp"

namespace tessera {

enum class ParamInit { Normal, Zeros, Ones };

struct ParamSpec {
  std::string name;          // e.g. "layers.3.attn.qkv.weight"
  Shape global_shape;        // e.g. [3, heads, head_dim, hidden]
  int split_axis = -1;       // -1: replicated on every tensor-parallel rank
  int64_t split_offset = 0;  // first global index along split_axis held here
  Shape local_shape;
  ParamInit init = ParamInit::Zeros;
  double init_std = 0;
  int64_t init_rows = -1;  // if >= 0, global rows (axis 0) at or past this are zero (vocab padding)
  bool weight_decay = false;  // matrices and embeddings decay; biases and LayerNorm do not
  // The next spec follows this one in the flat buffers with nothing between (never split by a
  // bucket boundary or its padding): one GEMM reads both as one weight (the query and key/value
  // projections of grouped-query attention).
  bool glue_next = false;
  // A routed expert's weight (MoE): held by the ranks of its expert-parallel rank only, so its
  // gradient reduces over the expert-data-parallel group instead of DP.
  bool expert = false;
  int64_t flat_offset = 0;  // into the flat parameter / gradient buffers
  int64_t numel() const { return shape_numel(local_shape); }
};

// Transformer layers [begin, end).
struct LayerRange {
  int begin = 0, end = 0;
  int size() const { return end - begin; }
};

// Which piece of the model a rank holds.
struct ModelShard {
  int tp_size = 1, tp_rank = 0;
  // The transformer layers on this pipeline rank: one range per model chunk (virtual pipeline
  // stage; one chunk without the interleaved schedule), in order. Chunk c of pipeline rank p is
  // virtual stage c * PP + p.
  std::vector<LayerRange> chunks{LayerRange{}};
  bool has_embedding = true;  // chunk 0 is the first (virtual) stage: wte and wpe
  bool has_head = true;       // the last chunk is the last stage: final norm and the output layer
  // Sequence parallelism (Megatron's, TP > 1): the LayerNorm, dropout and residual regions hold
  // this rank's 1/TP of the micro-batch's tokens; it changes activations, never parameters.
  bool sequence_parallel = false;
  // Expert parallelism (MoE): this rank holds experts [ep_rank * E/EP, (ep_rank + 1) * E/EP) of
  // every MoE layer.
  int ep_size = 1, ep_rank = 0;
  // Context parallelism (model/context_parallel.cpp): this rank holds local rows of each sample
  // at the global positions cp_position(cp_rank, cp_size, T/2, t) of a cp_size*T-token
  // sequence; attention runs around the CP ring. Changes activations, never parameters.
  int cp_size = 1, cp_rank = 0;
  // Multi-token prediction: its transformer layers [mtp_begin, mtp_begin + mtp_count) (indices
  // after the model's), run by the head piece of the last chunk, not by the chunk loops. On the
  // last stage beside the loss, or (a layout's "m|L") on a stage of their own, whose head piece
  // is then multi-token prediction alone: it holds copies of the word embedding and the output
  // layer, their gradients summed with the other stages' (step/optimizer_set.cpp).
  int mtp_begin = 0, mtp_count = 0;

  int num_chunks() const { return static_cast<int>(chunks.size()); }
  // The last chunk ends in a head piece: the loss, multi-token prediction, or both.
  bool head_piece() const { return has_head || mtp_count > 0; }
  bool is_mtp_layer(int layer) const {
    return mtp_count > 0 && layer >= mtp_begin && layer < mtp_begin + mtp_count;
  }
  // This rank's layers in chunk order (then multi-token prediction's), and their number.
  std::vector<int> layers() const;
  int num_layers() const;
  // The position of `layer` in layers(); -1 when this rank does not hold it.
  int local_index(int layer) const;
  // The chunk that holds `layer` (-1: none).
  int chunk_of(int layer) const;
  // The experts of a model with `experts` experts this rank holds: [first, first + count).
  int experts_local(int experts) const { return experts / ep_size; }
  int experts_begin(int experts) const { return experts_local(experts) * ep_rank; }
  // "3-5" or "1, 5" (chunks' layer ranges) for messages.
  std::string describe_layers() const;
};

// The shard of (tp_rank, pp_rank) in a TP x PP layout: the stage split of `split`
// (model/pipeline_split.hpp; default: the layers split evenly over the stages), the embedding on
// the first stage, the final norm and the (tied or own) output layer on the last. With
// `virtual_stages` V > 1 (the interleaved schedule) the layers are split into PP x V chunks and
// pipeline rank p holds chunks p, p + PP, p + 2 PP, ... A layout string sets V itself
// (virtual_stages 0 or equal).
ModelShard model_shard_for(const GPTConfig& cfg, int tp_size, int tp_rank, int pp_size, int pp_rank,
                           int virtual_stages = 1, const PipelineSplitOptions& split = {});

// Builds a shard's parameter specs in flat-buffer order (build_param_specs; each layer's parts add
// theirs, model/parts.hpp).
struct ParamSpecBuilder {
  const GPTConfig& cfg;
  const ModelShard& shard;
  // Only each MoE layer's first local expert (every expert of a layer has the same shapes), so
  // counting costs the same for 8 experts as for 10^8 (count_param_specs).
  bool one_expert = false;
  std::vector<ParamSpec> specs;
  int64_t offset = 0;

  // split_axis -1: replicated. Otherwise the global extent along the axis is split evenly over TP.
  void add(std::string name, Shape global, int split_axis, ParamInit init, double std, bool decay,
           int64_t init_rows = -1);
  // A norm of `width` features: its weight (ones, or zeros with --apply-layernorm-1p, which
  // applies 1 + w) and, for LayerNorm, its bias.
  void norm(const std::string& name, int64_t width);
  // The init std of a residual branch's output projection (fc2, the attention projection).
  double out_std() const;
};

// The specs of this shard's parameters, in flat-buffer order.
std::vector<ParamSpec> build_param_specs(const GPTConfig& cfg, const ModelShard& shard);
// Every parameter of the model whole (one rank, one stage): the global shapes, as the
// Hugging Face import and export see them.
std::vector<ParamSpec> global_param_specs(const GPTConfig& cfg);

// What build_param_specs would hold, counted without building a spec per expert (the memory
// estimate's and --dry-run's cost does not grow with --num-experts).
struct ParamCount {
  int64_t parameters = 0, expert_parameters = 0;
};
ParamCount count_param_specs(const GPTConfig& cfg, const ModelShard& shard);
// The specs count_param_specs counts: each MoE layer's first local expert only (`expert` set;
// the layer's other local experts have the same shapes). The step-time predictor reads its GEMMs.
std::vector<ParamSpec> counted_param_specs(const GPTConfig& cfg, const ModelShard& shard);

// A piece of a stage's passes: a transformer layer (its global index), or one of these two (the
// head: the final norm, the logits, the loss and multi-token prediction; the embedding). The
// model's passes, the gradient reduction, FSDP's ledger and the collective plan all count in them.
constexpr int kHeadPiece = -1, kEmbedPiece = -2;

// The backward pieces that write each spec's gradient (kHeadPiece, kEmbedPiece
// or the layer index): the gradient of a parameter is final when all of its pieces have run. wte
// on a stage with both ends has two. The data-parallel reducer starts a bucket when its
// parameters are final (step/grad_reducer.hpp); the step-time predictor's collective plan
// orders the buckets the same way.
std::vector<std::vector<int>> param_pieces(const std::vector<ParamSpec>& specs,
                                           const ModelShard& shard);

// A piece's slot in per-piece tables: 0 the embedding piece, 1 the head, 2 + a layer's local
// index on `shard`; num_piece_slots(shard) slots in all.
int piece_slot(int piece, const ModelShard& shard);
int num_piece_slots(const ModelShard& shard);

// Global linear index of local element `i` of a shard (for counter-based init and checks).
int64_t global_element_index(const ParamSpec& spec, int64_t local_index);

// Fills `out` (local_shape, f32) from the counter-based RNG keyed by (seed, name, global index).
void init_param(const ParamSpec& spec, uint64_t seed, float* out);

// How the flat buffers are cut into data-parallel gradient buckets: whole parameters, from the
// end of the buffer backwards (the order the backward finishes them), each bucket at least
// bucket_elems. With the distributed optimizer every bucket is padded at its end to a multiple of
// `shards` (the DP size), so each DP rank owns one equal block of each bucket, and the tied
// embedding gets a bucket of its own (its gradient is summed between the first and last pipeline
// stage block by block, and the blocks must be the same elements on both).
struct FlatLayout {
  int64_t bucket_elems = 0;  // 0: one bucket
  int shards = 1;
  // HSDP's outer optimizer sharding: each of the `shards` blocks is cut again into this many
  // (the buckets padded to a multiple of shards x shard_split).
  int shard_split = 1;
  bool embedding_alone = false;
  // The output layer in a bucket of its own too: multi-token prediction on a stage of its own
  // holds a copy, its gradient summed with the last stage's block by block.
  bool head_alone = false;
  // Expert parallelism: routed experts' parameters never share a bucket with the others (their
  // buckets reduce over another group).
  bool experts_apart = false;
  // false: no f32 master buffer here (mixed precision with the distributed optimizer, which
  // keeps the master weights of its blocks); param()/flat_params() are then an error.
  bool master = true;
  // Megatron-FSDP (step/fsdp.hpp): one bucket per FSDP unit (a layer, the embedding, the head;
  // fsdp_unit_of), whatever bucket_elems says. units_only_grads / units_only_compute: the
  // gradients / compute weights have no flat buffer; each bucket's are an unbound tensor
  // (ParamStore::bucket_grads, bucket_compute) that FSDP binds while a pass needs them.
  bool fsdp_units = false;
  bool units_only_grads = false;
  bool units_only_compute = false;
};

// The FSDP unit a parameter belongs to: "layers.<l>" for a layer's (multi-token prediction's
// layers too), "embedding" (wte, wpe), "head" (the final norm, the output layer, MTP's own).
std::string fsdp_unit_of(const std::string& param_name);

struct FlatBucket {
  int64_t begin = 0, end = 0;          // flat element range, padding included
  int first_param = 0, end_param = 0;  // specs [first, end) in it
  bool expert = false;                 // holds routed experts' parameters (experts_apart)
  int64_t numel() const { return end - begin; }
};

// Assigns flat_offset to `specs` (in their order) for `layout`; returns the buckets in the order
// the backward finishes them (the one at the end of the buffer first). With one shard and no
// bucket of its own for the embedding, the offsets are the plain running sum.
std::vector<FlatBucket> layout_flat_buffer(std::vector<ParamSpec>& specs, const FlatLayout& layout);

// Per piece slot (piece_slot), the buckets holding a parameter the piece writes, in bucket order:
// what the distributed optimizer's overlapped gather waits for before a piece, and FSDP's units
// a piece gathers.
std::vector<std::vector<int>> buckets_of_pieces(const std::vector<ParamSpec>& specs,
                                                const std::vector<FlatBucket>& buckets,
                                                const ModelShard& shard);

// This rank's parameters and gradients, each in one flat f32 buffer (room for ZeRO-style
// reduce-scatter by range later); every parameter is a view into them. With a bf16 or f16 compute
// dtype (mixed precision), a third flat buffer holds the parameters in that dtype for the forward
// and backward: the f32 ones are the master weights the optimizer updates, and the compute copy
// is refreshed from them (GPTModel::sync_compute_weights). In f32 the compute copy is the master.
class ParamStore {
 public:
  ParamStore(std::vector<ParamSpec> specs, Allocator& alloc, DType compute = DType::F32,
             const FlatLayout& layout = {});
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const std::vector<FlatBucket>& buckets() const { return buckets_; }
  const FlatLayout& layout() const { return layout_; }
  // Elements of the flat buffers (parameters plus bucket padding).
  int64_t numel() const { return numel_; }
  bool has_master() const { return layout_.master; }
  Tensor& flat_params() {
    check_master();
    return flat_params_;
  }
  Tensor& flat_grads() {
    check_flat(flat_grads_, "gradients");
    return flat_grads_;
  }
  Tensor& flat_compute() {
    check_flat(flat_compute_, "compute weights");
    return flat_compute_;
  }
  // Bucket b's gradients / compute weights: a view of the flat buffer, or (FSDP units) the
  // bucket's own tensor, bound only while FSDP holds it.
  Tensor bucket_grads(int b) const;
  Tensor bucket_compute(int b) const;
  // The bucket that holds spec index i.
  int bucket_of(size_t spec_index) const { return bucket_of_[spec_index]; }
  // The forward's and backward's dtype (also when no flat compute buffer exists: FSDP's
  // units_only_compute).
  DType compute_dtype() const { return compute_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const ParamSpec& spec(const std::string& name) const;
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  Tensor param(const ParamSpec& s) const {
    check_master();
    return flat_params_.view(s.flat_offset, s.local_shape);
  }
  Tensor grad(const ParamSpec& s) const { return flat_view(true, s, s.local_shape); }
  // Two glued parameters (ParamSpec::glue_next) as one (rows, cols) matrix, rows summed: the
  // compute weights, or the gradients.
  Tensor compute_fused(const std::string& first, const std::string& second) const;
  Tensor grad_fused(const std::string& first, const std::string& second) const;
  // The weights the forward and backward read (the master ones in f32).
  Tensor compute_param(const std::string& name) const;
  Tensor compute_param(const ParamSpec& s) const { return flat_view(false, s, s.local_shape); }

 private:
  void check_master() const;
  static void check_flat(const Tensor& t, const char* what);
  // `shape` at spec s's offset in the gradients (grads) or the compute weights.
  Tensor flat_view(bool grads, const ParamSpec& s, Shape shape) const;
  std::vector<ParamSpec> specs_;
  FlatLayout layout_;
  std::vector<FlatBucket> buckets_;
  std::map<std::string, size_t> index_;
  Tensor flat_params_, flat_grads_, flat_compute_;
  DType compute_ = DType::F32;
  std::vector<Tensor> unit_grads_, unit_compute_;  // per bucket, when the layout says so
  std::vector<int> bucket_of_;                     // per spec
  int64_t numel_ = 0;
};

}  // namespace tessera
