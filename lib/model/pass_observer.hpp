// pass_observer.hpp: who watches the model's passes piece by piece (a transformer layer, the head
// or the embedding: model/params.hpp's pieces). The gradient reduction starts a piece's buckets
// when its gradients are complete, the distributed optimizer's overlapped gather waits for a
// piece's weights before its forward, Megatron-FSDP gathers and releases a piece's units around
// its passes. Each registers itself with GPTModel::add_observer; the model calls every observer in
// the order they registered, so two owners never replace each other's hook.
#pragma once

namespace tessera {

class PassObserver {
 public:
  virtual ~PassObserver() = default;
  // Before a forward piece reads its weights; after it.
  virtual void before_forward(int /*piece*/) {}
  virtual void after_forward(int /*piece*/) {}
  // Before a backward piece (ahead of its recomputation); after it: first every observer's
  // grads_ready (the piece's parameter gradients are complete for this micro-batch), then every
  // observer's after_backward.
  virtual void before_backward(int /*piece*/) {}
  // With zero-bubble's split backward (model/weight_grads.hpp) grads_ready comes after the piece's
  // W pass, not with the B pass's after_backward.
  virtual void grads_ready(int /*piece*/) {}
  virtual void after_backward(int /*piece*/) {}
};

}  // namespace tessera
