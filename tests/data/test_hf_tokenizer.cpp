// test_hf_tokenizer.cpp: Hugging Face tokenizer.json support. Against Tokenizers.js
// (@huggingface/tokenizers, run with node) on real tokenizer files and a multilingual corpus:
// identical ids and decoded text, ill-formed UTF-8 included; the preprocessing pipeline's shards
// hold the library's ids + EOD. Hand-derived cases pin the `tokenizers` library's semantics where
// the JavaScript port differs or has no equivalent (regex case folding and \s, Split behaviors,
// Metaspace splitting, Digits, BPE options, decoders), the end-of-document rules, and the refusal
// of unsupported parts with one line naming the file and the part.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>

#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/json.hpp"
#include "data/hf_tokenizer.hpp"
#include "data/preprocess.hpp"
#include "data/shard.hpp"
#include "data/split_patterns.hpp"
#include "data/tokenizer.hpp"

using namespace tessera;

namespace {

const std::string kHfDir = TESSERA_SOURCE_DIR "/data/hf-tokenizers";
const std::string kReference = TESSERA_SOURCE_DIR "/tests/data/hf_reference.mjs";
const std::string kCorpus = TESSERA_SOURCE_DIR "/tests/data/hf_tokenizer_corpus.txt";
const char* kFetch = "missing: run scripts/get-hf-tokenizers.sh (scripts/setup.sh runs it)";

bool file_exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fetched tokenizer, loaded once per process; nullptr (and a test failure) when it is missing.
std::shared_ptr<const HfTokenizer> hf(const std::string& name) {
  static std::map<std::string, std::shared_ptr<const HfTokenizer>> loaded;
  auto it = loaded.find(name);
  if (it != loaded.end()) return it->second;
  const std::string file = kHfDir + "/" + name + "/tokenizer.json";
  if (!file_exists(file)) {
    ADD_FAILURE() << file << " " << kFetch;
    return nullptr;
  }
  return loaded[name] = HfTokenizer::load(kHfDir + "/" + name);
}

struct Reference {
  std::vector<int32_t> ids;
  std::string decoded;
};

// Tokenizers.js on each text (written to a file as bytes; node reads it as UTF-8).
std::vector<Reference> reference(const std::string& name, const std::vector<std::string>& texts) {
  char dir[] = "/tmp/tessera_hfref_XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  std::string cmd = "node " + kReference + " " + kHfDir + "/" + name + " files";
  std::vector<std::string> files;
  for (size_t i = 0; i < texts.size(); ++i) {
    files.push_back(std::string(dir) + "/" + std::to_string(i) + ".txt");
    std::ofstream(files.back(), std::ios::binary) << texts[i];
    cmd += " " + files.back();
  }
  const std::string out_file = std::string(dir) + "/out.json";
  const int rc = std::system((cmd + " > " + out_file).c_str());
  EXPECT_EQ(rc, 0) << "node failed: is nodejs installed (scripts/setup.sh)? " << cmd;
  std::vector<Reference> refs;
  try {
    const std::string json = read_all(out_file);
    JsonReader r(json);
    const JsonValue v = r.value();
    for (const JsonValue& item : v.items) {
      Reference ref;
      for (const JsonValue& id : item.find("ids")->items)
        ref.ids.push_back(static_cast<int32_t>(id.number));
      ref.decoded = item.find("decoded")->string;
      refs.push_back(std::move(ref));
    }
  } catch (const JsonError& e) {
    ADD_FAILURE() << "reference output does not parse: " << e.message;
  }
  for (const std::string& f : files) std::remove(f.c_str());
  std::remove(out_file.c_str());
  rmdir(dir);
  EXPECT_EQ(refs.size(), texts.size());
  return refs;
}

std::vector<std::string> corpus_documents() {
  const std::string text = read_all(kCorpus);
  EXPECT_GT(text.size(), 5000u) << kCorpus;
  std::vector<std::string> docs;
  const std::string sep = "\n=== document ===\n";
  size_t i = 0;
  while (true) {
    const size_t k = text.find(sep, i);
    docs.push_back(text.substr(i, k == std::string::npos ? std::string::npos : k - i));
    if (k == std::string::npos) break;
    i = k + sep.size();
  }
  docs.push_back(text);  // and the whole file as one text
  return docs;
}

// A tokenizer.json written to a fresh directory (with tokenizer_config.json when `config` is set).
std::string write_tokenizer(const std::string& json, const std::string& config = "") {
  char dir[] = "/tmp/tessera_hftok_XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  std::ofstream(std::string(dir) + "/tokenizer.json") << json;
  if (!config.empty()) std::ofstream(std::string(dir) + "/tokenizer_config.json") << config;
  return std::string(dir) + "/tokenizer.json";
}

// A tokenizer.json with a tiny BPE model and the given parts (JSON texts).
std::string tiny(const std::string& pre_tokenizer, const std::string& normalizer = "null",
                 const std::string& model_extra = "", const std::string& added = "[]",
                 const std::string& decoder = "null") {
  return R"({"version": "1.0", "added_tokens": )" + added + R"(, "normalizer": )" + normalizer +
         R"(, "pre_tokenizer": )" + pre_tokenizer + R"(, "post_processor": null, "decoder": )" +
         decoder +
         R"(, "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", )"
         R"("vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "abc": 5, "bc": 6, "</s>": 7, )"
         R"("<0xC3>": 8, "<0xA9>": 9, "<0x0A>": 10, "x": 11}, "merges": ["a b", "ab c"])" +
         model_extra + "}}";
}

