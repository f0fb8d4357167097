// cuda_backend.hpp: the CUDA implementation of the Backend interface (fp32), built wherever nvcc
// is, run where a GPU is. Every op is tested against the CPU backend (tests/backend/test_cuda_ops).
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace tessera {

// Needs a visible CUDA device (throws Error naming the problem otherwise); uses the current device.
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace tessera
