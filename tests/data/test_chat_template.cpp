// The built-in chat templates (data/chat_template.hpp): the text each renders, which pieces are
// targets, and the conversations they refuse. Llama 3's and Mistral's are also checked token for
// token against Jinja2 + Tokenizers.js in tests/data/test_chat.sh; ChatML here against the text of
// Qwen2.5's template (without its default system message).
#include <gtest/gtest.h>

#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "data/chat_template.hpp"

using namespace tessera;

namespace {

// The rendered text, with the targets' pieces in [brackets].
std::string shown(ChatFormat f, const std::vector<ChatMessage>& m) {
  std::string s;
  for (const ChatPiece& p : render_chat(f, m)) s += p.counted ? "[" + p.text + "]" : p.text;
  return s;
}

const std::vector<ChatMessage> kConv = {{"system", "Be brief."},
                                        {"user", "Hi"},
                                        {"assistant", " Hello "},
                                        {"user", "Bye"},
                                        {"assistant", "Ciao"}};

}  // namespace

TEST(ChatTemplate, EachTemplateRendersAndMarksTheAnswers) {
  EXPECT_EQ(shown(ChatFormat::ChatML, kConv),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n[ Hello ][<|im_end|>]\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n[Ciao][<|im_end|>]\n");
  EXPECT_EQ(shown(ChatFormat::Llama3, kConv),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n[Hello][<|eot_id|>]"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n[Ciao][<|eot_id|>]");
  // Mistral's template keeps the system message only before a final user turn.
  EXPECT_EQ(shown(ChatFormat::Mistral, kConv),
            "<s>[INST]Hi[/INST][ Hello ][</s>][INST]Bye[/INST][Ciao][</s>]");
  EXPECT_EQ(shown(ChatFormat::Mistral, {kConv[0], kConv[1], kConv[2], kConv[3]}),
            "<s>[INST]Hi[/INST][ Hello ][</s>][INST]Be brief.\n\nBye[/INST]");
  for (ChatFormat f : {ChatFormat::ChatML, ChatFormat::Llama3, ChatFormat::Mistral})
    for (const ChatPiece& p : render_chat(f, kConv))
      if (p.special) {
        const auto s = chat_special_tokens(f);
        EXPECT_NE(std::find(s.begin(), s.end(), p.text), s.end()) << p.text;
      }
}

TEST(ChatTemplate, MessagesAreParsedAndBadOnesRefused) {
  const auto m = parse_chat_messages(
      R"({"id": 3, "conv": [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]})",
      "conv");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].content, "a\nb");
  EXPECT_EQ(m[1].role, "assistant");
  auto error = [](const std::string& line) {
    try {
      parse_chat_messages(line, "messages");
    } catch (const JsonError& e) {
      return e.message;
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error(R"({"messages": {"role": "user"}})"),
            "\"messages\" is not a list of messages ([{\"role\": ..., \"content\": ...}, ...])");
  EXPECT_EQ(error(R"({"messages": [{"role": "tool", "content": "x"}]})"),
            "message 0 has role 'tool' (allowed: system, user, assistant)");
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": 5}]})"),
            "message 0 is not an object with string \"role\" and \"content\"");
  EXPECT_EQ(error(R"({"text": "x"})"), "no member \"messages\" (a list of messages)");
  EXPECT_EQ(
      error(
          R"({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})"),
      "message 1 is a system message; only the first may be one");
  EXPECT_THROW(render_chat(ChatFormat::Mistral, {{"assistant", "x"}}), JsonError);
}

TEST(ChatTemplate, AutoFindsAChatmlTemplatesDefaultSystemMessage) {
  // A Qwen2.5-style template (written here): a system message of its own when the conversation
  // has none, a plain literal among the template's Jinja.
  char tmpl_dir[] = "/tmp/tessera_chat_XXXXXX";
  const std::string dir = mkdtemp(tmpl_dir);
  {
    std::ofstream f(dir + "/tokenizer_config.json");
    f << R"({"eos_token": "<|im_end|>", "chat_template": "{%- if tools %}{{- '<|im_start|>system\\n' }})"
         R"({%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + )"
         R"(messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou )"
         R"(are Tess, a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for )"
         R"(message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + )"
         R"('<|im_end|>' + '\\n' }}{%- endfor %}"})";
  }
  std::string def;
  EXPECT_EQ(resolve_chat_format("auto", dir + "/tokenizer.json", &def), ChatFormat::ChatML);
  EXPECT_EQ(def, "You are Tess, a helpful assistant.");
  const std::vector<ChatMessage> conv = {{"user", "Hi"}, {"assistant", "Yo"}};
  std::string with;
  for (const ChatPiece& p : render_chat(ChatFormat::ChatML, conv, def))
    with += p.counted ? "[" + p.text + "]" : p.text;
  EXPECT_EQ(with,
            "<|im_start|>system\nYou are Tess, a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "Hi<|im_end|>\n<|im_start|>assistant\n[Yo][<|im_end|>]\n");
  // A conversation with its own system message keeps it alone; llama3 has no default.
  EXPECT_EQ(render_chat(ChatFormat::ChatML, kConv, def).size(),
            render_chat(ChatFormat::ChatML, kConv).size());
  std::system(("rm -rf " + dir).c_str());
}
