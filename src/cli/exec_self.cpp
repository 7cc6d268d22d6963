#include "cli/exec_self.h"

#include <unistd.h>

namespace kiln::cli {

void exec_self(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string self = "kiln";
  argv.push_back(self.data());
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv("/proc/self/exe", argv.data());
}

}  // namespace kiln::cli
