// inspect.cpp: a sample of the run, located and read.
#include "run/inspect.hpp"

#include <sstream>

#include "core/error.hpp"
#include "data/unicode.hpp"

namespace tessera {

int64_t iteration_of_sample(const TrainConfig& t, int dp_size, int64_t sample) {
  TESSERA_CHECK(sample >= 0, "sample ", sample, " is negative");
  // The last iteration n whose first sample is at or before `sample` (at least one sample each).
  int64_t lo = 1, hi = sample + 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (t.samples_before_iteration(dp_size, mid) <= sample)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The sample's documents as a range when they follow each other ("3-5"), else in their order
// ("43, 0": --sft packs documents in the order of its bins).
std::string documents_text(const SampleRecord& r) {
  const std::vector<int64_t>& d = r.documents;
  if (d.empty())
    return r.last_document == r.first_document
               ? std::to_string(r.first_document)
               : std::to_string(r.first_document) + "-" + std::to_string(r.last_document);
  bool consecutive = true;
  for (size_t i = 1; i < d.size(); ++i) consecutive &= d[i] == d[i - 1] + 1;
  if (consecutive)
    return d.size() == 1 ? std::to_string(d[0])
                         : std::to_string(d.front()) + "-" + std::to_string(d.back());
  std::string out;
  for (int64_t x : d) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out;
}

SampleRecord inspect_sample(const BlendedDataset& data, const TrainConfig& t, int dp_size,
                            int64_t sample) {
  SampleRecord r;
  r.sample = sample;
  r.iteration = iteration_of_sample(t, dp_size, sample);
  const BlendIndex::Entry e = data.locate(sample);
  r.dataset = e.dataset;
  r.prefix = data.blend().prefixes[e.dataset];
  r.dataset_sample = e.sample;
  const auto docs = data.dataset(e.dataset).documents_of(e.sample);
  r.first_document = docs.first;
  r.last_document = docs.second;
  r.documents = data.dataset(e.dataset).documents_in(e.sample);
  const int64_t T = data.seq_length();
  r.tokens.resize(static_cast<size_t>(T) + 1);
  data.get(sample, r.tokens.data());
  std::vector<uint8_t> mask;
  if (data.has_loss_mask()) {
    mask.resize(r.tokens.size());
    data.get_loss_mask(sample, mask.data());
  }
  r.masked = data.has_loss_mask() || t.documents.eod_mask_loss;
  r.loss_mask.resize(static_cast<size_t>(T));
  loss_counts(r.tokens.data(), mask.empty() ? nullptr : mask.data(), T, t.documents,
              r.loss_mask.data());
  r.position_ids.resize(static_cast<size_t>(T));
  r.key_begin.resize(static_cast<size_t>(T));
  ltor_layout(r.tokens.data(), mask.empty() ? nullptr : mask.data(), T, t.documents,
              r.position_ids.data(), r.key_begin.data(), nullptr);
  for (int64_t p = 0; p < T; ++p)
    if (p == 0 ||
        (t.documents.packed ? (mask[p] & kDocumentStart) != 0 : r.tokens[p - 1] == t.documents.eod))
      r.document_starts.push_back(static_cast<int32_t>(p));
  return r;
}

std::string sample_json(const SampleRecord& r) {
  std::ostringstream os;
  os << "{\"sample\": " << r.sample << ", \"iteration\": " << r.iteration
     << ", \"dataset\": " << r.dataset << ", \"prefix\": " << json_quote(r.prefix)
     << ", \"dataset_sample\": " << r.dataset_sample << ", \"documents\": [";
  for (size_t i = 0; i < r.documents.size(); ++i) os << (i ? ", " : "") << r.documents[i];
  auto list = [&](const char* name, const auto& v) {
    os << "], \"" << name << "\": [";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << static_cast<int64_t>(v[i]);
  };
  list("tokens", r.tokens);
  list("loss_mask", r.loss_mask);
  list("position_ids", r.position_ids);
  list("document_starts", r.document_starts);
  os << "]}";
  return os.str();
}

}  // namespace tessera
