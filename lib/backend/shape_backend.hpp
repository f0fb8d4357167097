// shape_backend.hpp: a backend that computes nothing. Its tensors have shapes and distinct
// addresses but no memory behind them, and its ops return at once; what an op hands to the host
// (routing counts, norms) is the figure a plan assumes: MoE's routing balanced over the experts,
// zero norms. The collective plan (plan/collectives.hpp) runs the trainer's own step on it, with
// communicators that record (comm/recording.hpp), to list what a rank issues without training.
// Host code that reads a tensor's contents would fault on it: the passes and the optimizers go
// through the backend for every read.
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace tessera {

// `device`: the device the backend stands for (the plan of a CUDA run: the optimizers' choices
// that depend on it, such as Muon's precision, follow).
std::unique_ptr<Backend> make_shape_backend(Device device = Device::CPU);

}  // namespace tessera
