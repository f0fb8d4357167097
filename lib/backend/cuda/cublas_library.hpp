// cublas_library.hpp: cuBLAS and cuBLASLt, loaded on the CUDA backend's first call into them
// (cublas_library.cpp says why). Host code; no CUDA header needed to include this.
#pragma once

#include <utility>
#include <vector>

namespace tessera::cuda {

enum class CublasLib { Blas, Lt };

// The address of `name` in cuBLAS (Blas) or cuBLASLt (Lt), loading the library on first use.
// Throws Error, naming the library and what to do, when it or the function is missing.
void* cublas_symbol(CublasLib lib, const char* name);

// Every cuBLAS function the backend calls (cublas_functions.inc), with its library: a test
// resolves them all where no GPU is.
const std::vector<std::pair<CublasLib, const char*>>& cublas_functions();

}  // namespace tessera::cuda
