// recording.hpp: communicators that record instead of communicating. The collective plan
// (plan/collectives.hpp) runs one rank's training step with them: every tensor collective and
// point-to-point call the step issues becomes a CollectiveCall, written as the collective log
// writes a real run's (comm/mpi/collective_trace.hpp: group key, operation, elements, bytes per
// element, the peer's world rank). Host reductions of doubles (losses, norms, counts) are not
// calls of the plan; they return this rank's own values, and all_gather_f64 assumes every rank of
// the group holds what this one holds (MoE's routing counts: balanced on the shape backend).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/collective_names.hpp"
#include "comm/communicator.hpp"
#include "comm/grid_layout.hpp"

namespace tessera {

// Where a recorded call was issued: the model piece whose pass issued it (model/params.hpp's
// piece ids: a layer, kEmbedPiece, kHeadPiece; kNoPiece outside the passes), the pass, the
// micro-batch's turn of that piece (0 for the first forward or backward of it in the step) and
// whether it was the step's last backward of the piece's chunk.
enum class CallPass : char { None, Forward, Backward };
struct CallMark {
  static constexpr int kNoPiece = -1000;
  int piece = kNoPiece;
  CallPass pass = CallPass::None;
  int turn = 0;
  bool last = false;
};

struct CollectiveCall {
  std::string group;     // the communicator: "tp", "cp", "pp", ... (trace_group_key's names)
  std::string op;        // "all_reduce", "send", ... (trace_op_name's names)
  int64_t elements = 0;  // the whole buffer (an all-gather's output, a reduce-scatter's input)
  int bytes = 4;         // per element
  int peer = -1;         // point-to-point: the partner's world rank
  CallMark mark;
  // The collective log's line: "<group> <op> <elements> <bytes>[ <peer>]".
  std::string line() const;
};

// Where one rank's recording communicators append; `on` while the step that counts runs.
struct CallRecorder {
  bool on = false;
  CallMark mark;  // carried by the calls recorded from now on
  std::vector<CollectiveCall> calls;
  void record(TraceGroup group, TraceOp op, int64_t elements, size_t bytes, int world_peer);
};

// The process grid of one rank (runtime/process_grid.hpp's groups, from the layout's arithmetic)
// as recording communicators: the same group sizes, ranks and members as the real run's.
struct RecordingGridSpec {
  GridLayout layout;
  int ep = 1;                  // expert parallelism (ProcessGrid::use_expert_parallel)
  int instances = 1;           // optimizer instances (ProcessGrid::use_optimizer_instances)
  bool pipeline_ring = false;  // the wrap-around groups (ProcessGrid::use_pipeline_ring)
  bool device = false;         // NCCL's: gradients flow back on their own group ("pp_grad")
};
class RecordingGrid {
 public:
  RecordingGrid(const RecordingGridSpec& spec, int world_rank, CallRecorder& recorder);
  ~RecordingGrid();
  RecordingGrid(const RecordingGrid&) = delete;
  RecordingGrid& operator=(const RecordingGrid&) = delete;
  const ParallelContext& context() const { return ctx_; }

 private:
  Communicator* make(TraceGroup g, int rank, std::vector<int> members);
  CallRecorder* recorder_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  ParallelContext ctx_;
};

}  // namespace tessera
