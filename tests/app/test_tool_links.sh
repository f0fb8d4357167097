#!/usr/bin/env bash
# test_tool_links.sh: the data and checkpoint tools (and tessera-inspect) start on a CPU-only node (issue 58): neither
# they nor any library they load is CUDA, cuBLAS, cuDNN, NCCL or MPI (ldd, transitively), and
# each answers --help; tessera-train does link them (the check can fail).
# Usage: test_tool_links.sh BIN_DIR
set -u
bin=$1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad
gpu='lib(cudart|cuda|cublas|cublasLt|cudnn[a-z_]*|nccl|mpi|mpi_cxx|open-pal|open-rte)\.so'
for tool in tessera-preprocess tessera-checkpoint tessera-reshard tessera-inspect tessera-plan; do
  libs=$(ldd "$bin/$tool" 2>&1) || { bad "$tool: ldd failed: $libs"; continue; }
  hits=$(grep -oE "$gpu" <<<"$libs" | sort -u | tr '\n' ' ')
  if [ -z "$hits" ] && "$bin/$tool" --help > /dev/null 2>&1; then
    ok "$tool: $(grep -c '=>' <<<"$libs") libraries, none of CUDA, NCCL or MPI; --help answers"
  else
    bad "$tool links ${hits:-nothing of CUDA/MPI but --help failed}"
  fi
done
hits=$(ldd "$bin/tessera-train" | grep -oE "$gpu" | sort -u | tr '\n' ' ')
[ -n "$hits" ] && ok "tessera-train links $hits(the check sees them)" || bad "tessera-train links no MPI: the pattern is wrong"
[ $fail -eq 0 ] && echo "app.tool_links: all passed"
exit $fail
