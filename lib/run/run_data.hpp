// run_data.hpp: the datasets a run's options name: the train, valid and test splits of
// --data-path (or of the per-split paths), or mock data, and the start-up log's lines about them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/blended_dataset.hpp"
#include "data/dataset.hpp"
#include "run/run_options.hpp"

namespace tessera {

// The training dataset the options ask for: the train split of --data-path, or mock data. Sets
// model.vocab_size from the shards when it was not given. ConfigError for an empty train split.
std::unique_ptr<TokenDataset> open_train_data(RunOptions& opts);

// The start-up log's lines about the data: for shards, one line per dataset (weight, documents,
// tokens, samples per epoch, samples the run draws from it) and one for the blend.
std::vector<std::string> data_report(const TokenDataset& data, const TrainConfig& t, int dp_size);

// The validation data for --eval-interval / --skip-train: the valid split of --data-path, or mock
// data of another stream. ConfigError when the split is needed but empty.
std::unique_ptr<TokenDataset> open_valid_data(const RunOptions& opts);
// The test split for the evaluation at the end of training; null when it is empty.
std::unique_ptr<TokenDataset> open_test_data(const RunOptions& opts);

// Split `s` of the options' data (--data-path cut by --split, or the split's own path), as the
// training run opens it (opts.model.seq_length, opts.train.seed): tessera-eval's data.
// ConfigError when the options give the split no data or one of its datasets has no sample.
std::unique_ptr<BlendedDataset> open_split_data(const RunOptions& opts, Split s);

}  // namespace tessera
