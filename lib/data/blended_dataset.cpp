// blended_dataset.cpp: parsing a blend, Megatron's blending order, the blended dataset.
#include "data/blended_dataset.hpp"

#include <unistd.h>
#include <algorithm>
#include <cmath>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/error.hpp"
#include "core/hash.hpp"

namespace tessera {

std::string DataBlend::describe() const {
  if (prefixes.size() == 1) return prefixes[0];
  std::ostringstream os;
  for (size_t d = 0; d < prefixes.size(); ++d)
    os << (d ? " " : "") << weights[d] << " " << prefixes[d];
  return os.str();
}

namespace {
// The words of one given value: whitespace separates them (a config file's `data-path = 0.3 A 0.7
// B`, a launch script's unquoted $BLEND), except inside double or single quotes, which are
// removed; a value that is the prefix of existing shards as a whole (a quoted command-line
// argument with a space) is one word.
void split_blend_words(const std::string& g, const std::string& option,
                       std::vector<std::string>& words) {
  std::error_code ec;
  if (g.find_first_of(" \t") != std::string::npos && g.find_first_of("\"'") == std::string::npos &&
      std::filesystem::exists(g + "_00000.h5", ec)) {
    words.push_back(g);
    return;
  }
  std::string w;
  bool in_word = false;
  char quote = 0;
  for (char c : g) {
    if (quote) {
      if (c == quote)
        quote = 0;
      else
        w += c;
    } else if (c == '"' || c == '\'') {
      quote = c;
      in_word = true;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      if (in_word) words.push_back(w);
      w.clear();
      in_word = false;
    } else {
      w += c;
      in_word = true;
    }
  }
  if (quote)
    throw ConfigError("--" + option + " " + g +
                      ": a quote is not closed (quote a prefix that has "
                      "spaces whole: \"my data/web\")");
  if (in_word) words.push_back(w);
}
}  // namespace

DataBlend parse_data_blend(const std::vector<std::string>& given, const std::string& option) {
  std::vector<std::string> words;
  for (const std::string& g : given) split_blend_words(g, option, words);
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
    // The same files however spelled (data/web, ./data/web, an absolute path, a symlink).
    auto same_files = [](const std::string& a, const std::string& c) {
      std::error_code e1, e2;
      const std::filesystem::path x = std::filesystem::weakly_canonical(a, e1),
                                  y = std::filesystem::weakly_canonical(c, e2);
      return a == c || (!e1 && !e2 && x == y);
    };
    for (const std::string& q : b.prefixes)
      if (same_files(p, q))
        throw ConfigError(named + ": the prefix '" + p + "' is given twice" +
                          (p == q ? std::string() : " (as '" + q + "' before)") +
                          "; give it once with the sum of its weights");
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
  std::vector<double> key(w_);
  key.push_back(static_cast<double>(kBlock));
  key_ = xxh64(key.data(), key.size() * sizeof(double), 0x626c656e64ull);
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

// ---- the cache file ----------------------------------------------------------------------------
// "TSBLEND1", then uint64 datasets, uint64 kBlock, the weights (doubles), uint64 blocks, the counts
// at blocks 1..blocks (int64, datasets each), and the xxh64 of everything before it.

namespace {
constexpr char kCacheMagic[8] = {'T', 'S', 'B', 'L', 'E', 'N', 'D', '1'};
}

std::string BlendIndex::cache_file(const std::string& dir) const {
  char name[40];
  std::snprintf(name, sizeof name, "blend-%016llx.idx", static_cast<unsigned long long>(key_));
  return (dir.empty() ? std::string(".") : dir) + "/" + name;
}

std::string BlendIndex::use_cache(const std::string& dir, int64_t samples, bool write) {
  if (w_.size() == 1) return "";
  const std::string path = cache_file(dir);
  const size_t n = w_.size();
  const int64_t need = samples / kBlock;  // checkpoints after 0
  std::lock_guard<std::mutex> lock(mu_);
  int64_t read = 0;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    std::vector<char> bytes;
    char buf[1 << 16];
    for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;)
      bytes.insert(bytes.end(), buf, buf + got);
    std::fclose(f);
    const size_t head = 8 + 8 + 8 + n * 8 + 8;
    uint64_t u[3] = {0, 0, 0};
    bool ok = bytes.size() >= head + 8 && std::memcmp(bytes.data(), kCacheMagic, 8) == 0;
    if (ok) {
      std::memcpy(&u[0], bytes.data() + 8, 8);
      std::memcpy(&u[1], bytes.data() + 16, 8);
      std::memcpy(&u[2], bytes.data() + head - 8, 8);
      ok = u[0] == n && u[1] == uint64_t(kBlock) &&
           std::memcmp(bytes.data() + 24, w_.data(), n * 8) == 0 && u[2] < (uint64_t(1) << 40) &&
           bytes.size() == head + u[2] * n * 8 + 8;
    }
    if (ok) {
      uint64_t sum = 0;
      std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
      ok = sum == xxh64(bytes.data(), bytes.size() - 8);
    }
    if (ok && static_cast<int64_t>(checkpoints_.size()) <= static_cast<int64_t>(u[2])) {
      const char* p = bytes.data() + head + (checkpoints_.size() - 1) * n * 8;
      for (uint64_t b = checkpoints_.size(); b <= u[2]; ++b, p += n * 8) {
        std::vector<int64_t> c(n);
        std::memcpy(c.data(), p, n * 8);
        checkpoints_.push_back(std::move(c));
      }
    }
    if (ok) read = static_cast<int64_t>(u[2]);
  }
  const int64_t had = static_cast<int64_t>(checkpoints_.size()) - 1;
  checkpoint(need);
  const int64_t blocks = static_cast<int64_t>(checkpoints_.size()) - 1;
  std::ostringstream os;
  os << "blend order of the run's " << samples << " samples: ";
  if (read >= need && read > 0) {  // (a run shorter than one block needs no file)
    os << "read from " << path;
    return os.str();
  }
  os << (read > 0 || had > 0 ? "extended" : "computed");
  if (!write) return os.str();
  std::string bytes(kCacheMagic, 8);
  auto put = [&](const void* p, size_t len) { bytes.append(static_cast<const char*>(p), len); };
  const uint64_t head[2] = {n, uint64_t(kBlock)};
  put(head, sizeof head);
  put(w_.data(), n * 8);
  const uint64_t nb = static_cast<uint64_t>(blocks);
  put(&nb, 8);
  for (int64_t b = 1; b <= blocks; ++b) put(checkpoints_[b].data(), n * 8);
  const uint64_t sum = xxh64(bytes.data(), bytes.size());
  put(&sum, 8);
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  const bool written = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = f && std::fclose(f) == 0;
  if (written && closed && std::rename(tmp.c_str(), path.c_str()) == 0) {
    os << " and cached in " << path;
  } else {
    std::remove(tmp.c_str());
    os << "; not cached: cannot write " << path << " (" << std::strerror(errno)
       << "; give --data-cache-path a writable directory to skip this at the next start)";
  }
  return os.str();
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

bool BlendedDataset::has_loss_mask() const {
  for (const auto& d : datasets_)
    if (d->has_loss_mask()) return true;
  return false;
}

void BlendedDataset::get_loss_mask(int64_t index, uint8_t* out) const {
  const BlendIndex::Entry e = index_.at(index);
  datasets_[e.dataset]->get_loss_mask(e.sample, out);
}

int64_t megatron_dataset_size(double weight, int64_t samples) {
  return static_cast<int64_t>(std::ceil(weight * static_cast<double>(samples) * 1.005));
}

}  // namespace tessera
