// shard.cpp: writing and reading HDF5 token shards.
#include "data/shard.hpp"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>

#include "core/error.hpp"
#include "core/hdf5_check.hpp"

namespace tessera {

namespace {

template <typename T>
void write_1d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const T* data,
              int64_t n, int64_t chunk) {
  const hsize_t dims[1] = {static_cast<hsize_t>(n)};
  H5Id space(H5Screate_simple(1, dims, nullptr));
  H5Id plist(H5Pcreate(H5P_DATASET_CREATE));
  if (n > 0) {
    const hsize_t c[1] = {static_cast<hsize_t>(std::min<int64_t>(n, chunk))};
    HDF5_CHECK(H5Pset_chunk(plist.get(), 1, c));
  }
  H5Id ds(H5Dcreate2(file, name, file_type, space.get(), H5P_DEFAULT, plist.get(), H5P_DEFAULT));
  HDF5_CHECK(ds.get());
  if (n > 0) HDF5_CHECK(H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
}

// The most elements a 1-D dataset can hold in `file_size` bytes of file: every element of a shard
// is written (none is a fill value), at its type's size unfiltered and compressed at most 1032:1
// (deflate's limit; token ids and offsets come nowhere near it). A damaged extent (found by
// tests/fuzz/fuzz_shard.cpp: 2 * 10^15 tokens in 37 bytes of deflated chunks) is refused with
// this before anything is sized by it. 0 when the dataset's storage claims more than the file has.
uint64_t storable_elements(hid_t ds, hid_t type, uint64_t file_size) {
  const uint64_t stored = H5Dget_storage_size(ds);
  if (stored > file_size) return 0;
  H5Id plist(H5Dget_create_plist(ds));
  const bool filtered = plist.valid() && H5Pget_nfilters(plist.get()) > 0;
  return stored * (filtered ? 1032 : 1) / std::max<size_t>(H5Tget_size(type), 1);
}

}  // namespace

void write_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                 const std::vector<uint64_t>& doc_offsets, const ShardMeta& meta,
                 const std::vector<uint8_t>& loss_mask) {
  TESSERA_CHECK(
      !doc_offsets.empty() && doc_offsets.front() == 0 && doc_offsets.back() == tokens.size(),
      "doc_offsets must run from 0 to the number of tokens");
  TESSERA_CHECK(loss_mask.empty() || loss_mask.size() == tokens.size(), "a loss mask of ",
                loss_mask.size(), " for ", tokens.size(), " tokens");
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  silence_hdf5_errors();
  const std::string tmp = path + ".tmp";
  try {
    H5Id file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    if (!file.valid())
      throw Error("cannot create shard '" + tmp + "'; check the directory exists and is writable");
    const bool u16 = meta.vocab_size <= 65536;
    if (u16) {
      std::vector<uint16_t> t16(tokens.begin(), tokens.end());
      write_1d(file.get(), "tokens", H5T_STD_U16LE, H5T_NATIVE_UINT16, t16.data(),
               static_cast<int64_t>(t16.size()), 1 << 20);
    } else {
      write_1d(file.get(), "tokens", H5T_STD_U32LE, H5T_NATIVE_UINT32, tokens.data(),
               static_cast<int64_t>(tokens.size()), 1 << 20);
    }
    write_1d(file.get(), "doc_offsets", H5T_STD_U64LE, H5T_NATIVE_UINT64, doc_offsets.data(),
             static_cast<int64_t>(doc_offsets.size()), 1 << 16);
    if (!loss_mask.empty())
      write_1d(file.get(), "loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, loss_mask.data(),
               static_cast<int64_t>(loss_mask.size()), 1 << 20);
    h5_write_attr(file.get(), "vocab_size", meta.vocab_size);
    h5_write_attr(file.get(), "eod_id", meta.eod_id);
    h5_write_attr(file.get(), "tokenizer", meta.tokenizer);
    h5_write_attr(file.get(), "format_version", kShardFormatVersion);
    HDF5_CHECK(H5Fflush(file.get(), H5F_SCOPE_GLOBAL));
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot rename '" + tmp + "' to '" + path + "'");
  }
}

