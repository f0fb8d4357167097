// preprocess.cpp: the reader -> workers -> ordered writer pipeline of tessera-preprocess.
#include "data/preprocess.hpp"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "core/json.hpp"
#include "core/timer.hpp"
#include "data/shard.hpp"

namespace tessera {

std::vector<std::string> expand_inputs(const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (const std::string& p : patterns) {
    glob_t g;
    const int rc = glob(p.c_str(), GLOB_NOCHECK, nullptr, &g);
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    globfree(&g);
  }
  for (const std::string& f : out) {
    struct stat st;
    if (stat(f.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      throw ConfigError("--input '" + f + "' is not a readable file (or matches nothing)");
  }
  if (out.empty()) throw ConfigError("--input names no files");
  return out;
}

int64_t parse_token_count(const std::string& text) {
  if (text.empty()) throw ConfigError("--shard-size is empty (e.g. 100M)");
  int64_t mult = 1;
  std::string num = text;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(text.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1000 : last == 'M' ? 1000000 : 1000000000;
    num.pop_back();
  }
  try {
    size_t used = 0;
    const double v = std::stod(num, &used);
    if (used != num.size() || !(v >= 1)) throw std::invalid_argument(text);
    return static_cast<int64_t>(v * static_cast<double>(mult));
  } catch (const std::exception&) {
    throw ConfigError("--shard-size '" + text + "' is not a token count (e.g. 100M, 5000000, 2G)");
  }
}

namespace {

struct Batch {
  int64_t seq = 0;
  std::vector<std::string> docs;
  // Chat data: each conversation's pieces (instead of docs) and where it is (FILE:LINE).
  std::vector<std::vector<ChatPiece>> convs;
  std::vector<std::string> where;
  std::vector<uint32_t> tokens;      // filled by a worker
  std::vector<uint8_t> masks;        // chat data: one per token
  std::vector<uint64_t> lengths;     // tokens per document
  std::vector<std::string> skipped;  // conversations without a target (FILE:LINE)
  int64_t bytes = 0;
};

bool is_jsonl(const std::string& path) {
  auto ends = [&](const char* s) {
    const std::string e(s);
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  return ends(".jsonl") || ends(".json") || ends(".ndjson");
}

// Shared state of the pipeline.
struct Pipeline {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Batch>> todo;
  std::map<int64_t, std::unique_ptr<Batch>> done;
  bool reading_finished = false, failed = false;
  std::string error;
  bool bad_input = false;  // the first failure was the input's (a ConfigError: exit 2)
  int64_t batches_read = 0;
  static constexpr size_t kMaxQueued = 64;

  void fail(const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failed) {
      error = e.what();
      bad_input = dynamic_cast<const ConfigError*>(&e) != nullptr;
    }
    failed = true;
    cv.notify_all();
  }
};

// A worker: tokenizes queued batches with its own BPE cache until reading ends or fails.
void tokenize_batches(Pipeline& pl, const Tokenizer& tok, const PreprocessOptions& opts) {
  Tokenizer::Cache cache;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  while (true) {
    std::unique_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lock(pl.mu);
      pl.cv.wait(lock, [&] { return pl.failed || !pl.todo.empty() || pl.reading_finished; });
      if (pl.failed || (pl.todo.empty() && pl.reading_finished)) return;
      b = std::move(pl.todo.front());
      pl.todo.pop_front();
      pl.cv.notify_all();
    }
    for (const std::string& d : b->docs) {
      ids.clear();
      tok.encode(d, ids, cache);
      if (opts.append_eod) ids.push_back(tok.eod_id());
      b->tokens.insert(b->tokens.end(), ids.begin(), ids.end());
      b->lengths.push_back(ids.size());
    }
    for (size_t c = 0; c < b->convs.size(); ++c) {
      ids = encode_chat(opts.chat_format, b->convs[c], tok, cache, &mask);
      if (std::find(mask.begin(), mask.end(), uint8_t(1)) == mask.end()) {  // nothing to learn
        b->skipped.push_back(b->where[c]);
        continue;
      }
      if (opts.append_eod) {  // the document's end: not a target
        ids.push_back(tok.eod_id());
        mask.push_back(0);
      }
      b->tokens.insert(b->tokens.end(), ids.begin(), ids.end());
      b->masks.insert(b->masks.end(), mask.begin(), mask.end());
      b->lengths.push_back(ids.size());
    }
    b->docs.clear();
    b->docs.shrink_to_fit();
    b->convs.clear();
    std::lock_guard<std::mutex> lock(pl.mu);
    pl.done.emplace(b->seq, std::move(b));
    pl.cv.notify_all();
  }
}

// The reader: documents in input order, in batches of ~1 MB; a failure stops the pipeline.
void read_documents(Pipeline& pl, const std::vector<std::string>& files,
                    const PreprocessOptions& opts) {
  try {
    int64_t seq = 0;
    auto batch = std::make_unique<Batch>();
    auto push = [&](bool force) {
      const size_t n = batch->docs.size() + batch->convs.size();
      if (n == 0 || (!force && batch->bytes < (1 << 20) && n < 1024)) return;
      batch->seq = seq++;
      std::unique_lock<std::mutex> lock(pl.mu);
      pl.cv.wait(lock, [&] {
        return pl.failed || pl.todo.size() + pl.done.size() < Pipeline::kMaxQueued;
      });
      if (pl.failed) throw Error("stopped");
      pl.todo.push_back(std::move(batch));
      ++pl.batches_read;
      pl.cv.notify_all();
      batch = std::make_unique<Batch>();
    };
    auto add = [&](std::string doc) {
      batch->bytes += static_cast<int64_t>(doc.size());
      batch->docs.push_back(std::move(doc));
      push(false);
    };
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) throw ConfigError("--input '" + f + "' cannot be read");
      if (opts.chat && !is_jsonl(f))
        throw ConfigError("--chat-template reads conversations from .jsonl inputs; '" + f +
                          "' is not one");
      if (is_jsonl(f)) {
        std::string line;
        int64_t lineno = 0;
        while (std::getline(in, line)) {
          ++lineno;
          if (!line.empty() && line.back() == '\r') line.pop_back();
          if (line.find_first_not_of(" \t") == std::string::npos) continue;
          try {
            if (opts.chat) {  // parsed and rendered here, so that errors name the line
              batch->convs.push_back(render_chat(opts.chat_format,
                                                 parse_chat_messages(line, opts.json_key),
                                                 opts.chat_default_system));
              batch->where.push_back(f + ":" + std::to_string(lineno));
              batch->bytes += static_cast<int64_t>(line.size());
              push(false);
              continue;
            }
            add(json_string_member(line, opts.json_key));
          } catch (const JsonError& e) {
            throw ConfigError(
                f + ":" + std::to_string(lineno) + ": " + e.message +
                (opts.chat ? " (--chat-template: each line must be a JSON object whose \"" +
                                 opts.json_key + "\" is a list of messages; see --json-keys)"
                           : " (each line must be a JSON object with a string \"" + opts.json_key +
                                 "\"; see --json-key)"));
          }
        }
      } else if (opts.split_lines) {
        std::string line;
        while (std::getline(in, line))
          if (line.find_first_not_of(" \t\r") != std::string::npos) add(line);
      } else {
        std::ostringstream ss;
        ss << in.rdbuf();
        add(ss.str());
      }
    }
    push(true);
    std::lock_guard<std::mutex> lock(pl.mu);
    pl.reading_finished = true;
    pl.cv.notify_all();
  } catch (const std::exception& e) {
    pl.fail(e);
  }
}

}  // namespace

