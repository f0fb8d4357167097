// split_patterns.hpp: the pre-tokenizer regexes that real tokenizer.json files carry, hand-coded
// over code points with the semantics of the `tokenizers` library's regex engine (Oniguruma:
// leftmost-first alternation, greedy quantifiers with backtracking, \s = White_Space, (?i:...) with
// Unicode case folding). A pattern is recognised by its exact string; any other is refused.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

enum class SplitPattern {
  Gpt2,    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  Cl100k,  // Llama 3 / 3.1, GPT-4 (cl100k_base)
  Qwen2,   // cl100k with single digits (Qwen2, Qwen2.5, Qwen3)
  O200k,   // GPT-4o (o200k_base)
  Tekken,  // Mistral NeMo (tekken)
};

// The pattern whose exact regex string is `regex`; false when it is none of them.
bool find_split_pattern(const std::string& regex, SplitPattern& out);
// The regex string of a pattern (as tokenizer.json writes it).
const std::string& split_pattern_regex(SplitPattern p);
const char* split_pattern_name(SplitPattern p);

// Length in bytes of the match of `p` starting at byte i of valid UTF-8 `s` (0: no match there).
size_t split_pattern_match(SplitPattern p, std::string_view s, size_t i);

// All matches of `p` in `s`, in order, each as [begin, end) byte offsets; the gaps between them
// are left to the caller (find_iter semantics).
void split_pattern_find_all(SplitPattern p, std::string_view s,
                            std::vector<std::pair<size_t, size_t>>& out);

}  // namespace tessera
