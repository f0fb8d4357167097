// phase_events.hpp: the PhaseClock of the CUDA backend (core/phase_timer.hpp): one cudaEvent per
// timestamp, recorded on the backend's stream, read after one synchronize. Usable from code
// compiled without nvcc.
#pragma once

#include <memory>

#include "core/phase_timer.hpp"

namespace tessera::cuda {

// Timestamps on `stream` (a cudaStream_t: Backend::stream() of the CUDA backend). A phase then
// measures the stream's time between its marks: the kernels queued there, and the waits the
// stream was told to do on other streams (NCCL). Events are created as slots are first used and
// reused after each PhaseTimer::collect().
std::unique_ptr<PhaseClock> make_event_clock(void* stream);

}  // namespace tessera::cuda