ShardReader::ShardReader(const std::string& path) : path_(path) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  silence_hdf5_errors();
  auto bad = [&](const std::string& what) {
    return ConfigError("data shard '" + path + "': " + what);
  };
  struct stat st;
  if (stat(path.c_str(), &st) != 0)
    throw bad("does not exist; check --data-path (shards are <prefix>_NNNNN.h5)");
  if (H5Fis_hdf5(path.c_str()) <= 0)
    throw bad("is not an HDF5 file (truncated or not a shard); re-run tessera-preprocess");
  file_ = H5Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file_.valid()) throw bad("cannot be opened (truncated?); re-run tessera-preprocess");
  if (!h5_read_attr(file_.get(), "format_version", meta_.format_version))
    throw bad("has no format_version attribute; it was not written by tessera-preprocess");
  if (meta_.format_version != kShardFormatVersion)
    throw bad("has format_version " + std::to_string(meta_.format_version) + ", this build reads " +
              std::to_string(kShardFormatVersion) + "; re-run tessera-preprocess");
  if (!h5_read_attr(file_.get(), "vocab_size", meta_.vocab_size))
    throw bad(
        "lacks the vocab_size attribute (an integer: the tokenizer's vocabulary size; see "
        "docs/data.md)");
  if (!h5_read_attr(file_.get(), "eod_id", meta_.eod_id))
    throw bad(
        "lacks the eod_id attribute (an integer: the end-of-document token; see docs/data.md)");
  if (!h5_read_attr(file_.get(), "tokenizer", meta_.tokenizer))
    throw bad("lacks the tokenizer attribute (a string naming the tokenizer; see docs/data.md)");
  if (meta_.vocab_size < 1 || meta_.vocab_size > (int64_t(1) << 31))
    throw bad("has vocab_size " + std::to_string(meta_.vocab_size) +
              ", out of range (allowed: 1 to 2^31); re-run tessera-preprocess");
  if (meta_.eod_id < 0 || meta_.eod_id >= meta_.vocab_size)
    throw bad("has eod_id " + std::to_string(meta_.eod_id) + ", outside its vocab_size " +
              std::to_string(meta_.vocab_size) +
              " (inconsistent attributes); re-run tessera-preprocess");
  if (H5Lexists(file_.get(), "tokens", H5P_DEFAULT) <= 0 ||
      H5Lexists(file_.get(), "doc_offsets", H5P_DEFAULT) <= 0)
    throw bad("lacks the /tokens or /doc_offsets dataset");
  tokens_ = H5Id(H5Dopen2(file_.get(), "tokens", H5P_DEFAULT));
  H5Id tspace(H5Dget_space(tokens_.get()));
  H5Id ttype(H5Dget_type(tokens_.get()));
  if (!tspace.valid() || H5Sget_simple_extent_ndims(tspace.get()) != 1 ||
      H5Tget_class(ttype.get()) != H5T_INTEGER)
    throw bad("/tokens is not a 1-D integer dataset");
  // uint16 / uint32 (tessera-preprocess) read straight as uint32; other integer types (int64 from
  // a plain numpy array, say) through an int64 buffer, so negative ids are seen, not clamped.
  wide_ = !(H5Tget_sign(ttype.get()) == H5T_SGN_NONE &&
            (H5Tget_size(ttype.get()) == 2 || H5Tget_size(ttype.get()) == 4));
  hsize_t n = 0;
  H5Sget_simple_extent_dims(tspace.get(), &n, nullptr);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  auto beyond_file = [&](const char* name, hsize_t extent) {
    return bad(std::string(name) + " has " + std::to_string(extent) + " entries, more than the " +
               std::to_string(file_size) +
               "-byte file can hold; the shard is damaged, re-run tessera-preprocess");
  };
  if (n > storable_elements(tokens_.get(), ttype.get(), file_size)) throw beyond_file("/tokens", n);
  num_tokens_ = static_cast<int64_t>(n);
  H5Id ds(H5Dopen2(file_.get(), "doc_offsets", H5P_DEFAULT));
  H5Id dspace(H5Dget_space(ds.get()));
  H5Id dtype(H5Dget_type(ds.get()));
  hsize_t nd = 0;
  if (!dspace.valid() || !dtype.valid() || H5Sget_simple_extent_ndims(dspace.get()) != 1)
    throw bad("/doc_offsets is not 1-D");
  H5Sget_simple_extent_dims(dspace.get(), &nd, nullptr);
  if (nd > storable_elements(ds.get(), dtype.get(), file_size))
    throw beyond_file("/doc_offsets", nd);
  // Offsets run from 0 to the number of tokens in order, one more than the documents: a damaged
  // extent (found by tests/fuzz/fuzz_shard.cpp: 2^61 entries) is refused before it is allocated.
  if (nd > n + 1)
    throw bad("/doc_offsets has " + std::to_string(nd) + " entries for " + std::to_string(n) +
              " tokens (at most one more than the tokens); the shard is damaged, re-run "
              "tessera-preprocess");
  doc_offsets_.resize(nd);
  if (nd == 0 ||
      H5Dread(ds.get(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, doc_offsets_.data()) < 0)
    throw bad("/doc_offsets cannot be read (truncated?); re-run tessera-preprocess");
  if (doc_offsets_.front() != 0 || doc_offsets_.back() != n ||
      !std::is_sorted(doc_offsets_.begin(), doc_offsets_.end()))
    throw bad("/doc_offsets does not run from 0 to the number of tokens in order");
  if (H5Lexists(file_.get(), "loss_mask", H5P_DEFAULT) > 0) {
    loss_mask_ = H5Id(H5Dopen2(file_.get(), "loss_mask", H5P_DEFAULT));
    H5Id mspace(H5Dget_space(loss_mask_.get()));
    H5Id mtype(H5Dget_type(loss_mask_.get()));
    hsize_t nm = 0;
    if (!mspace.valid() || !mtype.valid() || H5Sget_simple_extent_ndims(mspace.get()) != 1 ||
        H5Tget_class(mtype.get()) != H5T_INTEGER)
      throw bad(
          "/loss_mask is not a 1-D integer dataset (uint8, one per token of /tokens: 1 = a "
          "target whose loss counts, 0 = not)");
    H5Sget_simple_extent_dims(mspace.get(), &nm, nullptr);
    if (nm != n)
      throw bad("/loss_mask has " + std::to_string(nm) + " entries for the " + std::to_string(n) +
                " tokens of /tokens (one per token); rewrite it, or re-run tessera-preprocess");
  }
}

