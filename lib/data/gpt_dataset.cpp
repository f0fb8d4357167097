// gpt_dataset.cpp: the corpus over shards, the splits and the shuffled sample index.
#include "data/gpt_dataset.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace tessera {

ShardedCorpus::ShardedCorpus(const std::string& prefix) : prefix_(prefix) {
  shard_start_.push_back(0);
  doc_start_.push_back(0);
  for (const std::string& p : shard_paths(prefix)) {
    auto r = std::make_unique<ShardReader>(p);
    if (shards_.empty()) {
      meta_ = r->meta();
    } else if (r->meta().vocab_size != meta_.vocab_size || r->meta().eod_id != meta_.eod_id ||
               r->meta().tokenizer != meta_.tokenizer) {
      throw ConfigError("data shard '" + p + "' was made with another tokenizer than '" +
                        shards_[0]->path() + "' (vocab_size, eod_id or tokenizer differ)");
    }
    const int64_t base = shard_start_.back();
    const auto& offs = r->doc_offsets();
    for (size_t i = 1; i < offs.size(); ++i)
      doc_start_.push_back(base + static_cast<int64_t>(offs[i]));
    shard_start_.push_back(base + r->num_tokens());
    has_loss_mask_ = has_loss_mask_ || r->has_loss_mask();
    shards_.push_back(std::move(r));
  }
}

int64_t ShardedCorpus::doc_of(int64_t token) const {
  TESSERA_CHECK(token >= 0 && token < num_tokens(), "corpus token ", token, " out of range");
  return std::upper_bound(doc_start_.begin(), doc_start_.end(), token) - doc_start_.begin() - 1;
}

namespace {

// Reads corpus elements [begin, begin + count) shard by shard: read(shard, local begin, n, out).
template <typename T, typename Read>
void read_across(const std::vector<int64_t>& shard_start, int64_t begin, int64_t count, T* out,
                 Read read) {
  // The shard holding `begin`: the last start at or before it.
  size_t s =
      std::upper_bound(shard_start.begin(), shard_start.end(), begin) - shard_start.begin() - 1;
  while (count > 0) {
    const int64_t n = std::min(count, shard_start[s + 1] - begin);
    read(s, begin - shard_start[s], n, out);
    out += n;
    begin += n;
    count -= n;
    ++s;
  }
}

}  // namespace

void ShardedCorpus::read(int64_t begin, int64_t count, int32_t* out) const {
  TESSERA_CHECK(begin >= 0 && begin + count <= num_tokens(), "corpus read past the end");
  read_across(shard_start_, begin, count, out,
              [this](size_t s, int64_t b, int64_t n, int32_t* o) { shards_[s]->read(b, n, o); });
}

void ShardedCorpus::read_loss_mask(int64_t begin, int64_t count, uint8_t* out) const {
  TESSERA_CHECK(begin >= 0 && begin + count <= num_tokens(), "corpus mask read past the end");
  read_across(shard_start_, begin, count, out, [this](size_t s, int64_t b, int64_t n, uint8_t* o) {
    shards_[s]->read_loss_mask(b, n, o);
  });
}

const char* split_name(Split s) {
  return s == Split::Train ? "train" : s == Split::Valid ? "valid" : "test";
}

std::array<double, 3> parse_split(const std::string& spec) {
  std::array<double, 3> w{0, 0, 0};
  std::stringstream ss(spec);
  std::string part;
  int i = 0;
  while (std::getline(ss, part, ',')) {
    if (i >= 3)
      throw ConfigError("--split '" + spec + "' has more than three parts (train,valid,test)");
    try {
      size_t used = 0;
      w[i] = std::stod(part, &used);
      if (used != part.size()) throw std::invalid_argument(part);
    } catch (const std::exception&) {
      throw ConfigError("--split '" + spec + "': '" + part + "' is not a number (e.g. 949,50,1)");
    }
    if (!(w[i] >= 0)) throw ConfigError("--split '" + spec + "' has a negative weight");
    ++i;
  }
  if (w[0] + w[1] + w[2] <= 0) throw ConfigError("--split '" + spec + "' has no positive weight");
  return w;
}

