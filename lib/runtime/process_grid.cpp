// process_grid.cpp: the MPI_Comm_split of every group (the arithmetic: comm/grid_layout.cpp).
#include "runtime/process_grid.hpp"

#ifdef TESSERA_HAVE_CUDA
#include "comm/nccl/nccl_communicator.hpp"
#endif

#include <unistd.h>

#include <cstring>
#include <sstream>

#include "comm/mpi/mpi_check.hpp"

namespace tessera {

namespace {
// Splits world so that ranks with the same `color` share a communicator, ordered by `key`.
MpiComm split(int color, int key) {
  MPI_Comm c = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &c));
  return MpiComm(c);
}
}  // namespace

ProcessGrid::ProcessGrid(int tp, int pp, int cp) {
  int world = 1;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  layout_ = GridLayout::make(world, tp, pp, cp);
  coords_ = layout_.coords(world_rank_);
  const GridCoords& c = coords_;
  const int TP = layout_.tp, DP = layout_.dp, PP = layout_.pp, CP = layout_.cp;
  // A (dp, cp) pair is one model replica for TP, PP and the embedding; the gradient group spans
  // DP x CP (key cp + CP * dp). With CP = 1: the (TP, PP, DP) grid's groups.
  const int dc = c.cp + CP * c.dp, DC = DP * CP;
  // Every rank makes the same splits in the same order (MPI_Comm_split is collective).
  tp_ = split(c.pp * DC + dc, c.tp);
  pp_ = split(dc * TP + c.tp, c.pp);
  dp_ = split(c.pp * TP + c.tp, dc);
  mp_ = split(dc, c.pp * TP + c.tp);
  const bool in_embedding = c.pp == 0 || c.pp == PP - 1;
  in_embedding_ = in_embedding;
  emb_ = split(in_embedding ? dc * TP + c.tp : MPI_UNDEFINED, c.pp);
  if (CP > 1) cp_ = split((c.pp * DP + c.dp) * TP + c.tp, c.cp);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL, &node));
  node_ = MpiComm(node);
  local_rank_ = node_.rank();
  local_size_ = node_.size();
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  host_ = h;

  world_comm_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, TraceGroup::World);
  tp_comm_ = std::make_unique<MpiCommunicator>(tp_.get(), TraceGroup::TensorParallel);
  pp_comm_ = std::make_unique<MpiCommunicator>(pp_.get(), TraceGroup::Pipeline);
  dp_comm_ = std::make_unique<MpiCommunicator>(dp_.get(), TraceGroup::DataParallel);
  mp_comm_ = std::make_unique<MpiCommunicator>(mp_.get(), TraceGroup::ModelParallel);
  if (in_embedding)
    emb_comm_ = std::make_unique<MpiCommunicator>(emb_.get(), TraceGroup::Embedding);
  else
    emb_comm_ = std::make_unique<LocalCommunicator>();
  if (CP > 1)
    cp_comm_ = std::make_unique<MpiCommunicator>(cp_.get(), TraceGroup::ContextParallel);
  else
    cp_comm_ = std::make_unique<LocalCommunicator>();
}

void ProcessGrid::use_pipeline_ring() {
  TESSERA_CHECK(!nccl_, "use_pipeline_ring must come before use_nccl");
  if (ring_ || layout_.pp == 1) return;
  // Two more splits of the embedding group's members (every rank takes part; the others get
  // MPI_COMM_NULL): key pp, so the first stage is rank 0 and the last rank 1.
  const GridCoords& c = coords_;
  const int color = in_embedding_ ? (c.cp + layout_.cp * c.dp) * layout_.tp + c.tp : MPI_UNDEFINED;
  wrap_ = split(color, c.pp);
  wrap_grad_ = split(color, c.pp);
  if (in_embedding_) {
    wrap_comm_ = std::make_unique<MpiCommunicator>(wrap_.get(), TraceGroup::PipelineWrap);
    wrap_grad_comm_ =
        std::make_unique<MpiCommunicator>(wrap_grad_.get(), TraceGroup::PipelineWrapGrad);
  }
  ring_ = true;
}

void ProcessGrid::use_expert_parallel(int ep) {
  TESSERA_CHECK(!nccl_, "use_expert_parallel must come before use_nccl");
  if (ep == ep_) return;
  TESSERA_CHECK(ep_ == 1, "use_expert_parallel called twice");
  check_expert_parallel(layout_, ep);
  const int DP = layout_.dp, TP = layout_.tp;
  ep_ = ep;
  const GridCoords& c = coords_;
  const int CP = layout_.cp;
  const int ep_rank = c.dp % ep, edp_rank = c.dp / ep;
  // An EP group: ep DP ranks of the same (tp, cp, pp). The expert-data-parallel group (the ranks
  // whose expert gradients are summed): the other EP groups' same ep_rank, times the CP ranks.
  ep_group_ = split(((c.pp * TP + c.tp) * CP + c.cp) * (DP / ep) + edp_rank, ep_rank);
  edp_group_ = split((c.pp * TP + c.tp) * ep + ep_rank, c.cp + CP * edp_rank);
  ep_comm_ = std::make_unique<MpiCommunicator>(ep_group_.get(), TraceGroup::Expert);
  edp_comm_ = std::make_unique<MpiCommunicator>(edp_group_.get(), TraceGroup::ExpertData);
}