std::string ShardReader::where(uint64_t at) const {
  const size_t doc =
      std::upper_bound(doc_offsets_.begin(), doc_offsets_.end(), at) - doc_offsets_.begin() - 1;
  return "document " + std::to_string(doc) + " (token " + std::to_string(at - doc_offsets_[doc]) +
         " of the document, " + std::to_string(at) + " of the shard)";
}

void ShardReader::read_loss_mask(int64_t begin, int64_t count, uint8_t* out) const {
  TESSERA_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "read of mask [", begin,
                ", ", begin + count, ") past the end of ", path_);
  if (!loss_mask_.valid()) {
    std::fill(out, out + count, uint8_t(1));
    return;
  }
  if (count == 0) return;
  std::vector<int64_t> v(static_cast<size_t>(count));
  {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    H5Id fspace(H5Dget_space(loss_mask_.get()));
    const hsize_t start[1] = {static_cast<hsize_t>(begin)}, cnt[1] = {static_cast<hsize_t>(count)};
    HDF5_CHECK(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, cnt, nullptr));
    H5Id mspace(H5Screate_simple(1, cnt, nullptr));
    if (H5Dread(loss_mask_.get(), H5T_NATIVE_INT64, mspace.get(), fspace.get(), H5P_DEFAULT,
                v.data()) < 0)
      throw Error("data shard '" + path_ + "': reading /loss_mask [" + std::to_string(begin) +
                  ", " + std::to_string(begin + count) + ") failed (truncated or corrupt)");
  }
  for (int64_t i = 0; i < count; ++i) {
    if (v[i] != 0 && v[i] != 1)
      throw ConfigError("data shard '" + path_ + "': /loss_mask of " +
                        where(static_cast<uint64_t>(begin + i)) + " is " + std::to_string(v[i]) +
                        "; a loss mask holds 0 (no loss) or 1 (a target that counts)");
    out[i] = static_cast<uint8_t>(v[i]);
  }
}

