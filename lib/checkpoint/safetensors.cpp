// safetensors.cpp: streaming writer and mmap reader of the safetensors format.
#include "checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/json.hpp"

namespace tessera {

namespace {
std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}
}  // namespace

SafetensorsWriter::SafetensorsWriter(const std::string& path,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), metadata_(metadata) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (f_) {
    std::fclose(f_);
    std::remove((path_ + ".tmp").c_str());
  }
}

size_t safetensors_width(const std::string& dtype) {
  return dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
}

void SafetensorsWriter::declare(const std::string& name, const Shape& shape,
                                const std::string& dtype) {
  TESSERA_CHECK(!header_done_, "declare after the first write");
  TESSERA_CHECK(safetensors_width(dtype) > 0, "safetensors dtype ", dtype, " is not F32/BF16/F16");
  tensors_.push_back({name, shape, dtype});
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t n = 0;
  for (const Declared& t : tensors_)
    n += safetensors_width(t.dtype) * static_cast<uint64_t>(shape_numel(t.shape));
  return n;
}

void SafetensorsWriter::write_header() {
  std::ostringstream h;
  h << "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata_) {
    h << (first ? "" : ",") << "\"" << json_escape(k) << "\":\"" << json_escape(v) << "\"";
    first = false;
  }
  h << "}";
  uint64_t off = 0;
  for (const auto& [name, shape, dtype] : tensors_) {
    const uint64_t bytes = safetensors_width(dtype) * static_cast<uint64_t>(shape_numel(shape));
    h << ",\"" << json_escape(name) << "\":{\"dtype\":\"" << dtype << "\",\"shape\":[";
    for (size_t i = 0; i < shape.size(); ++i) h << (i ? "," : "") << shape[i];
    h << "],\"data_offsets\":[" << off << "," << off + bytes << "]}";
    off += bytes;
  }
  h << "}";
  std::string header = h.str();
  while (header.size() % 8) header += ' ';
  f_ = std::fopen((path_ + ".tmp").c_str(), "wb");
  if (!f_) throw Error("cannot create '" + path_ + ".tmp'; check the directory is writable");
  unsigned char len[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  if (std::fwrite(len, 1, 8, f_) != 8 ||
      std::fwrite(header.data(), 1, header.size(), f_) != header.size())
    throw Error("writing '" + path_ + ".tmp' failed (disk full?)");
  header_done_ = true;
}

void SafetensorsWriter::write(const std::string& name, const float* data) {
  if (!header_done_) write_header();
  TESSERA_CHECK(next_ < tensors_.size() && tensors_[next_].name == name, "safetensors tensor ",
                name, " written out of declaration order");
  const Declared& t = tensors_[next_];
  const size_t n = static_cast<size_t>(shape_numel(t.shape));
  bool ok = true;
  if (t.dtype == "F32") {
    ok = std::fwrite(data, sizeof(float), n, f_) == n;
  } else {
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; ++i)
      h[i] = t.dtype == "BF16" ? f32_to_bf16(data[i]) : f32_to_f16(data[i]);
    ok = std::fwrite(h.data(), sizeof(uint16_t), n, f_) == n;  // little-endian hosts
  }
  if (!ok) throw Error("writing '" + path_ + ".tmp' failed (disk full?)");
  ++next_;
}

void SafetensorsWriter::finish() {
  if (!header_done_) write_header();
  TESSERA_CHECK(next_ == tensors_.size(), "safetensors: ", tensors_.size() - next_,
                " tensors not written");
  const bool ok = std::fflush(f_) == 0 && fsync(fileno(f_)) == 0;
  std::fclose(f_);
  f_ = nullptr;
  if (!ok) throw Error("writing '" + path_ + ".tmp' failed (disk full?)");
  if (std::rename((path_ + ".tmp").c_str(), path_.c_str()) != 0)
    throw Error("cannot rename '" + path_ + ".tmp' to '" + path_ + "'");
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw ConfigError("'" + path + "' cannot be opened; check the path");
  struct stat st;
  fstat(fd, &st);
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    throw ConfigError("'" + path + "' is too short to be a safetensors file (truncated?)");
  }
  void* m = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) throw ConfigError("'" + path + "' cannot be mapped");
  map_ = static_cast<const unsigned char*>(m);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(map_[i]) << (8 * i);
  if (n > size_ - 8)
    throw ConfigError("'" + path + "': header length " + std::to_string(n) +
                      " exceeds the file (truncated?)");
  data_start_ = 8 + n;
  const std::string_view header(reinterpret_cast<const char*>(map_ + 8), n);
  try {
    JsonReader r(header);
    r.object([&](const std::string& key) {
      if (key == "__metadata__") {
        r.skip_value();
        return;
      }
      SafetensorsEntry e;
      std::vector<int64_t> offs;
      r.object([&](const std::string& field) {
        if (field == "dtype")
          e.dtype = r.string_value();
        else if (field == "shape")
          r.array([&] { e.shape.push_back(r.int_value()); });
        else if (field == "data_offsets")
          r.array([&] { offs.push_back(r.int_value()); });
        else
          r.skip_value();
      });
      if (offs.size() != 2 || offs[0] < 0 || offs[1] < offs[0])
        throw JsonError{"tensor " + key + " has bad data_offsets"};
      e.begin = static_cast<uint64_t>(offs[0]);
      e.end = static_cast<uint64_t>(offs[1]);
      entries_[key] = e;
    });
    r.expect_end();
  } catch (const JsonError& e) {
    throw ConfigError("'" + path + "': the safetensors header does not parse: " + e.message);
  }
  for (const auto& [name, e] : entries_) {
    const size_t width = safetensors_width(e.dtype);
    if (!width)
      throw ConfigError("'" + path + "': tensor " + name + " has dtype " + e.dtype +
                        " (supported: F32, F16, BF16)");
    if (e.end - e.begin != width * static_cast<uint64_t>(shape_numel(e.shape)) ||
        data_start_ + e.end > size_)
      throw ConfigError("'" + path + "': tensor " + name +
                        " does not fit its shape or the file (truncated?)");
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (map_) munmap(const_cast<unsigned char*>(map_), size_);
}

