// phase_events.cu: see phase_events.hpp.
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/phase_events.hpp"

namespace tessera::cuda {

namespace {

class EventClock final : public PhaseClock {
 public:
  explicit EventClock(cudaStream_t stream) : stream_(stream) {}
  ~EventClock() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void record(int slot) override {
    while (static_cast<int>(events_.size()) <= slot) {
      cudaEvent_t e = nullptr;
      CUDA_CHECK(cudaEventCreate(&e));  // timing enabled (the default flags)
      events_.push_back(e);
    }
    CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(slot)], stream_));
    last_ = slot;
  }
  void synchronize() override {
    // The events share one stream: when the last one has happened, so have the others.
    if (last_ >= 0) CUDA_CHECK(cudaEventSynchronize(events_[static_cast<size_t>(last_)]));
  }
  double elapsed_ms(int from, int to) override {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_.at(static_cast<size_t>(from)),
                                    events_.at(static_cast<size_t>(to))));
    return ms;
  }

 private:
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
  int last_ = -1;
};

}  // namespace

std::unique_ptr<PhaseClock> make_event_clock(void* stream) {
  return std::make_unique<EventClock>(static_cast<cudaStream_t>(stream));
}

}  // namespace tessera::cuda
