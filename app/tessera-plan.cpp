// tessera-plan: which layout to use (issue 57, docs/planning.md). Takes tessera-train's model and
// batch options (--config, --seq-length, --global-batch-size, --bf16, FP8 ...) or a Hugging Face
// model's config.json (--hf-config DIR), the GPUs of the
// run (--world-size) and the cluster (--cluster), enumerates every layout that fits the GPU's
// memory, predicts each one's step and prints the fastest with their breakdowns and the
// tessera-train and sbatch lines that run them. Runs on a login node: no MPI, CUDA or NCCL.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/hf_llama.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "options/options.hpp"
#include "plan/planner.hpp"

using namespace tessera;

namespace {

// `w` as one shell word (single-quoted when it holds anything but safe characters).
std::string shell_word(const std::string& w) {
  const bool safe = !w.empty() && w.find_first_not_of(
                                      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP"
                                      "QRSTUVWXYZ0123456789-_=./:,+@") == std::string::npos;
  if (safe) return w;
  std::string q = "'";
  for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// --hf-config DIR: the options config.json settles for the run where the command line does not
// (appended to it), each also said in `assumed`: the sequence length (rope_scaling's
// original_max_position_embeddings: the length it was trained at; a max_position_embeddings alone
// is what the model takes, not a training length: --seq-length is then required) and the
// precision (torch_dtype, or dtype).
std::vector<std::string> hf_run_options(int argc, char** argv, std::vector<std::string>& assumed) {
  std::string dir;
  bool seq = false, precision = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string key = a.substr(0, a.find('='));
    if (key == "--hf-config")
      dir = a.find('=') != std::string::npos ? a.substr(11) : (i + 1 < argc ? argv[i + 1] : "");
    seq = seq || key == "--seq-length";
    precision = precision || key == "--bf16" || key == "--fp16";
  }
  std::vector<std::string> out;
  if (dir.empty()) return out;
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) return out;  // named below, with the directory
  std::stringstream text;
  text << in.rdbuf();
  JsonValue root;
  try {
    const std::string t = text.str();
    root = JsonReader(t).value();
  } catch (const JsonError& e) {
    throw ConfigError("'" + path + "': " + e.message);
  }
  auto number = [](const JsonValue* v) { return v && v->type == JsonValue::Type::Number; };
  if (seq) {
    assumed.push_back("the sequence length of --seq-length");
  } else {
    const JsonValue* rs = root.find("rope_scaling");
    const JsonValue* orig = rs ? rs->find("original_max_position_embeddings") : nullptr;
    if (!number(orig)) {
      const JsonValue* mp = root.find("max_position_embeddings");
      throw ConfigError("--hf-config " + dir + ": give --seq-length (" + path + " has no " +
                        "rope_scaling.original_max_position_embeddings" +
                        (number(mp) ? "; its max_position_embeddings " +
                                          std::to_string(static_cast<long long>(mp->number)) +
                                          " is the longest the model takes, not a training length"
                                    : std::string()) +
                        ")");
    }
    const std::string n = std::to_string(static_cast<long long>(orig->number));
    out.insert(out.end(), {"--seq-length", n});
    assumed.push_back("sequence " + n + " (rope_scaling.original_max_position_embeddings; " +
                      "--seq-length changes it)");
  }
  if (precision) {
    assumed.push_back("the precision of --bf16/--fp16");
  } else {
    const JsonValue* d = root.find("torch_dtype");
    if (!d || d->type != JsonValue::Type::String) d = root.find("dtype");
    const std::string dt = d && d->type == JsonValue::Type::String ? d->string : "";
    if (dt == "bfloat16") out.push_back("--bf16");
    if (dt == "float16") out.push_back("--fp16");
    assumed.push_back(dt == "bfloat16" || dt == "float16"
                          ? dt + " (config.json's " +
                                (root.find("torch_dtype") ? "torch_dtype" : "dtype") + ")"
                          : "float32 (config.json states " + (dt.empty() ? "no dtype" : dt) +
                                "; --bf16 plans in bf16)");
  }
  assumed.push_back("Hugging Face's defaults for what config.json leaves out");
  return out;
}

const char* recompute_name(RecomputeGranularity g) {
  return g == RecomputeGranularity::Full        ? "full"
         : g == RecomputeGranularity::Selective ? "selective"
                                                : "none";
}

}  // namespace

