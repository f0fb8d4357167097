// hdf5_handle.cpp: closing HDF5 ids by type.
#include "core/hdf5_handle.hpp"

#include "core/hdf5_check.hpp"

namespace tessera {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

void H5Id::reset() {
  if (id_ < 0) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  switch (H5Iget_type(id_)) {
    case H5I_FILE:
      H5Fclose(id_);
      break;
    case H5I_DATASET:
      H5Dclose(id_);
      break;
    case H5I_DATASPACE:
      H5Sclose(id_);
      break;
    case H5I_ATTR:
      H5Aclose(id_);
      break;
    case H5I_GENPROP_LST:
      H5Pclose(id_);
      break;
    case H5I_DATATYPE:
      H5Tclose(id_);
      break;
    case H5I_GROUP:
      H5Gclose(id_);
      break;
    default:
      break;
  }
  id_ = H5I_INVALID_HID;
}

void h5_write_attr(hid_t obj, const char* name, int64_t v) {
  H5Id space(H5Screate(H5S_SCALAR));
  H5Id attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  HDF5_CHECK(attr.get());
  HDF5_CHECK(H5Awrite(attr.get(), H5T_NATIVE_INT64, &v));
}

void h5_write_attr(hid_t obj, const char* name, const std::string& v) {
  H5Id type(H5Tcopy(H5T_C_S1));
  HDF5_CHECK(H5Tset_size(type.get(), v.size() ? v.size() : 1));
  H5Id space(H5Screate(H5S_SCALAR));
  H5Id attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
  HDF5_CHECK(attr.get());
  HDF5_CHECK(H5Awrite(attr.get(), type.get(), v.c_str()));
}

void h5_write_attr(hid_t obj, const char* name, const std::vector<int64_t>& v) {
  const hsize_t n[1] = {v.size()};
  H5Id space(v.empty() ? H5Screate(H5S_NULL) : H5Screate_simple(1, n, nullptr));
  H5Id attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  HDF5_CHECK(attr.get());
  if (!v.empty()) HDF5_CHECK(H5Awrite(attr.get(), H5T_NATIVE_INT64, v.data()));
}

bool h5_read_attr(hid_t obj, const char* name, int64_t& v) {
  if (H5Aexists(obj, name) <= 0) return false;
  H5Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  H5Id space(H5Aget_space(attr.get()));
  H5Id type(H5Aget_type(attr.get()));
  // Any integer width and sign (h5py writes a Python int as int64, numpy scalars as they are);
  // HDF5 converts to int64. A float or string is not an integer attribute.
  if (!space.valid() || !type.valid() || H5Sget_simple_extent_npoints(space.get()) != 1 ||
      H5Tget_class(type.get()) != H5T_INTEGER)
    return false;
  return H5Aread(attr.get(), H5T_NATIVE_INT64, &v) >= 0;
}

bool h5_read_attr(hid_t obj, const char* name, std::string& v) {
  if (H5Aexists(obj, name) <= 0) return false;
  H5Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  H5Id type(H5Aget_type(attr.get()));
  H5Id space(H5Aget_space(attr.get()));
  if (!type.valid() || !space.valid() || H5Tget_class(type.get()) != H5T_STRING ||
      H5Sget_simple_extent_npoints(space.get()) != 1)
    return false;
  // Read in the attribute's own character set (HDF5 does not convert ASCII <-> UTF-8).
  const H5T_cset_t cset = H5Tget_cset(type.get());
  H5Id mem(H5Tcopy(H5T_C_S1));
  H5Tset_cset(mem.get(), cset);
  if (H5Tis_variable_str(type.get()) > 0) {  // h5py's default for a Python str
    H5Tset_size(mem.get(), H5T_VARIABLE);
    char* text = nullptr;
    if (H5Aread(attr.get(), mem.get(), &text) < 0) return false;
    v = text ? text : "";
    H5free_memory(text);
    return true;
  }
  // A fixed-length string of n bytes has them in the attribute's storage: a type claiming more
  // (a damaged file) is no string attribute, not an allocation of its claimed size.
  const size_t n = H5Tget_size(type.get());
  if (n == 0 || n > H5Aget_storage_size(attr.get())) return false;
  std::string buf(n + 1, '\0');
  H5Tset_size(mem.get(), n + 1);
  if (H5Aread(attr.get(), mem.get(), buf.data()) < 0) return false;
  v = buf.c_str();
  return true;
}

bool h5_read_attr(hid_t obj, const char* name, std::vector<int64_t>& v) {
  if (H5Aexists(obj, name) <= 0) return false;
  H5Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  H5Id space(H5Aget_space(attr.get()));
  H5Id type(H5Aget_type(attr.get()));
  if (!space.valid() || !type.valid()) return false;
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  // Integers only, and no more elements than the attribute stores (a damaged file's dataspace can
  // claim any count: it is an unreadable attribute, not an allocation of that size).
  if (n > 0 &&
      (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) == 0 ||
       static_cast<hsize_t>(n) > H5Aget_storage_size(attr.get()) / H5Tget_size(type.get())))
    return false;
  v.assign(n > 0 ? static_cast<size_t>(n) : 0, 0);
  return n <= 0 || H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()) >= 0;
}

void silence_hdf5_errors() {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

}  // namespace tessera
