// text_server.cpp: the HTTP front (rank 0), the request queue and the batch loop (every rank).
#include "inference/text_server.hpp"

#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "core/json.hpp"
#include "core/timer.hpp"
#include "data/unicode.hpp"
#include "inference/generator.hpp"

namespace tessera {

namespace {
namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// ---- the request's JSON ----------------------------------------------------------------------

bool is_integer(const JsonValue& v) {
  return v.type == JsonValue::Type::Number && std::isfinite(v.number) &&
         v.number == std::floor(v.number) && std::fabs(v.number) <= 9007199254740992.0;
}
int64_t integer(const JsonValue& v, const char* name, int64_t lo, int64_t hi, const char* rule) {
  if (!is_integer(v) || v.number < static_cast<double>(lo) || v.number > static_cast<double>(hi))
    throw ApiError(std::string(name) + " must be " + rule);
  return static_cast<int64_t>(v.number);
}
double number(const JsonValue& v, const char* name, const char* rule) {
  if (v.type != JsonValue::Type::Number || !std::isfinite(v.number))
    throw ApiError(std::string(name) + " must be " + rule);
  return v.number;
}
bool boolean(const JsonValue& v, const char* name) {
  if (v.type != JsonValue::Type::Bool)
    throw ApiError(std::string(name) + " must be a boolean value");
  return v.boolean;
}
}  // namespace

ApiRequest parse_api_request(std::string_view body) {
  JsonValue root;
  try {
    JsonReader r(body);
    root = r.value();
    r.expect_end();
  } catch (const JsonError& e) {
    throw ApiError("the body is not JSON: " + e.message);
  }
  if (root.type != JsonValue::Type::Object) throw ApiError("the body must be a JSON object");
  ApiRequest q;
  bool have_prompts = false, have_top_p_decay = false, have_beam = false;
  for (const auto& [key, v] : root.members) {
    if (key == "prompts") {
      if (v.type != JsonValue::Type::Array) throw ApiError("prompts is not a list of strings");
      for (const JsonValue& p : v.items) {
        if (p.type != JsonValue::Type::String) throw ApiError("prompts is not a list of strings");
        q.prompts.push_back(p.string);
      }
      have_prompts = true;
    } else if (key == "tokens_to_generate") {
      q.tokens_to_generate =
          integer(v, "tokens_to_generate", 0, 1 << 30, "an integer greater than or equal to 0");
    } else if (key == "temperature") {
      q.temperature = number(v, "temperature", "a number from 0 (greedy) to 100");
      if (!(q.temperature >= 0 && q.temperature <= 100))
        throw ApiError("temperature must be a number from 0 (greedy) to 100");
    } else if (key == "top_k") {
      q.top_k =
          static_cast<int>(integer(v, "top_k", 0, 1000, "an integer from 0 (no limit) to 1000"));
    } else if (key == "top_p") {
      q.top_p = number(v, "top_p", "a number from 0 (off) to 1");
      if (!(q.top_p >= 0 && q.top_p <= 1))
        throw ApiError("top_p must be a number from 0 (off) to 1");
    } else if (key == "top_p_decay") {
      q.top_p_decay = number(v, "top_p_decay", "a number from 0 to 1");
      if (!(q.top_p_decay >= 0 && q.top_p_decay <= 1))
        throw ApiError("top_p_decay must be a number from 0 to 1");
      have_top_p_decay = q.top_p_decay > 0;
    } else if (key == "top_p_bound") {
      q.top_p_bound = number(v, "top_p_bound", "a number from 0 to top_p");
    } else if (key == "logprobs") {
      q.logprobs = boolean(v, "logprobs");
    } else if (key == "add_BOS") {
      q.add_BOS = boolean(v, "add_BOS");
    } else if (key == "random_seed") {
      q.random_seed = integer(v, "random_seed", 0, int64_t{1} << 53, "an integer from 0 to 2^53");
    } else if (key == "beam_width") {
      if (v.type == JsonValue::Type::Null) continue;
      q.beam_width = static_cast<int>(integer(v, "beam_width", 1, 64, "an integer from 1 to 64"));
      have_beam = true;
    } else if (key == "stop_token") {
      q.stop_token = integer(v, "stop_token", 0, (int64_t{1} << 31) - 1, "a token id");
    } else if (key == "length_penalty") {
      q.length_penalty = number(v, "length_penalty", "a number");
    } else if (key == "no_log") {
      boolean(v, "no_log");  // accepted for Megatron-LM's clients; requests are always logged
    } else {
      throw ApiError("unknown field '" + key +
                     "' (allowed: prompts, tokens_to_generate, temperature, top_k, top_p, "
                     "top_p_decay, top_p_bound, logprobs, add_BOS, random_seed, beam_width, "
                     "stop_token, length_penalty, no_log)");
    }
  }
  if (!have_prompts) throw ApiError("prompts argument required");
  if (q.prompts.empty()) throw ApiError("prompts is empty");
  if (q.tokens_to_generate == 0 && !q.logprobs && !have_beam)
    throw ApiError("tokens_to_generate=0 implies logprobs should be True");
  if (q.top_k > 0 && q.top_p > 0) throw ApiError("cannot set both top-k and top-p samplings");
  if (have_top_p_decay && q.top_p == 0) throw ApiError("top_p_decay cannot be set without top_p");
  if (!(q.top_p_bound >= 0 && q.top_p_bound <= std::max(q.top_p, 0.0)) ||
      (q.top_p_bound > 0 && q.top_p == 0))
    throw ApiError("top_p_bound must be a number from 0 to top_p");
  if (have_beam) {
    if (q.prompts.size() != 1)
      throw ApiError("beam search takes one prompt per request (beam_width given with " +
                     std::to_string(q.prompts.size()) + " prompts)");
    if (q.tokens_to_generate < 1)
      throw ApiError("tokens_to_generate must be at least 1 with beam_width");
  }
  return q;
}

namespace {
std::string json_number(double x, int digits) {
  if (!std::isfinite(x)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*g", digits, x);
  return buf;
}

// ---- the queue between the HTTP threads and the batch loop --------------------------------------

// One accepted request: what every rank needs to run it, and where rank 0 puts the answer.
struct Job {
  ApiRequest req;
  std::vector<std::vector<int32_t>> prompts;  // tokenized (BOS added)
  uint64_t seed = 0;
  int32_t stop = -1;
  std::promise<std::pair<int, std::string>> reply;  // HTTP status, body
  bool answered = false;                            // the promise is set once
  void answer(int status, std::string body) {
    if (answered) return;
    answered = true;
    reply.set_value({status, std::move(body)});
  }
};

class JobQueue {
 public:
  // False once the queue is closed (the server is stopping): the caller answers 503.
  bool push(std::shared_ptr<Job> j) {
    {
      std::lock_guard<std::mutex> g(m_);
      if (closed_) return false;
      q_.push_back(std::move(j));
    }
    cv_.notify_one();
    return true;
  }
  // The next batch: a beam-search job alone, or sampling jobs up to `max_prompts` prompts (at least
  // one job). Empty when nothing came within `wait`.
  std::vector<std::shared_ptr<Job>> take(int max_prompts, std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> g(m_);
    cv_.wait_for(g, wait, [&] { return !q_.empty(); });
    std::vector<std::shared_ptr<Job>> out;
    size_t prompts = 0;
    while (!q_.empty()) {
      const auto& j = q_.front();
      const bool beam = j->req.beam_width > 0;
      if (!out.empty() && (beam || out[0]->req.beam_width > 0 ||
                           prompts + j->prompts.size() > static_cast<size_t>(max_prompts)))
        break;
      prompts += j->prompts.size();
      out.push_back(q_.front());
      q_.pop_front();
    }
    return out;
  }
  // Closes the queue and returns every job left, for a refusal at shutdown.
  std::deque<std::shared_ptr<Job>> close() {
    std::lock_guard<std::mutex> g(m_);
    closed_ = true;
    return std::exchange(q_, {});
  }

 private:
  bool closed_ = false;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> q_;
};

// ---- batches as messages from rank 0 to every rank ---------------------------------------------

constexpr double kStop = 0, kBatch = 1;

std::vector<double> encode_batch(const std::vector<std::shared_ptr<Job>>& jobs) {
  std::vector<double> m{kBatch, static_cast<double>(jobs.size())};
  for (const auto& j : jobs) {
    const ApiRequest& q = j->req;
    m.insert(m.end(),
             {static_cast<double>(q.beam_width), static_cast<double>(q.tokens_to_generate),
              q.temperature, static_cast<double>(q.top_k), q.top_p, q.top_p_decay, q.top_p_bound,
              static_cast<double>(j->seed), q.logprobs ? 1.0 : 0.0, static_cast<double>(j->stop),
              q.length_penalty, static_cast<double>(j->prompts.size())});
    for (const auto& p : j->prompts) {
      m.push_back(static_cast<double>(p.size()));
      m.insert(m.end(), p.begin(), p.end());
    }
  }
  return m;
}

std::vector<std::shared_ptr<Job>> decode_batch(const std::vector<double>& m) {
  size_t at = 1;
  const size_t n = static_cast<size_t>(m.at(at++));
  std::vector<std::shared_ptr<Job>> jobs;
  for (size_t k = 0; k < n; ++k) {
    auto j = std::make_shared<Job>();
    ApiRequest& q = j->req;
    q.beam_width = static_cast<int>(m.at(at++));
    q.tokens_to_generate = static_cast<int64_t>(m.at(at++));
    q.temperature = m.at(at++);
    q.top_k = static_cast<int>(m.at(at++));
    q.top_p = m.at(at++);
    q.top_p_decay = m.at(at++);
    q.top_p_bound = m.at(at++);
    j->seed = static_cast<uint64_t>(m.at(at++));
    q.logprobs = m.at(at++) != 0;
    j->stop = static_cast<int32_t>(m.at(at++));
    q.length_penalty = m.at(at++);
    const size_t prompts = static_cast<size_t>(m.at(at++));
    for (size_t p = 0; p < prompts; ++p) {
      const size_t len = static_cast<size_t>(m.at(at++));
      j->prompts.emplace_back(m.begin() + at, m.begin() + at + len);
      at += len;
    }
    jobs.push_back(std::move(j));
  }
  return jobs;
}

GenerationOptions options_of(const Job& j) {
  GenerationOptions o;
  const ApiRequest& q = j.req;
  o.max_new_tokens = q.tokens_to_generate;
  o.sampling.temperature = q.temperature;
  o.sampling.top_k = q.top_k;
  o.sampling.top_p = q.top_p > 0 ? q.top_p : 1.0;
  o.sampling.top_p_decay = q.top_p_decay;
  o.sampling.top_p_bound = q.top_p_bound;
  o.sampling.seed = j.seed;
  o.eod_id = j.stop;
  o.log_probs = o.prompt_log_probs = q.logprobs;
  o.beam_size = std::max(1, q.beam_width);
  o.length_penalty = q.length_penalty;
  return o;
}

// The JSON answer to one job: text (prompt and generation, decoded), segments (each token's text)
// and logprobs (of every token after the first), per prompt or per beam; beams add scores.
std::string answer_json(const Job& j, const Tokenizer& tok,
                        const std::vector<std::vector<int32_t>>& prompts,
                        const std::vector<std::vector<int32_t>>& completions,
                        const std::vector<std::vector<float>>& prompt_lp,
                        const std::vector<std::vector<float>>& completion_lp,
                        const std::vector<double>& scores) {
  std::string text = "[", segments = "[", logprobs = "[";
  for (size_t i = 0; i < completions.size(); ++i) {
    std::vector<int32_t> all = prompts[i];
    all.insert(all.end(), completions[i].begin(), completions[i].end());
    const char* sep = i ? ", " : "";
    text += sep + json_quote(tok.decode(all));
    segments += sep;
    segments += "[";
    for (size_t t = 0; t < all.size(); ++t)
      segments += (t ? ", " : "") + json_quote(tok.token_bytes(all[t]));
    segments += "]";
    if (j.req.logprobs) {
      logprobs += sep;
      logprobs += "[";
      std::vector<float> lp = prompt_lp.at(i);
      lp.insert(lp.end(), completion_lp.at(i).begin(), completion_lp.at(i).end());
      for (size_t t = 0; t < lp.size(); ++t) logprobs += (t ? ", " : "") + json_number(lp[t], 9);
      logprobs += "]";
    }
  }
  std::string out = "{\"text\": " + text + "], \"segments\": " + segments +
                    "], \"logprobs\": " + (j.req.logprobs ? logprobs + "]" : std::string("null"));
  if (j.req.beam_width > 0) {
    out += ", \"scores\": [";
    for (size_t i = 0; i < scores.size(); ++i) out += (i ? ", " : "") + json_number(scores[i], 17);
    out += "]";
  }
  return out + "}\n";
}

// Runs one batch on every rank; rank 0 answers the jobs.
void run_batch(GPTModel& model, const ParallelContext& ctx, const Tokenizer& tok,
               std::vector<std::shared_ptr<Job>>& jobs, bool root, int64_t positions) {
  int64_t longest = 0, budget = 0;
  int sequences = 0;
  for (const auto& j : jobs) {
    for (const auto& p : j->prompts) longest = std::max<int64_t>(longest, p.size());
    budget = std::max(budget, j->req.tokens_to_generate);
    sequences += j->req.beam_width > 0 ? j->req.beam_width : static_cast<int>(j->prompts.size());
  }
  // The caches may not fit (memory differs by stage): every rank learns whether all could
  // allocate, and a batch that does not fit is refused together.
  const bool beam = jobs.size() == 1 && jobs[0]->req.beam_width > 0;
  std::unique_ptr<InferenceEngine> built;
  std::string why;
  try {
    built = std::make_unique<InferenceEngine>(
        model, ctx, sequences, std::min(positions, longest + std::max<int64_t>(budget, 1)));
    if (beam) built->reserve_reorder();
  } catch (const std::exception& e) {
    why = e.what();
  }
  double failed = why.empty() ? 0 : 1;
  ctx.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (failed != 0) {
    built.reset();
    if (root)
      for (auto& j : jobs)
        j->answer(503, "the batch does not fit in memory (" +
                           (why.empty() ? std::string("on another rank") : why) +
                           "); send fewer or shorter prompts\n");
    return;
  }
  InferenceEngine& engine = *built;
  if (beam) {
    Job& j = *jobs[0];
    const GenerationResult r = beam_search(engine, ctx, j.prompts[0], options_of(j));
    if (root) {
      const std::vector<std::vector<int32_t>> prompts(r.completions.size(), j.prompts[0]);
      j.answer(200, answer_json(j, tok, prompts, r.completions, r.prompt_log_probs,
                                r.completion_log_probs, r.beam_scores));
    }
    return;
  }
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerationOptions> opts;
  for (const auto& j : jobs)
    for (size_t i = 0; i < j->prompts.size(); ++i) {
      prompts.push_back(j->prompts[i]);
      opts.push_back(options_of(*j));
      opts.back().sample_stream = static_cast<int64_t>(i);
    }
  const GenerationResult r = generate(engine, ctx, prompts, opts);
  if (!root) return;
  size_t at = 0;
  for (const auto& j : jobs) {
    const size_t n = j->prompts.size();
    auto slice = [&](const std::vector<std::vector<float>>& v) {
      return v.empty() ? std::vector<std::vector<float>>(n)
                       : std::vector<std::vector<float>>(v.begin() + at, v.begin() + at + n);
    };
    const std::vector<std::vector<int32_t>> comp(r.completions.begin() + at,
                                                 r.completions.begin() + at + n);
    j->answer(200, answer_json(*j, tok, j->prompts, comp, slice(r.prompt_log_probs),
                               slice(r.completion_log_probs), {}));
    at += n;
  }
}

// ---- HTTP ----------------------------------------------------------------------------------

// SIGINT, SIGTERM and SIGUSR1 only set this flag; the batch loop polls it. SIGUSR1 is the one
// Open MPI's mpirun forwards to every rank and then waits for them: a SIGTERM or SIGINT to mpirun
// itself is an abort there (the ranks are killed a second later and mpirun exits 1), so under
// mpirun signal rank 0 (its pid is in the listening line) or send mpirun SIGUSR1.
std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int) {
  g_stop = true;
}

// The stop handlers for the server's lifetime; the previous ones come back when it returns.
class StopSignals {
 public:
  StopSignals() {
    g_stop = false;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGUSR1, &sa, &old_usr1_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGUSR1, &old_usr1_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
  struct sigaction old_usr1_ {};
};

struct Front {
  std::shared_ptr<const Tokenizer> tok;
  int64_t positions = 0, vocab = 0;
  ServerOptions opts;
  JobQueue queue;
  std::atomic<bool> stopping{false};  // set once the batch loop has ended
  std::atomic<uint64_t> requests{0}, refused{0};
};

http::response<http::string_body> reply(int status, const std::string& body, unsigned version,
                                        const char* type) {
  http::response<http::string_body> res{static_cast<http::status>(status), version};
  res.set(http::field::server, "tessera-serve");
  res.set(http::field::content_type, type);
  res.body() = body;
  return res;
}

// The job of a valid request, tokenized and checked against the model; throws ApiError.
std::shared_ptr<Job> make_job(const Front& f, const std::string& body) {
  auto j = std::make_shared<Job>();
  j->req = parse_api_request(body);
  const ApiRequest& q = j->req;
  if (static_cast<int>(q.prompts.size()) > f.opts.max_prompts)
    throw ApiError("Maximum number of prompts is " + std::to_string(f.opts.max_prompts) + " (got " +
                   std::to_string(q.prompts.size()) + ")");
  j->stop = q.stop_token >= 0 ? static_cast<int32_t>(q.stop_token) : f.tok->eod_id();
  if (j->stop >= f.vocab)
    throw ApiError("stop_token " + std::to_string(j->stop) + " is outside the vocabulary of " +
                   std::to_string(f.vocab) + " tokens");
  for (size_t i = 0; i < q.prompts.size(); ++i) {
    std::vector<int32_t> ids;
    if (q.add_BOS) ids.push_back(f.tok->bos_id());
    const std::vector<int32_t> text = f.tok->encode(q.prompts[i]);
    ids.insert(ids.end(), text.begin(), text.end());
    if (ids.empty())
      throw ApiError("prompt " + std::to_string(i + 1) + " is empty (give it text, or add_BOS)");
    if (static_cast<int64_t>(ids.size()) + std::max<int64_t>(q.tokens_to_generate, 1) > f.positions)
      throw ApiError("prompt " + std::to_string(i + 1) + " has " + std::to_string(ids.size()) +
                     (ids.size() == 1 ? " token" : " tokens") + "; with tokens_to_generate " +
                     std::to_string(q.tokens_to_generate) + " that is more than the context of " +
                     std::to_string(f.positions) + " positions");
    j->prompts.push_back(std::move(ids));
  }
  if (q.random_seed >= 0) {
    j->seed = static_cast<uint64_t>(q.random_seed);
  } else {
    std::random_device rd;
    j->seed = (static_cast<uint64_t>(rd()) << 21) ^ rd();  // below 2^53: exact in the message
  }
  return j;
}

const char* const kShuttingDown = "the server is shutting down\n";

http::response<http::string_body> answer(Front& f, const http::request<http::string_body>& req,
                                         const std::string& peer) {
  const unsigned v = req.version();
  std::string target(req.target());
  if (const size_t q = target.find('?'); q != std::string::npos) target.resize(q);
  if (target != "/api")
    return reply(404, "no such path '" + target + "' (the API is PUT /api)\n", v, "text/plain");
  if (req.method() != http::verb::put && req.method() != http::verb::post) {
    auto r = reply(405, "use PUT or POST on /api\n", v, "text/plain");
    r.set(http::field::allow, "PUT, POST");
    return r;
  }
  const uint64_t id = ++f.requests;
  Timer t;
  std::shared_ptr<Job> job;
  try {
    job = make_job(f, req.body());
  } catch (const ApiError& e) {
    std::fprintf(stderr, "tessera-serve: request %llu from %s: 400 %s\n",
                 static_cast<unsigned long long>(id), peer.c_str(), e.what());
    return reply(400, std::string(e.what()) + "\n", v, "text/plain");
  }
  auto done = job->reply.get_future();
  std::pair<int, std::string> result{503, kShuttingDown};
  if (f.queue.push(job)) result = done.get();  // answered by the batch loop or by the stop
  const auto& [status, body] = result;
  if (status == 503) ++f.refused;
  size_t prompt_tokens = 0;
  for (const auto& p : job->prompts) prompt_tokens += p.size();
  std::fprintf(stderr,
               "tessera-serve: request %llu from %s: %d, %zu prompts (%zu tokens), %lld "
               "tokens to generate%s, %.3f s\n",
               static_cast<unsigned long long>(id), peer.c_str(), status, job->prompts.size(),
               prompt_tokens, static_cast<long long>(job->req.tokens_to_generate),
               job->req.beam_width > 0 ? " (beam search)" : "", t.seconds());
  return reply(status, body, v, status == 200 ? "application/json" : "text/plain");
}

// Waits for the first byte of the connection's next request: true when the client sent something
// (or closed: the read tells which), false when the server stops while the connection is idle. A
// connection taken during the stop gets `late_ms` for its request to arrive.
bool wait_for_request(tcp::socket& sock, const Front& f, int late_ms) {
  pollfd p{sock.native_handle(), POLLIN, 0};
  for (;;) {
    const bool stopping = f.stopping;
    const int r = ::poll(&p, 1, stopping ? late_ms : 100);
    if (r > 0 || (r < 0 && errno != EINTR)) return true;
    if (stopping && r == 0) return false;
  }
}

// One connection: requests in turn (keep-alive) until the client closes, an error, or the stop.
void session(Front& f, tcp::socket& sock) {
  beast::error_code ec;
  std::string peer = "?";
  if (auto ep = sock.remote_endpoint(ec); !ec)
    peer = ep.address().to_string() + ":" + std::to_string(ep.port());
  beast::flat_buffer buf;
  for (bool first = true;; first = false) {
    if (buf.size() == 0 && !wait_for_request(sock, f, first ? 500 : 0)) break;
    http::request_parser<http::string_body> parser;
    parser.body_limit(64u << 20);
    http::read(sock, buf, parser, ec);
    if (ec == http::error::end_of_stream) break;
    if (ec) {
      // A request the parser refuses gets its reason; a dropped connection gets nothing.
      if (ec.category() != boost::system::system_category() &&
          ec.category() != net::error::get_misc_category() && ec != beast::error::timeout) {
        auto r = reply(400, "malformed HTTP request: " + ec.message() + "\n", 11, "text/plain");
        r.keep_alive(false);
        r.prepare_payload();
        http::write(sock, r, ec);
      }
      break;
    }
    const http::request<http::string_body>& req = parser.get();
    http::response<http::string_body> res;
    try {
      res = answer(f, req, peer);
    } catch (const std::exception& e) {
      res = reply(500, std::string("generation failed: ") + e.what() + "\n", req.version(),
                  "text/plain");
    }
    res.keep_alive(req.keep_alive() && !f.stopping);
    res.prepare_payload();
    http::write(sock, res, ec);
    if (ec || !res.keep_alive()) break;
  }
  sock.shutdown(tcp::socket::shutdown_both, ec);
}

// Every connection's thread, joined before the server returns: no thread outlives it.
class Connections {
 public:
  // Serves `sock` on a thread of its own.
  void start(Front& f, tcp::socket sock) {
    auto c = std::make_unique<Conn>(std::move(sock));
    Conn* raw = c.get();
    c->thread = std::thread([this, &f, raw] {
      session(f, raw->sock);
      std::lock_guard<std::mutex> g(m_);
      raw->done = true;
      cv_.notify_all();
    });
    std::lock_guard<std::mutex> g(m_);
    live_.push_back(std::move(c));
  }
  // Joins the threads whose connection has ended (their sockets close here).
  void reap() {
    std::list<std::unique_ptr<Conn>> ended;
    {
      std::lock_guard<std::mutex> g(m_);
      for (auto it = live_.begin(); it != live_.end();)
        if ((*it)->done)
          ended.splice(ended.end(), live_, it++);
        else
          ++it;
    }
    for (auto& c : ended) c->thread.join();
  }
  // At the stop (the queue closed, no connection left to accept): waits up to `grace` for every
  // exchange to end, then cuts the connections of clients that still send or read nothing, and
  // joins every thread.
  void finish(std::chrono::milliseconds grace) {
    std::unique_lock<std::mutex> g(m_);
    cv_.wait_for(g, grace, [&] {
      return std::all_of(live_.begin(), live_.end(), [](const auto& c) { return c->done; });
    });
    for (auto& c : live_)
      if (!c->done) ::shutdown(c->sock.native_handle(), SHUT_RDWR);  // its blocked call returns
    std::list<std::unique_ptr<Conn>> all = std::move(live_);
    live_.clear();
    g.unlock();
    for (auto& c : all) c->thread.join();
  }
  size_t count() {
    std::lock_guard<std::mutex> g(m_);
    return live_.size();
  }

