// verify.cpp: every dataset of every file of a checkpoint against its checksum and the layout.
#include "checkpoint/verify.hpp"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "checkpoint/checkpoint.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/hdf5_handle.hpp"
#include "core/paths.hpp"
#include "model/params.hpp"

namespace tessera {

namespace {

// Limits on what a file may make this reader walk or allocate (DESIGN.md: parsers are bounded).
constexpr hssize_t kMaxAttrElements = 4096;  // elements of one numeric attribute
constexpr size_t kMaxObjects = 1 << 20;      // links walked in one file
constexpr int kMaxDepth = 8;                 // group nesting
constexpr ssize_t kMaxName = 4096;           // one link name

const char* const kAbsent = "(absent)";

int64_t file_size(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

std::string join(const std::vector<int64_t>& v, const char* sep = ", ") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}
std::string shape_text(const std::vector<int64_t>& v) {
  return "[" + join(v) + "]";
}

// An attribute value for a message: one line, at most ~60 characters.
std::string shown(const std::string& v) {
  std::string s;
  for (char c : v) s += c == '\n' ? std::string("\\n") : std::string(1, c);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// The value most entries hold. On a tie for the most, `preferred` when it is one of them, else
// none (found false).
struct Consensus {
  bool found = false;
  bool by_preference = false;  // a tie, broken by `preferred`
  std::string value;
  int count = 0;
};
Consensus consensus(const std::vector<std::string>& values, const std::string& preferred = "") {
  std::map<std::string, int> counts;
  for (const std::string& v : values) ++counts[v];
  int best = 0;
  for (const auto& [v, n] : counts) best = std::max(best, n);
  std::vector<std::string> top;
  for (const auto& [v, n] : counts)
    if (n == best) top.push_back(v);
  Consensus c;
  c.count = best;
  if (top.size() == 1) {
    c.found = true;
    c.value = top[0];
  } else if (!preferred.empty() && std::count(top.begin(), top.end(), preferred)) {
    c.found = c.by_preference = true;
    c.value = preferred;
  }
  return c;
}

// One attribute as text: integers and floats as numbers (arrays space-separated), strings as they
// are; kAbsent when missing.
std::string attribute_text(hid_t obj, const char* name) {
  if (H5Aexists(obj, name) <= 0) return kAbsent;
  H5Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  H5Id type(H5Aget_type(attr.get()));
  H5Id space(H5Aget_space(attr.get()));
  if (!attr.valid() || !type.valid() || !space.valid()) return "(unreadable)";
  const H5T_class_t cls = H5Tget_class(type.get());
  if (cls == H5T_STRING) {
    std::string text;
    return h5_read_attr(obj, name, text) ? text : "(unreadable string)";
  }
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0 || n > kMaxAttrElements) return "(" + std::to_string(n) + " elements)";
  std::string s;
  if (cls == H5T_INTEGER) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    if (n > 0 && H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()) < 0) return "(unreadable)";
    return join(v, " ");
  }
  if (cls == H5T_FLOAT) {
    std::vector<double> v(static_cast<size_t>(n));
    if (n > 0 && H5Aread(attr.get(), H5T_NATIVE_DOUBLE, v.data()) < 0) return "(unreadable)";
    for (size_t i = 0; i < v.size(); ++i) {
      char b[32];
      std::snprintf(b, sizeof b, "%s%.17g", i ? " " : "", v[i]);
      s += b;
    }
    return s;
  }
  return "(HDF5 type class " + std::to_string(static_cast<int>(cls)) + ")";
}

