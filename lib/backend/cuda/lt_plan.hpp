// lt_plan.hpp: what the cuBLASLt plans of matmul.cu (bf16 epilogues) and fp8.cu (FP8 GEMMs) share.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_check.hpp"

namespace tessera::cuda_ops {

// A heuristic preference with the workspace cap and the operands' alignments (cuBLASLt assumes
// 256-byte aligned pointers unless told, and refuses a call whose pointers are less aligned than
// the algorithm it chose). The caller destroys it.
inline cublasLtMatmulPreference_t lt_preference(size_t workspace_bytes, uint32_t align_a,
                                                uint32_t align_b, uint32_t align_d) {
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof workspace_bytes));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof align_d));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof align_d));
  return pref;
}

}  // namespace tessera::cuda_ops
