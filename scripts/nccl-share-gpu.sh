#!/usr/bin/env bash
# nccl-share-gpu.sh (issue 56): starts one rank of a job whose ranks share GPUs (tests on the one
# lent GPU; tessera-train --ranks-per-gpu N). NCCL refuses two ranks on one GPU when they report
# the same host (its host hash), and takes the host hash from NCCL_HOSTID when it is set (computed
# once per process, so it holds for every communicator the rank creates): each rank gets its own,
# and NCCL joins them as separate nodes through its socket transport over loopback (correct, not
# fast: ~15 ms a collective between 3 ranks). Peer-to-peer, shared-memory and InfiniBand
# transports are off (they would see one host).
# Usage: mpirun -np N scripts/nccl-share-gpu.sh PROGRAM [ARGS...]
#   e.g. mpirun -np 2 scripts/nccl-share-gpu.sh build/bin/tessera-train --device cuda --ranks-per-gpu 2 ...
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: mpirun -np N $0 PROGRAM [ARGS...]" >&2; exit 2; }
rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-${SLURM_PROCID:-}}}}
if [ -z "$rank" ]; then
  echo "nccl-share-gpu.sh: error: no rank in the environment (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK or SLURM_PROCID); start it through mpirun or srun" >&2
  exit 2
fi
export NCCL_HOSTID="${NCCL_HOSTID_PREFIX:-tessera-rank}-$rank"
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_IB_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
exec "$@"
