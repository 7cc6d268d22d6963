// Replaces a forked child with this same kiln binary running `kiln ARGS...` (kiln launch's
// ranks, kiln loss-gap's training runs): /proc/self/exe, so the child is the exact build
// the parent is, wherever it was started from.
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

// Returns only when execv fails (then errno says why); the caller reports it and exits.
void exec_self(const std::vector<std::string>& args);

}  // namespace kiln::cli
