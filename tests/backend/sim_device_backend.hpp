// sim_device_backend.hpp: a test double that behaves like a device backend on a machine without
// a GPU. Its memory is host memory that is read- and write-protected (mprotect) except while one
// of its own ops, transfers or the test's communicators run, so any code that touches "device"
// memory directly from the host (instead of through copy_from_host / copy_to_host) crashes. The
// ops themselves are the CPU backend's, so results must equal a CPU run bit for bit.
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace tessera::simdev {

// device() is Device::CUDA (callers take their device paths); tensors it allocates report
// Device::CPU so the wrapped CPU kernels accept them.
std::unique_ptr<Backend> make_sim_device_backend();

// Opens every sim allocation for the lifetime of the object (e.g. around a host-side check).
class SimDeviceUnlock {
 public:
  SimDeviceUnlock();
  ~SimDeviceUnlock();
};

}  // namespace tessera::simdev
