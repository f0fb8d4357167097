// inspect.hpp: what a run trains on, sample by sample (tessera-inspect): for a global sample index,
// the iteration that reads it, the dataset of the blend it comes from, its index in that dataset,
// the documents it holds and its S+1 tokens; the same reads as the trainer's (the dataset's get).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/blended_dataset.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct SampleRecord {
  int64_t sample = 0;     // global index: the order every layout reads
  int64_t iteration = 0;  // 1-based
  int dataset = 0;        // in the blend
  std::string prefix;
  int64_t dataset_sample = 0;                     // the index inside that dataset (epochs included)
  int64_t first_document = 0, last_document = 0;  // in the prefix's corpus
  std::vector<int64_t> documents;                 // all of them, in order (--sft: the packed)
  std::vector<int32_t> tokens;                    // seq_length + 1 ids
  // The trainer's view of the sample's seq_length positions (run/sample_layout.hpp): whether
  // position t's loss counts (its target, token t + 1: the shards' loss mask, --eod-mask-loss),
  // its position id (--reset-position-ids) and its first visible key (--reset-attention-mask).
  std::vector<uint8_t> loss_mask;
  std::vector<int32_t> position_ids, key_begin;
  // The positions where a document starts inside the sample: 0 and each one after an EOD.
  std::vector<int32_t> document_starts;
  bool masked = false;  // the data has loss masks (or --eod-mask-loss leaves positions out)
};

// The iteration (1-based) whose global batch holds global sample `sample` (the ramp of
// --rampup-batch-size included).
int64_t iteration_of_sample(const TrainConfig& t, int dp_size, int64_t sample);

// The sample's documents as a range when they follow each other ("3-5"), else in their order
// ("43, 0": --sft packs documents in the order of its bins).
std::string documents_text(const SampleRecord& r);

// t.documents.eod must be the data's end-of-document token.
SampleRecord inspect_sample(const BlendedDataset& data, const TrainConfig& t, int dp_size,
                            int64_t sample);

// One JSON object on one line: {"sample": i, "iteration": n, "dataset": d, "prefix": "...",
// "dataset_sample": k, "documents": [...], "tokens": [...], "loss_mask": [...],
// "position_ids": [...], "document_starts": [...]}.
std::string sample_json(const SampleRecord& r);

}  // namespace tessera