ShardWriter::ShardWriter(std::string prefix, int64_t shard_tokens, ShardMeta meta)
    : prefix_(std::move(prefix)), shard_tokens_(shard_tokens), meta_(std::move(meta)) {}

ShardWriter::~ShardWriter() {
  if (!committed_)
    for (const std::string& t : tmp_) std::remove(t.c_str());
}

void ShardWriter::add(const uint32_t* tokens, size_t n, const uint8_t* mask) {
  TESSERA_CHECK(documents_ == 0 || masked_ == (mask != nullptr),
                "documents with and without loss masks in one preprocessing run");
  masked_ = mask != nullptr;
  // What the tokenizer (or an imported file) produced must fit the vocabulary the shards declare:
  // an id past it would train as an impossible target.
  for (size_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(tokens[i]) >= meta_.vocab_size)
      throw ConfigError(detail::concat(
          "document ", documents_, " (counting from 0 over the inputs) has token id ", tokens[i],
          " at position ", i, ", outside the vocabulary of ", meta_.vocab_size,
          " tokens of tokenizer '", meta_.tokenizer, "'; no shard was written"));
  ++documents_;
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  if (mask) mask_.insert(mask_.end(), mask, mask + n);
  offsets_.push_back(tokens_.size());
  if (static_cast<int64_t>(tokens_.size()) >= shard_tokens_) flush();
}

