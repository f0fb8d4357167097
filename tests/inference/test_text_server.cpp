// test_text_server.cpp: tessera-serve's stop with requests in flight (issue 27). Each round starts
// the server in this process, sends 25 concurrent requests and SIGTERM, and checks that every
// request sent before the signal got an answer (200 or 503), idle keep-alive connections were
// closed, and the server returned (every thread it started joined: under ASan a thread still
// writing after it returned is a use after free). CI runs it in the sanitizer build too.
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "inference/text_server.hpp"
#include "model/params.hpp"

using namespace tessera;

namespace {
namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Bytes as tokens, 256 ends a document: a tokenizer without files.
class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer() {
    for (int i = 0; i < 256; ++i) bytes_.emplace_back(1, static_cast<char>(i));
    bytes_.emplace_back("<eod>");
  }
  int64_t vocab_size() const override { return 257; }
  int32_t eod_id() const override { return 256; }
  std::string name() const override { return "bytes"; }
  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<int32_t>& out, Cache&) const override {
    for (const char c : text) out.push_back(static_cast<unsigned char>(c));
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (const int32_t id : ids) s += token_bytes(id);
    return s;
  }
  const std::string& token_bytes(int32_t id) const override { return bytes_.at(id); }

 private:
  std::vector<std::string> bytes_;
};

// Blocks SIGINT/SIGTERM in the threads started while it lives (the clients), so the signal the
// test sends goes to the server's thread or the test's, never into a client's blocking read.
struct BlockStopSignals {
  sigset_t old;
  BlockStopSignals() {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGINT);
    sigaddset(&s, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &s, &old);
  }
  ~BlockStopSignals() { pthread_sigmask(SIG_SETMASK, &old, nullptr); }
};

// One HTTP exchange on a fresh connection: the status, or 0 when no answer came (refused,
// reset, closed without a response). `sent` (when given) counts the request once its connect and
// write have returned, whatever they returned: the test signals only after every request is in
// the server's backlog and socket buffer, so a request "sent before the signal" is one the server
// must answer (a client descheduled between starting and writing would otherwise meet a closed
// port, or the stop's 500 ms wait for a late request, and read as a lost request).
int put(int port, const std::string& body, std::string* answer, std::atomic<int>* sent = nullptr) {
  struct Count {
    std::atomic<int>* n;
    ~Count() {
      if (n) ++*n;
    }
  };
  try {
    net::io_context io;
    tcp::socket sock(io);
    http::request<http::string_body> req{http::verb::put, "/api", 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    {
      Count count{sent};
      sock.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)));
      http::write(sock, req);
    }
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(sock, buf, res);
    if (answer) *answer = res.body();
    return static_cast<int>(res.result_int());
  } catch (const std::exception&) {
    return 0;
  }
}

struct Model {
  GPTConfig cfg;
  std::unique_ptr<Backend> be = make_cpu_backend();
  ParallelContext ctx = ParallelContext::single();
  std::unique_ptr<GPTModel> model;
  Model() {
    cfg.num_layers = 2;
    cfg.hidden_size = 32;
    cfg.num_attention_heads = 2;
    cfg.seq_length = 128;
    cfg.vocab_size = 257;
    cfg.make_vocab_size_divisible_by = 1;
    model = std::make_unique<GPTModel>(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, *ctx.tp);
    model->init_parameters(5);
  }
};
}  // namespace

TEST(TextServer, SigtermWithRequestsInFlightAnswersEveryRequestAndJoinsEveryThread) {
  Model m;
  auto tok = std::make_shared<const ByteTokenizer>();
  std::mt19937 rng(27);
  int answered_200 = 0, answered_503 = 0;
  constexpr int kRounds = 20, kClients = 25;
  for (int round = 0; round < kRounds; ++round) {
    std::promise<int> listening;
    ServerOptions so;
    so.host = "127.0.0.1";
    so.port = 0;
    so.max_batch_prompts = 4;  // several batches, so the signal finds some requests queued
    so.on_listening = [&](int port) { listening.set_value(port); };
    std::exception_ptr server_error;
    std::atomic<bool> returned{false};
    std::thread server([&] {
      try {
        serve_text_generation(*m.model, m.ctx, tok, so);
      } catch (...) {
        server_error = std::current_exception();
      }
      returned = true;
    });
    const int port = listening.get_future().get();

    std::vector<int> status(kClients, -1);
    std::vector<std::string> bodies(kClients);
    std::vector<std::thread> clients;
    std::atomic<int> sent{0};  // requests written (or refused) by their clients
    std::atomic<int> idle_connected{0};
    std::vector<int> idle_closed(2, 0);
    {
      BlockStopSignals block;
      for (int c = 0; c < kClients; ++c)
        clients.emplace_back([&, c] {
          const std::string body = "{\"prompts\": [\"request " + std::to_string(c) +
                                   "\"], \"tokens_to_generate\": 48, \"temperature\": 0}";
          status[c] = put(port, body, &bodies[c], &sent);
        });
      // Two idle keep-alive connections: connected, nothing sent; the stop must close them.
      for (int k = 0; k < 2; ++k)
        clients.emplace_back([&, k] {
          try {
            net::io_context io;
            tcp::socket sock(io);
            boost::system::error_code cec;
            sock.connect(
                tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)),
                cec);
            ++idle_connected;
            if (cec) {
              idle_closed[k] = 3;
              return;
            }
            char byte;
            boost::system::error_code ec;
            sock.read_some(net::buffer(&byte, 1), ec);  // returns when the server closes
            idle_closed[k] = ec == net::error::eof ? 1 : 2;
          } catch (const std::exception&) {
            idle_closed[k] = 3;
          }
        });
    }
    // Every connection is made before the signal: a connection the server has not yet accepted
    // sits in its backlog, which the stop drains.
    while (sent < kClients || idle_connected < 2)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 40));
    ASSERT_EQ(kill(getpid(), SIGTERM), 0);
    for (auto& t : clients) t.join();
    server.join();
    ASSERT_TRUE(returned);
    if (server_error) std::rethrow_exception(server_error);
    for (int c = 0; c < kClients; ++c) {
      EXPECT_TRUE(status[c] == 200 || status[c] == 503)
          << "round " << round << ", request " << c << ": status " << status[c]
          << " (0: no answer)";
      if (status[c] == 200) {
        ++answered_200;
        EXPECT_NE(bodies[c].find("\"text\": [\"request " + std::to_string(c)), std::string::npos)
            << bodies[c];
      } else if (status[c] == 503) {
        ++answered_503;
        EXPECT_EQ(bodies[c], "the server is shutting down\n");
      }
    }
    EXPECT_EQ(idle_closed[0], 1) << "round " << round << ": an idle connection was not closed";
    EXPECT_EQ(idle_closed[1], 1) << "round " << round << ": an idle connection was not closed";
    // After the stop nothing listens on the port any more.
    EXPECT_EQ(put(port, "{\"prompts\": [\"late\"]}", nullptr), 0);
  }
  // Both outcomes happened: batches finished during the stop, and queued requests were refused.
  EXPECT_GT(answered_200, 0);
  EXPECT_GT(answered_503, 0);
  std::printf("%d rounds of %d requests and SIGTERM: %d answered 200, %d answered 503\n", kRounds,
              kClients, answered_200, answered_503);
}
