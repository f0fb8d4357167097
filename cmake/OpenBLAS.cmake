# Finds OpenBLAS, preferring Debian's OpenMP build (libopenblas-openmp-dev): Tessera parallelizes
# its own loops with OpenMP, and only the OpenMP build of OpenBLAS runs single-threaded when called
# from inside an OpenMP parallel region instead of oversubscribing the cores.
set(_tessera_multiarch_dirs /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu)
set(_hint_libs "")
set(_hint_incs "")
foreach(d ${_tessera_multiarch_dirs})
  list(APPEND _hint_libs ${d}/openblas-openmp)
endforeach()
list(APPEND _hint_incs /usr/include/x86_64-linux-gnu/openblas-openmp
     /usr/include/aarch64-linux-gnu/openblas-openmp)
find_library(TESSERA_OPENBLAS_LIBRARY NAMES openblas HINTS ${_hint_libs} NO_DEFAULT_PATH)
find_path(TESSERA_OPENBLAS_INCLUDE cblas.h HINTS ${_hint_incs} NO_DEFAULT_PATH)
if(NOT TESSERA_OPENBLAS_LIBRARY OR NOT TESSERA_OPENBLAS_INCLUDE)
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
  set(TESSERA_OPENBLAS_LIBRARY ${BLAS_LIBRARIES})
  find_path(TESSERA_OPENBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas REQUIRED)
  message(WARNING "OpenMP build of OpenBLAS not found (apt-get install libopenblas-openmp-dev); "
                  "using ${BLAS_LIBRARIES}")
endif()
add_library(tessera_openblas INTERFACE)
target_link_libraries(tessera_openblas INTERFACE ${TESSERA_OPENBLAS_LIBRARY})
target_include_directories(tessera_openblas SYSTEM INTERFACE ${TESSERA_OPENBLAS_INCLUDE})
get_filename_component(_openblas_dir ${TESSERA_OPENBLAS_LIBRARY} DIRECTORY)
# The run path makes the loader pick this build over the one Debian's alternatives point to.
set(CMAKE_BUILD_RPATH ${_openblas_dir})
set(CMAKE_INSTALL_RPATH ${_openblas_dir})