// The datasets under `group` ("model/wte", "optimizer/exp_avg/wte", ...), depth first.
void list_datasets(hid_t group, const std::string& prefix, int depth, size_t& visited,
                   std::vector<std::string>& out, std::vector<std::string>& problems,
                   const std::string& file) {
  H5G_info_t info;
  if (H5Gget_info(group, &info) < 0) {
    problems.push_back(file + ": /" + prefix + ": group cannot be read (corrupt)");
    return;
  }
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    if (++visited > kMaxObjects) {
      problems.push_back(file + ": holds more than " + std::to_string(kMaxObjects) +
                         " objects; the rest are not checked");
      return;
    }
    const ssize_t len =
        H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (len <= 0 || len > kMaxName) {
      problems.push_back(file + ": /" + prefix + ": a link name cannot be read (corrupt)");
      continue;
    }
    std::string name(static_cast<size_t>(len) + 1, '\0');
    H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                       H5P_DEFAULT);
    name.resize(static_cast<size_t>(len));
    const std::string path = prefix.empty() ? name : prefix + "/" + name;
    H5Id obj(H5Oopen(group, name.c_str(), H5P_DEFAULT));
    if (!obj.valid()) {
      problems.push_back(file + ": /" + path + ": cannot be opened (dangling link or corrupt)");
      continue;
    }
    const H5I_type_t type = H5Iget_type(obj.get());
    if (type == H5I_DATASET) {
      out.push_back(path);
    } else if (type == H5I_GROUP) {
      if (depth >= kMaxDepth)
        problems.push_back(file + ": /" + path + ": groups nested deeper than " +
                           std::to_string(kMaxDepth) + "; not checked");
      else
        list_datasets(obj.get(), path, depth + 1, visited, out, problems, file);
    }
  }
}

struct ShardFile {
  int tp = 0, pp = 0;  // from its name
  std::string path;
  std::unique_ptr<H5Id> handle;
  std::map<std::string, std::string> attrs;  // root attributes as text
  bool attrs_agree = true;
};

// The iteration directory to check; "" when the --save directory's latest file points nowhere
// (reported as a problem).
std::string resolve(const std::string& dir, int64_t iteration, CheckpointVerifyReport& r) {
  if (!is_dir(dir))
    throw ConfigError("'" + dir +
                      "' is not a directory; pass a checkpoint directory (the --save directory "
                      "of a run, or one of its iter_NNNNNNN directories)");
  auto holds = [&] {
    const std::vector<int64_t> iters = checkpoint_iterations(dir);
    return iters.empty() ? std::string("it holds none") : "it holds iterations " + join(iters);
  };
  if (iteration >= 0) {
    const std::string sub = dir + "/" + iteration_dir_name(iteration);
    if (is_dir(sub)) return sub;
    if (parse_iteration_dir_name(dir) == iteration) return dir;
    throw ConfigError("'" + dir + "' has no checkpoint of iteration " + std::to_string(iteration) +
                      " (" + holds() + ")");
  }
  const std::string latest = dir + "/latest_checkpointed_iteration.txt";
  if (is_file(latest)) {
    const int64_t it = latest_checkpoint_iteration(dir);
    if (it < 0) {
      r.problems.push_back(latest + ": holds no iteration number (" + holds() +
                           "; check one with --iteration N)");
      return "";
    }
    const std::string sub = dir + "/" + iteration_dir_name(it);
    if (!is_dir(sub)) {
      r.problems.push_back(latest + ": points at iteration " + std::to_string(it) + " but " + sub +
                           " does not exist (" + holds() + ")");
      return "";
    }
    return sub;
  }
  if (parse_iteration_dir_name(dir) >= 0 || is_file(dir + "/" + shard_file_name(0, 0))) return dir;
  if (!checkpoint_iterations(dir).empty())
    throw ConfigError("'" + dir + "' has no latest_checkpointed_iteration.txt; choose the " +
                      "checkpoint to verify with --iteration N (" + holds() + ")");
  throw ConfigError("'" + dir +
                    "' holds no checkpoint (no latest_checkpointed_iteration.txt, no "
                    "iter_NNNNNNN directory, no shard files); pass the --save directory of a run");
}

// The shard files of an iteration directory, by (pp, tp).
std::vector<ShardFile> list_shard_files(const std::string& dir) {
  std::vector<ShardFile> files;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      int tp = -1, pp = -1;
      char tail = 0;
      if (std::sscanf(e->d_name, "mp_rank_%d_%d.h5%c", &tp, &pp, &tail) != 2 || tp < 0 || pp < 0 ||
          shard_file_name(tp, pp) != e->d_name)
        continue;
      ShardFile f;
      f.tp = tp;
      f.pp = pp;
      f.path = dir + "/" + e->d_name;
      files.push_back(std::move(f));
    }
    closedir(d);
  }
  std::sort(files.begin(), files.end(), [](const ShardFile& a, const ShardFile& b) {
    return std::make_pair(a.pp, a.tp) < std::make_pair(b.pp, b.tp);
  });
  return files;
}