void ProcessGrid::use_optimizer_instances(int instances) {
  TESSERA_CHECK(!nccl_, "use_optimizer_instances must come before use_nccl");
  if (instances == instances_) return;
  TESSERA_CHECK(instances_ == 1, "use_optimizer_instances called twice");
  check_optimizer_instances(layout_, ep_, instances);
  instances_ = instances;
  const GridCoords& c = coords_;
  const int TP = layout_.tp, CP = layout_.cp, N = instances;
  const int mp = c.pp * TP + c.tp;  // the gradient group's (tp, pp)
  // The gradient group's rank dc = cp + CP * dp; instance dc / S of S consecutive ranks.
  const int dc = c.cp + CP * c.dp, S = layout_.dp * CP / N;
  shard_ = split(mp * N + dc / S, dc % S);
  replica_ = split(mp * S + dc % S, dc / S);
  shard_comm_ = std::make_unique<MpiCommunicator>(shard_.get(), TraceGroup::DataParallelShard);
  replica_comm_ =
      std::make_unique<MpiCommunicator>(replica_.get(), TraceGroup::DataParallelReplica);
  if (ep_ > 1) {  // the expert-data-parallel group's rank: cp + CP * (dp / ep), per ep_rank
    const int ep_rank = c.dp % ep_, e = c.cp + CP * (c.dp / ep_);
    const int ES = layout_.dp / ep_ * CP / N;
    eshard_ = split((mp * ep_ + ep_rank) * N + e / ES, e % ES);
    ereplica_ = split((mp * ep_ + ep_rank) * ES + e % ES, e / ES);
    eshard_comm_ = std::make_unique<MpiCommunicator>(eshard_.get(), TraceGroup::ExpertDataShard);
    ereplica_comm_ =
        std::make_unique<MpiCommunicator>(ereplica_.get(), TraceGroup::ExpertDataReplica);
  }
}

void ProcessGrid::use_nccl(void* compute_stream) {
#ifdef TESSERA_HAVE_CUDA
  TESSERA_CHECK(!nccl_, "use_nccl called twice");
  auto make = [&](MPI_Comm group, int size, TraceGroup trace) -> std::unique_ptr<Communicator> {
    if (size == 1) return std::make_unique<LocalCommunicator>();
    return make_nccl_communicator(group, compute_stream, trace);
  };
  // The same order on every rank: TP, PP activations, PP gradients, DP, embedding.
  tp_comm_ = make(tp_.get(), layout_.tp, TraceGroup::TensorParallel);
  pp_comm_ = make(pp_.get(), layout_.pp, TraceGroup::Pipeline);
  pp_grad_comm_ = make(pp_.get(), layout_.pp, TraceGroup::PipelineGrad);
  dp_comm_ = make(dp_.get(), layout_.dp * layout_.cp, TraceGroup::DataParallel);
  // Every rank takes part in the split above; only the embedding group's members create it.
  if (in_embedding_ && layout_.pp > 1) emb_comm_ = make(emb_.get(), 2, TraceGroup::Embedding);
  if (ring_ && in_embedding_) {  // then the ring's wrap-around, activations first
    wrap_comm_ = make(wrap_.get(), 2, TraceGroup::PipelineWrap);
    wrap_grad_comm_ = make(wrap_grad_.get(), 2, TraceGroup::PipelineWrapGrad);
  }
  if (ep_ > 1) {  // then expert parallelism: EP, expert-data-parallel
    ep_comm_ = make(ep_group_.get(), ep_, TraceGroup::Expert);
    edp_comm_ = make(edp_group_.get(), layout_.dp / ep_ * layout_.cp, TraceGroup::ExpertData);
  }
  if (instances_ > 1) {  // then HSDP's instances: shard, replica (experts' after)
    const int S = layout_.dp * layout_.cp / instances_;
    shard_comm_ = make(shard_.get(), S, TraceGroup::DataParallelShard);
    replica_comm_ = make(replica_.get(), instances_, TraceGroup::DataParallelReplica);
    if (ep_ > 1) {
      eshard_comm_ = make(eshard_.get(), layout_.dp / ep_ * layout_.cp / instances_,
                          TraceGroup::ExpertDataShard);
      ereplica_comm_ = make(ereplica_.get(), instances_, TraceGroup::ExpertDataReplica);
    }
  }
  if (layout_.cp > 1)
    cp_comm_ = make(cp_.get(), layout_.cp,
                    TraceGroup::ContextParallel);  // last: the context-parallel ring
  nccl_ = true;
#else
  (void)compute_stream;
  throw Error("use_nccl: this build has no CUDA/NCCL");
#endif
}

