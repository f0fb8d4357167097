// fp8_checkpoint.cpp: FP8's delayed-scaling state in checkpoints (train/fp8_checkpoint.hpp).
#include "train/fp8_checkpoint.hpp"

#include <map>
#include <utility>

#include "core/ini.hpp"

namespace tessera {

namespace {

bool delayed(GPTModel& model) {
  return model.fp8() && model.fp8()->config().recipe == Fp8Recipe::Delayed &&
         model.fp8()->tensors() > 0;
}

}  // namespace

std::vector<ExtraTensor> fp8_checkpoint_tensors(GPTModel& model, Backend& be) {
  std::vector<ExtraTensor> out;
  if (!delayed(model)) return out;
  Fp8Scaling& f = *model.fp8();
  const int64_t n = f.tensors(), H = f.history().numel() / n, cols = f.per_layer();
  std::vector<float> history(static_cast<size_t>(H * n)), scales(static_cast<size_t>(n));
  be.copy_to_host(history.data(), f.history());
  be.copy_to_host(scales.data(), f.scales());
  const std::vector<int> layers = model.shard().layers();
  for (size_t li = 0; li < layers.size(); ++li) {
    ExtraTensor e;
    e.group = "fp8";
    e.spec.name = fp8_state_name(layers[li]);
    e.spec.global_shape = e.spec.local_shape = {H + 1, cols};
    for (int64_t h = 0; h <= H; ++h)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t i = int64_t(li) * cols + j;
        e.data.push_back(h < H ? history[size_t(h * n + i)] : scales[size_t(i)]);
      }
    out.push_back(std::move(e));
  }
  return out;
}

std::string restore_fp8_state(const CheckpointReader& r, GPTModel& model, Backend& be) {
  const std::vector<int> layers = model.shard().layers();
  const int L = model.config().num_layers;
  int64_t stored = -1;  // the first layer's stored tensor (any layer, for a run without FP8)
  if (delayed(model)) {
    for (int l : layers)
      if ((stored = r.whole_numel("fp8", fp8_state_name(l))) >= 0) break;
  } else {
    for (int l = 0; l < L && stored < 0; ++l) stored = r.whole_numel("fp8", fp8_state_name(l));
  }
  if (!delayed(model))
    return stored < 0 ? std::string()
                      : "checkpoint " + r.path() +
                            " holds FP8 delayed-scaling state; this run does not use it (" +
                            (model.fp8() ? "--fp8-recipe tensorwise" : "no --fp8-format") + ")";
  Fp8Scaling& f = *model.fp8();
  const int64_t n = f.tensors(), H = f.history().numel() / n, cols = f.per_layer();
  if (stored < 0)
    return "checkpoint " + r.path() +
           " holds no FP8 delayed-scaling state (saved without --fp8-format, or tensorwise): "
           "the amax histories start empty and the scales at 1";
  if (stored != (H + 1) * cols)
    return "checkpoint " + r.path() + " holds an amax history of " +
           std::to_string(stored / cols - 1) + " steps, this run's --fp8-amax-history-len is " +
           std::to_string(H) + ": the amax histories start empty and the scales at 1";
  // The scales belong to the saved run's formats, margin and amax algorithm (its options, saved
  // with the checkpoint): under others the state starts afresh, said (older checkpoints' options
  // may lack a key: not compared).
  const std::map<std::string, std::string> saved = ini_values(r.meta().config_text);
  const Fp8Config& c = f.config();
  const std::pair<const char*, std::string> now[] = {
      {"fp8-format", c.hybrid ? "hybrid" : "e4m3"},
      {"fp8-amax-compute-algo", c.amax_most_recent ? "most_recent" : "max"},
      {"fp8-margin", std::to_string(c.margin)}};
  for (const auto& [key, mine] : now)
    if (const auto it = saved.find(key); it != saved.end() && it->second != mine)
      return "checkpoint " + r.path() + " holds FP8 scales for --" + key + " " + it->second +
             ", this run has " + mine +
             ": the amax histories start empty and the scales at 1 (resume with --" + key + " " +
             it->second + " to keep them)";
  std::vector<float> history(static_cast<size_t>(H * n)), scales(static_cast<size_t>(n));
  std::vector<float> t(static_cast<size_t>(stored));
  for (size_t li = 0; li < layers.size(); ++li) {
    const std::string name = fp8_state_name(layers[li]);
    if (r.whole_numel("fp8", name) != stored)
      throw ConfigError("checkpoint " + r.path() + " lacks fp8/" + name +
                        " (or holds it in another shape) while other layers have theirs "
                        "(damaged); use another checkpoint");
    r.read_whole("fp8", name, t.data());
    for (int64_t h = 0; h <= H; ++h)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t i = int64_t(li) * cols + j;
        (h < H ? history[size_t(h * n + i)] : scales[size_t(i)]) = t[size_t(h * cols + j)];
      }
  }
  be.copy_from_host(f.history(), history.data());
  be.copy_from_host(f.scales(), scales.data());
  return std::string();
}

}  // namespace tessera
