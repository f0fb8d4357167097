// pipeline_split.cpp: the layers of each pipeline stage (model/pipeline_split.hpp), after
// Megatron-Core's get_num_layers_to_build / get_transformer_layer_offset, TransformerConfig's
// checks and PipelineParallelLayerLayout.
#include "model/pipeline_split.hpp"

#include <algorithm>
#include <cctype>

#include "core/error.hpp"

namespace tessera {

using detail::concat;

namespace {

constexpr const char* kLayout = "--pipeline-model-parallel-layout";
constexpr const char* kFirst = "--decoder-first-pipeline-num-layers";
constexpr const char* kLast = "--decoder-last-pipeline-num-layers";
constexpr const char* kPP = "--pipeline-model-parallel-size";

// "N" digits at s[i...]: their value and the index after them; -1 when none.
int digits_at(const std::string& s, size_t& i) {
  const size_t start = i;
  long long v = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    v = v * 10 + (s[i] - '0');
    if (v > 1000000)
      throw ConfigError(concat(kLayout, ": a repeat count in \"", s, "\" exceeds 1000000"));
    ++i;
  }
  return i == start ? -1 : static_cast<int>(v);
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int k = 0; k < n; ++k) out += s;
  return out;
}

// Megatron's first pattern, r'\(([^)]+)\)\*(\d+)', in one left-to-right pass.
std::string unroll_groups(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '(') {
      const size_t close = s.find(')', i + 1);
      if (close != std::string::npos && close > i + 1 && close + 1 < s.size() &&
          s[close + 1] == '*') {
        size_t j = close + 2;
        const int n = digits_at(s, j);
        if (n >= 0) {
          out += repeat(s.substr(i + 1, close - i - 1), n);
          i = j;
          continue;
        }
      }
    }
    out += s[i++];
  }
  return out;
}

// The second, r'(.)\*(\d+)'.
std::string unroll_letters(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (i + 1 < s.size() && s[i + 1] == '*') {
      size_t j = i + 2;
      const int n = digits_at(s, j);
      if (n >= 0) {
        out += repeat(std::string(1, s[i]), n);
        i = j;
        continue;
      }
    }
    out += s[i++];
  }
  return out;
}

int count_of(const std::vector<std::string>& stages, char c) {
  int n = 0;
  for (const std::string& s : stages) n += static_cast<int>(std::count(s.begin(), s.end(), c));
  return n;
}