// Compares the root attributes of the files (all but tp_rank and layers, checked per file).
// `authority` gives the value an attribute must have whatever the files say ("iteration": the
// directory's name); `preferred` breaks a tie ("tensor_model_parallel_size": the file names).
void compare_attributes(std::vector<ShardFile*>& files, const std::string& dir,
                        const std::map<std::string, std::string>& authority,
                        const std::map<std::string, std::string>& preferred,
                        std::vector<std::string>& problems) {
  std::set<std::string> names;
  for (const ShardFile* f : files)
    for (const auto& [name, value] : f->attrs) names.insert(name);
  for (const std::string& name : names) {
    if (name == "tp_rank" || name == "layers") continue;
    std::vector<std::string> values;
    for (const ShardFile* f : files) {
      auto it = f->attrs.find(name);
      values.push_back(it == f->attrs.end() ? kAbsent : it->second);
    }
    std::string expected, where;
    if (auto a = authority.find(name); a != authority.end()) {
      expected = a->second;
      where = "its directory is " + dir.substr(dir.rfind('/') + 1);
    } else {
      auto p = preferred.find(name);
      const Consensus c = consensus(values, p == preferred.end() ? "" : p->second);
      if (!c.found) {  // a tie: say what each file holds
        std::string line = dir + ": the files disagree on attribute " + name + ":";
        for (size_t i = 0; i < files.size(); ++i) {
          line += (i ? ", " : " ") + files[i]->path.substr(files[i]->path.rfind('/') + 1) +
                  " has " + shown(values[i]);
          files[i]->attrs_agree = false;
        }
        problems.push_back(line);
        continue;
      }
      expected = c.value;
      where = c.by_preference
                  ? "the file names say " + shown(c.value)
                  : "the other " + std::to_string(c.count) + " files have " + shown(c.value);
    }
    for (size_t i = 0; i < files.size(); ++i) {
      if (values[i] == expected) continue;
      files[i]->attrs_agree = false;
      problems.push_back(files[i]->path + ": attribute " + name + " is " + shown(values[i]) +
                         ", but " + where);
    }
  }
}

// Problems of one kind in one file: a line each, or for more than a few (a layout or model
// attribute damaged the same way in every file puts every tensor off) one line with their number
// and the first.
void report_each_or_count(const std::string& file, const std::string& what,
                          const std::vector<std::string>& items, size_t of,
                          std::vector<std::string>& problems) {
  if (items.size() <= 3) {
    for (const std::string& item : items) problems.push_back(file + ": " + item);
    return;
  }
  problems.push_back(file + ": " + std::to_string(items.size()) +
                     (of ? " of its " + std::to_string(of) : std::string()) + " tensors " + what +
                     " (damaged layout or model attributes?); the first: " + items[0]);
}

struct CopyOf {
  std::string file;
  uint64_t hash = 0;
};

// One slice's copies, by slice ("PATH [local] of [global] axis A offset O").
using SliceCopies = std::map<std::string, std::vector<CopyOf>>;

// The model every file must hold a shard of, from the attributes of a file that agrees with the
// rest (have_layout false when there is none).
struct ExpectedModel {
  bool have_layout = false;
  CheckpointMeta meta;
  int virtual_stages = 1;
};

// One file under check: what the layout puts in it, and its tensors that do not fit the layout.
struct FileCheck {
  const ShardFile* file = nullptr;
  hid_t h = -1;
  int64_t size_of_file = 0;
  std::map<std::string, ParamSpec> expected;  // group/name -> spec
  // State a file may hold beside them: FP8's per-layer scaling state, of its stage's layers.
  std::set<std::string> optional;  // FP8 state: (history + 1, fp8_columns) unsplit
  int64_t fp8_columns = 0;
  bool check_expected = false;
  std::vector<std::string> off_layout, unexpected;
};

// A dataset's extent and its layout attributes, as the file stores them.
struct StoredTensor {
  std::vector<int64_t> local, global;
  int64_t axis = -2, offset = -1, stored = 0;
  std::string dtype;
  std::vector<std::string> lacking;  // layout attributes it does not have
  bool has_layout = false;
};

