// collective_names.cpp: the groups' and operations' names (comm/collective_names.hpp).
#include "comm/collective_names.hpp"

#include <atomic>

namespace tessera {

const char* trace_group_name(TraceGroup g) {
  switch (g) {
    case TraceGroup::World:
      return "world";
    case TraceGroup::TensorParallel:
      return "tensor-parallel group";
    case TraceGroup::Pipeline:
      return "pipeline group";
    case TraceGroup::PipelineGrad:
      return "pipeline gradient group";
    case TraceGroup::DataParallel:
      return "data-parallel group";
    case TraceGroup::ModelParallel:
      return "model-parallel group";
    case TraceGroup::Embedding:
      return "embedding group";
    case TraceGroup::ContextParallel:
      return "context-parallel group";
    case TraceGroup::PipelineWrap:
      return "pipeline wrap-around group";
    case TraceGroup::PipelineWrapGrad:
      return "pipeline wrap-around gradient group";
    case TraceGroup::Expert:
      return "expert-parallel group";
    case TraceGroup::ExpertData:
      return "expert-data-parallel group";
    case TraceGroup::DataParallelShard:
      return "data-parallel shard group (one optimizer instance)";
    case TraceGroup::DataParallelReplica:
      return "data-parallel replica group (across optimizer instances)";
    case TraceGroup::ExpertDataShard:
      return "expert-data-parallel shard group (one optimizer instance)";
    case TraceGroup::ExpertDataReplica:
      return "expert-data-parallel replica group (across optimizer instances)";
    default:
      return "group";
  }
}

const char* trace_group_key(TraceGroup g) {
  switch (g) {
    case TraceGroup::World:
      return "world";
    case TraceGroup::TensorParallel:
      return "tp";
    case TraceGroup::Pipeline:
      return "pp";
    case TraceGroup::PipelineGrad:
      return "pp_grad";
    case TraceGroup::DataParallel:
      return "dp";
    case TraceGroup::ModelParallel:
      return "mp";
    case TraceGroup::Embedding:
      return "embedding";
    case TraceGroup::ContextParallel:
      return "cp";
    case TraceGroup::PipelineWrap:
      return "pp_wrap";
    case TraceGroup::PipelineWrapGrad:
      return "pp_wrap_grad";
    case TraceGroup::Expert:
      return "ep";
    case TraceGroup::ExpertData:
      return "edp";
    case TraceGroup::DataParallelShard:
      return "dp_shard";
    case TraceGroup::DataParallelReplica:
      return "dp_replica";
    case TraceGroup::ExpertDataShard:
      return "edp_shard";
    case TraceGroup::ExpertDataReplica:
      return "edp_replica";
    default:
      return "none";
  }
}

const char* trace_op_name(TraceOp op) {
  switch (op) {
    case TraceOp::AllReduce:
      return "all_reduce";
    case TraceOp::Broadcast:
      return "broadcast";
    case TraceOp::AllGather:
      return "all_gather";
    case TraceOp::ReduceScatter:
      return "reduce_scatter";
    case TraceOp::AllToAll:
      return "all_to_all";
    case TraceOp::Barrier:
      return "barrier";
    case TraceOp::Send:
      return "send";
    case TraceOp::Recv:
      return "recv";
    case TraceOp::SendRecv:
      return "send_recv";
    default:
      return "collective";
  }
}

namespace {
std::atomic<int64_t> g_pipeline_pass{0};
}

void trace_pipeline_pass(PipePass pass, int micro, int chunk) {
  g_pipeline_pass.store(static_cast<int64_t>(pass) | (int64_t(micro) << 8) | (int64_t(chunk) << 40),
                        std::memory_order_relaxed);
}

int64_t trace_pipeline_word() {
  return g_pipeline_pass.load(std::memory_order_relaxed);
}

std::string describe_pipeline_word(int64_t word) {
  const int64_t micro = (word >> 8) & ((int64_t(1) << 32) - 1), chunk = word >> 40;
  std::string what;
  switch (static_cast<PipePass>(word & 0xff)) {
    case PipePass::Forward:
      what = "the forward";
      break;
    case PipePass::Backward:
      what = "the backward";
      break;
    case PipePass::InputGrad:
      what = "the B pass (input gradients)";
      break;
    case PipePass::WeightGrad:
      what = "the W pass (weight gradients)";
      break;
    default:
      return "";
  }
  return what + " of micro-batch " + std::to_string(micro) +
         (chunk > 0 ? ", model chunk " + std::to_string(chunk) : "");
}

}  // namespace tessera