std::vector<float> SafetensorsReader::read(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw ConfigError("'" + path_ + "' has no tensor " + name);
  const SafetensorsEntry& e = it->second;
  const unsigned char* p = map_ + data_start_ + e.begin;
  const size_t n = static_cast<size_t>(shape_numel(e.shape));
  std::vector<float> out(n);
  if (e.dtype == "F32") {
    std::memcpy(out.data(), p, 4 * n);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
      out[i] = e.dtype == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
  return out;
}

std::string SafetensorsReader::raw(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw ConfigError("'" + path_ + "' has no tensor " + name);
  const SafetensorsEntry& e = it->second;
  return std::string(reinterpret_cast<const char*>(map_ + data_start_ + e.begin), e.end - e.begin);
}

SafetensorsDir::SafetensorsDir(const std::string& dir) {
  const std::string index = dir + "/model.safetensors.index.json";
  std::ifstream in(index);
  if (!in) {  // one file
    files_.push_back(std::make_unique<SafetensorsReader>(dir + "/model.safetensors"));
    for (const auto& [name, e] : files_[0]->entries()) where_[name] = 0;
    return;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::map<std::string, std::string> weight_map;
  try {
    JsonReader r(text);
    bool found = false;
    r.object([&](const std::string& k) {
      if (k != "weight_map") {
        r.skip_value();
        return;
      }
      found = true;
      r.object([&](const std::string& tensor) { weight_map[tensor] = r.string_value(); });
    });
    r.expect_end();
    if (!found) throw JsonError{"no \"weight_map\" member"};
  } catch (const JsonError& e) {
    throw ConfigError("'" + index + "' does not parse: " + e.message);
  }
  std::map<std::string, size_t> file_index;
  for (const auto& [tensor, file] : weight_map) {
    if (file.find('/') != std::string::npos)
      throw ConfigError("'" + index + "' maps " + tensor + " to '" + file +
                        "', outside the directory");
    auto it = file_index.find(file);
    if (it == file_index.end()) {
      files_.push_back(std::make_unique<SafetensorsReader>(dir + "/" + file));
      it = file_index.emplace(file, files_.size() - 1).first;
    }
    if (!files_[it->second]->has(tensor))
      throw ConfigError("'" + index + "' maps " + tensor + " to '" + file +
                        "', which has no such tensor");
    where_[tensor] = it->second;
  }
}

const SafetensorsReader& SafetensorsDir::reader(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    throw ConfigError("the Hugging Face model in '" +
                      files_[0]->path().substr(0, files_[0]->path().rfind('/')) +
                      "' has no tensor " + name);
  return *files_[it->second];
}

std::vector<std::string> SafetensorsDir::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

const SafetensorsEntry& SafetensorsDir::entry(const std::string& name) const {
  return reader(name).entries().at(name);
}

std::vector<float> SafetensorsDir::read(const std::string& name) const {
  std::vector<float> v = reader(name).read(name);
  // A NaN or infinite weight trains nothing but NaN losses, which would then blame the learning
  // rate: the import stops here, naming the tensor.
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw ConfigError("'" + file_of(name) + "': tensor \"" + name + "\" holds " +
                        (std::isnan(v[i]) ? "NaN" : "an infinity") + " at element " +
                        std::to_string(i) +
                        " (damaged or not a trained checkpoint); fix or re-download the weights");
  return v;
}

const std::string& SafetensorsDir::file_of(const std::string& name) const {
  return reader(name).path();
}

}  // namespace tessera