void ShardReader::read(int64_t begin, int64_t count, int32_t* out) const {
  TESSERA_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "read of tokens [", begin,
                ", ", begin + count, ") past the end of ", path_);
  if (count == 0) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  H5Id fspace(H5Dget_space(tokens_.get()));
  const hsize_t start[1] = {static_cast<hsize_t>(begin)}, cnt[1] = {static_cast<hsize_t>(count)};
  HDF5_CHECK(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, cnt, nullptr));
  H5Id mspace(H5Screate_simple(1, cnt, nullptr));
  auto failed = [&] {
    return Error("data shard '" + path_ + "': reading tokens [" + std::to_string(begin) + ", " +
                 std::to_string(begin + count) +
                 ") failed (truncated or corrupt); re-run tessera-preprocess");
  };
  // Every id handed out is inside the vocabulary (a max over the read, cheap next to the step).
  int64_t worst_at = -1, worst = 0;
  if (!wide_) {  // uint16 / uint32: read as uint32 straight into the int32 output
    if (H5Dread(tokens_.get(), H5T_NATIVE_UINT32, mspace.get(), fspace.get(), H5P_DEFAULT, out) < 0)
      throw failed();
    const uint32_t* ids = reinterpret_cast<const uint32_t*>(out);
    uint32_t top = 0;
    for (int64_t i = 0; i < count; ++i) top = std::max(top, ids[i]);
    if (static_cast<int64_t>(top) >= meta_.vocab_size)
      for (int64_t i = 0; i < count && worst_at < 0; ++i)
        if (static_cast<int64_t>(ids[i]) >= meta_.vocab_size) worst_at = i, worst = ids[i];
  } else {
    std::vector<int64_t> wide(static_cast<size_t>(count));
    if (H5Dread(tokens_.get(), H5T_NATIVE_INT64, mspace.get(), fspace.get(), H5P_DEFAULT,
                wide.data()) < 0)
      throw failed();
    for (int64_t i = 0; i < count; ++i) {
      if ((wide[i] < 0 || wide[i] >= meta_.vocab_size) && worst_at < 0)
        worst_at = i, worst = wide[i];
      out[i] = static_cast<int32_t>(wide[i]);
    }
  }
  if (worst_at < 0) return;
  throw ConfigError(
      "data shard '" + path_ + "': " + where(static_cast<uint64_t>(begin + worst_at)) + " has id " +
      std::to_string(worst) + ", outside the vocabulary of " + std::to_string(meta_.vocab_size) +
      " tokens (its vocab_size attribute); re-run tessera-preprocess with the "
      "tokenizer that matches");
}

std::string shard_path(const std::string& prefix, int index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "_%05d.h5", index);
  return prefix + buf;
}

std::vector<std::string> shard_paths(const std::string& prefix) {
  struct stat st;
  if (prefix.size() > 3 && prefix.compare(prefix.size() - 3, 3, ".h5") == 0 &&
      stat(prefix.c_str(), &st) == 0)
    return {prefix};
  std::vector<std::string> out;
  for (int i = 0;; ++i) {
    const std::string p = shard_path(prefix, i);
    if (stat(p.c_str(), &st) != 0) break;
    out.push_back(p);
  }
  if (out.empty() && stat((prefix + ".h5").c_str(), &st) == 0) out.push_back(prefix + ".h5");
  if (out.empty())
    throw ConfigError("--data-path '" + prefix + "' names no shards (looked for " +
                      shard_path(prefix, 0) + " and " + prefix +
                      ".h5); run tessera-preprocess first");
  // A gap (shard 3 missing while 4 exists) would silently drop data: refuse it.
  glob_t g;
  if (glob((prefix + "_[0-9][0-9][0-9][0-9][0-9].h5").c_str(), 0, nullptr, &g) == 0) {
    const size_t found = g.gl_pathc;
    globfree(&g);
    if (found != out.size())
      throw ConfigError(
          "--data-path '" + prefix + "': shard " + shard_path(prefix, (int)out.size()) +
          " is missing but later shards exist; restore it or re-run tessera-preprocess");
  }
  return out;
}

}  // namespace tessera
