// collective_names.hpp: the names of the process grid's groups and of the collective operations,
// as the hang record (comm/mpi/collective_trace.hpp), the collective log and the collective plan
// (plan/collectives.hpp, recorded by comm/recording.hpp) write them. No MPI.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

enum class TraceGroup : int {
  World,
  TensorParallel,
  Pipeline,
  PipelineGrad,
  DataParallel,
  ModelParallel,
  Embedding,
  ContextParallel,
  PipelineWrap,
  PipelineWrapGrad,
  Expert,
  ExpertData,
  DataParallelShard,    // HSDP: one optimizer instance's data-parallel ranks
  DataParallelReplica,  // HSDP: the same shard across the instances
  ExpertDataShard,
  ExpertDataReplica,
  Count,
  None = -1,  // not traced (communicators outside the process grid)
};
const char* trace_group_name(TraceGroup g);  // "data-parallel group"
const char* trace_group_key(TraceGroup g);   // "dp": the collective log's and predictor's name

enum class TraceOp : int {
  None,
  AllReduce,
  Broadcast,
  AllGather,
  ReduceScatter,
  AllToAll,
  Barrier,
  Send,
  Recv,
  SendRecv,
};
const char* trace_op_name(TraceOp op);  // "all_reduce"

// The pipeline step this rank's main thread runs, for the hang report (comm/mpi/
// collective_trace.hpp): a forward, a whole backward (1F1B), or zero-bubble's B (input gradients)
// or W (weight gradients) pass of a micro-batch of a model chunk; None between steps.
enum class PipePass : int { None, Forward, Backward, InputGrad, WeightGrad };
void trace_pipeline_pass(PipePass pass, int micro = 0, int chunk = 0);
int64_t trace_pipeline_word();  // the step as one word of the heartbeat's record
// "the W pass (weight gradients) of micro-batch 3, model chunk 1"; "" for None.
std::string describe_pipeline_word(int64_t word);

}  // namespace tessera