std::vector<std::string> pieces_of(const std::string& json, const std::string& text) {
  return HfTokenizer::load(write_tokenizer(json))->pretokenize(text);
}

std::string error_of(const std::string& json, const std::string& config = "",
                     const std::string& eod = "", std::string* path = nullptr) {
  const std::string p = write_tokenizer(json, config);
  if (path) *path = p;
  try {
    HfTokenizer::load(p, eod);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

using Pieces = std::vector<std::string>;

Pieces split_pieces(SplitPattern p, const std::string& s) {
  std::vector<std::pair<size_t, size_t>> m;
  split_pattern_find_all(p, s, m);
  Pieces out;
  for (auto [b, e] : m) out.push_back(s.substr(b, e - b));
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Against Tokenizers.js

class HfReference : public ::testing::TestWithParam<std::string> {};

TEST_P(HfReference, IdsAndDecodedTextEqualTokenizersJsOnTheCorpus) {
  const auto t = hf(GetParam());
  ASSERT_NE(t, nullptr);
  const std::vector<std::string> docs = corpus_documents();
  const std::vector<Reference> refs = reference(GetParam(), docs);
  ASSERT_EQ(refs.size(), docs.size());
  size_t ids = 0, bytes = 0, round_trips = 0;
  Tokenizer::Cache cache;  // one cache across texts, as a preprocessing worker keeps it
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int32_t> got;
    t->encode(docs[i], got, cache);
    ASSERT_FALSE(refs[i].ids.empty()) << "text " << i;
    EXPECT_EQ(got, refs[i].ids) << GetParam() << ", text " << i << ": " << docs[i].substr(0, 200);
    EXPECT_EQ(t->encode(docs[i]), got) << "a cold cache gives other ids";
    EXPECT_EQ(t->decode(got), refs[i].decoded) << GetParam() << ", text " << i;
    if (refs[i].decoded == docs[i]) {
      EXPECT_EQ(t->decode(got), docs[i]);
      ++round_trips;
    }
    ids += got.size();
    bytes += docs[i].size();
  }
  // Where the library's decode(encode(x)) is x, ours is too (equal outputs); it is not for texts
  // that the tokenizer changes: NFC composes a decomposed accent, SentencePiece-style decoding
  // turns a literal metaspace into a space and spaces out special tokens (the corpus, the texts
  // holding them, and the whole file).
  EXPECT_GE(round_trips, docs.size() - 4) << GetParam();
  std::cout << "[ " << GetParam() << " ] " << docs.size() << " texts, " << bytes
            << " bytes: " << ids << " ids identical to Tokenizers.js; decode(encode(x)) == x for "
            << round_trips << " texts" << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, HfReference,
                         ::testing::Values("llama3", "llama3_1", "gpt4o", "mistral_nemo", "llama2",
                                           "gpt-neox-style", "llama2-metaspace", "qwen2-regex"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(HfTokenizer, IllFormedUtf8IsReplacedAsAUtf8ReaderDoes) {
  // Each ill-formed sequence becomes U+FFFD per maximal subpart, as node reads the file.
  const std::vector<std::string> texts = {
      "lone continuation \x80 byte",
      "truncated \xE2\x82 euro and \xF0\x9F\x98 emoji",
      "overlong \xC0\xAF and \xE0\x80\x80 and surrogate \xED\xA0\x80 end",
      "out of range \xF5\x80\x80\x80 \xF4\x90\x80\x80 \xFF\xFE",
      "trailing lead byte \xC3",
      "mixed \xC3\xA9\xC3 valid \xE2\x82\xAC then \x80\x80\x80 <|end_of_text|>\xE2 </s>\xC3",
  };
  for (const char* name : {"llama3", "llama2", "gpt4o"}) {
    const auto t = hf(name);
    ASSERT_NE(t, nullptr);
    const std::vector<Reference> refs = reference(name, texts);
    ASSERT_EQ(refs.size(), texts.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(t->encode(texts[i]), refs[i].ids) << name << ", text " << i;
      EXPECT_EQ(t->decode(t->encode(texts[i])), refs[i].decoded) << name << ", text " << i;
    }
  }
}

TEST(HfTokenizer, KnownIdsVocabularySizesAndEndOfDocument) {
  const auto l3 = hf("llama3"), l31 = hf("llama3_1"), g4o = hf("gpt4o"), nemo = hf("mistral_nemo"),
             l2 = hf("llama2"), neox = hf("gpt-neox-style");
  ASSERT_TRUE(l3 && l31 && g4o && nemo && l2 && neox);
  // Tokenizers.js's README: "Hello World" -> [9906, 4435] with Llama 3's tokenizer.
  EXPECT_EQ(l3->encode("Hello World"), (std::vector<int32_t>{9906, 4435}));
  EXPECT_EQ(l3->token_bytes(4435), " World");
  EXPECT_EQ(l3->vocab_size(), 128256);  // 128000 + 256 special tokens
  EXPECT_EQ(l3->eod_id(), 128001);      // tokenizer_config.json: <|end_of_text|>
  EXPECT_EQ(l31->eod_id(), 128009);     // tokenizer_config.json: <|eot_id|>
  EXPECT_EQ(l31->token_to_id("<|eot_id|>"), 128009);
  EXPECT_EQ(l3->encode("<|end_of_text|>"), (std::vector<int32_t>{128001}));
  EXPECT_EQ(g4o->eod_id(), g4o->token_to_id("<|endoftext|>"));
  EXPECT_EQ(g4o->vocab_size(), 200019);  // <|endofprompt|> is 200018
  EXPECT_EQ(nemo->eod_id(), 2);          // </s>
  EXPECT_EQ(nemo->vocab_size(), 131072);
  EXPECT_EQ(l2->eod_id(), 2);
  EXPECT_EQ(l2->vocab_size(), 32000);
  // No tokenizer_config.json beside the GPT-NeoX-style file: the well-known <|endoftext|>.
  EXPECT_EQ(neox->eod_id(), 50256);
  EXPECT_EQ(neox->vocab_size(), 50257);
  // SentencePiece style: the metaspace is a space when a token continues text, byte tokens are
  // raw bytes; decode() strips the space the normalizer prepended.
  const int32_t hello = l2->token_to_id("\xE2\x96\x81Hello");
  ASSERT_GE(hello, 0);
  EXPECT_EQ(l2->encode("Hello"), (std::vector<int32_t>{hello}));
  EXPECT_EQ(l2->token_bytes(hello), " Hello");
  EXPECT_EQ(l2->decode({hello}), "Hello");
  EXPECT_EQ(l2->token_bytes(l2->token_to_id("<0x0A>")), "\n");
  EXPECT_EQ(l2->token_bytes(l2->token_to_id("<0xC3>")), "\xC3");
  // Streaming a multi-byte character over byte tokens gives its bytes in order.
  std::string streamed;
  for (int32_t id : l2->encode("\xF0\x9F\xA6\x99")) streamed += l2->token_bytes(id);  // U+1F999
  EXPECT_EQ(streamed, " \xF0\x9F\xA6\x99");
  // NFC: a decomposed é is tokenized as the precomposed one (GPT-2 itself would not).
  EXPECT_EQ(neox->encode("caf\x65\xCC\x81"), neox->encode("caf\xC3\xA9"));
  // The shard attribute: the XXH64 of tokenizer.json.
  const std::string bytes = read_all(kHfDir + "/llama3/tokenizer.json");
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(xxh64(bytes.data(), bytes.size())));
  EXPECT_EQ(l3->name(), std::string("hf:xxh64:") + hex);
  EXPECT_NE(l3->name(), l31->name());
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer regexes: the library's engine (Oniguruma) semantics, by hand

TEST(HfTokenizer, Gpt2PatternEqualsGpt2TokenizerOnRandomText) {
  std::mt19937 g(11);
  const std::vector<uint32_t> pool = {' ',    ' ',   ' ',     'a',    'Z',    '7',    '\'',  's',
                                      '\n',   '\t',  '!',     0xA0,   0x85,   0x3000, 0xE9,  0x301,
                                      0x4E2D, 0x661, 0x1F600, 0x2028, 0xFEFF, 0xBD,   0x1C5, 0x2B0};
  for (int trial = 0; trial < 500; ++trial) {
    std::string s;
    const int n = std::uniform_int_distribution<int>(0, 30)(g);
    for (int i = 0; i < n; ++i) {
      const uint32_t cp = pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(g)];
      std::string c;
      if (cp < 0x80) {
        c = static_cast<char>(cp);
      } else if (cp < 0x800) {
        c = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      } else if (cp < 0x10000) {
        c = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
             static_cast<char>(0x80 | (cp & 0x3F))};
      } else {
        c = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
             static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
      }
      s += c;
    }
    Pieces want;
    for (auto v : GPT2Tokenizer::pretokenize(s)) want.emplace_back(v);
    ASSERT_EQ(split_pieces(SplitPattern::Gpt2, s), want) << s;
  }
}

TEST(HfTokenizer, SplitPatternsFollowTheRegexEngine) {
  using P = SplitPattern;
  // cl100k / Llama 3: a space leaves a run of spaces for the word after it; newlines end a run.
  EXPECT_EQ(split_pieces(P::Cl100k, "I'm  here\n\n  x 12345 ab'S"),
            (Pieces{"I", "'m", " ", " here", "\n\n", " ", " x", " ", "123", "45", " ab", "'S"}));
  EXPECT_EQ(split_pieces(P::Cl100k, "(hello) \tworld!!\n\nok  "),
            (Pieces{"(hello", ")", " ", "\tworld", "!!\n\n", "ok", "  "}));
  // (?i:...) folds case the Unicode way: the long s (U+017F) matches 's'; GPT-2's is exact.
  EXPECT_EQ(split_pieces(P::Cl100k, "it'\xC5\xBF"), (Pieces{"it", "'\xC5\xBF"}));
  EXPECT_EQ(split_pieces(P::Gpt2, "it'\xC5\xBF it'S"),
            (Pieces{"it", "'", "\xC5\xBF", " it", "'", "S"}));
  // \s is White_Space: U+0085 is a space, U+FEFF is not (JavaScript's \s says the opposite).
  EXPECT_EQ(split_pieces(P::Gpt2,
                         "a\xC2\x85\xC2\x85"
                         "b\xEF\xBB\xBF"
                         "c"),
            (Pieces{"a", "\xC2\x85", "\xC2\x85", "b", "\xEF\xBB\xBF", "c"}));
  EXPECT_EQ(split_pieces(P::Qwen2, "x 12345"), (Pieces{"x", " ", "1", "2", "3", "4", "5"}));
  // o200k: an upper run takes the lower run after it; camelCase splits; a contraction attaches.
  EXPECT_EQ(split_pieces(P::O200k, "HTTPServer camelCase ABC def don't DON'T"),
            (Pieces{"HTTPServer", " camel", "Case", " ABC", " def", " don't", " DON'T"}));
  EXPECT_EQ(split_pieces(P::O200k, "a/b/c x ://\n\ny 12345"),
            (Pieces{"a", "/b", "/c", " x", " ://\n\n", "y", " ", "123", "45"}));
  // Letters that are both "upper" and "lower" in its classes (Lo, Lm, marks): the upper run gives
  // back its last such character to the lower run.
  EXPECT_EQ(split_pieces(P::O200k, "\xE6\x97\xA5\xE6\x9C\xAC ABC\xCC\x81 \xCC\x81x"),
            (Pieces{"\xE6\x97\xA5\xE6\x9C\xAC", " ABC\xCC\x81", " \xCC\x81x"}));
  // tekken: no contractions, single digits.
  EXPECT_EQ(split_pieces(P::Tekken, "don't 123"), (Pieces{"don", "'t", " ", "1", "2", "3"}));
  SplitPattern p;
  EXPECT_TRUE(find_split_pattern(split_pattern_regex(P::O200k), p));
  EXPECT_EQ(p, P::O200k);
  EXPECT_FALSE(find_split_pattern(R"(\w+|[^\w\s]+)", p));
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers, normalizers and added tokens: the library's rules, by hand

TEST(HfTokenizer, SplitBehaviors) {
  auto split = [](const std::string& behavior, bool invert) {
    return tiny(R"({"type": "Split", "pattern": {"String": "-"}, "behavior": ")" + behavior +
                R"(", "invert": )" + (invert ? "true" : "false") + "}");
  };
  const std::string s = "a-b--c";
  EXPECT_EQ(pieces_of(split("Removed", false), s), (Pieces{"a", "b", "c"}));
  EXPECT_EQ(pieces_of(split("Isolated", false), s), (Pieces{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(pieces_of(split("MergedWithPrevious", false), s), (Pieces{"a-", "b-", "-", "c"}));
  EXPECT_EQ(pieces_of(split("MergedWithNext", false), s), (Pieces{"a", "-b", "-", "-c"}));
  EXPECT_EQ(pieces_of(split("Contiguous", false), s), (Pieces{"a", "-", "b", "--", "c"}));
  EXPECT_EQ(pieces_of(split("Removed", true), s), (Pieces{"-", "-", "-"}));
}

TEST(HfTokenizer, MetaspaceDigitsByteLevelAndSequences) {
  const std::string ms = "\xE2\x96\x81";  // U+2581
  auto metaspace = [](const std::string& scheme, bool split) {
    return tiny(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": ")" + scheme +
                    R"(", "split": )" + (split ? "true" : "false") + "}",
                "null", "",
                R"([{"id": 7, "content": "</s>", "special": true, "normalized": false}])");
  };
  EXPECT_EQ(pieces_of(metaspace("always", true), "  hello world"),
            (Pieces{ms, ms + "hello", ms + "world"}));
  EXPECT_EQ(pieces_of(metaspace("always", false), "hi</s>there"),
            (Pieces{ms + "hi", ms + "there"}));
  // "first": only the text at offset 0 of the input gets the metaspace.
  EXPECT_EQ(pieces_of(metaspace("first", false), "hi</s>there"), (Pieces{ms + "hi", "there"}));
  EXPECT_EQ(pieces_of(metaspace("never", false), "hi there"), (Pieces{"hi" + ms + "there"}));
  // Digits: char::is_numeric, so the Arabic-Indic three counts too.
  EXPECT_EQ(
      pieces_of(tiny(R"({"type": "Digits", "individual_digits": true})"), "abc123de4\xD9\xA3"),
      (Pieces{"abc", "1", "2", "3", "de", "4", "\xD9\xA3"}));
  EXPECT_EQ(
      pieces_of(tiny(R"({"type": "Digits", "individual_digits": false})"), "abc123de4\xD9\xA3"),
      (Pieces{"abc", "123", "de", "4\xD9\xA3"}));
  EXPECT_EQ(pieces_of(tiny(R"({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true})"),
                      "hello world"),
            (Pieces{" hello", " world"}));
  EXPECT_EQ(
      pieces_of(tiny(R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false})"),
                "hello world"),
      (Pieces{"hello world"}));
  EXPECT_EQ(pieces_of(tiny(R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"},
                          {"type": "Digits", "individual_digits": true}]})"),
                      "ab 12 c"),
            (Pieces{"ab", "1", "2", "c"}));
}

