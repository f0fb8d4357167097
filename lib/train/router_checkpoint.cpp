// router_checkpoint.cpp: the MoE router's expert bias in checkpoints (train/router_checkpoint.hpp).
#include "train/router_checkpoint.hpp"

#include "model/parts.hpp"

namespace tessera {

std::vector<ExtraTensor> router_checkpoint_tensors(const GPTModel& model) {
  std::vector<ExtraTensor> out;
  const GPTConfig& c = model.config();
  if (!c.moe_router_enable_expert_bias) return out;
  for (int l : model.shard().layers()) {
    if (!c.is_moe_layer(l)) continue;
    ExtraTensor e;
    e.group = kRouterGroup;
    e.spec.name = expert_bias_name(l);
    e.spec.global_shape = e.spec.local_shape = {c.num_experts};
    e.data = model.mlp_part(l).router()->expert_bias();
    out.push_back(std::move(e));
  }
  return out;
}

std::string restore_router_state(const CheckpointReader& r, GPTModel& model) {
  const GPTConfig& c = model.config();
  if (!c.moe_router_enable_expert_bias) return std::string();
  std::vector<int> layers;
  for (int l : model.shard().layers())
    if (c.is_moe_layer(l)) layers.push_back(l);
  if (layers.empty()) return std::string();
  int found = 0;
  for (int l : layers) found += r.whole_numel(kRouterGroup, expert_bias_name(l)) >= 0;
  if (found == 0)
    return "checkpoint " + r.path() +
           " holds no expert bias (saved without --moe-router-enable-expert-bias): the biases "
           "start at zero";
  std::vector<float> b(static_cast<size_t>(c.num_experts));
  for (int l : layers) {
    const std::string name = expert_bias_name(l);
    if (r.whole_numel(kRouterGroup, name) != c.num_experts)
      throw ConfigError("checkpoint " + r.path() + " lacks " + kRouterGroup + "/" + name +
                        " (or holds it for another expert count) while other layers have theirs "
                        "(damaged); use another checkpoint");
    r.read_whole(kRouterGroup, name, b.data());
    model.mlp_part(l).router()->set_expert_bias(b.data());
  }
  return std::string();
}

}  // namespace tessera