void ShardWriter::flush() {
  if (offsets_.size() == 1) return;
  const std::string tmp = shard_path(prefix_, static_cast<int>(tmp_.size())) + ".part";
  tmp_.push_back(tmp);  // removed on failure even when half written
  write_shard(tmp, tokens_, offsets_, meta_, mask_);
  tokens_.clear();
  mask_.clear();
  offsets_.assign(1, 0);
}

std::vector<std::string> ShardWriter::commit() {
  flush();
  // Everything succeeded: move the shards under their final names, then drop stale shards of an
  // earlier, longer run of the same prefix (they would otherwise be read as part of this corpus).
  std::vector<std::string> out;
  for (size_t i = 0; i < tmp_.size(); ++i) {
    const std::string final_name = shard_path(prefix_, static_cast<int>(i));
    if (std::rename(tmp_[i].c_str(), final_name.c_str()) != 0) {
      // Leave no mix of this run's and an earlier run's shards under the final names.
      for (const std::string& done : out) std::remove(done.c_str());
      for (int k = static_cast<int>(i);; ++k)
        if (std::remove(shard_path(prefix_, k).c_str()) != 0) break;
      throw Error("cannot rename '" + tmp_[i] + "' to '" + final_name +
                  "'; the shards of this run are removed, run it again");
    }
    out.push_back(final_name);
  }
  committed_ = true;
  for (int i = static_cast<int>(tmp_.size());; ++i) {
    const std::string stale = shard_path(prefix_, i);
    if (std::remove(stale.c_str()) != 0) break;
  }
  return out;
}