TEST(HfTokenizer, Normalizers) {
  const std::string none = "null";
  EXPECT_EQ(pieces_of(tiny(none, R"({"type": "NFKC"})"), "\xEF\xAC\x81 \xE2\x85\xAB \xE2\x91\xA0"),
            (Pieces{"fi XII 1"}));
  EXPECT_EQ(pieces_of(tiny(none, R"({"type": "NFD"})"), "\xC3\xA9"), (Pieces{"e\xCC\x81"}));
  // Lowercase is character by character: İ -> i + combining dot, a final Σ stays σ.
  EXPECT_EQ(pieces_of(tiny(none, R"({"type": "Lowercase"})"),
                      "\xC3\x80"
                      "B \xC4\xB0 \xCE\xA3\xCE\xA3"),
            (Pieces{"\xC3\xA0"
                    "b i\xCC\x87 \xCF\x83\xCF\x83"}));
  EXPECT_EQ(pieces_of(tiny(none, R"({"type": "Strip", "strip_left": true, "strip_right": false})"),
                      " \xE3\x80\x80x "),
            (Pieces{"x "}));
  EXPECT_EQ(pieces_of(tiny(none, R"({"type": "Sequence", "normalizers": [
                          {"type": "Prepend", "prepend": "▁"},
                          {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})"),
                      "a b"),
            (Pieces{"\xE2\x96\x81"
                    "a\xE2\x96\x81"
                    "b"}));
}

