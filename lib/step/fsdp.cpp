// fsdp.cpp: Megatron-FSDP's units on the model's hooks (step/fsdp.hpp).
#include "step/fsdp.hpp"

#include "core/error.hpp"
#include "core/phase_timer.hpp"

namespace tessera {

FsdpUnits::FsdpUnits(GPTModel& model, Backend& be, DistributedAdamW& opt)
    : model_(model),
      be_(be),
      opt_(opt),
      ledger_(fsdp_units(model.params().specs(), model.params().buckets(), model.shard()),
              model.shard(), model.params().layout().units_only_grads,
              model.params().layout().units_only_compute, model.params().compute_dtype(),
              &be.allocator()) {
  TESSERA_CHECK(
      model_.params().layout().fsdp_units && (ledger_.shards_grads() || ledger_.shards_params()),
      "FsdpUnits without sharded FSDP units");
  ledger_.set_actions(this);
  ops_.resize(model_.params().buckets().size());
  gathers_.resize(ops_.size());
  model_.add_observer(this);
}

FsdpUnits::~FsdpUnits() {
  model_.remove_observer(this);
  for (auto& op : ops_)
    if (op) op->wait();
  for (auto& op : gathers_)
    if (op) op->wait();
}

void FsdpUnits::before_forward(int piece) {
  if (ledger_.shards_params()) ledger_.before_forward(piece);
}

void FsdpUnits::after_forward(int piece) {
  if (ledger_.shards_params()) ledger_.after_forward(piece);
}

void FsdpUnits::after_backward(int piece) {
  if (ledger_.shards_params()) ledger_.after_backward(piece);
}

void FsdpUnits::begin_step() {
  TESSERA_CHECK(ledger_.idle(), "FSDP reductions left from the previous step");
  if (ledger_.shards_grads()) be_.zero(opt_.grad_shard());
}

void FsdpUnits::gather(int unit, const Tensor& mem) {
  TESSERA_PHASE("fsdp-param-gather");
  Tensor full = model_.params().bucket_compute(unit);
  full.bind_storage(mem);
  const DistributedAdamW::Block& k = opt_.blocks()[static_cast<size_t>(unit)];
  Tensor mine = full.view(k.cut_begin - model_.params().buckets()[unit].begin, {k.cut_numel});
  be_.cast(mine, opt_.cut_compute(k));  // this rank's cut of the compute copy
  gathers_[static_cast<size_t>(unit)] = k.comm->all_gather_async(full);
}

void FsdpUnits::wait_gather(int unit) {
  auto& op = gathers_[static_cast<size_t>(unit)];
  TESSERA_CHECK(op, "FSDP unit ", unit, " waited for without a gather");
  op->wait_device();  // the compute stream (not the host) waits: the gather ran behind compute
  op.reset();
}

void FsdpUnits::release_params(int unit) {
  model_.params().bucket_compute(unit).unbind_storage();
}

void FsdpUnits::bind_grads(int unit, const Tensor& mem) {
  Tensor g = model_.params().bucket_grads(unit);
  g.bind_storage(mem);
  be_.zero(g);
}

void FsdpUnits::start_reduce(int unit) {
  Tensor g = model_.params().bucket_grads(unit);
  if (before_reduce) before_reduce(g);
  const DistributedAdamW::Block& k = opt_.blocks()[static_cast<size_t>(unit)];
  ops_[static_cast<size_t>(unit)] = k.comm->reduce_scatter_async(g);
}

void FsdpUnits::finish_reduce(int unit) {
  TESSERA_PHASE("fsdp-grad-reduce-scatter");
  auto& op = ops_[static_cast<size_t>(unit)];
  op->wait();
  op.reset();
  Tensor g = model_.params().bucket_grads(unit);
  const DistributedAdamW::Block& k = opt_.blocks()[static_cast<size_t>(unit)];
  Tensor mine = g.view(k.cut_begin - model_.params().buckets()[unit].begin, {k.cut_numel});
  Tensor acc = opt_.cut_grads(k);
  be_.add(acc, acc, mine);  // this micro-batch's sum over DP, into the step's
  g.unbind_storage();
}

}  // namespace tessera