int main(int argc, char** argv) {
  int top = 10;
  std::string config, hf_dir;
  try {
    RunOptions o;
    RunOptionsProgram program;
    program.name = "tessera-plan";
    program.usage =
        "(--config FILE | --hf-config DIR) --world-size GPUS --cluster "
        "dgx-a100|dgx-h100|dgx-h200|FILE --global-batch-size G [--seq-length S] [--top N]";
    program.add_options = [&](OptionParser& p) {
      p.group("Plan").add_options()("top", po::value(&top)->default_value(10),
                                    "how many of the fastest layouts to print")(
          "hf-config", po::value(&hf_dir),
          "a Hugging Face model directory (its config.json alone is read: Llama, Qwen2/3, "
          "Mistral, Mixtral, DeepSeek-V3): the model, instead of the model options");
    };
    // The planning options belong to a dry run: tessera-plan is one. With --hf-config, what
    // config.json says of the run (its sequence and dtype) joins them where not given.
    std::vector<std::string> assumed;
    std::vector<std::string> from_file = hf_run_options(argc, argv, assumed);
    std::vector<const char*> args(argv, argv + argc);
    for (const std::string& a : from_file) args.push_back(a.c_str());
    args.push_back("--dry-run");
    if (!parse_run_options(static_cast<int>(args.size()), args.data(), o, program)) return 0;
    // The printed command lines: the config file, and the options given here that tessera-train
    // takes too (the batch, sequence, precision, vocabulary, ...), as given.
    // The layout options given restrict the search (PlanConstraints); each row spells its
    // layout out, so they are not carried over as given.
    const std::set<std::string> layout_keys = {"--tensor-model-parallel-size",
                                               "--pipeline-model-parallel-size",
                                               "--context-parallel-size",
                                               "--expert-model-parallel-size",
                                               "--virtual-pipeline-model-parallel-size",
                                               "--num-virtual-stages-per-pipeline-rank",
                                               "--num-layers-per-virtual-pipeline-stage",
                                               "--micro-batch-size",
                                               "--recompute-granularity",
                                               "--recompute-method",
                                               "--recompute-num-layers",
                                               "--use-distributed-optimizer",
                                               "--use-megatron-fsdp",
                                               "--data-parallel-sharding-strategy",
                                               "--sequence-parallel",
                                               "--decoder-first-pipeline-num-layers",
                                               "--decoder-last-pipeline-num-layers",
                                               "--account-for-embedding-in-pipeline-split",
                                               "--account-for-loss-in-pipeline-split",
                                               "--pipeline-model-parallel-layout",
                                               "--overlap-param-gather",
                                               "--num-distributed-optimizer-instances",
                                               "--pipeline-schedule",
                                               "--enable-zero-bubble"};
    std::set<std::string> given;
    std::string passed;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const std::string key = a.substr(0, a.find('='));
      const bool planner_only = key == "--world-size" || key == "--cluster" || key == "--top" ||
                                key == "--hf-config" || key == "--config";
      const bool joined = a.find('=') != std::string::npos;
      if (key == "--config") config = joined ? a.substr(9) : (i + 1 < argc ? argv[i + 1] : "");
      const bool layout = layout_keys.count(key) > 0;
      if (layout) given.insert(key);
      if (planner_only || layout) {
        // Its value, unless it is a switch (the next word another option).
        if (!joined && i + 1 < argc &&
            (planner_only || std::string(argv[i + 1]).rfind("--", 0) != 0))
          ++i;
        continue;
      }
      passed += " " + shell_word(a);
    }
    PlanConstraints fixed;
    auto has = [&](const char* k) { return given.count(k) > 0; };
    if (has("--tensor-model-parallel-size")) fixed.tp = o.tp;
    if (has("--pipeline-model-parallel-size")) fixed.pp = o.pp;
    if (has("--context-parallel-size")) fixed.cp = o.cp;
    if (has("--expert-model-parallel-size")) fixed.ep = o.ep;
    if (has("--virtual-pipeline-model-parallel-size") ||
        has("--num-virtual-stages-per-pipeline-rank") ||
        has("--num-layers-per-virtual-pipeline-stage") || has("--pipeline-model-parallel-layout"))
      fixed.v = o.train.virtual_pipeline_size;
    if (has("--micro-batch-size")) fixed.micro_batch = o.train.micro_batch_size;
    if (has("--recompute-granularity")) {
      fixed.recompute_set = true;
      fixed.recompute = o.train.recompute.granularity;
    }
    if (has("--use-megatron-fsdp") || has("--use-distributed-optimizer")) {
      fixed.sharding_set = true;
      fixed.sharding = o.train.megatron_fsdp               ? PlanCandidate::Sharding::Fsdp
                       : o.train.use_distributed_optimizer ? PlanCandidate::Sharding::DistOpt
                                                           : PlanCandidate::Sharding::None;
    }
    if (has("--decoder-first-pipeline-num-layers") || has("--decoder-last-pipeline-num-layers") ||
        has("--account-for-embedding-in-pipeline-split") ||
        has("--account-for-loss-in-pipeline-split") || has("--pipeline-model-parallel-layout")) {
      fixed.split_set = true;
      fixed.split = o.train.pipeline_split;
    }
    if (has("--pipeline-schedule") || has("--enable-zero-bubble")) {
      fixed.schedule_set = true;
      fixed.zero_bubble = o.train.zero_bubble;
    }
    for (const std::string& a : from_file) passed += " " + shell_word(a);  // config.json's
    if (!o.cluster_spec)
      throw ConfigError("give --cluster (dgx-a100, dgx-h100, dgx-h200 or a cluster file)");
    if (o.world_size <= 0) throw ConfigError("give --world-size: the GPUs of the run");
    if (top < 1)
      throw ConfigError("--top=" + std::to_string(top) + " is out of range (allowed: >= 1)");
    if (!hf_dir.empty()) {  // the model of config.json, at the run's sequence length
      if (!std::ifstream(hf_dir + "/config.json"))
        throw ConfigError("--hf-config " + hf_dir +
                          ": no readable config.json there (give a Hugging Face model directory)");
      GPTConfig m = hf_model_config(hf_dir, o.model.make_vocab_size_divisible_by);
      m.seq_length = o.model.seq_length;
      m.validate();
      o.model = m;
      std::printf(
          "tessera-plan: the model of %s/config.json (the model options of the command "
          "line and --config are not used)\n",
          hf_dir.c_str());
      std::string a;
      for (const std::string& x : assumed) a += (a.empty() ? "" : "; ") + x;
      std::printf("tessera-plan: the plan rests on: %s\n", a.c_str());
    }
    if (o.model.vocab_size == 0) o.model.vocab_size = 50257;  // the data's is not known here
    const ClusterSpec& c = *o.cluster_spec;
    const auto start = std::chrono::steady_clock::now();
    const PlanResult r = plan_layouts(o.model, o.train, o.world_size, c, fixed);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf(
        "tessera-plan: %s\n  %lld parameters on %d GPUs of %s; global batch %d x %d "
        "tokens; %lld layouts, %lld valid, %lld fit %.1f GiB (estimate + %.1f GiB "
        "reserve); %.2f s\n",
        o.model.describe().c_str(), (long long)o.model.num_parameters(), o.world_size,
        describe_cluster(c).c_str(), o.train.global_batch_size, o.model.seq_length,
        (long long)r.considered, (long long)r.valid, (long long)r.fitting, c.gpu_memory_gib,
        kRuntimeReserveGiB, seconds);
    if (r.ranked.empty()) {
      std::fprintf(stderr,
                   "tessera-plan: error: no layout of %d GPUs fits %s's %.1f GiB: give more GPUs "
                   "(--world-size), a smaller --global-batch-size or --seq-length, or a cluster "
                   "with more memory\n",
                   o.world_size, c.name.c_str(), c.gpu_memory_gib);
      return 2;
    }
    std::printf(
        "\n  #  TP  PP   V  CP  EP   DP  mb  recompute  sharding  memory GiB  step s  "
        "tokens/s  TFLOP/s/GPU  MFU %%  bubble %%  exposed comm %%  sched  split\n");
    const size_t n = std::min(r.ranked.size(), size_t(top));
    for (size_t i = 0; i < n; ++i) {
      const PlanCandidate& k = r.ranked[i];
      const StepPrediction& p = k.prediction;
      std::printf(
          "%3zu %3d %3d %3d %3d %3d %4d %3d  %-9s  %-8s  %10.1f  %6.3f  %8.0f  %11.1f  %5.1f  "
          "%8.1f  %14.1f  %-5s  %s\n",
          i + 1, k.tp, k.pp, k.v, k.cp, k.ep, k.dp, k.micro_batch, recompute_name(k.recompute),
          k.sharding_name().c_str(), k.memory / 1073741824.0, p.step, p.tokens_per_s,
          p.tflops_per_gpu, 100 * p.mfu, 100 * p.bubble / p.step, 100 * p.exposed_comm / p.step,
          k.pp == 1       ? "-"
          : k.zero_bubble ? "zb"
                          : "1f1b",
          k.split_name().c_str());
    }
    const std::string cfg = config.empty() ? "CONFIG.ini" : config;
    const GpuRates rates = rates_for(c);  // read once for the breakdowns below
    // Whole nodes of equal task counts whose product is the world size (12 GPUs of 8-GPU nodes:
    // 2 nodes of 6).
    int nodes = (o.world_size + c.gpus_per_node - 1) / c.gpus_per_node;
    while (o.world_size % nodes != 0) ++nodes;
    const int per_node = o.world_size / nodes;
    for (size_t i = 0; i < n; ++i) {
      const PlanCandidate& k = r.ranked[i];
      std::printf("\n%zu: %s", i + 1, prediction_report(k.prediction, c, rates).c_str());
      const std::string args = (passed + " " + k.options()).substr(1);
      // The shell's words: a layout string's '|' quoted (EXTRA_ARGS below is split on spaces
      // only, without quotes).
      std::string words, word;
      std::istringstream in(k.options());
      while (in >> word) words += " " + shell_word(word);
      const std::string quoted = (passed + words).substr(1);
      std::printf("  srun -N %d --ntasks-per-node %d tessera-train --config %s %s\n", nodes,
                  per_node, cfg.c_str(), quoted.c_str());
      std::printf(
          "  sbatch --nodes=%d --gpus-per-node=%d --ntasks-per-node=%d "
          "--export=ALL,CONFIG=%s,EXTRA_ARGS=\"%s\" slurm/train.sbatch\n",
          nodes, per_node, per_node, cfg.c_str(), args.c_str());
    }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-plan: error: %s\n", e.what());
    return 2;
  }
}
