// gpt_dataset.hpp: Megatron's GPTDataset over HDF5 shards. The documents of all shards of a prefix
// form one corpus; --split cuts it into train/valid/test by documents, in order. A split's
// samples are windows of seq_length+1 tokens over its concatenated documents (consecutive
// windows share one token); each epoch visits every window once in a seeded random order, and
// sample index e*N+p is epoch e's p-th, so any index maps to its sample without state: resuming
// from a number of consumed samples is exact, and the index costs one permutation per epoch.
#pragma once

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.hpp"
#include "data/packing.hpp"
#include "data/shard.hpp"

namespace tessera {

// All shards of one prefix, their documents concatenated in shard order.
class ShardedCorpus {
 public:
  explicit ShardedCorpus(const std::string& prefix);
  const ShardMeta& meta() const { return meta_; }
  int64_t num_docs() const { return static_cast<int64_t>(doc_start_.size()) - 1; }
  int64_t num_tokens() const { return doc_start_.back(); }
  // Global token offset of document d (d == num_docs() gives the end).
  int64_t doc_start(int64_t d) const { return doc_start_[d]; }
  // The document holding corpus token `token` (0 <= token < num_tokens()).
  int64_t doc_of(int64_t token) const;
  // Reads corpus tokens [begin, begin + count), across shard boundaries.
  void read(int64_t begin, int64_t count, int32_t* out) const;
  // Whether a shard has /loss_mask, and the mask of corpus tokens [begin, begin + count) (1 where
  // a shard has none).
  bool has_loss_mask() const { return has_loss_mask_; }
  void read_loss_mask(int64_t begin, int64_t count, uint8_t* out) const;
  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
  std::vector<std::unique_ptr<ShardReader>> shards_;
  std::vector<int64_t> shard_start_;  // global token offset of each shard, plus the end
  std::vector<int64_t> doc_start_;
  ShardMeta meta_;
  bool has_loss_mask_ = false;
};

enum class Split { Train = 0, Valid = 1, Test = 2 };
const char* split_name(Split s);

// "949,50,1" (or fractions): weights of train, valid, test. Throws ConfigError naming --split.
std::array<double, 3> parse_split(const std::string& spec);
// Megatron's document ranges [begin, end) of the three splits for n documents.
std::array<int64_t, 4> split_doc_bounds(const std::array<double, 3>& weights, int64_t n_docs);

// --sft: samples are whole documents packed first-fit (data/packing.hpp) instead of windows.
struct PackOptions {
  bool enabled = false;
  bool no_truncate = false;  // a document longer than a sample is an error, not cut
};

class GPTDataset final : public TokenDataset {
 public:
  // Packed (--sft): the split's documents in a seeded order packed first-fit into samples of
  // seq_length+1 tokens, the rest padded with -1 (no token, never a target); each epoch visits
  // the samples in its own seeded order. ConfigError naming the document with no_truncate.
  GPTDataset(std::shared_ptr<const ShardedCorpus> corpus, Split split,
             const std::array<double, 3>& weights, int seq_length, uint64_t seed,
             PackOptions pack = {});
  std::string describe() const override;
  int seq_length() const override { return seq_; }
  int64_t num_samples() const override { return samples_per_epoch_; }  // per epoch
  void get(int64_t index, int32_t* out) const override;
  bool has_loss_mask() const override { return packed_ || corpus_->has_loss_mask(); }
  void get_loss_mask(int64_t index, uint8_t* out) const override;
  int64_t num_docs() const { return doc_end_ - doc_begin_; }
  int64_t doc_begin() const { return doc_begin_; }
  int64_t doc_end() const { return doc_end_; }
  int64_t num_tokens() const { return token_end_ - token_begin_; }
  Split split() const { return split_; }
  int64_t first_token() const { return token_begin_; }
  // Position of sample `index` within its epoch's unshuffled windows.
  int64_t window_of(int64_t index) const;
  // The documents (ids within the prefix's corpus) whose tokens sample `index` holds: [first,
  // last].
  std::pair<int64_t, int64_t> documents_of(int64_t index) const;
  // Every document sample `index` holds, in order (packed: the packing's; else first..last).
  std::vector<int64_t> documents_in(int64_t index) const;
  const ShardedCorpus& corpus() const { return *corpus_; }
  bool packed() const { return packed_; }
  // Packed: the packing efficiency (document tokens / sample tokens) and the documents cut, as
  // "; packed (--sft): ..."; empty otherwise.
  std::string packing_summary() const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;

  std::shared_ptr<const ShardedCorpus> corpus_;
  Split split_;
  int seq_;
  uint64_t seed_;
  int64_t doc_begin_ = 0, doc_end_ = 0, token_begin_ = 0, token_end_ = 0;
  int64_t samples_per_epoch_ = 0;
  bool packed_ = false;
  Packing packing_;  // packed: the samples' documents
  mutable std::mutex mu_;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

}  // namespace tessera