// Opens every shard file and reads its root attributes; the files that opened.
std::vector<ShardFile*> open_shard_files(std::vector<ShardFile>& files, CheckpointVerifyReport& r) {
  std::vector<ShardFile*> opened;
  for (ShardFile& f : files) {
    if (H5Fis_hdf5(f.path.c_str()) > 0)
      f.handle = std::make_unique<H5Id>(H5Fopen(f.path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    if (!f.handle || !f.handle->valid()) {
      r.problems.push_back(f.path +
                           ": not an HDF5 file or cannot be opened (truncated or corrupt)");
      continue;
    }
    ++r.files;
    const hid_t h = f.handle->get();
    // The format's attributes by name: enumerating a damaged attribute table crashes libhdf5
    // 1.10 (H5Aiterate2, found by tests/fuzz/fuzz_checkpoint.cpp), looking one up does not.
    for (const std::string& name : checkpoint_file_attributes()) {
      const std::string value = attribute_text(h, name.c_str());
      if (value != kAbsent) f.attrs[name] = value;
    }
    const std::string rank = attribute_text(h, "tp_rank");
    if (rank != std::to_string(f.tp))
      r.problems.push_back(f.path + ": attribute tp_rank is " + shown(rank) +
                           ", but its name says tensor rank " + std::to_string(f.tp));
    opened.push_back(&f);
  }
  return opened;
}

// Sets the layout the files record and checks that every file it names is present, none outside
// it.
void check_layout_files(const std::vector<ShardFile>& files, const std::vector<ShardFile*>& opened,
                        int name_tp, int name_pp, CheckpointVerifyReport& r) {
  auto layout_value = [&](const char* name, int from_names) {
    std::vector<std::string> values;
    for (const ShardFile* f : opened) {
      auto it = f->attrs.find(name);
      values.push_back(it == f->attrs.end() ? kAbsent : it->second);
    }
    const Consensus c = consensus(values, std::to_string(from_names));
    const long v = c.found ? std::strtol(c.value.c_str(), nullptr, 10) : 0;
    return v >= 1 && v <= (1 << 16) ? static_cast<int>(v) : from_names;
  };
  r.tp_size = layout_value("tensor_model_parallel_size", name_tp);
  r.pp_size = layout_value("pipeline_model_parallel_size", name_pp);
  {
    const std::string layout =
        "TP " + std::to_string(r.tp_size) + " x PP " + std::to_string(r.pp_size);
    const int64_t want = int64_t(r.tp_size) * r.pp_size;
    const int64_t inside = std::count_if(files.begin(), files.end(), [&](const ShardFile& f) {
      return f.tp < r.tp_size && f.pp < r.pp_size;
    });
    std::vector<std::string> missing;  // named while the layout is small enough to walk
    for (int pp = 0; pp < r.pp_size && want <= (1 << 16); ++pp)
      for (int tp = 0; tp < r.tp_size; ++tp)
        if (std::none_of(files.begin(), files.end(),
                         [&](const ShardFile& f) { return f.tp == tp && f.pp == pp; }))
          missing.push_back(shard_file_name(tp, pp));
    if (want - inside > 0 && (missing.size() > 3 || missing.empty()))
      r.problems.push_back(r.dir + ": " + std::to_string(want - inside) + " of the " +
                           std::to_string(want) + " files of the layout " + layout +
                           " are missing" + (missing.empty() ? "" : ", the first " + missing[0]));
    else
      for (const std::string& name : missing)
        r.problems.push_back(r.dir + "/" + name + ": missing (the layout " + layout +
                             " has a file for every tensor rank and pipeline stage)");
  }
  for (const ShardFile& f : files)
    if (f.tp >= r.tp_size || f.pp >= r.pp_size)
      r.problems.push_back(f.path + ": lies outside the layout TP " + std::to_string(r.tp_size) +
                           " x PP " + std::to_string(r.pp_size) + " the files record");
}

// The model of the first file whose attributes agree with the rest (none when every file differs
// somewhere: the tensors are then checked against their own attributes and checksums only).
ExpectedModel read_expected_model(const std::vector<ShardFile*>& opened,
                                  CheckpointVerifyReport& r) {
  ExpectedModel m;
  for (ShardFile* f : opened) {
    if (!f->attrs_agree) continue;
    try {
      m.meta = read_checkpoint_meta(f->handle->get(), f->path);  // its errors name the file
      int64_t v = 1;
      h5_read_attr(f->handle->get(), "virtual_pipeline_model_parallel_size", v);
      if (v < 1 || v > (1 << 16))
        throw ConfigError("checkpoint file '" + f->path +
                          "' has virtual_pipeline_model_parallel_size " + std::to_string(v) +
                          ", outside 1..65536 (damaged?)");
      m.virtual_stages = static_cast<int>(v);
    } catch (const Error& e) {
      r.problems.push_back(e.what());
      break;
    }
    try {
      m.meta.model.validate();
      m.have_layout = true;
    } catch (const Error& e) {
      r.problems.push_back(f->path + ": the model its attributes record is invalid: " + e.what());
    }
    break;
  }
  return m;
}

// Fills fc.expected with what the layout puts in the file (group/name -> spec), when there is a
// model to lay out and the file lies inside the layout.
void layout_expected_tensors(FileCheck& fc, const ExpectedModel& m,
                             const std::vector<std::string>& datasets, CheckpointVerifyReport& r) {
  const ShardFile& f = *fc.file;
  if (!m.have_layout || f.tp >= r.tp_size || f.pp >= r.pp_size) return;
  try {
    PipelineSplitOptions split;  // the uneven split the files were saved at, if any
    split.layout = m.meta.pipeline_layout;
    const ModelShard shard =
        model_shard_for(m.meta.model, r.tp_size, f.tp, r.pp_size, f.pp, m.virtual_stages, split);
    std::vector<int64_t> layers;
    for (int l : shard.layers()) layers.push_back(l);
    const std::string have = attribute_text(fc.h, "layers");
    if (have != join(layers, " "))
      r.problems.push_back(f.path + ": attribute layers is " + shown(have) +
                           ", but the layout puts layers " + shown(join(layers, " ")) +
                           " on pipeline stage " + std::to_string(f.pp));
    // Each layer has tensors in the file: a model attribute claiming far more layers than
    // the file could hold is not expanded into a list of that many tensors.
    if (layers.size() > datasets.size())
      throw ConfigError("the layout puts " + std::to_string(layers.size()) +
                        " layers on its stage, but the file holds " +
                        std::to_string(datasets.size()) + " tensors");
    std::vector<std::string> groups{"model"};
    if (m.meta.has_optimizer)
      groups.insert(groups.end(), {"optimizer/exp_avg", "optimizer/exp_avg_sq"});
    for (const ParamSpec& s : build_param_specs(m.meta.model, shard))
      for (const std::string& g : groups) fc.expected[g + "/" + s.name] = s;
    for (int l : shard.layers()) fc.optional.insert("fp8/" + fp8_state_name(l));
    // The aux-loss-free router's expert bias of each MoE layer (group "router", E unsplit).
    const GPTConfig& mc = m.meta.model;
    if (mc.moe_router_enable_expert_bias)
      for (int l : shard.layers()) {
        if (!mc.is_moe_layer(l)) continue;
        ParamSpec s;
        s.name = expert_bias_name(l);
        s.global_shape = s.local_shape = {mc.num_experts};
        fc.expected[std::string(kRouterGroup) + "/" + s.name] = s;
      }
    fc.fp8_columns = fp8_state_columns(m.meta.model.num_experts);
  } catch (const Error& e) {
    r.problems.push_back(f.path + ": the model its attributes record cannot be laid out at " +
                         "TP " + std::to_string(r.tp_size) + " x PP " + std::to_string(r.pp_size) +
                         ": " + e.what());
  }
}

// Reads a dataset's layout attributes into t, reporting those it lacks and a dtype other than f32.
void read_tensor_attributes(hid_t ds, const std::string& where, StoredTensor& t,
                            std::vector<std::string>& problems) {
  if (!h5_read_attr(ds, "global_shape", t.global)) t.lacking.push_back("global_shape");
  if (!h5_read_attr(ds, "split_axis", t.axis)) t.lacking.push_back("split_axis");
  if (!h5_read_attr(ds, "split_offset", t.offset)) t.lacking.push_back("split_offset");
  if (!h5_read_attr(ds, "xxh64", t.stored)) t.lacking.push_back("xxh64");
  if (!h5_read_attr(ds, "dtype", t.dtype)) t.lacking.push_back("dtype");
  if (!t.lacking.empty()) {
    std::string names;
    for (const std::string& n : t.lacking) names += (names.empty() ? "" : ", ") + n;
    problems.push_back(where + "lacks its attribute" + (t.lacking.size() > 1 ? "s " : " ") + names);
  } else if (t.dtype != "f32") {
    problems.push_back(where + "attribute dtype is " + shown(t.dtype) + ", not f32");
  }
}

// Checks a dataset's extent and layout attributes against what the layout puts in the file, or,
// with no layout to check against, against each other.
void check_tensor_layout(FileCheck& fc, const std::string& path, const std::string& where,
                         const StoredTensor& t, std::vector<std::string>& problems) {
  const std::vector<int64_t>& local = t.local;
  const std::vector<int64_t>& global = t.global;
  const int64_t axis = t.axis, offset = t.offset;
  if (fc.check_expected) {
    auto e = fc.expected.find(path);
    if (fc.optional.count(path)) {  // unsplit (history + 1, fp8_columns)
      if (axis != -1 || local != global || local.size() != 2 || local[0] < 2 ||
          local[1] != fc.fp8_columns)
        fc.off_layout.push_back("/" + path + ": holds " + shape_text(local) + " of " +
                                shape_text(global) + " split on axis " + std::to_string(axis) +
                                ", not FP8 scaling state (history + 1, " +
                                std::to_string(fc.fp8_columns) + ") unsplit");
    } else if (e == fc.expected.end()) {
      fc.unexpected.push_back("/" + path + ": not part of this file's shard of the model");
    } else {
      const ParamSpec& s = e->second;
      const std::vector<int64_t> want_local(s.local_shape.begin(), s.local_shape.end()),
          want_global(s.global_shape.begin(), s.global_shape.end());
      if (local != want_local || global != want_global || axis != s.split_axis ||
          offset != s.split_offset)
        fc.off_layout.push_back("/" + path + ": holds " + shape_text(local) + " of " +
                                shape_text(global) + " split on axis " + std::to_string(axis) +
                                " at offset " + std::to_string(offset) + ", the layout puts " +
                                shape_text(want_local) + " of " + shape_text(want_global) +
                                " split on axis " + std::to_string(s.split_axis) + " at offset " +
                                std::to_string(s.split_offset) + " here");
      fc.expected.erase(e);
    }
  } else if (t.lacking.empty()) {
    bool fits = t.has_layout && axis < static_cast<int64_t>(local.size());
    for (size_t d = 0; fits && d < local.size(); ++d)
      fits = local[d] <= global[d] &&
             (static_cast<int64_t>(d) != axis || offset <= global[d] - local[d]);
    if (!fits)
      problems.push_back(where + "holds " + shape_text(local) + " at offset " +
                         std::to_string(offset) + " of " + shape_text(global) + " split on axis " +
                         std::to_string(axis) + ", which do not fit together");
  }
}

// Checks one dataset of a file: it opens, its extent fits the file, its attributes and layout,
// and its data against its checksum; a slice that passes is noted in `copies`.
void check_dataset(FileCheck& fc, const std::string& path, std::vector<float>& data,
                   SliceCopies& copies, CheckpointVerifyReport& r) {
  const ShardFile& f = *fc.file;
  const std::string where = f.path + ": /" + path + ": ";
  H5Id ds(H5Dopen2(fc.h, path.c_str(), H5P_DEFAULT));
  H5Id space(H5Dget_space(ds.get()));
  H5Id type(H5Dget_type(ds.get()));
  const int nd = space.valid() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (!ds.valid() || !type.valid() || nd < 0 || nd > H5S_MAX_RANK) {
    r.problems.push_back(where + "cannot be opened (corrupt)");
    return;
  }
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  StoredTensor t;
  t.local.assign(dims.begin(), dims.end());
  // The data is in the file, so its size bounds the extent (and what is allocated here).
  int64_t numel = 1;
  bool fits_file = true;
  for (int64_t d : t.local) {
    if (d != 0 && numel > fc.size_of_file / 4 / d) fits_file = false;
    numel *= fits_file ? d : 1;
  }
  if (!fits_file || numel * 4 > fc.size_of_file) {
    r.problems.push_back(where + "extent " + shape_text(t.local) + " is larger than the file " +
                         "(damaged)");
    return;
  }
  if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 4)
    r.problems.push_back(where + "is not stored as 32-bit floats (tensors are f32)");
  // The layout attributes, and the layout's own description of the tensor.
  read_tensor_attributes(ds.get(), where, t, r.problems);
  t.has_layout = t.global.size() == t.local.size() && t.axis >= -1 && t.offset >= 0;
  check_tensor_layout(fc, path, where, t, r.problems);
  // The data against its checksum.
  data.resize(static_cast<size_t>(numel));
  if (numel > 0 &&
      H5Dread(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) < 0) {
    r.problems.push_back(where + "data cannot be read (truncated or corrupt)");
    return;
  }
  const uint64_t hash = xxh64(data.data(), sizeof(float) * static_cast<size_t>(numel));
  ++r.tensors;
  r.bytes += numel * 4;
  if (std::find(t.lacking.begin(), t.lacking.end(), "xxh64") != t.lacking.end()) return;
  if (static_cast<uint64_t>(t.stored) != hash) {
    char line[160];
    std::snprintf(line, sizeof line,
                  "checksum mismatch: the data hashes to xxh64 %016" PRIx64
                  ", its attribute says %016" PRIx64 " (damaged data)",
                  hash, static_cast<uint64_t>(t.stored));
    r.problems.push_back(where + line);
    return;
  }
  if (t.has_layout)
    copies[path + " " + shape_text(t.local) + " of " + shape_text(t.global) + " axis " +
           std::to_string(t.axis) + " offset " + std::to_string(t.offset)]
        .push_back({f.path, hash});
}

// Reports a file's tensors off the layout, outside its shard, and missing from it.
void report_layout_problems(const FileCheck& fc, size_t datasets, CheckpointVerifyReport& r) {
  const ShardFile& f = *fc.file;
  std::vector<std::string> missing;
  for (const auto& [path, spec] : fc.expected)
    missing.push_back("/" + path + ": missing (the layout puts " +
                      shape_text({spec.local_shape.begin(), spec.local_shape.end()}) +
                      " of it here)");
  const std::string layout =
      "TP " + std::to_string(r.tp_size) + " x PP " + std::to_string(r.pp_size);
  report_each_or_count(f.path, "differ from what the layout " + layout + " puts there",
                       fc.off_layout, datasets, r.problems);
  report_each_or_count(f.path, "are not part of its shard of the model at " + layout, fc.unexpected,
                       datasets, r.problems);
  report_each_or_count(f.path, "that the layout " + layout + " puts there are missing", missing, 0,
                       r.problems);
}

// The progress line of a file checked: its tensors, bytes and problems.
void report_file_progress(const ShardFile& f, size_t fi, size_t nfiles, int64_t tensors_before,
                          int64_t bytes_before, const CheckpointVerifyReport& r,
                          const std::function<void(const std::string&)>& progress) {
  const size_t n = static_cast<size_t>(std::count_if(
      r.problems.begin(), r.problems.end(),
      [&](const std::string& p) { return p.compare(0, f.path.size() + 1, f.path + ":") == 0; }));
  char line[256];
  std::snprintf(line, sizeof line, "[%zu/%zu] %s: %lld tensors, %lld bytes, %s", fi + 1, nfiles,
                f.path.c_str(), (long long)(r.tensors - tensors_before),
                (long long)(r.bytes - bytes_before),
                n == 0 ? "ok" : (std::to_string(n) + (n == 1 ? " problem" : " problems")).c_str());
  progress(line);
}

// Checks every dataset of one opened file (the fi-th of nfiles) against its checksum and the
// layout.
void verify_shard_file(const ShardFile& f, size_t fi, size_t nfiles, const ExpectedModel& m,
                       std::vector<float>& data, SliceCopies& copies, CheckpointVerifyReport& r,
                       const std::function<void(const std::string&)>& progress) {
  const int64_t tensors_before = r.tensors, bytes_before = r.bytes;
  FileCheck fc;
  fc.file = &f;
  fc.h = f.handle->get();
  std::vector<std::string> datasets;
  size_t visited = 0;
  list_datasets(fc.h, "", 0, visited, datasets, r.problems, f.path);
  layout_expected_tensors(fc, m, datasets, r);
  fc.check_expected = !fc.expected.empty();
  fc.size_of_file = file_size(f.path);
  for (const std::string& path : datasets) check_dataset(fc, path, data, copies, r);
  report_layout_problems(fc, datasets.size(), r);
  if (progress) report_file_progress(f, fi, nfiles, tensors_before, bytes_before, r, progress);
}

// Copies of one slice (replicated tensors in every TP rank's file, the tied embedding on the
// first and last stages) hold the same data.
void compare_copies(const SliceCopies& copies, CheckpointVerifyReport& r) {
  for (const auto& [slice, list] : copies) {
    if (list.size() < 2) continue;
    std::vector<std::string> hashes;
    for (const CopyOf& c : list) hashes.push_back(std::to_string(c.hash));
    const std::string path = slice.substr(0, slice.find(' '));
    const Consensus c = consensus(hashes);
    if (c.found && c.count == static_cast<int>(list.size())) continue;
    if (!c.found) {
      std::string line =
          r.dir + ": /" + path + ": its copies differ (each matches its own " + "checksum):";
      for (size_t i = 0; i < list.size(); ++i) {
        char b[40];
        std::snprintf(b, sizeof b, " xxh64 %016" PRIx64, list[i].hash);
        line += (i ? ", " : " ") + list[i].file.substr(list[i].file.rfind('/') + 1) + b;
      }
      r.problems.push_back(line);
      continue;
    }
    for (size_t i = 0; i < list.size(); ++i)
      if (hashes[i] != c.value)
        r.problems.push_back(list[i].file + ": /" + path + ": differs from its copy in the other " +
                             std::to_string(c.count) +
                             " files, though it matches its own checksum");
  }
}

}  // namespace