TEST(HfTokenizer, AddedTokensSplitBeforeNormalization) {
  const auto t = HfTokenizer::load(write_tokenizer(tiny(
      R"({"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"})",
      R"({"type": "Lowercase"})", "",
      R"([{"id": 7, "content": "</S>", "special": true, "normalized": false, "lstrip": true, "rstrip": true},
          {"id": 11, "content": "x", "special": false, "normalized": true, "single_word": true},
          {"id": 12, "content": "ABC", "special": false, "normalized": false}])")));
  // "</S>" is matched in the raw text (it would not survive Lowercase) and takes the spaces around
  // it; the normalized "x" only as a whole word; "ABC" before lowercasing.
  EXPECT_EQ(t->encode("ab  </S>  c"), (std::vector<int32_t>{4, 7, 3}));
  EXPECT_EQ(t->encode("X xa ab"), (std::vector<int32_t>{11, 11, 1, 4}));
  EXPECT_EQ(t->encode("ABCabc"), (std::vector<int32_t>{12, 5}));
  EXPECT_EQ(t->vocab_size(), 13);
  EXPECT_EQ(t->eod_id(), 7);  // no config, no <|end_of_text|> or <|endoftext|>: </s>
}

// ---------------------------------------------------------------------------------------------
// The BPE model's options, by hand (vocabulary and merges of tiny()).

TEST(HfTokenizer, BpeModelOptions) {
  auto load = [](const std::string& extra) {
    return HfTokenizer::load(write_tokenizer(tiny("null", "null", extra)));
  };
  using V = std::vector<int32_t>;
  const auto plain = load("");
  EXPECT_EQ(plain->encode("abcab"), (V{5, 4}));       // a b -> ab (both), then ab c -> abc
  EXPECT_EQ(plain->encode("bc"), (V{2, 3}));          // no merge makes bc
  EXPECT_EQ(plain->encode("yyaz"), (V{0, 0, 1, 0}));  // unknown characters
  EXPECT_EQ(load(R"(, "fuse_unk": true)")->encode("yyaz"), (V{0, 1, 0}));
  EXPECT_EQ(load(R"(, "ignore_merges": true)")->encode("bc"), (V{6}));
  // byte_fallback: é (C3 A9) as its byte tokens, a character without them as unknown.
  EXPECT_EQ(load(R"(, "byte_fallback": true)")
                ->encode("\xC3\xA9"
                         "a\xC3\xBC"),
            (V{8, 9, 1, 0}));
  // continuing_subword_prefix and end_of_word_suffix take part in the symbol look-ups and merges.
  const auto affixed = HfTokenizer::load(write_tokenizer(
      R"({"added_tokens": [], "normalizer": null, "pre_tokenizer": null, "decoder": null,
          "model": {"type": "BPE", "unk_token": "<unk>", "continuing_subword_prefix": "##",
                    "end_of_word_suffix": "</w>",
                    "vocab": {"<unk>": 0, "a": 1, "##b": 2, "##c</w>": 3, "ab": 4, "abc</w>": 5,
                              "</s>": 6},
                    "merges": ["a ##b", "ab ##c</w>"]}})"));
  EXPECT_EQ(affixed->encode("abc"), (V{5}));
  EXPECT_EQ(affixed->encode("ab"), (V{1, 0}));  // "##b</w>" is not a token
}

TEST(HfTokenizer, Decoders) {
  using V = std::vector<int32_t>;
  const std::string sp_decoder = R"({"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
      {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";
  const auto t = HfTokenizer::load(write_tokenizer(tiny("null", "null", "", "[]", sp_decoder)));
  EXPECT_EQ(t->decode(V{8, 9, 1}),
            "\xC3\xA9"
            "a");
  // A run of byte tokens that is not UTF-8 becomes one U+FFFD per byte; token_bytes stays raw.
  EXPECT_EQ(t->decode(V{8, 1, 9, 9}),
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(t->token_bytes(9), "\xA9");
  const auto l2 = hf("llama2");
  ASSERT_NE(l2, nullptr);
  // Prepend adds one metaspace, Strip takes one space back.
  EXPECT_EQ(l2->decode(l2->encode(" two  spaces")), " two  spaces");
  const auto meta = HfTokenizer::load(write_tokenizer(
      tiny("null", "null", "", "[]",
           R"({"type": "Metaspace", "replacement": "x", "prepend_scheme": "always"})")));
  // The library drops every metaspace of the first token and spaces the others.
  EXPECT_EQ(meta->decode(V{11, 11, 1, 11}), " a ");
  EXPECT_EQ(meta->token_bytes(11), " ");
  const auto l3 = hf("llama3");
  ASSERT_NE(l3, nullptr);
  // ByteLevel: the bytes of all tokens, ill-formed UTF-8 replaced; token_bytes raw.
  const V euro = l3->encode("\xE2\x82\xAC");
  std::string streamed;
  for (int32_t id : euro) streamed += l3->token_bytes(id);
  EXPECT_EQ(streamed, "\xE2\x82\xAC");
  const int32_t e2 = l3->token_to_id("\xC3\xA2");  // byte 0xE2 stands for U+00E2
  ASSERT_GE(e2, 0);
  EXPECT_EQ(l3->token_bytes(e2), "\xE2");
  EXPECT_EQ(l3->decode(V{e2, 9906}), "\xEF\xBF\xBDHello");
  EXPECT_EQ(l3->decode(V{128000, 9906, 128001}), "<|begin_of_text|>Hello<|end_of_text|>");
  EXPECT_THROW(l3->decode(V{128256}), Error);
  EXPECT_THROW(l3->token_bytes(-1), Error);
}

// ---------------------------------------------------------------------------------------------
// End of document, options, refusals

TEST(HfTokenizer, EndOfDocumentRules) {
  const std::string json = tiny("null");  // has </s> (7) and <unk> (0)
  auto eod = [&](const std::string& config, const std::string& option = "") {
    return HfTokenizer::load(write_tokenizer(json, config), option)->eod_id();
  };
  EXPECT_EQ(eod(R"({"eos_token": "b"})"), 2);
  EXPECT_EQ(eod(R"({"eos_token": {"content": "c", "lstrip": false}, "bos_token": "a"})"), 3);
  EXPECT_EQ(eod(""), 7);                              // no config: the well-known </s>
  EXPECT_EQ(eod(R"({"eos_token": null})"), 7);        // no eos_token: the same
  EXPECT_EQ(eod(R"({"eos_token": "b"})", "abc"), 5);  // --eod-token wins
  std::string path;
  std::string e = error_of(json, R"({"eos_token": "zzz"})", "", &path);
  EXPECT_NE(e.find("eos_token 'zzz' is not a token of '" + path + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("--eod-token"), std::string::npos) << e;
  e = error_of(json, "", "nope", &path);
  EXPECT_NE(e.find("--eod-token 'nope' is not a token of '" + path + "'"), std::string::npos) << e;
  std::string no_eod = json;
  no_eod.replace(no_eod.find("\"</s>\""), 6, "\"<z>\"");
  e = error_of(no_eod, "", "", &path);
  EXPECT_NE(e.find("'" + path + "': no end-of-document token"), std::string::npos) << e;
  EXPECT_NE(e.find("--eod-token"), std::string::npos) << e;
}

TEST(HfTokenizer, UnsupportedPartsAreRefusedWithOneLineNamingFileAndPart) {
  struct Case {
    std::string json, want;
  };
  const std::vector<Case> cases = {
      {tiny(R"({"type": "Whitespace"})"),
       "pre_tokenizer type Whitespace is not supported (supported: ByteLevel, Split, Metaspace, "
       "Digits, Sequence)"},
      {tiny(
           R"({"type": "Split", "pattern": {"Regex": "\\w+|[^\\w\\s]+"}, "behavior": "Isolated"})"),
       "pre_tokenizer Split regex '\\w+|[^\\w\\s]+' is not supported"},
      {tiny(
           R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]})"),
       "ByteLevel must come last"},
      {tiny("null", R"({"type": "BertNormalizer", "lowercase": true})"),
       "normalizer type BertNormalizer is not supported (supported: NFC, NFD, NFKC, NFKD, "
       "Lowercase, Prepend, Replace, Strip, Sequence)"},
      {tiny("null", R"({"type": "Replace", "pattern": {"Regex": " +"}, "content": " "})"),
       "normalizer Replace with a Regex pattern is not supported"},
      {tiny("null", "null", "", "[]", R"({"type": "WordPiece", "prefix": "##"})"),
       "decoder type WordPiece is not supported"},
      {[] {
         std::string j = tiny("null");
         return j.replace(j.find("\"dropout\": null"), 15, "\"dropout\": 0.1");
       }(),
       "model BPE dropout"},
      // Issue 27: a key twice, and nesting past 512 levels (a stack overflow before).
      {tiny("null", "null", R"(, "dropout": 0.1)"),
       "does not parse as a tokenizer.json: duplicate key \"dropout\" at byte "},
      {tiny("null", std::string(50000, '[') + std::string(50000, ']')),
       "does not parse as a tokenizer.json: nesting deeper than 512 levels at byte "},
      {R"({"added_tokens": [], "normalizer": null, "pre_tokenizer": null, "decoder": null,
          "model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "a": 1}}})",
       "model type WordPiece is not supported (supported: BPE)"},
      {R"({"added_tokens": [], "normalizer": null, "pre_tokenizer": null, "decoder": null,
          "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["a", -1.5]]}})",
       "model type Unigram is not supported (supported: BPE)"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})",
       "model BPE merge 0 ('a' 'b') uses a token missing from the vocabulary"},
      {"{\"model\": ", "does not parse as a tokenizer.json"},
  };
  for (const Case& c : cases) {
    std::string path;
    const std::string e = error_of(c.json, "", "", &path);
    EXPECT_EQ(e.rfind("'" + path + "': ", 0), 0u) << e;
    EXPECT_NE(e.find(c.want), std::string::npos) << "got: " << e << "\nwant: " << c.want;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(HfTokenizer, TokenizerOptions) {
  auto error_of_opts = [](const TokenizerOptions& o) -> std::string {
    try {
      load_tokenizer(o);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  TokenizerOptions o;
  o.type = "SentencePieceTokenizer";
  EXPECT_NE(error_of_opts(o).find("--tokenizer-type 'SentencePieceTokenizer' is not supported "
                                  "(supported: GPT2BPETokenizer, HuggingFaceTokenizer)"),
            std::string::npos);
  o.type = "HuggingFaceTokenizer";
  EXPECT_NE(error_of_opts(o).find("needs --tokenizer-model"), std::string::npos);
  o.model = "/no/such/dir";
  EXPECT_NE(error_of_opts(o).find("--tokenizer-model '/no/such/dir' cannot be read"),
            std::string::npos);
  o.type = "GPT2BPETokenizer";
  EXPECT_NE(error_of_opts(o).find("--tokenizer-model is for --tokenizer-type HuggingFaceTokenizer"),
            std::string::npos);
  // A directory or the file itself.
  const std::string file = write_tokenizer(tiny("null"));
  o.type = "HuggingFaceTokenizer";
  o.model = file.substr(0, file.rfind('/'));
  const auto t = load_tokenizer(o);
  EXPECT_EQ(t->vocab_size(), 12);
  EXPECT_EQ(t->name().rfind("hf:xxh64:", 0), 0u);
}

// ---------------------------------------------------------------------------------------------
// Preprocessing: shards hold the library's ids + EOD

TEST(HfTokenizer, PreprocessShardsHoldTheLibraryIdsAndEod) {
  for (const char* name : {"llama3", "llama2"}) {
    const auto t = hf(name);
    ASSERT_NE(t, nullptr);
    std::vector<std::string> docs = corpus_documents();
    docs.pop_back();  // the whole file is not a document here
    char dir[] = "/tmp/tessera_hfpre_XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    const std::string jsonl = std::string(dir) + "/c.jsonl";
    {
      std::ofstream out(jsonl);
      for (const std::string& d : docs) {
        std::string esc;
        for (unsigned char c : d) {
          char buf[8];
          if (c == '"' || c == '\\') {
            esc += '\\';
            esc += static_cast<char>(c);
          } else if (c < 0x20 || c == 0x7F) {
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            esc += buf;
          } else {
            esc += static_cast<char>(c);
          }
        }
        out << "{\"text\": \"" << esc << "\"}\n";
      }
    }
    PreprocessOptions o;
    o.inputs = {jsonl};
    o.output_prefix = std::string(dir) + "/out";
    o.workers = 2;
    o.shard_tokens = 1000;  // several shards
    o.progress_seconds = 1e9;
    const PreprocessResult r = preprocess(o, *t, nullptr, false);
    EXPECT_GT(r.shards.size(), 1u);
    const std::vector<Reference> refs = reference(name, docs);
    ASSERT_EQ(refs.size(), docs.size());
    std::vector<int32_t> all;
    for (const std::string& s : r.shards) {
      ShardReader sr(s);
      EXPECT_EQ(sr.meta().tokenizer, t->name());
      EXPECT_EQ(sr.meta().vocab_size, t->vocab_size());
      EXPECT_EQ(sr.meta().eod_id, t->eod_id());
      std::vector<int32_t> ids(sr.num_tokens());
      sr.read(0, sr.num_tokens(), ids.data());
      all.insert(all.end(), ids.begin(), ids.end());
      std::remove(s.c_str());
    }
    std::vector<int32_t> want;
    for (const Reference& ref : refs) {
      want.insert(want.end(), ref.ids.begin(), ref.ids.end());
      want.push_back(t->eod_id());
    }
    EXPECT_EQ(all, want) << name;
    std::remove(jsonl.c_str());
    rmdir(dir);
  }
}