PreprocessResult preprocess(const PreprocessOptions& opts, const Tokenizer& tok,
                            const std::function<void(const std::string&, bool)>& progress,
                            bool tty) {
  TESSERA_CHECK(opts.workers >= 1, "--workers must be >= 1");
  const std::vector<std::string> files = expand_inputs(opts.inputs);
  if (opts.output_prefix.empty()) throw ConfigError("--output-prefix is required");
  Timer clock;
  Pipeline pl;
  PreprocessResult res;

  // Chat data: the template's special tokens, each one token of this tokenizer (checked here,
  // before any input is read).
  if (opts.chat) {
    std::vector<ChatPiece> all;
    for (const std::string& s : chat_special_tokens(opts.chat_format)) all.push_back({s, true});
    Tokenizer::Cache cache;
    encode_chat(opts.chat_format, all, tok, cache);
  }
  // The end of a turn that is also the end of a document: scanning for EOD tokens (the reset
  // options) would cut conversations at every turn.
  for (const ChatPiece& p : render_chat(opts.chat_format, {{"user", "q"}, {"assistant", "a"}}))
    if (opts.chat && p.special && p.counted && tok.special_token_id(p.text) == tok.eod_id())
      res.note = "the template's end-of-turn token '" + p.text +
                 "' is the tokenizer's end-of-document token: --reset-position-ids and "
                 "--reset-attention-mask would cut conversations at every turn; pack them with "
                 "--sft (documents from the shards' boundaries), or give --eod-token another "
                 "token";

  // Workers: tokenize batches, each with its own BPE cache.
  std::vector<std::thread> workers;
  for (int w = 0; w < opts.workers; ++w)
    workers.emplace_back([&] { tokenize_batches(pl, tok, opts); });

  // Reader: documents in input order, in batches of ~1 MB.
  std::thread reader([&] { read_documents(pl, files, opts); });

  // Writer (this thread): batches in order into shards under temporary names.
  ShardMeta meta;
  meta.vocab_size = tok.vocab_size();
  meta.eod_id = tok.eod_id();
  meta.tokenizer = tok.name();
  ShardWriter out(opts.output_prefix, opts.shard_tokens, meta);
  Timer since_report;
  auto report = [&](bool final) {
    if (!progress) return;
    const double s = std::max(clock.seconds(), 1e-9);
    char line[256];
    std::snprintf(line, sizeof line,
                  "%s%lld documents (%.0f docs/s), %lld tokens (%.0f tokens/s, %.0f per worker), "
                  "%zu shard%s",
                  final ? "done: " : "", (long long)res.documents, res.documents / s,
                  (long long)res.tokens, res.tokens / s, res.tokens / s / opts.workers,
                  out.shards(), out.shards() == 1 ? "" : "s");
    progress(line, final);
  };
  int64_t next = 0;
  try {
    while (true) {
      std::unique_ptr<Batch> b;
      {
        std::unique_lock<std::mutex> lock(pl.mu);
        pl.cv.wait_for(lock, std::chrono::milliseconds(200), [&] {
          return pl.failed || pl.done.count(next) ||
                 (pl.reading_finished && next == pl.batches_read);
        });
        if (pl.failed) break;
        if (pl.reading_finished && next == pl.batches_read && !pl.done.count(next)) break;
        auto it = pl.done.find(next);
        if (it != pl.done.end()) {
          b = std::move(it->second);
          pl.done.erase(it);
          ++next;
          pl.cv.notify_all();
        }
      }
      if (b) {
        size_t pos = 0;
        res.skipped += static_cast<int64_t>(b->skipped.size());
        if (res.first_skipped.empty() && !b->skipped.empty()) res.first_skipped = b->skipped[0];
        for (uint64_t len : b->lengths) {
          out.add(b->tokens.data() + pos, len, opts.chat ? b->masks.data() + pos : nullptr);
          pos += len;
          ++res.documents;
          res.tokens += static_cast<int64_t>(len);
        }
        res.bytes += b->bytes;
      }
      if (tty || since_report.seconds() >= opts.progress_seconds) {
        if (!tty || since_report.seconds() >= 0.2) {
          report(false);
          since_report.reset();
        }
      }
    }
  } catch (const std::exception& e) {
    pl.fail(e);
  }
  reader.join();
  for (auto& w : workers) w.join();
  if (pl.failed) {  // the writer removes its shards
    if (pl.bad_input) throw ConfigError(pl.error);
    throw Error(pl.error);
  }
  if (res.documents == 0)
    throw ConfigError(res.skipped > 0
                          ? detail::concat("none of the ", res.skipped,
                                           " conversations has an assistant turn to learn (the "
                                           "first: ",
                                           res.first_skipped, "); nothing was written")
                          : "the inputs hold no documents (empty files, or no non-empty lines)");
  res.shards = out.commit();
  res.seconds = clock.seconds();
  report(true);
  return res;
}

}  // namespace tessera
