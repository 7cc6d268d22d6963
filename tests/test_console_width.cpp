// The live progress line's cut to the terminal's width (train/console.h); the pseudo-terminal
// test of the whole line is Console.TheLiveLineFitsANarrowTerminal.
#include "train/console.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

TEST(ConsoleWidth, LinesAreCutByCharactersNeverInsideOne) {
  EXPECT_EQ(fit_to_width("step 1/10 | loss 3.2", 0), "step 1/10 | loss 3.2");  // width unknown
  EXPECT_EQ(fit_to_width("step 1/10 | loss 3.2", 11), "step 1/10 ");
  EXPECT_EQ(fit_to_width("short", 80), "short");
  EXPECT_EQ(fit_to_width("ab\u00e9\u00e9cd", 4), "ab\u00e9");  // 3 characters, 4 bytes
  EXPECT_EQ(fit_to_width("abc", 1), "");
}

}  // namespace
}  // namespace kiln
