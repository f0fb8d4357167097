// hf_reference.mjs: the reference the Hugging Face tokenizer tests compare against: Tokenizers.js
// (@huggingface/tokenizers, a pure JavaScript port of the `tokenizers` library), from the directory
// scripts/get-hf-tokenizers.sh fills. Encoding adds no special tokens; decoding does no clean-up.
// Usage:
//   node hf_reference.mjs TOKDIR files F...       JSON [{"ids": [...], "decoded": "..."}] per file
//                                                 (each file read as UTF-8, ill-formed bytes -> U+FFFD)
//   node hf_reference.mjs TOKDIR jsonl F KEY      one line of space-separated ids per document
//   node hf_reference.mjs TOKDIR decode "IDS"      the text of space-separated ids
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [dir, mode, ...args] = process.argv.slice(2);
const js = path.join(path.dirname(path.resolve(dir)), "tokenizers-js", "dist", "tokenizers.mjs");
const { Tokenizer } = await import(pathToFileURL(js).href);
const readJson = (f) => JSON.parse(fs.readFileSync(f, "utf8"));
const configFile = path.join(dir, "tokenizer_config.json");
const tokenizer = new Tokenizer(readJson(path.join(dir, "tokenizer.json")),
                                fs.existsSync(configFile) ? readJson(configFile) : {});
const encode = (text) => tokenizer.encode(text, { add_special_tokens: false }).ids;
const decode = (ids) =>
  ids.length === 0 ? "" : tokenizer.decode(ids, { clean_up_tokenization_spaces: false });

if (mode === "files") {
  const out = args.map((f) => {
    const ids = encode(fs.readFileSync(f, "utf8"));
    return { ids, decoded: decode(ids) };
  });
  process.stdout.write(JSON.stringify(out));
} else if (mode === "jsonl") {
  const [file, key] = args;
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    if (line.trim().length === 0) continue;
    process.stdout.write(encode(JSON.parse(line)[key]).join(" ") + "\n");
  }
} else if (mode === "decode") {
  process.stdout.write(decode(args[0].trim().split(/\s+/).map(Number)));
} else {
  console.error("usage: node hf_reference.mjs TOKDIR (files F... | jsonl F KEY | decode IDS)");
  process.exit(2);
}
