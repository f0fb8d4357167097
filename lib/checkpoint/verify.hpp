// verify.hpp: reading a whole checkpoint back to find damage (tessera-checkpoint verify).
//
// Loading reads each tensor once, from the first file that holds it, and checks that copy's
// checksum; the copies it does not read (replicated tensors in the files of TP ranks > 0, the
// tied word embedding of the last pipeline stage) are never looked at. verify_checkpoint reads
// every dataset of every file of one checkpoint (model and optimizer state) and checks:
//   - the directory: a shard file for every (tp, pp) of the layout, and no file outside it;
//   - each file's attributes: readable, of this format version, the iteration its directory is
//     named after, the tp rank its name says, the layout and model the other files record, and the
//     transformer layers its pipeline stage holds;
//   - each tensor: present where the layout puts one (and nothing else), f32, its shape and layout
//     attributes those of the model's global layout (docs/model.md), its data against its xxh64;
//   - copies of one slice in several files (replicated tensors, the tied embedding): equal.
// Every problem is one line naming the file and the object; the checkpoint is clean when there is
// none.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tessera {

struct CheckpointVerifyReport {
  std::string dir;               // the iteration directory checked
  int64_t iteration = -1;        // from its name (-1: not an iter_NNNNNNN directory)
  int tp_size = 0, pp_size = 0;  // the layout the files record (from their names if they disagree)
  int files = 0;                 // shard files opened
  int64_t tensors = 0;           // datasets read in full and hashed
  int64_t bytes = 0;             // their data
  std::vector<std::string> problems;  // "FILE: OBJECT: what is wrong", one per problem
  bool clean() const { return problems.empty(); }
};

// Verifies the checkpoint `dir` points at: a --save directory (its latest checkpoint, or
// iter_<iteration> when `iteration` >= 0) or an iter_NNNNNNN directory. Throws ConfigError when
// `dir` holds no checkpoint to check (not a directory, no latest file and no shard files, no such
// iteration); damage is reported in the result. `progress` (optional) gets one line per file.
CheckpointVerifyReport verify_checkpoint(
    const std::string& dir, int64_t iteration = -1,
    const std::function<void(const std::string&)>& progress = nullptr);

// Whether the checkpoint --load `dir` names is damaged on disk, as verify finds it: `latest`
// naming a missing iteration (or no number), a missing, empty or truncated shard, unreadable
// attributes, a checksum. Not: a run's options against an intact checkpoint. Reads it whole.
bool checkpoint_damaged(const std::string& dir);
// "2, 4, 6" (or "none"), for the messages that name the iterations present.
std::string checkpoint_iterations_text(const std::vector<int64_t>& its);

}  // namespace tessera
