// hdf5_handle.cpp: closing HDF5 ids by type.
#include "core/hdf5_handle.hpp"

namespace tessera {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

void H5Id::reset() {
  if (id_ < 0) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  switch (H5Iget_type(id_)) {
    case H5I_FILE: H5Fclose(id_); break;
    case H5I_DATASET: H5Dclose(id_); break;
    case H5I_DATASPACE: H5Sclose(id_); break;
    case H5I_ATTR: H5Aclose(id_); break;
    case H5I_GENPROP_LST: H5Pclose(id_); break;
    case H5I_DATATYPE: H5Tclose(id_); break;
    case H5I_GROUP: H5Gclose(id_); break;
    default: break;
  }
  id_ = H5I_INVALID_HID;
}

void silence_hdf5_errors() {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

}  // namespace tessera
