// hf-tokenizer-variants.mjs: derives tokenizer.json files of kinds no fetched package carries, so
// the tests check them against Tokenizers.js too. Usage: node hf-tokenizer-variants.mjs DEST GPT2_DIR
//   gpt-neox-style/   GPT-2's vocabulary and merges in GPT-NeoX's form: NFC normalizer, ByteLevel
//                     pre-tokenizer with its regex, ByteLevel decoder; no tokenizer_config.json (the
//                     end-of-document token comes from the well-known names)
//   llama2-metaspace/ Llama 2 as newer converters write it: no normalizer, Metaspace pre-tokenizer
//                     (prepend_scheme first, split false)
//   qwen2-regex/      Llama 3 with Qwen2's Split regex (single digits) and merges as ["a", "b"] pairs
import fs from "node:fs";
import path from "node:path";

const [dest, gpt2] = process.argv.slice(2);
const read = (f) => JSON.parse(fs.readFileSync(f, "utf8"));
const write = (dir, name, obj) => {
  fs.mkdirSync(path.join(dest, dir), { recursive: true });
  fs.writeFileSync(path.join(dest, dir, name), JSON.stringify(obj));
};

// GPT-NeoX style.
const vocab = read(path.join(gpt2, "encoder.json"));
const merges = fs
  .readFileSync(path.join(gpt2, "vocab.bpe"), "utf8")
  .split("\n")
  .filter((l, i) => l.length > 0 && !(i === 0 && l.startsWith("#version")));
const byteLevel = { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true };
write("gpt-neox-style", "tokenizer.json", {
  version: "1.0",
  truncation: null,
  padding: null,
  added_tokens: [
    { id: vocab["<|endoftext|>"], content: "<|endoftext|>", single_word: false, lstrip: false,
      rstrip: false, normalized: false, special: true },
  ],
  normalizer: { type: "NFC" },
  pre_tokenizer: byteLevel,
  post_processor: byteLevel,
  decoder: byteLevel,
  model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null,
           end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, vocab, merges },
});

// Llama 2 with a Metaspace pre-tokenizer.
const llama2 = read(path.join(dest, "llama2", "tokenizer.json"));
llama2.normalizer = null;
llama2.pre_tokenizer = { type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false };
write("llama2-metaspace", "tokenizer.json", llama2);
fs.copyFileSync(path.join(dest, "llama2", "tokenizer_config.json"),
                path.join(dest, "llama2-metaspace", "tokenizer_config.json"));

// Llama 3 with Qwen2's regex and pair merges.
const llama3 = read(path.join(dest, "llama3", "tokenizer.json"));
const split = llama3.pre_tokenizer.pretokenizers[0];
if (!split.pattern.Regex.includes("\\p{N}{1,3}")) throw new Error("unexpected Llama 3 regex");
split.pattern.Regex = split.pattern.Regex.replace("\\p{N}{1,3}", "\\p{N}");
llama3.model.merges = llama3.model.merges.map((m) => m.split(" "));
write("qwen2-regex", "tokenizer.json", llama3);
fs.copyFileSync(path.join(dest, "llama3", "tokenizer_config.json"),
                path.join(dest, "qwen2-regex", "tokenizer_config.json"));
