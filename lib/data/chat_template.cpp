// chat_template.cpp: the built-in chat templates (data/chat_template.hpp).
#include "data/chat_template.hpp"

#include <sys/stat.h>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/json.hpp"

namespace tessera {

namespace {

std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

// The tokenizer_config.json beside a tokenizer.json (or in the directory given).
std::string config_beside(const std::string& model) {
  struct stat st;
  const bool dir = stat(model.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  if (dir) return model + "/tokenizer_config.json";
  const size_t slash = model.find_last_of('/');
  return (slash == std::string::npos ? std::string(".") : model.substr(0, slash)) +
         "/tokenizer_config.json";
}

}  // namespace

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::ChatML:
      return "chatml";
    case ChatFormat::Llama3:
      return "llama3";
    case ChatFormat::Mistral:
      return "mistral";
  }
  return "?";
}

namespace {

// The literal system message of a ChatML template for conversations without one: the text of
// '<|im_start|>system\n...<|im_end|>' when it is a plain string (no quote, no Jinja), with the
// escapes \n and \\ decoded; empty when the template has none.
std::string chatml_default_system(const std::string& tmpl) {
  const std::string open = "<|im_start|>system\\n", close = "<|im_end|>";
  for (size_t at = tmpl.find(open); at != std::string::npos; at = tmpl.find(open, at + 1)) {
    const size_t begin = at + open.size(), end = tmpl.find(close, begin);
    if (end == std::string::npos) break;
    const std::string raw = tmpl.substr(begin, end - begin);
    if (raw.empty() || raw.find_first_of("'\"{}") != std::string::npos) continue;
    std::string text;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\\' && i + 1 < raw.size() && (raw[i + 1] == 'n' || raw[i + 1] == '\\')) {
        text += raw[i + 1] == 'n' ? '\n' : '\\';
        ++i;
      } else {
        text += raw[i];
      }
    }
    return text;
  }
  return "";
}

}  // namespace

ChatFormat resolve_chat_format(const std::string& name, const std::string& tokenizer_model,
                               std::string* default_system) {
  if (default_system) default_system->clear();
  if (name == "chatml") return ChatFormat::ChatML;
  if (name == "llama3") return ChatFormat::Llama3;
  if (name == "mistral") return ChatFormat::Mistral;
  if (name != "auto")
    throw ConfigError("--chat-template '" + name +
                      "' is not a template (allowed: chatml, llama3, mistral, auto)");
  if (tokenizer_model.empty())
    throw ConfigError(
        "--chat-template auto reads the template from the tokenizer_config.json beside "
        "--tokenizer-model: give --tokenizer-model, or name the template (chatml, llama3, "
        "mistral)");
  const std::string path = config_beside(tokenizer_model);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError("--chat-template auto: '" + path +
                      "' cannot be read; name the template (chatml, llama3, mistral)");
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string json = ss.str();
  std::string tmpl;
  try {
    JsonReader r(json);
    const JsonValue v = r.value();
    const JsonValue* t = v.find("chat_template");
    if (t && t->type == JsonValue::Type::String) tmpl = t->string;
    if (t && t->type == JsonValue::Type::Array)  // [{"name": "default", "template": "..."}, ...]
      for (const JsonValue& e : t->items) {
        const JsonValue* n = e.find("name");
        const JsonValue* s = e.find("template");
        if (n && n->string == "default" && s) tmpl = s->string;
      }
  } catch (const JsonError& e) {
    throw ConfigError("--chat-template auto: '" + path + "' is not JSON: " + e.message);
  }
  if (tmpl.empty())
    throw ConfigError("--chat-template auto: '" + path +
                      "' has no chat_template; name the template (chatml, llama3, mistral)");
  auto has = [&](const char* s) { return tmpl.find(s) != std::string::npos; };
  if (has("<|im_start|>") && has("<|im_end|>")) {
    if (default_system) *default_system = chatml_default_system(tmpl);
    return ChatFormat::ChatML;
  }
  if (has("<|start_header_id|>") && has("<|eot_id|>")) return ChatFormat::Llama3;
  if (has("[INST]") && has("[/INST]") && !has("<<SYS>>")) return ChatFormat::Mistral;
  throw ConfigError("--chat-template auto: the chat_template of '" + path +
                    "' is none of the built-in ones (chatml, llama3, mistral); name the one "
                    "that renders like it, or convert the data yourself");
}

std::vector<std::string> chat_special_tokens(ChatFormat f) {
  switch (f) {
    case ChatFormat::ChatML:
      return {"<|im_start|>", "<|im_end|>"};
    case ChatFormat::Llama3:
      return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case ChatFormat::Mistral:
      return {"<s>", "</s>", "[INST]", "[/INST]"};
  }
  return {};
}