std::vector<StageSpan> from_layout(const PipelineSplitOptions& o, int L, int M, int pp, int vp) {
  const char* other = o.first > 0           ? kFirst
                      : o.last > 0          ? kLast
                      : o.account_embedding ? "--account-for-embedding-in-pipeline-split"
                      : o.account_loss      ? "--account-for-loss-in-pipeline-split"
                                            : nullptr;
  if (other)
    throw ConfigError(concat(kLayout, " places every layer itself: drop ", other,
                             " (Megatron-LM refuses the two together)"));
  const std::vector<std::string> stages = parse_pipeline_layout(o.layout);
  const int n = static_cast<int>(stages.size());
  if (n % pp != 0)
    throw ConfigError(concat(kLayout, " \"", o.layout, "\" has ", n, " stages, not a multiple of ",
                             kPP, "=", pp));
  const int V = n / pp;
  if (vp > 0 && vp != V)
    throw ConfigError(concat("--virtual-pipeline-model-parallel-size=", vp, " disagrees with ",
                             kLayout, ": its ", n, " stages over PP ", pp, " make ", V,
                             " virtual stages per rank (give ", V, ", or leave it out)"));
  // The flattened layout in layer order is the stages in order of s.
  std::string flat;
  for (const std::string& s : stages) flat += s;
  if (stages.front().empty() || stages.front().front() != 'E')
    throw ConfigError(concat(kLayout, " \"", o.layout,
                             "\" must begin with E (the embedding, in the first stage)"));
  if (stages.back().empty() || stages.back().back() != 'L')
    throw ConfigError(
        concat(kLayout, " \"", o.layout, "\" must end with L (the loss, in the last stage)"));
  if (count_of(stages, 'E') != 1)
    throw ConfigError(concat(kLayout, " \"", o.layout, "\" has ", count_of(stages, 'E'),
                             " E: the embedding must be given exactly once"));
  if (count_of(stages, 'L') != 1)
    throw ConfigError(concat(kLayout, " \"", o.layout, "\" has ", count_of(stages, 'L'),
                             " L: the loss must be given exactly once"));
  if (count_of(stages, 't') != L)
    throw ConfigError(concat(kLayout, " \"", o.layout, "\" places ", count_of(stages, 't'),
                             " decoder layers (t), but --num-layers=", L));
  if (count_of(stages, 'm') != M)
    throw ConfigError(concat(kLayout, " \"", o.layout, "\" places ", count_of(stages, 'm'),
                             " MTP layers (m), but --mtp-num-layers=", M));
  const size_t first_m = flat.find('m');
  if (first_m != std::string::npos && flat.find('t', first_m) != std::string::npos)
    throw ConfigError(concat(kLayout, " \"", o.layout,
                             "\": decoder layers (t) must come before the MTP layers (m)"));
  std::vector<StageSpan> spans(static_cast<size_t>(n));
  int next = 0;
  for (int s = 0; s < n; ++s) {
    const std::string& st = stages[static_cast<size_t>(s)];
    StageSpan& sp = spans[static_cast<size_t>(s)];
    const int t = static_cast<int>(std::count(st.begin(), st.end(), 't'));
    sp.begin = next;
    sp.end = next + t;
    next += t;
    sp.embedding = st.find('E') != std::string::npos;
    sp.loss = st.find('L') != std::string::npos;
    sp.mtp = static_cast<int>(std::count(st.begin(), st.end(), 'm'));
    if (sp.mtp > 0 && s / pp != V - 1)
      throw ConfigError(concat(kLayout, " \"", o.layout, "\": the MTP layers are in virtual stage ",
                               s / pp, " of pipeline rank ", s % pp,
                               "; they must be in the rank's last virtual stage (", V - 1, ")"));
    if (sp.mtp > 0 && sp.mtp != M)
      throw ConfigError(concat(kLayout, " \"", o.layout,
                               "\": all MTP layers (m) must be in one stage (stage ", s, " holds ",
                               sp.mtp, " of ", M, ")"));
  }
  return spans;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& layout) {
  std::string s;
  for (char c : layout)
    if (c != ',') s += c;  // commas are cosmetic
  s = unroll_letters(unroll_groups(s));
  std::vector<std::string> stages(1);
  for (char c : s) {
    if (c == '|') {
      stages.emplace_back();
      continue;
    }
    if (c != 'E' && c != 'L' && c != 't' && c != 'm')
      throw ConfigError(concat(kLayout, " \"", layout, "\": invalid layer character '", c,
                               "' (known: E embedding, t decoder layer, m MTP layer, L loss; "
                               "| between stages, (...)*N and x*N repeat, commas are cosmetic)"));
    stages.back() += c;
  }
  return stages;
}

int layout_virtual_stages(const std::string& layout, int pp) {
  const int n = static_cast<int>(parse_pipeline_layout(layout).size());
  if (pp < 1 || n % pp != 0)
    throw ConfigError(
        concat(kLayout, " \"", layout, "\" has ", n, " stages, not a multiple of ", kPP, "=", pp));
  return n / pp;
}

