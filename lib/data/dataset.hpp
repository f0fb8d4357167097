// dataset.hpp: the sample interface the training loop reads from. A sample is seq_length+1 tokens
// (inputs are tokens[0:T], targets tokens[1:T+1]). Sample indices are global: the sample at index i
// is the same whatever the parallel layout, so each data-parallel rank can read its own slice of a
// global batch (DESIGN.md invariant 2). The HDF5 shard loader implements the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace tessera {

// The bits of a sample's per-token flags (TokenDataset::get_loss_mask).
constexpr uint8_t kLossTarget = 1;     // the token is a target whose loss counts (the shards' mask)
constexpr uint8_t kDocumentStart = 2;  // a packed document, or the padding, begins here (--sft)

class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual std::string describe() const = 0;
  virtual int seq_length() const = 0;
  // Samples available without repeating; the loader wraps around in epochs past it.
  virtual int64_t num_samples() const = 0;
  // Writes seq_length()+1 tokens of sample `index` (0 <= index, any value: epochs are handled
  // here).
  virtual void get(int64_t index, int32_t* out) const = 0;
  // Whether the data has loss masks (shards with /loss_mask, or packed samples); without them
  // every token counts.
  virtual bool has_loss_mask() const { return false; }
  // The flags of sample `index`'s seq_length()+1 tokens (kLossTarget | kDocumentStart): whether
  // the token is a target whose loss counts (the first token is never one), and whether a packed
  // document begins there (--sft). kLossTarget alone without masks.
  virtual void get_loss_mask(int64_t index, uint8_t* out) const {
    (void)index;
    for (int i = 0; i <= seq_length(); ++i) out[i] = 1;
  }
};

// Synthetic data from a random order-1 Markov chain: each token has four successors drawn from the
// vocabulary with probabilities 1/2, 1/4, 1/8, 1/8 (entropy 1.75 bits = 1.213 nats per token, the
// loss a perfect model reaches). Every sample is a pure function of (seed, index): no files.
std::unique_ptr<TokenDataset> make_mock_dataset(int64_t vocab_size, int seq_length, uint64_t seed);

// The lowest loss a model can reach on the mock data, in nats per token.
constexpr double kMockDataEntropyNats = 1.75 * 0.6931471805599453;

}  // namespace tessera
