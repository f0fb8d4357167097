// inspect.cpp: a sample of the run, located and read.
#include "train/inspect.hpp"

#include <sstream>

#include "core/error.hpp"
#include "inference/text_server.hpp"

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
  r.tokens.resize(static_cast<size_t>(data.seq_length()) + 1);
  data.get(sample, r.tokens.data());
  return r;
}

std::string sample_json(const SampleRecord& r) {
  std::ostringstream os;
  os << "{\"sample\": " << r.sample << ", \"iteration\": " << r.iteration
     << ", \"dataset\": " << r.dataset << ", \"prefix\": " << json_quote(r.prefix)
     << ", \"dataset_sample\": " << r.dataset_sample << ", \"documents\": [";
  for (int64_t d = r.first_document; d <= r.last_document; ++d)
    os << (d > r.first_document ? ", " : "") << d;
  os << "], \"tokens\": [";
  for (size_t i = 0; i < r.tokens.size(); ++i) os << (i ? ", " : "") << r.tokens[i];
  os << "]}";
  return os.str();
}

}  // namespace tessera
