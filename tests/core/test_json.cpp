// test_json.cpp: the JSON reader's bounds (nesting depth, duplicate keys) in each of its modes:
// the tree (value()), skipping (skip_value()) and the callbacks (object(), array()).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/json.hpp"

using namespace tessera;

namespace {

// `depth` arrays one inside the other around 7: [[...[7]...]].
std::string nested_arrays(int depth) {
  return std::string(depth, '[') + "7" + std::string(depth, ']');
}

// `depth` objects one inside the other: {"a":{"a":...{"a":7}...}}.
std::string nested_objects(int depth) {
  std::string s;
  for (int d = 0; d < depth; ++d) s += "{\"a\":";
  return s + "7" + std::string(depth, '}');
}

// The error of reading `text` whole in one mode, or "ok".
std::string error_of(const std::string& text, const std::function<void(JsonReader&)>& read) {
  try {
    JsonReader r(text);
    read(r);
    r.expect_end();
  } catch (const JsonError& e) {
    return e.message;
  }
  return "ok";
}

void tree(JsonReader& r) {
  (void)r.value();
}
void skip(JsonReader& r) {
  r.skip_value();
}
// Callbacks all the way down: objects through object(), arrays through array(), strings and
// integers read.
void walk(JsonReader& r) {
  const char c = r.peek_char();
  if (c == '{')
    r.object([&](const std::string&) { walk(r); });
  else if (c == '[')
    r.array([&] { walk(r); });
  else if (c == '"')
    (void)r.string_value();
  else
    (void)r.int_value();
}

}  // namespace

TEST(Json, NestingOf512LevelsIsReadAnd513IsRefused) {
  // The tree of 512 levels holds them all, with 7 at the bottom.
  {
    const std::string text = nested_arrays(512);  // the reader keeps a view of it
    JsonReader r(text);
    const JsonValue v = r.value();
    const JsonValue* at = &v;
    int depth = 0;
    while (at->type == JsonValue::Type::Array) {
      ASSERT_EQ(at->items.size(), 1u);
      at = &at->items[0];
      ++depth;
    }
    EXPECT_EQ(depth, 512);
    EXPECT_EQ(at->type, JsonValue::Type::Number);
    EXPECT_EQ(at->number, 7);
  }
  {
    const std::string text = nested_objects(512);
    JsonReader r(text);
    const JsonValue v = r.value();
    const JsonValue* at = &v;
    int depth = 0;
    while (at->type == JsonValue::Type::Object) {
      ASSERT_EQ(at->members.size(), 1u);
      at = at->find("a");
      ASSERT_NE(at, nullptr);
      ++depth;
    }
    EXPECT_EQ(depth, 512);
    EXPECT_EQ(at->number, 7);
  }
  // Every mode counts every level: 512 pass, the 513th bracket (byte 512 of the arrays, byte
  // 512 * 5 of the objects, each level being `{"a":`) is named.
  for (const auto& mode : {tree, skip, walk}) {
    EXPECT_EQ(error_of(nested_arrays(512), mode), "ok");
    EXPECT_EQ(error_of(nested_objects(512), mode), "ok");
    EXPECT_EQ(error_of(nested_arrays(513), mode), "nesting deeper than 512 levels at byte 512");
    EXPECT_EQ(error_of(nested_objects(513), mode), "nesting deeper than 512 levels at byte 2560");
  }
  // Arrays and objects count together, and inside a value the callback reads as a tree.
  std::string mixed;
  for (int d = 0; d < 256; ++d) mixed += "[{\"k\":";
  EXPECT_EQ(error_of(mixed + "[1]" + std::string(256, '}'), tree),
            "nesting deeper than 512 levels at byte " + std::to_string(256 * 6));
  const std::string member = "{\"x\": " + nested_arrays(512) + "}";
  EXPECT_EQ(
      error_of(member, [](JsonReader& r) { r.object([&](const std::string&) { r.value(); }); }),
      "nesting deeper than 512 levels at byte 517");
  EXPECT_EQ(error_of(member,
                     [](JsonReader& r) { r.object([&](const std::string&) { r.skip_value(); }); }),
            "nesting deeper than 512 levels at byte 517");
  // A level closed is given back: many arrays side by side, each 512 deep, all pass.
  std::string wide = "[";
  for (int k = 0; k < 100; ++k) wide += (k ? "," : "") + nested_arrays(511);
  EXPECT_EQ(error_of(wide + "]", tree), "ok");
  EXPECT_EQ(error_of(wide + "]", walk), "ok");
}