std::vector<ChatMessage> parse_chat_messages(std::string_view line, const std::string& key) {
  JsonReader r(line);
  std::vector<ChatMessage> out;
  bool found = false;
  r.object([&](const std::string& k) {
    if (k != key || found) {
      r.skip_value();
      return;
    }
    found = true;
    if (r.peek_char() != '[')
      throw JsonError{"\"" + key +
                      "\" is not a list of messages ([{\"role\": ..., "
                      "\"content\": ...}, ...])"};
    r.array([&] {
      const JsonValue m = r.value();
      const JsonValue* role = m.find("role");
      const JsonValue* content = m.find("content");
      const std::string at = "message " + std::to_string(out.size());
      if (m.type != JsonValue::Type::Object || !role || role->type != JsonValue::Type::String ||
          !content || content->type != JsonValue::Type::String)
        throw JsonError{at + " is not an object with string \"role\" and \"content\""};
      if (role->string != "system" && role->string != "user" && role->string != "assistant")
        throw JsonError{at + " has role '" + role->string + "' (allowed: system, user, assistant)"};
      out.push_back({role->string, content->string});
    });
  });
  r.expect_end();
  if (!found) throw JsonError{"no member \"" + key + "\" (a list of messages)"};
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].role == "system")
      throw JsonError{"message " + std::to_string(i) +
                      " is a system message; only the first may be one"};
  return out;
}

std::vector<ChatPiece> render_chat(ChatFormat f, const std::vector<ChatMessage>& messages,
                                   const std::string& default_system) {
  std::vector<ChatPiece> p;
  auto special = [&](const char* t, bool counted = false) { p.push_back({t, true, counted}); };
  auto text = [&](std::string t, bool counted = false) {
    if (!t.empty()) p.push_back({std::move(t), false, counted});
  };
  if (f == ChatFormat::ChatML) {
    if (!default_system.empty() && (messages.empty() || messages[0].role != "system")) {
      special("<|im_start|>");
      text("system\n" + default_system);
      special("<|im_end|>");
      text("\n");
    }
    for (const ChatMessage& m : messages) {
      const bool a = m.role == "assistant";
      special("<|im_start|>");
      text(m.role + "\n");
      text(m.content, a);
      special("<|im_end|>", a);
      text("\n");
    }
  } else if (f == ChatFormat::Llama3) {
    special("<|begin_of_text|>");
    for (const ChatMessage& m : messages) {
      const bool a = m.role == "assistant";
      special("<|start_header_id|>");
      text(m.role);
      special("<|end_header_id|>");
      text("\n\n");
      text(strip(m.content), a);
      special("<|eot_id|>", a);
    }
  } else {
    const bool sys = !messages.empty() && messages[0].role == "system";
    const size_t first = sys ? 1 : 0;
    size_t last_user = first;
    for (size_t i = first; i < messages.size(); ++i) {
      if ((messages[i].role == "user") != ((i - first) % 2 == 0))
        throw JsonError{"message " + std::to_string(i) + " is a " + messages[i].role +
                        " turn; after the optional system message, mistral's template needs "
                        "user and assistant turns alternating from a user turn"};
      if (messages[i].role == "user") last_user = i;
    }
    special("<s>");
    for (size_t i = first; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if (m.role == "user") {
        special("[INST]");
        // As Mistral's template: the system message joins the last user turn only when that turn
        // ends the conversation (a prompt); a conversation ending in an answer drops it.
        const bool with_system = sys && i == last_user && i + 1 == messages.size();
        text(with_system ? messages[0].content + "\n\n" + m.content : m.content);
        special("[/INST]");
      } else {
        text(m.content, true);
        special("</s>", true);
      }
    }
  }
  return p;
}

std::vector<ChatPiece> chat_generation_prompt(ChatFormat f) {
  switch (f) {
    case ChatFormat::ChatML:
      return {{"<|im_start|>", true, false}, {"assistant\n", false, false}};
    case ChatFormat::Llama3:
      return {{"<|start_header_id|>", true, false},
              {"assistant", false, false},
              {"<|end_header_id|>", true, false},
              {"\n\n", false, false}};
    case ChatFormat::Mistral:
      return {};  // the answer follows [/INST]
  }
  return {};
}

const char* chat_end_of_turn(ChatFormat f) {
  return f == ChatFormat::ChatML ? "<|im_end|>" : f == ChatFormat::Llama3 ? "<|eot_id|>" : "</s>";
}

std::vector<int32_t> encode_chat(ChatFormat f, const std::vector<ChatPiece>& pieces,
                                 const Tokenizer& tok, Tokenizer::Cache& cache,
                                 std::vector<uint8_t>* mask) {
  std::vector<int32_t> ids;
  if (mask) mask->clear();
  for (const ChatPiece& p : pieces) {
    const size_t before = ids.size();
    if (p.special) {
      const int32_t id = tok.special_token_id(p.text);
      if (id < 0)
        throw ConfigError(std::string("--chat-template ") + chat_format_name(f) +
                          " writes the special token '" + p.text + "', which the tokenizer '" +
                          tok.name() +
                          "' does not have as one token; give the template of the tokenizer's "
                          "model (or --chat-template auto)");
      ids.push_back(id);
    } else {
      tok.encode(p.text, ids, cache);
    }
    if (mask) mask->insert(mask->end(), ids.size() - before, p.counted ? 1 : 0);
  }
  return ids;
}

}  // namespace tessera