 private:
  struct Conn {
    explicit Conn(tcp::socket s) : sock(std::move(s)) {}
    tcp::socket sock;   // closed only once its thread has been joined
    bool done = false;  // guarded by m_
    std::thread thread;
  };
  std::mutex m_;
  std::condition_variable cv_;
  std::list<std::unique_ptr<Conn>> live_;
};

// Takes connections until asked to stop, then every connection already waiting, so a client that
// connected before the stop gets an answer (503) rather than a reset.
void accept_loop(Front& f, net::io_context& io, tcp::acceptor& acceptor, Connections& conns,
                 const std::atomic<bool>& stop) {
  beast::error_code ec;
  acceptor.non_blocking(true, ec);
  pollfd p{acceptor.native_handle(), POLLIN, 0};
  for (;;) {
    const bool last = stop;  // read before the poll: after the stop, one more pass drains
    const int r = ::poll(&p, 1, last ? 0 : 100);
    if (r > 0) {
      for (;;) {
        tcp::socket sock(io);
        acceptor.accept(sock, ec);
        if (ec == net::error::would_block || ec == net::error::try_again) break;
        if (ec) {  // a connection reset before it was taken, or out of descriptors: try later
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          break;
        }
        conns.start(f, std::move(sock));
      }
    }
    conns.reap();
    if (last) return;
  }
}

// Rank 0's HTTP side: the acceptor's thread and the connections, stopped and joined in order on
// every path out of the server (the normal stop, or an exception leaving the batch loop).
class HttpFront {
 public:
  HttpFront(Front& f, tcp::acceptor& acceptor, net::io_context& io) : f_(f), acceptor_(acceptor) {
    // The threads start with the stop signals blocked (and keep them blocked): the signal goes to
    // the batch loop's thread, and a connection's blocking read is never interrupted by it.
    sigset_t stop_signals, old;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &stop_signals, &old);
    acceptor_thread_ = std::thread(accept_loop, std::ref(f), std::ref(io), std::ref(acceptor),
                                   std::ref(conns_), std::cref(stop_accepting_));
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  // Refuses the queued requests (503), takes and answers the connections already waiting, gives
  // the exchanges in progress a grace period, and joins every thread.
  void stop() {
    if (stopped_) return;
    stopped_ = true;
    f_.stopping = true;
    for (auto& j : f_.queue.close()) j->answer(503, kShuttingDown);
    stop_accepting_ = true;
    acceptor_thread_.join();
    beast::error_code ec;
    acceptor_.close(ec);
    conns_.finish(std::chrono::seconds(5));
  }
  ~HttpFront() { stop(); }
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

