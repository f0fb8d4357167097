// communicator.hpp: the one collective interface layers and schedules talk to. Implementations:
// LocalCommunicator (a group of one: every collective is the identity) here; MPI for host tensors
// and NCCL for device tensors over the process grid's groups.
#pragma once

#include <cstdint>
#include <memory>

#include "core/tensor.hpp"

namespace tessera {

enum class ReduceOp { Sum, Max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over a whole f32 tensor (host or device, per implementation).
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual void barrier() = 0;
};

// A group of one rank.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(Tensor&, ReduceOp) override {}
  void barrier() override {}
};

}  // namespace tessera
