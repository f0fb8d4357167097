// prefetcher.cpp: one background reader with one buffer in flight.
#include "data/prefetcher.hpp"

#include <cstring>
#include <utility>

#include "core/timer.hpp"

namespace tessera {

Prefetcher::Prefetcher(const TokenDataset& data, int64_t count)
    : data_(data),
      count_(count),
      stride_(data.seq_length() + 1),
      buffer_(static_cast<size_t>(count * (data.seq_length() + 1))),
      mask_buffer_(data.has_loss_mask() ? buffer_.size() : 0) {
  thread_ = std::thread([this] { worker(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Prefetcher::read(int64_t first, int32_t* out, uint8_t* mask) const {
  for (int64_t i = 0; i < count_; ++i) {
    data_.get(first + i, out + i * stride_);
    if (mask) data_.get_loss_mask(first + i, mask + i * stride_);
  }
}

void Prefetcher::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || (want_ >= 0 && want_ != have_ && !busy_); });
    if (stop_) return;
    const int64_t first = want_;
    busy_ = true;
    lock.unlock();
    std::exception_ptr err;
    try {
      read(first, buffer_.data(), mask_buffer_.empty() ? nullptr : mask_buffer_.data());
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    busy_ = false;
    have_ = first;
    error_ = err;
    cv_.notify_all();
  }
}

void Prefetcher::fetch(int64_t first, int32_t* out, int64_t next_first, uint8_t* mask) {
  if (mask_buffer_.empty()) mask = nullptr;
  Timer t;
  std::unique_lock<std::mutex> lock(mu_);
  if (want_ == first) {  // requested earlier: wait for the background read to complete
    cv_.wait(lock, [&] { return have_ == first && !busy_; });
    if (error_) {
      want_ = have_ = -1;  // the buffer is partly filled: never hand it out
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
    std::memcpy(out, buffer_.data(), buffer_.size() * sizeof(int32_t));
    if (mask) std::memcpy(mask, mask_buffer_.data(), mask_buffer_.size());
  } else {
    cv_.wait(lock, [this] { return !busy_; });  // the buffer is ours to reuse after this
    lock.unlock();
    read(first, out, mask);
    lock.lock();
  }
  waited_ += t.seconds();
  want_ = next_first;
  have_ = -1;
  cv_.notify_all();
}

double Prefetcher::take_wait_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(waited_, 0.0);
}

}  // namespace tessera
