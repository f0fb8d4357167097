// test_test_hooks.cpp: the fault and test hooks' parsing (core/test_hooks.hpp) for the hooks read
// at each call; the ones read once are covered by the end-to-end tests that set them.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <stdexcept>

#include "core/error.hpp"
#include "core/test_hooks.hpp"

namespace tessera {
namespace {

// Sets an environment variable for one scope (nullptr: unset) and restores "unset" after.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() { unsetenv(name); }
};

TEST(TestHooks, SaveFaultAfterRankAndFromIteration) {
  {
    ScopedEnv env("TESSERA_FAULT_SAVE_RANK", nullptr);
    EXPECT_EQ(test_hooks::save_fault_after(0, 0), -1);
    EXPECT_EQ(test_hooks::save_fault_after(1, 100), -1);
  }
  {
    ScopedEnv env("TESSERA_FAULT_SAVE_RANK", "1:10");
    EXPECT_EQ(test_hooks::save_fault_after(1, 9), -1);
    EXPECT_EQ(test_hooks::save_fault_after(1, 10), 3);
    EXPECT_EQ(test_hooks::save_fault_after(1, 12), 3);
    EXPECT_EQ(test_hooks::save_fault_after(0, 12), -1);
  }
  {
    ScopedEnv env("TESSERA_FAULT_SAVE_RANK", "2");  // FROM_ITERATION defaults to 0
    EXPECT_EQ(test_hooks::save_fault_after(2, 0), 3);
    EXPECT_EQ(test_hooks::save_fault_after(3, 0), -1);
  }
  {
    ScopedEnv env("TESSERA_FAULT_SAVE_RANK", "x");  // no leading integer: off
    EXPECT_EQ(test_hooks::save_fault_after(0, 5), -1);
  }
}

TEST(TestHooks, MoeDispatchWrongRank) {
  {
    ScopedEnv env("TESSERA_FAULT_MOE_DISPATCH", "wrong-rank");
    EXPECT_TRUE(test_hooks::moe_dispatch_wrong_rank());
  }
  {
    ScopedEnv env("TESSERA_FAULT_MOE_DISPATCH", "wrong");
    EXPECT_FALSE(test_hooks::moe_dispatch_wrong_rank());
  }
  EXPECT_FALSE(test_hooks::moe_dispatch_wrong_rank());
}

TEST(TestHooks, MoeLogitBiasItemsAndBadInput) {
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", nullptr);
    EXPECT_TRUE(test_hooks::moe_logit_bias(4).empty());
  }
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", "");
    EXPECT_TRUE(test_hooks::moe_logit_bias(4).empty());
  }
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", "0:10,1:9.5");
    const auto bias = test_hooks::moe_logit_bias(4);
    ASSERT_EQ(bias.size(), 2u);
    EXPECT_EQ(bias[0].first, 0);
    EXPECT_EQ(bias[0].second, 10.f);
    EXPECT_EQ(bias[1].first, 1);
    EXPECT_EQ(bias[1].second, 9.5f);
  }
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", "4:1");  // expert outside [0, 4)
    EXPECT_THROW(test_hooks::moe_logit_bias(4), Error);
  }
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", "0=1");  // no ':'
    EXPECT_THROW(test_hooks::moe_logit_bias(4), Error);
  }
  {
    ScopedEnv env("TESSERA_TEST_MOE_LOGIT_BIAS", "a:1");
    EXPECT_THROW(test_hooks::moe_logit_bias(4), std::invalid_argument);
  }
}

}  // namespace
}  // namespace tessera
