#include "cli/commands.h"
#include "data/tokenizer.h"
#include "nn/modules.h"
#include "nn/moe/router.h"
#include "train/optimizer.h"
#include "train/schedules.h"

#include <fmt/format.h>

#include <algorithm>

namespace kiln::cli {

namespace {
// The names in one column as wide as the longest ("layernorm_nobias", "gemma_rmsnorm"),
// under "<kind>s (<the keys that choose one>):".
template <typename R>
void show(const char* keys, const R& registry) {
  fmt::print("{}s ({}):\n", registry.kind(), keys);
  size_t width = 0;
  for (const auto& entry : registry.list()) width = std::max(width, entry.first.size());
  for (const auto& [name, help] : registry.list()) fmt::print("  {:<{}} {}\n", name, width, help);
}
}  // namespace

void add_list_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("list", "show the registered components a config can name");
  cmd->callback([] {
    show("model.norm", norm_registry());
    show("model.attention, model.alt_attention", mixer_registry());
    show("model.mlp, model.alt_mlp", mlp_registry());
    show("model.position", position_registry());
    show("model.moe.router", router_registry());
    show("optim.name", optimizer_registry());
    show("optim.schedule", schedule_registry());
    fmt::print("tokenizer:\n");
    for (const std::string& name : tokenizer_names()) fmt::print("  {}\n", name);
  });
}

}  // namespace kiln::cli