CheckpointVerifyReport verify_checkpoint(const std::string& dir, int64_t iteration,
                                         const std::function<void(const std::string&)>& progress) {
  CheckpointVerifyReport r;
  r.dir = resolve(dir, iteration, r);
  if (r.dir.empty()) return r;
  r.iteration = parse_iteration_dir_name(r.dir);
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  silence_hdf5_errors();

  std::vector<ShardFile> files = list_shard_files(r.dir);
  if (files.empty()) {
    r.problems.push_back(r.dir + ": holds no shard files (mp_rank_TT_PPP.h5)");
    return r;
  }
  int name_tp = 0, name_pp = 0;
  for (const ShardFile& f : files) {
    name_tp = std::max(name_tp, f.tp + 1);
    name_pp = std::max(name_pp, f.pp + 1);
  }

  // ---- open every file and compare their attributes ----
  std::vector<ShardFile*> opened = open_shard_files(files, r);
  if (opened.empty()) return r;
  std::map<std::string, std::string> authority, preferred;
  if (r.iteration >= 0) authority["iteration"] = std::to_string(r.iteration);
  preferred["tensor_model_parallel_size"] = std::to_string(name_tp);
  preferred["pipeline_model_parallel_size"] = std::to_string(name_pp);
  compare_attributes(opened, r.dir, authority, preferred, r.problems);

  // ---- the layout: every file it names is present, none outside it ----
  check_layout_files(files, opened, name_tp, name_pp, r);

  // ---- the tensors each file must hold ----
  const ExpectedModel model = read_expected_model(opened, r);

  // ---- every dataset of every file ----
  std::vector<float> data;
  SliceCopies copies;
  for (size_t fi = 0; fi < files.size(); ++fi) {
    const ShardFile& f = files[fi];
    if (!f.handle || !f.handle->valid()) continue;
    verify_shard_file(f, fi, files.size(), model, data, copies, r, progress);
  }

  // ---- copies of one slice hold the same data ----
  compare_copies(copies, r);
  return r;
}

bool checkpoint_damaged(const std::string& dir) {
  const std::string latest = dir + "/latest_checkpointed_iteration.txt";
  std::error_code ec;
  if (std::filesystem::is_regular_file(latest, ec)) {
    std::ifstream in(latest);
    int64_t it = -1;
    if (!(in >> it) || it < 0) return true;
    if (!std::filesystem::is_directory(dir + "/" + iteration_dir_name(it), ec)) return true;
  }
  try {
    return !verify_checkpoint(dir).clean();
  } catch (const ConfigError&) {
    return true;
  }
}

std::string checkpoint_iterations_text(const std::vector<int64_t>& its) {
  std::string out;
  for (int64_t i : its) out += (out.empty() ? "" : ", ") + std::to_string(i);
  return out.empty() ? "none" : out;
}

}  // namespace tessera