ParallelContext ProcessGrid::context() {
  ParallelContext c;
  c.tp_size = layout_.tp;
  c.pp_size = layout_.pp;
  c.dp_size = layout_.dp;
  c.tp_rank = coords_.tp;
  c.pp_rank = coords_.pp;
  c.dp_rank = coords_.dp;
  c.cp_size = layout_.cp;
  c.cp_rank = coords_.cp;
  c.cp = cp_comm_.get();
  c.world_rank = world_rank_;
  c.world = world_comm_.get();
  c.tp = tp_comm_.get();
  c.pp = pp_comm_.get();
  c.pp_grad = pp_grad_comm_ ? pp_grad_comm_.get() : pp_comm_.get();
  c.dp = dp_comm_.get();
  c.model_parallel = mp_comm_.get();
  c.embedding = emb_comm_.get();
  c.pp_wrap = wrap_comm_.get();
  c.pp_wrap_grad = wrap_grad_comm_.get();
  c.ep_size = ep_;
  c.ep_rank = coords_.dp % ep_;
  if (ep_ > 1) {
    c.ep = ep_comm_.get();
    c.edp = edp_comm_.get();
  } else {
    static LocalCommunicator local;
    c.ep = &local;
    c.edp = dp_comm_.get();
  }
  static LocalCommunicator alone;
  c.dp_instances = instances_;
  c.dp_shard = instances_ > 1 ? shard_comm_.get() : c.dp;
  c.dp_replica = instances_ > 1 ? replica_comm_.get() : &alone;
  c.edp_shard = instances_ > 1 && ep_ > 1 ? eshard_comm_.get()
                : instances_ > 1          ? c.dp_shard
                                          : c.edp;
  c.edp_replica = instances_ > 1 && ep_ > 1 ? ereplica_comm_.get()
                  : instances_ > 1          ? c.dp_replica
                                            : &alone;
  return c;
}

std::string ProcessGrid::layout_table() {
  // Gather (local rank, host) of every rank on rank 0; collective, other ranks get "".
  constexpr int kRec = 96;
  char mine[kRec] = {0};
  std::snprintf(mine, sizeof mine, "%d %s", local_rank_, host_.c_str());
  std::vector<char> all(world_rank_ == 0 ? size_t(kRec) * layout_.world : 1);
  MPI_CHECK(MPI_Gather(mine, kRec, MPI_CHAR, all.data(), kRec, MPI_CHAR, 0, MPI_COMM_WORLD));
  if (world_rank_ != 0) return "";
  std::ostringstream os;
  const int CP = layout_.cp;
  if (CP > 1)
    os << "process grid: world " << layout_.world << " = TP " << layout_.tp << " x CP " << CP
       << " x DP " << layout_.dp << " x PP " << layout_.pp
       << " (rank = tp + TP*(cp + CP*(dp + DP*pp))); groups: TP size " << layout_.tp << ", CP size "
       << CP << " (ring), PP size " << layout_.pp << ", DP size " << layout_.dp
       << ", gradients summed over DP x CP = " << layout_.dp * CP << ", model-parallel size "
       << layout_.tp * layout_.pp;
  else
    os << "process grid: world " << layout_.world << " = TP " << layout_.tp << " x PP "
       << layout_.pp << " x DP " << layout_.dp << " (rank = tp + TP*(dp + DP*pp)); groups: TP size "
       << layout_.tp << ", PP size " << layout_.pp << ", DP size " << layout_.dp
       << ", model-parallel size " << layout_.tp * layout_.pp;
  if (ep_ > 1)
    os << ", expert-parallel size " << ep_ << " (ep = dp % " << ep_
       << "), expert-data-parallel size " << layout_.dp / ep_ * layout_.cp;
  if (instances_ > 1)
    os << ", " << instances_ << " optimizer instances of " << layout_.dp * CP / instances_
       << " consecutive data-parallel ranks (HSDP: sharded inside one, replicated across)";
  os << "\n";
  os << (ep_ > 1  ? "  rank   tp   pp   dp   ep  local  host\n"
         : CP > 1 ? "  rank   tp   cp   dp   pp  local  host\n"
                  : "  rank   tp   pp   dp  local  host\n");
  for (int r = 0; r < layout_.world; ++r) {
    const GridCoords c = layout_.coords(r);
    int local = 0;
    char host[kRec] = {0};
    std::sscanf(all.data() + size_t(r) * kRec, "%d %95s", &local, host);
    char line[200];
    if (ep_ > 1)
      std::snprintf(line, sizeof line, "  %4d %4d %4d %4d %4d %6d  %s\n", r, c.tp, c.pp, c.dp,
                    c.dp % ep_, local, host);
    else if (CP > 1)
      std::snprintf(line, sizeof line, "  %4d %4d %4d %4d %4d %6d  %s\n", r, c.tp, c.cp, c.dp, c.pp,
                    local, host);
    else
      std::snprintf(line, sizeof line, "  %4d %4d %4d %4d %6d  %s\n", r, c.tp, c.pp, c.dp, local,
                    host);
    os << line;
  }
  return os.str();
}

}  // namespace tessera