std::array<int64_t, 4> split_doc_bounds(const std::array<double, 3>& weights, int64_t n) {
  const double sum = weights[0] + weights[1] + weights[2];
  std::array<int64_t, 4> b{0, 0, 0, 0};
  for (int i = 0; i < 3; ++i)
    b[i + 1] = b[i] + static_cast<int64_t>(std::llround(weights[i] / sum * static_cast<double>(n)));
  const int64_t diff = b[3] - n;  // Megatron's correction: rounding must end exactly at n
  for (int i = 1; i < 4; ++i) b[i] -= diff;
  return b;
}

GPTDataset::GPTDataset(std::shared_ptr<const ShardedCorpus> corpus, Split split,
                       const std::array<double, 3>& weights, int seq_length, uint64_t seed,
                       PackOptions pack)
    : corpus_(std::move(corpus)),
      split_(split),
      seq_(seq_length),
      seed_(seed),
      packed_(pack.enabled) {
  const auto b = split_doc_bounds(weights, corpus_->num_docs());
  doc_begin_ = std::max<int64_t>(0, b[static_cast<int>(split)]);
  doc_end_ = std::max(doc_begin_, b[static_cast<int>(split) + 1]);
  token_begin_ = corpus_->doc_start(doc_begin_);
  token_end_ = corpus_->doc_start(doc_end_);
  const int64_t tokens = token_end_ - token_begin_;
  samples_per_epoch_ = tokens > seq_ ? (tokens - 1) / seq_ : 0;
  if (!packed_) return;
  // The documents in an order drawn from (seed, split), then first-fit into seq+1 tokens each.
  const int64_t n = doc_end_ - doc_begin_, cap = int64_t(seq_) + 1;
  std::vector<int64_t> docs(static_cast<size_t>(n)), length(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) docs[i] = doc_begin_ + i;
  const CounterRng rng(seed_, stable_hash("data.pack") + static_cast<uint64_t>(split_));
  for (int64_t i = n - 1; i > 0; --i) {
    const Philox4 r = rng.bits(static_cast<uint64_t>(i));
    std::swap(docs[i], docs[((static_cast<uint64_t>(r[0]) << 32) | r[1]) % uint64_t(i + 1)]);
  }
  for (int64_t d = doc_begin_; pack.no_truncate && d < doc_end_; ++d) {  // the first in order
    const int64_t len = corpus_->doc_start(d + 1) - corpus_->doc_start(d);
    if (len > cap)
      throw ConfigError(
          detail::concat("--sft-no-truncate: document ", d, " of '", corpus_->prefix(), "' has ",
                         len, " tokens, more than a sample's --seq-length+1 = ", cap,
                         "; raise --seq-length, or leave --sft-no-truncate out to cut it"));
  }
  for (int64_t i = 0; i < n; ++i)
    length[i] = corpus_->doc_start(docs[i] + 1) - corpus_->doc_start(docs[i]);
  packing_ = pack_first_fit(docs, length, cap);
  samples_per_epoch_ = packing_.bins();
}

std::string GPTDataset::describe() const {
  std::ostringstream os;
  os << split_name(split_) << " split of '" << corpus_->prefix() << "': documents " << doc_begin_
     << "-" << doc_end_ << " of " << corpus_->num_docs() << ", " << token_end_ - token_begin_
     << " tokens, " << samples_per_epoch_ << " samples of " << seq_ + 1 << " tokens per epoch";
  return os.str() + packing_summary();
}

std::string GPTDataset::packing_summary() const {
  if (!packed_ || samples_per_epoch_ == 0) return "";
  char eff[32];
  std::snprintf(eff, sizeof eff, "%.1f%%",
                100.0 * double(packing_.tokens) / (double(samples_per_epoch_) * (seq_ + 1)));
  std::ostringstream os;
  os << "; packed (--sft): " << eff << " of the samples' tokens are document tokens, the rest "
     << "padding";
  if (packing_.truncated > 0) os << "; " << packing_.truncated << " document(s) cut to fit";
  return os.str();
}

