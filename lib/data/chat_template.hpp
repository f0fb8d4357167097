// chat_template.hpp: conversations as token pieces for supervised fine-tuning (docs/data.md,
// "Chat data"). tessera-preprocess --chat-template reads JSONL lines holding
// {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}, renders each
// conversation with one of the built-in templates, and tokenizes it piece by piece: the
// template's special tokens as single ids, the text pieces through the tokenizer. Only the
// assistant turns' content and their end-of-turn token are targets whose loss counts.
//   chatml   <|im_start|>ROLE\nCONTENT<|im_end|>\n per message (Qwen2 / Qwen2.5 / Qwen3); with
//            auto, the template's default system message (Qwen2.5's "You are Qwen, ...") goes
//            first in a conversation without one, as apply_chat_template writes it
//   llama3   <|begin_of_text|>, then <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>
//            per message, CONTENT stripped of surrounding whitespace (Llama 3 / 3.1 / 3.2)
//   mistral  <s>, then [INST]USER[/INST] and ASSISTANT</s>, roles alternating from a user turn;
//            a system message goes before the last user turn's content with "\n\n" when that
//            turn ends the conversation, and is dropped otherwise, exactly as Mistral's v3-tekken
//            template does (Mistral NeMo, Small, Large 2)
// `auto` takes the template the tokenizer_config.json beside the tokenizer names, when it is
// recognizably one of these.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.hpp"

namespace tessera {

enum class ChatFormat { ChatML, Llama3, Mistral };
const char* chat_format_name(ChatFormat f);

struct ChatMessage {
  std::string role, content;
};

// One piece of a rendered conversation: a special token (one id) or text to tokenize, and
// whether its tokens are targets whose loss counts.
struct ChatPiece {
  std::string text;
  bool special = false, counted = false;
};

// --chat-template NAME: chatml | llama3 | mistral, or auto (the chat_template of the
// tokenizer_config.json beside `tokenizer_model`, a tokenizer.json or its directory). ConfigError
// naming the option or the file otherwise. With auto, `default_system` (when given) receives the
// system message a ChatML template writes for a conversation without one (Qwen2 / Qwen2.5's
// '<|im_start|>system\nYou are ...<|im_end|>\n'), empty when it writes none.
ChatFormat resolve_chat_format(const std::string& name, const std::string& tokenizer_model,
                               std::string* default_system = nullptr);

// The special tokens the template writes (each must be one token of the tokenizer).
std::vector<std::string> chat_special_tokens(ChatFormat f);

// The messages of one JSONL line: the array member `key` of objects with string "role" and
// "content". Throws JsonError (the caller adds the file and line) for anything else, an unknown
// role included.
std::vector<ChatMessage> parse_chat_messages(std::string_view line, const std::string& key);

// The conversation as pieces. Throws JsonError for an order the template cannot render (a system
// message after the first, mistral's roles not alternating from a user turn). ChatML with a
// `default_system`: a conversation without a system message gets that one first.
std::vector<ChatPiece> render_chat(ChatFormat f, const std::vector<ChatMessage>& messages,
                                   const std::string& default_system = "");

// What opens the assistant's turn after a conversation (the generation prompt of
// apply_chat_template(add_generation_prompt=True)), and the special token that ends it.
std::vector<ChatPiece> chat_generation_prompt(ChatFormat f);
const char* chat_end_of_turn(ChatFormat f);

// The pieces' token ids: special pieces as their single id, text through the tokenizer; with
// `mask`, one 0/1 per id (1: a counted piece's). ConfigError naming a special token the
// tokenizer does not have as one token.
std::vector<int32_t> encode_chat(ChatFormat f, const std::vector<ChatPiece>& pieces,
                                 const Tokenizer& tok, Tokenizer::Cache& cache,
                                 std::vector<uint8_t>* mask = nullptr);

}  // namespace tessera