std::vector<StageSpan> split_stages(const PipelineSplitOptions& o, int L, int M, int pp, int vp) {
  if (pp < 1) throw ConfigError(concat(kPP, "=", pp, " is out of range (allowed: >= 1)"));
  if (!o.layout.empty()) return from_layout(o, L, M, pp, vp);
  const int V = std::max(vp, 1);
  const int stages = pp * V;
  std::vector<int> per_rank(static_cast<size_t>(pp));
  if (o.first > 0 || o.last > 0) {
    if (o.account_embedding || o.account_loss)
      throw ConfigError(
          concat(o.first > 0 ? kFirst : kLast, " cannot be given with --account-for-",
                 o.account_embedding ? "embedding" : "loss",
                 "-in-pipeline-split (Megatron-LM refuses the two together): give one of them"));
    if (pp == 1)
      throw ConfigError(concat(o.first > 0 ? kFirst : kLast, "=", o.first > 0 ? o.first : o.last,
                               " needs ", kPP, " > 1: the one stage holds all ", L,
                               " layers (Megatron-LM would quietly build fewer, its issue #1778)"));
    int rest = L, left = pp;
    for (const auto& [n, name] : {std::pair<int, const char*>{o.first, kFirst}, {o.last, kLast}}) {
      if (n <= 0) continue;
      if (n % V != 0)
        throw ConfigError(concat(name, "=", n, " is not divisible by the ", V,
                                 " virtual stages per pipeline rank"));
      rest -= n;
      --left;
    }
    if (rest < 0)
      throw ConfigError(concat(kFirst, "=", o.first, " and ", kLast, "=", o.last,
                               " hold more than --num-layers=", L));
    if ((rest > 0) != (left > 0))
      throw ConfigError(concat("--num-layers=", L, " less the first (", o.first, ") and last (",
                               o.last, ") stages' layers leaves ", rest, " layers for ", left,
                               " middle pipeline stages"));
    if (left > 0 && rest % left != 0)
      throw ConfigError(concat("the ", rest, " middle layers (--num-layers=", L, " less ", kFirst,
                               "=", o.first, " and ", kLast, "=", o.last,
                               ") do not divide over the ", left, " middle pipeline stages"));
    const int middle = left > 0 ? rest / left : 0;
    if (left > 0 && middle % V != 0)
      throw ConfigError(concat("each middle pipeline stage's ", middle,
                               " layers are not divisible by the ", V,
                               " virtual stages per pipeline rank"));
    std::fill(per_rank.begin(), per_rank.end(), middle);
    if (o.first > 0) per_rank.front() = o.first;
    if (o.last > 0) per_rank.back() = o.last;
  } else {
    const int counted = L + (o.account_embedding ? 1 : 0) + (o.account_loss ? 1 : 0);
    const std::string what =
        o.account_embedding || o.account_loss
            ? concat(" (--num-layers=", L, o.account_embedding ? " + 1 for the embedding" : "",
                     o.account_loss ? " + 1 for the loss" : "", ")")
            : std::string(" (--num-layers)");
    if (counted % pp != 0)
      throw ConfigError(concat(counted, " layers", what, " are not divisible by ", kPP, "=", pp));
    if ((counted / pp) % V != 0)
      throw ConfigError(concat("each pipeline rank's ", counted / pp, " layers", what,
                               " are not divisible by its ", V, " virtual stages"));
    std::fill(per_rank.begin(), per_rank.end(), counted / pp);
  }
  std::vector<StageSpan> spans(static_cast<size_t>(stages));
  int next = 0;
  for (int s = 0; s < stages; ++s) {
    int n = per_rank[static_cast<size_t>(s % pp)] / V;
    if (s == 0 && o.account_embedding) --n;      // the embedding counts as a layer
    if (s == stages - 1 && o.account_loss) --n;  // and the loss
    StageSpan& sp = spans[static_cast<size_t>(s)];
    sp.begin = next;
    sp.end = next + n;
    next += n;
  }
  TESSERA_CHECK(next == L, "pipeline split: ", next, " of ", L, " layers placed");
  spans.front().embedding = true;
  spans.back().loss = true;
  spans.back().mtp = M;
  return spans;
}

int standalone_mtp_rank(const std::vector<StageSpan>& spans, int pp) {
  for (size_t s = 0; s < spans.size(); ++s)
    if (spans[s].mtp > 0 && !spans[s].loss) return static_cast<int>(s) % pp;
  return -1;
}

std::string layout_string(const std::vector<StageSpan>& spans) {
  std::string out;
  for (size_t s = 0; s < spans.size(); ++s) {
    if (s) out += '|';
    if (spans[s].embedding) out += 'E';
    out += std::string(static_cast<size_t>(spans[s].layers()), 't');
    out += std::string(static_cast<size_t>(spans[s].mtp), 'm');
    if (spans[s].loss) out += 'L';
  }
  return out;
}

std::string describe_stage(const StageSpan& s) {
  std::vector<std::string> parts;
  auto add = [&](const char* name, int n) {
    if (n == 1) parts.push_back(name);
    if (n > 1) parts.push_back(concat(name, "*", n));
  };
  add("embedding", s.embedding ? 1 : 0);
  add("decoder", s.layers());
  add("mtp", s.mtp);
  add("loss", s.loss ? 1 : 0);
  if (parts.empty()) return "(empty stage)";
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ",") + p;
  return out;
}

}  // namespace tessera