const std::vector<int64_t>& GPTDataset::permutation(int64_t epoch) const {
  if (perm_epoch_ == epoch) return perm_;
  // Fisher-Yates with counter-based draws keyed by (seed, split, epoch): the same on every rank.
  const CounterRng rng(seed_, stable_hash("data.shuffle") +
                                  static_cast<uint64_t>(split_) * 1000003u +
                                  static_cast<uint64_t>(epoch) * 0x9E3779B97F4A7C15ull);
  perm_.resize(samples_per_epoch_);
  for (int64_t i = 0; i < samples_per_epoch_; ++i) perm_[i] = i;
  for (int64_t i = samples_per_epoch_ - 1; i > 0; --i) {
    const Philox4 r = rng.bits(static_cast<uint64_t>(i));
    const uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
    std::swap(perm_[i], perm_[x % static_cast<uint64_t>(i + 1)]);
  }
  perm_epoch_ = epoch;
  return perm_;
}

int64_t GPTDataset::window_of(int64_t index) const {
  TESSERA_CHECK(samples_per_epoch_ > 0, "the ", split_name(split_), " split has no samples");
  std::lock_guard<std::mutex> lock(mu_);
  return permutation(index / samples_per_epoch_)[index % samples_per_epoch_];
}

std::pair<int64_t, int64_t> GPTDataset::documents_of(int64_t index) const {
  if (packed_) {  // the lowest and highest document of the sample
    const int64_t b = window_of(index);
    const auto first = packing_.piece_doc.begin() + packing_.bin_begin[b];
    const auto last = packing_.piece_doc.begin() + packing_.bin_begin[b + 1];
    return {*std::min_element(first, last), *std::max_element(first, last)};
  }
  const int64_t begin = token_begin_ + window_of(index) * seq_;
  return {corpus_->doc_of(begin), corpus_->doc_of(begin + seq_)};
}

std::vector<int64_t> GPTDataset::documents_in(int64_t index) const {
  std::vector<int64_t> out;
  if (packed_) {
    const int64_t b = window_of(index);
    for (int64_t i = packing_.bin_begin[b]; i < packing_.bin_begin[b + 1]; ++i)
      out.push_back(packing_.piece_doc[i]);
    return out;
  }
  const auto [first, last] = documents_of(index);
  for (int64_t d = first; d <= last; ++d) out.push_back(d);
  return out;
}

void GPTDataset::get(int64_t index, int32_t* out) const {
  const int64_t w = window_of(index);
  if (!packed_) {
    corpus_->read(token_begin_ + w * seq_, seq_ + 1, out);
    return;
  }
  int64_t at = 0;
  for (int64_t i = packing_.bin_begin[w]; i < packing_.bin_begin[w + 1]; ++i) {
    corpus_->read(corpus_->doc_start(packing_.piece_doc[i]), packing_.piece_len[i], out + at);
    at += packing_.piece_len[i];
  }
  std::fill(out + at, out + seq_ + 1, -1);  // padding: no token
}

void GPTDataset::get_loss_mask(int64_t index, uint8_t* out) const {
  const int64_t w = window_of(index);
  if (!packed_) {
    corpus_->read_loss_mask(token_begin_ + w * seq_, seq_ + 1, out);
    return;
  }
  int64_t at = 0;
  for (int64_t i = packing_.bin_begin[w]; i < packing_.bin_begin[w + 1]; ++i) {
    corpus_->read_loss_mask(corpus_->doc_start(packing_.piece_doc[i]), packing_.piece_len[i],
                            out + at);
    out[at] = kDocumentStart;  // a document's first token is never a target
    at += packing_.piece_len[i];
  }
  if (at <= seq_) {  // the padding: a document of its own, no targets
    std::fill(out + at, out + seq_ + 1, uint8_t(0));
    out[at] = kDocumentStart;
  }
}

}  // namespace tessera
