// blended_dataset.hpp: Megatron-LM's data blends (`--data-path 0.7 web 0.2 code 0.1 books`).
// Blended sample i comes from the dataset d that maximizes w_d * max(i, 1) - count_d(i) (the
// first on ties), where count_d(i) is the number of samples d gave to blended samples 0..i-1; it
// is that dataset's next sample (Megatron's build_blending_indices). The order is a pure function
// of the normalized weights: every layout, every resume and tessera-inspect see the same samples,
// and a longer run only appends to it. Each dataset is a GPTDataset (its own split, shuffled by
// epochs), so a dataset drawn past its samples starts another epoch in a new order.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/gpt_dataset.hpp"

namespace tessera {

// A blend as the options give it: one prefix (weight 1), or weights and prefixes.
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // normalized: positive, summing to 1
  std::string text;             // the words as given, e.g. "0.7 web 0.3 code"
  bool empty() const { return prefixes.empty(); }
  size_t size() const { return prefixes.size(); }
  // "web" or "0.7 web 0.2 code 0.1 books" (the weights as given, normalized).
  std::string describe() const;
};

// Megatron's `PREFIX` or `W1 P1 W2 P2 ...` (words of one value are split on white space, so a
// config file's `data-path = 0.7 web 0.3 code` works). ConfigError naming `option` for an odd
// number of words, a weight that is not a positive finite number, or a prefix given twice. No
// words: an empty blend. Prefixes are not opened here.
DataBlend parse_data_blend(const std::vector<std::string>& words, const std::string& option);

// The blend order, computed on demand: counts at every kBlock-th sample are kept (a few bytes per
// 4,096 samples), the block in hand is decoded once. Thread-safe.
class BlendIndex {
 public:
  explicit BlendIndex(std::vector<double> weights);
  struct Entry {
    int dataset = 0;
    int64_t sample = 0;  // index inside that dataset
  };
  Entry at(int64_t i) const;
  // Samples each dataset gives to blended samples [0, n).
  std::vector<int64_t> counts_before(int64_t n) const;
  // The file in `dir` that caches this blend's index: the order depends on the weights only, so
  // the name is a hash of them ("blend-<hash>.idx").
  std::string cache_file(const std::string& dir) const;
  // Makes the index cover `samples` samples, from the cache file where it already covers them
  // (a file of other weights, truncated or damaged is not used); when `write`, writes the file
  // back (atomically) if it had to compute more. Returns a line for the log saying which.
  std::string use_cache(const std::string& dir, int64_t samples, bool write);
  static constexpr int64_t kBlock = 4096;

 private:
  // Advances `count` over samples [from, to) and records them in the decoded block when asked.
  void advance(std::vector<int64_t>& count, int64_t from, int64_t to, Entry* record) const;
  const std::vector<int64_t>& checkpoint(int64_t block) const;  // counts at block * kBlock

  std::vector<double> w_;
  uint64_t key_ = 0;  // hash of the weights' bits and kBlock
  mutable std::mutex mu_;
  mutable std::vector<std::vector<int64_t>> checkpoints_;
  mutable int64_t decoded_block_ = -1;
  mutable std::vector<Entry> decoded_;
};

class BlendedDataset final : public TokenDataset {
 public:
  BlendedDataset(std::vector<std::unique_ptr<GPTDataset>> datasets, DataBlend blend);
  std::string describe() const override;
  int seq_length() const override { return datasets_[0]->seq_length(); }
  // One epoch of every dataset (what --full-validation evaluates).
  int64_t num_samples() const override;
  void get(int64_t index, int32_t* out) const override;
  // Any dataset's masks; a dataset without them gives all 1 (blends may mix both).
  bool has_loss_mask() const override;
  void get_loss_mask(int64_t index, uint8_t* out) const override;

  BlendIndex::Entry locate(int64_t index) const { return index_.at(index); }
  const BlendIndex& index() const { return index_; }
  BlendIndex& index() { return index_; }
  const DataBlend& blend() const { return blend_; }
  const GPTDataset& dataset(int d) const { return *datasets_[d]; }
  int num_datasets() const { return static_cast<int>(datasets_.size()); }

 private:
  std::vector<std::unique_ptr<GPTDataset>> datasets_;
  DataBlend blend_;
  BlendIndex index_;
};

// Megatron's size of dataset d for a run of `samples` blended samples: ceil(w_d * samples *
// 1.005) (the 0.5% surplus). Tessera's datasets have no fixed size (they repeat by epochs), so
// this is what the start-up log reports beside the samples the blend really draws.
int64_t megatron_dataset_size(double weight, int64_t samples);

}  // namespace tessera
