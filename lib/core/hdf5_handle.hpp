// hdf5_handle.hpp: RAII for HDF5 ids, and the process-wide lock around HDF5 calls (Debian's
// libhdf5 is not built thread-safe; the data loader's prefetch thread and checkpointing both use
// it).
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

std::recursive_mutex& hdf5_mutex();

// Owns one HDF5 id (file, dataset, dataspace, attribute, property list, type) and closes it
// with the matching H5?close.
class H5Id {
 public:
  H5Id() = default;
  explicit H5Id(hid_t id) : id_(id) {}
  ~H5Id() { reset(); }
  H5Id(H5Id&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// Attributes on a file, group or dataset. Writers throw Error; readers return false when the
// attribute is missing or of another kind.
void h5_write_attr(hid_t obj, const char* name, int64_t v);
void h5_write_attr(hid_t obj, const char* name, const std::string& v);
void h5_write_attr(hid_t obj, const char* name, const std::vector<int64_t>& v);
bool h5_read_attr(hid_t obj, const char* name, int64_t& v);
bool h5_read_attr(hid_t obj, const char* name, std::string& v);
bool h5_read_attr(hid_t obj, const char* name, std::vector<int64_t>& v);

// Turns off HDF5's automatic error stack printing: Tessera reports its own one-line errors.
void silence_hdf5_errors();

}  // namespace tessera