 private:
  Front& f_;
  tcp::acceptor& acceptor_;
  Connections conns_;
  std::atomic<bool> stop_accepting_{false};
  std::thread acceptor_thread_;
  bool stopped_ = false;
};

}  // namespace

void serve_text_generation(GPTModel& model, const ParallelContext& ctx,
                           std::shared_ptr<const Tokenizer> tok, const ServerOptions& opts) {
  const bool root = ctx.world->rank() == 0;
  StopSignals signals;
  // Rank 0 listens; every rank learns whether it could.
  Front front;
  front.tok = tok;
  front.positions = opts.context > 0 ? opts.context : model.config().max_positions();
  front.vocab = model.config().vocab_size;
  front.opts = opts;
  net::io_context io(1);
  tcp::acceptor acceptor(io);
  std::string listen_error;
  if (root) {
    beast::error_code ec;
    const auto address = net::ip::make_address(opts.host, ec);
    if (ec) {
      listen_error = "--host '" + opts.host + "' is not an IP address";
    } else {
      const tcp::endpoint ep(address, static_cast<unsigned short>(opts.port));
      acceptor.open(ep.protocol(), ec);
      if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
      if (!ec) acceptor.bind(ep, ec);
      if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
      if (ec)
        listen_error = "--port " + std::to_string(opts.port) + ": cannot listen on " + opts.host +
                       ":" + std::to_string(opts.port) + ": " + ec.message();
    }
  }
  double failed = listen_error.empty() ? 0 : 1;
  ctx.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (failed != 0) throw ConfigError(root ? listen_error : "rank 0 cannot listen");
  std::unique_ptr<HttpFront> http_front;
  if (root) {
    const int port = acceptor.local_endpoint().port();
    std::fprintf(stderr, "tessera-serve: listening on http://%s:%d/api (PUT or POST); pid %d\n",
                 opts.host.c_str(), port, static_cast<int>(getpid()));
    http_front = std::make_unique<HttpFront>(front, acceptor, io);
    if (opts.on_listening) opts.on_listening(port);
  }
  // The batch loop. Rank 0 announces each batch (or the stop) with a small all-reduce the other
  // ranks poll for, so an idle server does not spin in MPI.
  Tensor header({2});
  for (;;) {
    std::vector<std::shared_ptr<Job>> jobs;
    if (root) {
      while (jobs.empty() && !g_stop)
        jobs = front.queue.take(opts.max_batch_prompts, std::chrono::milliseconds(100));
      if (g_stop) {  // taken while the signal came: queued at the stop, so refused with the rest
        for (auto& j : jobs) j->answer(503, kShuttingDown);
        jobs.clear();
      }
    }
    std::vector<double> msg;
    if (root) msg = jobs.empty() ? std::vector<double>{kStop} : encode_batch(jobs);
    header.f32()[0] = root ? 1.f : 0.f;
    header.f32()[1] = 0.f;
    auto op = ctx.world->all_reduce_async(header, ReduceOp::Sum);
    while (!op->test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    op->wait();
    broadcast_f64(*ctx.world, msg, 0);
    if (msg.at(0) == kStop) break;
    std::vector<std::shared_ptr<Job>> run = root ? jobs : decode_batch(msg);
    if (root && run.size() > 1) {
      size_t prompts = 0;
      for (const auto& j : run) prompts += j->prompts.size();
      std::fprintf(stderr, "tessera-serve: batch of %zu requests (%zu prompts)\n", run.size(),
                   prompts);
    }
    try {
      run_batch(model, ctx, *tok, run, root, front.positions);
    } catch (const ConfigError& e) {  // a request the checks above let through (every rank)
      if (root)
        for (auto& j : run) j->answer(400, std::string(e.what()) + "\n");
    } catch (const std::exception& e) {  // the job ends; its clients hear why before it does
      if (root)
        for (auto& j : run) j->answer(500, std::string("generation failed: ") + e.what() + "\n");
      throw;
    }
  }
  if (root) {
    http_front->stop();
    std::fprintf(stderr, "tessera-serve: stopped after %llu requests (%llu answered 503)\n",
                 static_cast<unsigned long long>(front.requests.load()),
                 static_cast<unsigned long long>(front.refused.load()));
  }
}

}  // namespace tessera