// A 100 KB body of 50,000 `[` used to overflow the stack (a crash of the server, of
// tessera-convert on a config.json, of tessera-preprocess on a tokenizer.json or jsonl line).
TEST(Json, FiftyThousandOpenBracketsAreAnErrorNotACrash) {
  const std::string deep(50000, '[');
  for (const auto& mode : {tree, skip, walk})
    EXPECT_EQ(error_of(deep, mode), "nesting deeper than 512 levels at byte 512");
  EXPECT_EQ(error_of(std::string(50000, '{'), tree), "expected a string at byte 1");
  std::string objects;
  for (int d = 0; d < 50000; ++d) objects += "{\"\":";
  EXPECT_EQ(error_of(objects, tree), "nesting deeper than 512 levels at byte 2048");
  try {
    (void)json_string_member("{\"text\": \"a\", \"meta\": " + deep, "text");
    FAIL() << "a jsonl line with 50,000 open brackets was accepted";
  } catch (const JsonError& e) {
    EXPECT_EQ(e.message, "nesting deeper than 512 levels at byte 533");
  }
}

TEST(Json, DuplicateKeysAreRefusedInEveryMode) {
  const std::string body = R"({"prompts":["Hello"],"prompts":["Bye"]})";
  const std::string want = "duplicate key \"prompts\" at byte 21";
  EXPECT_EQ(error_of(body, tree), want);
  EXPECT_EQ(error_of(body, skip), want);
  EXPECT_EQ(error_of(body, walk), want);
  // The callback is called for the first member only, and the error comes before the second.
  std::vector<std::string> seen;
  try {
    JsonReader r(body);
    r.object([&](const std::string& key) {
      seen.push_back(key);
      r.skip_value();
    });
    FAIL() << "a duplicate key was accepted by object()";
  } catch (const JsonError& e) {
    EXPECT_EQ(e.message, want);
  }
  EXPECT_EQ(seen, std::vector<std::string>{"prompts"});
  // Inside a nested object, in a part skipped, and spelled with an escape.
  EXPECT_EQ(error_of(R"({"a": 1, "b": {"x": 1, "y": 2, "x": 3}})", tree),
            "duplicate key \"x\" at byte 31");
  EXPECT_EQ(error_of(R"({"a": 1, "b": {"x": 1, "y": 2, "x": 3}})", skip),
            "duplicate key \"x\" at byte 31");
  EXPECT_EQ(error_of(R"({"ab": 1, "\u0061b": 2})", tree), "duplicate key \"ab\" at byte 10");
  try {
    (void)json_string_member(R"({"text": "a", "text": "b"})", "text");
    FAIL() << "a jsonl line with \"text\" twice was accepted";
  } catch (const JsonError& e) {
    EXPECT_EQ(e.message, "duplicate key \"text\" at byte 14");
  }
  // The key in the message stays on one line and short.
  EXPECT_EQ(error_of(R"({"a\nb": 1, "a\nb": 2})", tree), "duplicate key \"a\\u000ab\" at byte 12");
  const std::string long_key(100, 'k');
  EXPECT_EQ(error_of("{\"" + long_key + "\": 1, \"" + long_key + "\": 2}", tree),
            "duplicate key \"" + std::string(64, 'k') + "...\" at byte 108");
}

TEST(Json, EqualKeysInDifferentObjectsAreFine) {
  JsonReader r(R"({"a": {"a": 1, "b": [{"a": 2}, {"a": 3}]}, "b": 4})");
  const JsonValue v = r.value();
  r.expect_end();
  ASSERT_EQ(v.members.size(), 2u);
  const JsonValue* inner = v.find("a");
  ASSERT_NE(inner, nullptr);
  EXPECT_EQ(inner->find("a")->number, 1);
  ASSERT_EQ(inner->find("b")->items.size(), 2u);
  EXPECT_EQ(inner->find("b")->items[0].find("a")->number, 2);
  EXPECT_EQ(inner->find("b")->items[1].find("a")->number, 3);
  EXPECT_EQ(v.find("b")->number, 4);
}
