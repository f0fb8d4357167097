// test_hooks.hpp: the fault and test hooks read from the environment, gathered in one place.
//
// These are for tests only (fault injection, mutation checks, forced edge cases), never for users:
// each makes a run wrong, fail or slow on purpose so that a test can check that it notices. Library
// code reads `TESSERA_FAULT_*`, `TESSERA_TEST_*` and `TESSERA_SLOW_SAVE_MS` through these accessors
// and nowhere else (docs/testing.md, "Fault and test hooks"). Unset, every hook is off and the run
// is the normal one. The user-facing environment switches (`TESSERA_ATTENTION=scalar`,
// `TESSERA_CUDA_GRAPHS=0`, docs/performance.md and docs/generation.md) are not hooks and are read
// where they act.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace tessera::test_hooks {

// TESSERA_FAULT_CP=no-lse-merge: the context-parallel ring merges every block as if its
// log-sum-exp were 0 (the correction dropped). Any other value or unset: off. Read once.
// Used by tests/train/test_context_parallel.sh (the layouts must then disagree).
bool cp_no_lse_merge();

// TESSERA_FAULT_DOC_MASK=leak: the first row of a micro-batch whose document starts after the
// sample's first token sees one key more, the last token of the document before (one
// cross-document attention left). Read at each call. Used by GPT.DocumentsMatchTheIndependent-
// Reference (the loss must then miss the reference).
bool doc_mask_leak();

// TESSERA_FAULT_CP=contiguous-split: each context-parallel rank takes the naive contiguous slice
// of a sample (rank r of T tokens each: [r*T, (r+1)*T)) instead of its chunks r and 2CP-1-r. Any
// other value or unset: off. Read once. Used by tests/train/test_context_parallel.sh (must
// disagree).
bool cp_contiguous_split();

// TESSERA_FAULT_DROPOUT_KEY=ignore-tp-offset: dropout masks keyed by rank-local instead of global
// positions (heads and sequence-parallel rows counted from 0 on every tensor-parallel rank). Any
// other value or unset: off. Read once. Used by tests/train/test_layout_equivalence.sh (the
// TP2+SP mutation check must disagree).
bool dropout_ignore_tp_offset();

// TESSERA_FAULT_FP8=no-tp-amax: FP8's amaxes are not reduced over the tensor-parallel group (each
// TP rank scales its own piece of a tensor). Any other value or unset: off. Read at each call
// (each model construction). Used by tests/train/test_fp8.sh (the TP2 mutation must disagree).
bool fp8_no_tp_amax();

// TESSERA_TEST_PERTURB_INIT=P: every initialized weight (normal init) multiplied by 1 + P, so a
// test can measure how far a run moves from a 1e-7 change of its start (FP8's rounding noise).
// std::strtof; unset or unparsable: 0 (no change). Read once. Used by tests/train/test_fp8.sh.
float perturb_init();

// TESSERA_TEST_DELAY_COMM_US=N / TESSERA_TEST_DELAY_COMPUTE_US=N (issue 56): every NCCL
// collective's stream sleeps N microseconds before the collective (its results arrive late), or
// the compute stream sleeps N microseconds after each collective is queued (the work that feeds
// the next one finishes late). Correct stream ordering leaves a run bitwise unchanged; a missing
// wait shows as different losses. std::strtol; unset or unparsable: 0. Read once. Used by
// scripts/nccl-layouts.sh on the GPU.
int delay_comm_us();
int delay_compute_us();

// TESSERA_FAULT_MOE_DISPATCH=wrong-rank: expert-parallel rank 0 swaps one token copy between the
// first two EP ranks' dispatch buffers. Any other value or unset: off. Read at each call (each
// model construction). Used by tests/train/test_layout_equivalence.sh (the EP2 mutation must
// disagree).
bool moe_dispatch_wrong_rank();

// TESSERA_FAULT_ROUTER=bias-in-weights: the aux-loss-free expert bias is added to the routing
// weights too (it must only choose the experts); TESSERA_FAULT_ROUTER=no-group-limit: the group
// limit is ignored (the top k of all experts). Read at each call (each model construction). Used
// by GPT.RouterMutationsMissTheReference (the loss must then miss the float64 reference).
bool router_bias_in_weights();
bool router_no_group_limit();

// TESSERA_TEST_MOE_LOGIT_BIAS=E:V[,E:V...]: the constant V added to expert E's router logit for
// every token, to force routing edge cases (every token to some experts, an EP rank receiving
// nothing). Returns the (expert, bias) pairs in order; empty when unset or empty. Throws
// tessera::Error on an item without ':' or an expert outside [0, num_experts); a non-numeric E or
// V throws std::invalid_argument (std::stoi, std::stof). Read at each call (each model
// construction). Used by tests/train/test_layout_equivalence.sh (the MoE edge cases).
std::vector<std::pair<int, float>> moe_logit_bias(int num_experts);

// TESSERA_FAULT_SAVE_RANK=RANK[:FROM_ITERATION]: world rank RANK's checkpoint write fails (after 3
// datasets) at every save from iteration FROM_ITERATION (default 0) on. Returns the dataset count
// after which the write fails, or -1. Parsed with sscanf("%d:%lld") at each call: unset or
// without a leading integer is -1. Used by tests/checkpoint/test_checkpoint.sh (1:10) and
// tests/checkpoint/test_hardening.sh (1:8 with asynchronous saves): the failed save must leave the
// last complete checkpoint loadable.
int save_fault_after(int world_rank, int64_t iteration);

// TESSERA_SLOW_SAVE_MS=N: sleep N milliseconds before each tensor's checkpoint write, so a test can
// land a kill or a signal inside a save. std::atol: unset, non-numeric or N <= 0 means no sleep.
// Read once. Used by tests/checkpoint/test_hardening.sh (the kill -9 and signal faults).
long slow_save_ms();

// TESSERA_TEST_COLLECTIVE_LOG=PREFIX: each rank appends every tensor collective and point-to-point
// call its process-grid communicators issue (groups of more than one rank; not the host f64
// reductions) to PREFIX.rank<world rank>, one line each, with a line "iteration N" as training
// iteration N starts (comm/mpi/collective_trace.hpp, trace_log). nullptr when unset or empty. Read
// once. Used by tests/plan/test_collective_sequence.sh (the predictor's sequence must equal it).
const char* collective_log_prefix();

// TESSERA_TEST_NVTX_LOG=PREFIX: each process appends the name of every scoped NVTX range it opens
// (core/nvtx.hpp's NvtxRange: the pipeline's forward / backward / backward-input /
// backward-weight, the layers' ranges) to PREFIX.rank<R>, one per line (R: the launcher's rank,
// OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID; else 0). Off when unset or empty. Read once.
// Used by tests/train/test_zero_bubble.sh (the Nsight names of B and W passes, checked on the CPU).
bool nvtx_log_on();
void nvtx_log(const char* name);

}  // namespace tessera::test_hooks
