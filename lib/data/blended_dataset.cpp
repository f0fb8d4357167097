// blended_dataset.cpp: parsing a blend, Megatron's blending order, the blended dataset.
#include "data/blended_dataset.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.hpp"

namespace tessera {

std::string DataBlend::describe() const {
  if (prefixes.size() == 1) return prefixes[0];
  std::ostringstream os;
  for (size_t d = 0; d < prefixes.size(); ++d)
    os << (d ? " " : "") << weights[d] << " " << prefixes[d];
  return os.str();
}

DataBlend parse_data_blend(const std::vector<std::string>& given, const std::string& option) {
  std::vector<std::string> words;
  for (const std::string& g : given) {
    std::istringstream in(g);
    for (std::string w; in >> w;) words.push_back(w);
  }
  DataBlend b;
  if (words.empty()) return b;
  for (const std::string& w : words) b.text += (b.text.empty() ? "" : " ") + w;
  if (words.size() == 1) {
    b.prefixes = words;
    b.weights = {1.0};
    return b;
  }
  const std::string named = "--" + option + " " + b.text;
  if (words.size() % 2 != 0)
    throw ConfigError(named + ": " + std::to_string(words.size()) +
                      " words; a blend is pairs of a weight and a prefix (W1 PREFIX1 W2 "
                      "PREFIX2 ...), or one prefix alone");
  double sum = 0;
  for (size_t i = 0; i < words.size(); i += 2) {
    const std::string& w = words[i];
    char* end = nullptr;
    const double v = std::strtod(w.c_str(), &end);
    if (end == w.c_str() || *end != 0 || !std::isfinite(v))
      throw ConfigError(named + ": '" + w + "' (word " + std::to_string(i + 1) +
                        ") is not a weight; a blend is pairs of a weight and a prefix (W1 "
                        "PREFIX1 W2 PREFIX2 ...)");
    if (!(v > 0))
      throw ConfigError(named + ": the weight " + w + " of '" + words[i + 1] +
                        "' must be positive (leave a dataset out to give it no samples)");
    const std::string& p = words[i + 1];
    if (std::find(b.prefixes.begin(), b.prefixes.end(), p) != b.prefixes.end())
      throw ConfigError(named + ": the prefix '" + p +
                        "' is given twice; give it once with the sum of its weights");
    b.weights.push_back(v);
    b.prefixes.push_back(p);
    sum += v;  // in order, as numpy sums a short array
  }
  for (double& w : b.weights) w /= sum;
  return b;
}

// ---- the blend order ---------------------------------------------------------------------------

BlendIndex::BlendIndex(std::vector<double> weights) : w_(std::move(weights)) {
  TESSERA_CHECK(!w_.empty() && w_.size() < 65536, "a blend needs 1 to 65535 datasets");
  checkpoints_.push_back(std::vector<int64_t>(w_.size(), 0));
}

void BlendIndex::advance(std::vector<int64_t>& count, int64_t from, int64_t to,
                         Entry* record) const {
  const size_t n = w_.size();
  for (int64_t i = from; i < to; ++i) {
    // Megatron's build_blending_indices: the dataset furthest behind its share, first on ties.
    const double x = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_error = w_[0] * x - static_cast<double>(count[0]);
    for (size_t d = 1; d < n; ++d) {
      const double error = w_[d] * x - static_cast<double>(count[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    if (record) *record++ = Entry{static_cast<int>(best), count[best]};
    ++count[best];
  }
}

const std::vector<int64_t>& BlendIndex::checkpoint(int64_t block) const {
  while (static_cast<int64_t>(checkpoints_.size()) <= block) {
    std::vector<int64_t> next = checkpoints_.back();
    const int64_t b = static_cast<int64_t>(checkpoints_.size()) - 1;
    advance(next, b * kBlock, (b + 1) * kBlock, nullptr);
    checkpoints_.push_back(std::move(next));
  }
  return checkpoints_[block];
}

BlendIndex::Entry BlendIndex::at(int64_t i) const {
  TESSERA_CHECK(i >= 0, "blended sample index ", i, " is negative");
  if (w_.size() == 1) return Entry{0, i};
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t block = i / kBlock;
  if (block != decoded_block_) {
    std::vector<int64_t> count = checkpoint(block);
    decoded_.resize(kBlock);
    advance(count, block * kBlock, (block + 1) * kBlock, decoded_.data());
    decoded_block_ = block;
  }
  return decoded_[i - block * kBlock];
}

std::vector<int64_t> BlendIndex::counts_before(int64_t n) const {
  TESSERA_CHECK(n >= 0, "blended sample count ", n, " is negative");
  if (w_.size() == 1) return {n};
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> count = checkpoint(n / kBlock);
  advance(count, n / kBlock * kBlock, n, nullptr);
  return count;
}

// ---- the blended dataset -----------------------------------------------------------------------

BlendedDataset::BlendedDataset(std::vector<std::unique_ptr<GPTDataset>> datasets, DataBlend blend)
    : datasets_(std::move(datasets)), blend_(std::move(blend)), index_(blend_.weights) {
  TESSERA_CHECK(!datasets_.empty() && datasets_.size() == blend_.size(),
                "a blend needs one dataset per prefix");
  for (const auto& d : datasets_)
    TESSERA_CHECK(d->seq_length() == datasets_[0]->seq_length(),
                  "the datasets of a blend differ in sequence length");
}

std::string BlendedDataset::describe() const {
  std::ostringstream os;
  os << "a blend of " << datasets_.size() << " datasets (" << blend_.describe() << ")";
  return os.str();
}

int64_t BlendedDataset::num_samples() const {
  int64_t n = 0;
  for (const auto& d : datasets_) n += d->num_samples();
  return n;
}

void BlendedDataset::get(int64_t index, int32_t* out) const {
  const BlendIndex::Entry e = index_.at(index);
  datasets_[e.dataset]->get(e.sample, out);
}

int64_t megatron_dataset_size(double weight, int64_t samples) {
  return static_cast<int64_t>(std::ceil(weight * static_cast<double>(samples) * 1.005));
}

}  // namespace tessera
