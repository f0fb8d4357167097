// prefetcher.hpp: reads the next batch of samples on a background thread while the current step
// computes, so a training step waits for data only when reading is slower than computing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "data/dataset.hpp"

namespace tessera {

class Prefetcher {
 public:
  // Each request is `count` consecutive samples of `data`.
  Prefetcher(const TokenDataset& data, int64_t count);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Copies samples [first, first + count) into out ((count, seq+1) tokens) and, when the data has
  // loss masks and `mask` is given, their masks into mask (as many bytes): from the background
  // read if it was for `first`, else read now. Then starts reading [next_first, ...).
  // Rethrows a read error of the background thread here, on the caller's thread.
  void fetch(int64_t first, int32_t* out, int64_t next_first, uint8_t* mask = nullptr);
  // Seconds fetch() spent blocked, summed since the last call of this function.
  double take_wait_seconds();

 private:
  void read(int64_t first, int32_t* out, uint8_t* mask) const;
  void worker();

  const TokenDataset& data_;
  const int64_t count_, stride_;
  std::vector<int32_t> buffer_;
  std::vector<uint8_t> mask_buffer_;  // empty when the data has no loss masks
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t want_ = -1, have_ = -1;  // requested / completed first sample of the buffer
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  double waited_ = 0;
  std::thread thread_;
};

}  // namespace tessera
