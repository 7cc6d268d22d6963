// The trainer's console: on a terminal one progress line updates in place with every other
// message scrolling above it; in a file or pipe, plain lines only (train/console.h). The
// terminal is a pseudo-terminal the test opens itself (forkpty), so no tool is needed.
#include "fault_test_util.h"

#include <pty.h>

using namespace kiln;
using namespace kiln::test;

namespace {

class Console : public TinyRunTest {
 protected:
  Console() : TinyRunTest("kiln_console") {}
  // `command` (through /bin/sh) on a pseudo-terminal of its own, its output captured.
  // `columns`: the terminal's width (0: the pseudo-terminal's default, none set).
  std::string on_terminal(const std::string& command, const std::string& env = "", int columns = 0) {
    int master = -1;
    winsize size{};
    size.ws_row = 24;
    size.ws_col = static_cast<unsigned short>(columns);
    const pid_t pid = forkpty(&master, nullptr, nullptr, columns > 0 ? &size : nullptr);
    if (pid == 0) {
      const std::string line = env + " exec " + command + " 2>&1";
      execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    EXPECT_GT(pid, 0) << "forkpty failed";
    std::string output;
    char buffer[4096];
    for (;;) {  // until the child closes the terminal (EIO on Linux)
      const ssize_t n = read(master, buffer, sizeof(buffer));
      if (n <= 0) break;
      output.append(buffer, static_cast<size_t>(n));
    }
    close(master);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
    return output;
  }
};

constexpr const char* kClearLine = "\r\033[2K";

}  // namespace

TEST_F(Console, ATerminalGetsOneLiveProgressLineWithMessagesAboveIt) {
  const std::string output =
      on_terminal(tiny_train(corpus_, dir_ + "/tty", "--set log.every=6 --set data.val_fraction=0.3 "
                                                     "--set train.eval_every=4 --set train.eval_batches=1"));
  // Every step redraws the line: 12 steps, and a redraw after each message below it.
  for (int step = 1; step <= 12; ++step)
    EXPECT_CONTAINS(output, std::string(kClearLine) + "step " + std::to_string(step) + "/12 | loss ");
  EXPECT_CONTAINS(output, " | val ");  // the last validation loss, once there is one
  EXPECT_CONTAINS(output, " tok/s | elapsed ");
  EXPECT_CONTAINS(output, "validation at step 4: loss");  // messages still scroll
  EXPECT_CONTAINS(output, "done: 12 steps");
  EXPECT_EQ(output.find("MFU"), std::string::npos);  // a CPU run has no MFU
  // The validation after the last step is drawn into the line left on the screen.
  const std::string final_message = "validation at step 12: loss ";
  const size_t at = output.find(final_message);
  ASSERT_NE(at, std::string::npos) << output;
  const size_t value_at = at + final_message.size();
  const std::string value = output.substr(value_at, output.find(' ', value_at) - value_at);
  const size_t redraw = output.rfind(std::string(kClearLine) + "step 12/12 | loss ");
  ASSERT_NE(redraw, std::string::npos);
  EXPECT_GT(redraw, at) << "no progress line drawn after the final validation";
  EXPECT_CONTAINS(output.substr(redraw, output.find('\r', redraw + 1) - redraw), " | val " + value + " | ");
}

// A progress line wider than the terminal would wrap, and each redraw would leave its
// first row behind (the erase reaches only the cursor's row): it is cut to the width.
TEST_F(Console, TheLiveLineFitsANarrowTerminal) {
  const std::string output = on_terminal(tiny_train(corpus_, dir_ + "/narrow"), "", 40);
  size_t redraws = 0;
  for (size_t at = output.find(kClearLine); at != std::string::npos; at = output.find(kClearLine, at + 1)) {
    const size_t start = at + std::string(kClearLine).size();
    const size_t end = output.find_first_of("\r\n", start);
    // A message printed above the line ends with its newline (\r\n on a terminal); the
    // live line does not.
    if (end != std::string::npos && (output[end] == '\n' || output.compare(end, 2, "\r\n") == 0)) continue;
    const std::string drawn = output.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (drawn.rfind("step ", 0) != 0) continue;
    ++redraws;
    EXPECT_LE(drawn.size(), 39u) << drawn;
  }
  EXPECT_GE(redraws, 12u) << output;
}

TEST_F(Console, AFileOrKilnPlainGetsPlainLines) {
  std::string piped;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, dir_ + "/piped"), "", &piped), 0) << piped;
  EXPECT_EQ(piped.find('\033'), std::string::npos);
  EXPECT_CONTAINS(piped, "step    12/12 | loss");
  const std::string plain = on_terminal(tiny_train(corpus_, dir_ + "/plain"), "KILN_PLAIN=1");
  EXPECT_EQ(plain.find('\033'), std::string::npos);
  EXPECT_CONTAINS(plain, "step    12/12 | loss");
}
