// megatron_import.cpp: reading a Megatron-LM .bin/.idx pair and writing its documents as shards.
#include "data/megatron_import.hpp"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "core/error.hpp"
#include "core/timer.hpp"

namespace tessera {

namespace {
constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

struct DTypeInfo {
  const char* name;
  int size;
  bool integer;
};
// Megatron's DType codes 1..8.
const DTypeInfo kDTypes[9] = {{"?", 0, false},       {"uint8", 1, true},    {"int8", 1, true},
                              {"int16", 2, true},    {"int32", 4, true},    {"int64", 8, true},
                              {"float64", 8, false}, {"float32", 4, false}, {"uint16", 2, true}};

template <typename T>
T get(const std::vector<char>& b, size_t& at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

int64_t token_at(const char* p, int code) {
  switch (code) {
    case 1:
      return *reinterpret_cast<const uint8_t*>(p);
    case 2:
      return *reinterpret_cast<const int8_t*>(p);
    case 3: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case 4: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case 5: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    default: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }  // 8: uint16
  }
}
}  // namespace

PreprocessResult import_megatron_dataset(
    const std::string& prefix, const std::string& output_prefix, int64_t shard_tokens,
    const Tokenizer& tok, const std::function<void(const std::string&, bool final)>& progress,
    bool tty) {
  using detail::concat;
  Timer clock;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  std::ifstream idx_in(idx_path, std::ios::binary);
  if (!idx_in)
    throw ConfigError("--input '" + prefix + "': '" + idx_path +
                      "' cannot be opened (give the dataset's prefix, without .bin/.idx)");
  const std::vector<char> idx((std::istreambuf_iterator<char>(idx_in)),
                              std::istreambuf_iterator<char>());
  const size_t header = 9 + 8 + 1 + 8 + 8;
  if (idx.size() < 9 || std::memcmp(idx.data(), kMagic, 9) != 0)
    throw ConfigError("'" + idx_path +
                      "' is not a Megatron-LM indexed dataset index (its first bytes are not "
                      "MMIDIDX)");
  if (idx.size() < header)
    throw ConfigError(concat("'", idx_path, "' is truncated: ", idx.size(),
                             " bytes, shorter than its ", header, "-byte header"));
  size_t at = 9;
  const uint64_t version = get<uint64_t>(idx, at);
  if (version != 1)
    throw ConfigError(concat("'", idx_path, "' has index version ", version,
                             "; only version 1 (MMapIndexedDataset) is supported"));
  const int code = get<uint8_t>(idx, at);
  if (code < 1 || code > 8)
    throw ConfigError(concat("'", idx_path, "' has dtype code ", code, " (allowed: 1 to 8)"));
  if (!kDTypes[code].integer)
    throw ConfigError(
        concat("'", idx_path, "' holds ", kDTypes[code].name, " values, not token ids"));
  const int item = kDTypes[code].size;
  const uint64_t S = get<uint64_t>(idx, at), D = get<uint64_t>(idx, at);
  const uint64_t need = header + S * 4 + S * 8 + D * 8;
  if (S > idx.size() || D > idx.size() || (idx.size() != need && idx.size() != need + S))
    throw ConfigError(concat("'", idx_path, "' has ", idx.size(), " bytes; its header (", S,
                             " sequences, ", D, " document-index entries) needs ", need));
  std::vector<int32_t> lengths(S);
  std::vector<int64_t> pointers(S), docs(D);
  std::memcpy(lengths.data(), idx.data() + at, S * 4);
  at += S * 4;
  std::memcpy(pointers.data(), idx.data() + at, S * 8);
  at += S * 8;
  std::memcpy(docs.data(), idx.data() + at, D * 8);
  if (D < 2 || docs.front() != 0 || docs.back() != static_cast<int64_t>(S))
    throw ConfigError(concat("'", idx_path, "': its document index must run from 0 to the ", S,
                             " sequences (it has ", D, " entries",
                             D ? concat(", from ", docs.front(), " to ", docs.back()) : "", ")"));
  for (uint64_t d = 1; d < D; ++d)
    if (docs[d] < docs[d - 1])
      throw ConfigError(concat("'", idx_path, "': its document index decreases at entry ", d));
  struct stat st;
  if (stat(bin_path.c_str(), &st) != 0)
    throw ConfigError("'" + bin_path + "' cannot be opened (the data beside '" + idx_path + "')");
  const int64_t bin_size = st.st_size;
  for (uint64_t s = 0; s < S; ++s)
    if (lengths[s] < 0 || pointers[s] < 0 ||
        pointers[s] + static_cast<int64_t>(lengths[s]) * item > bin_size)
      throw ConfigError(concat("'", bin_path, "' has ", bin_size, " bytes; its index '", idx_path,
                               "' says sequence ", s, " lies at bytes ", pointers[s], " to ",
                               pointers[s] + static_cast<int64_t>(lengths[s]) * item,
                               " (a truncated or mismatched .bin)"));
  std::ifstream bin(bin_path, std::ios::binary);
  if (!bin) throw ConfigError("'" + bin_path + "' cannot be opened");

  ShardMeta meta;
  meta.vocab_size = tok.vocab_size();
  meta.eod_id = tok.eod_id();
  meta.tokenizer = tok.name();
  ShardWriter out(output_prefix, shard_tokens, meta);
  PreprocessResult res;
  Timer since_report;
  auto report = [&](bool final) {
    if (!progress) return;
    const double secs = std::max(clock.seconds(), 1e-9);
    char line[256];
    std::snprintf(line, sizeof line,
                  "%s%lld of %llu documents (%.0f%%), %lld tokens (%.0f tokens/s), %zu shard%s",
                  final ? "done: " : "", (long long)res.documents,
                  static_cast<unsigned long long>(D - 1), 100.0 * res.documents / (D - 1),
                  (long long)res.tokens, res.tokens / secs, out.shards(),
                  out.shards() == 1 ? "" : "s");
    progress(line, final);
  };
  std::vector<char> raw;
  std::vector<uint32_t> doc;
  for (uint64_t d = 0; d + 1 < D; ++d) {
    doc.clear();
    for (int64_t s = docs[d]; s < docs[d + 1]; ++s) {
      raw.resize(static_cast<size_t>(lengths[s]) * item);
      bin.seekg(pointers[s]);
      bin.read(raw.data(), static_cast<std::streamsize>(raw.size()));
      if (!bin)
        throw Error("cannot read '" + bin_path + "' at byte " + std::to_string(pointers[s]));
      for (int32_t t = 0; t < lengths[s]; ++t) {
        const int64_t id = token_at(raw.data() + static_cast<size_t>(t) * item, code);
        if (id < 0 || id >= tok.vocab_size())
          throw ConfigError(concat("'", bin_path, "': document ", d, " (sequence ", s, ", token ",
                                   t, ") has id ", id, ", outside the vocabulary of ",
                                   tok.vocab_size(), " tokens of ", tok.name(),
                                   "; give the tokenizer the data was made with"));
        doc.push_back(static_cast<uint32_t>(id));
      }
    }
    out.add(doc.data(), doc.size());
    ++res.documents;
    res.tokens += static_cast<int64_t>(doc.size());
    res.bytes += static_cast<int64_t>(doc.size()) * item;
    if ((tty && since_report.seconds() >= 0.2) || since_report.seconds() >= 5) {
      report(false);
      since_report.reset();
    }
  }
  res.shards = out.commit();
  res.seconds = clock.seconds();
  report(true);
  return res;
}

}  // namespace tessera
