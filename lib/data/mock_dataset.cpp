// mock_dataset.cpp: the synthetic Markov-chain dataset (--mock-data).
#include <sstream>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "data/dataset.hpp"

namespace tessera {

namespace {

class MockDataset final : public TokenDataset {
 public:
  MockDataset(int64_t vocab, int seq, uint64_t seed)
      : vocab_(vocab),
        seq_(seq),
        chain_(seed, stable_hash("mock.chain")),
        draws_(seed, stable_hash("mock.samples")) {
    TESSERA_CHECK(vocab >= 2 && seq >= 1, "mock data needs vocab >= 2 and seq >= 1");
  }
  std::string describe() const override {
    std::ostringstream os;
    os << "mock data (Markov chain over " << vocab_ << " tokens, floor " << kMockDataEntropyNats
       << " nats/token)";
    return os.str();
  }
  int seq_length() const override { return seq_; }
  int64_t num_samples() const override { return int64_t(1) << 40; }
  void get(int64_t index, int32_t* out) const override {
    const uint64_t base = static_cast<uint64_t>(index) * static_cast<uint64_t>(seq_ + 1);
    int64_t tok = draws_.bits(base)[0] % static_cast<uint64_t>(vocab_);
    out[0] = static_cast<int32_t>(tok);
    for (int t = 1; t <= seq_; ++t) {
      const double u = draws_.uniform(base + t);
      const int k = u < 0.5 ? 0 : u < 0.75 ? 1 : u < 0.875 ? 2 : 3;
      tok = chain_.bits(static_cast<uint64_t>(tok) * 4 + k)[0] % static_cast<uint64_t>(vocab_);
      out[t] = static_cast<int32_t>(tok);
    }
  }

 private:
  int64_t vocab_;
  int seq_;
  CounterRng chain_, draws_;
};

}  // namespace

std::unique_ptr<TokenDataset> make_mock_dataset(int64_t vocab_size, int seq_length, uint64_t seed) {
  return std::make_unique<MockDataset>(vocab_size, seq_length, seed);
}

}  // namespace tessera
