#include "nn/slot_state.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace kiln {

namespace {

// Decoders are made and dropped on several threads (the trainer's samples, a server's
// model thread), so the table is guarded.
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

std::map<const Arena*, std::vector<const Tensor*>>& table() {
  static std::map<const Arena*, std::vector<const Tensor*>> t;
  return t;
}

}  // namespace

void register_slot_state(const Arena& arena, const Tensor* state) {
  std::lock_guard lock(table_mutex());
  table()[&arena].push_back(state);
}

void unregister_slot_state(const Arena& arena, const Tensor* state) {
  std::lock_guard lock(table_mutex());
  auto it = table().find(&arena);
  if (it == table().end()) return;
  std::erase(it->second, state);
  if (it->second.empty()) table().erase(it);
}

void copy_slot_states(const Arena& arena, int32_t from, int32_t to, int64_t positions) {
  std::vector<const Tensor*> states;
  {
    std::lock_guard lock(table_mutex());
    if (auto it = table().find(&arena); it != table().end()) states = it->second;
  }
  // On the GPU the copy runs on the legacy stream, which waits for kiln's (blocking)
  // stream: it follows the step that wrote the slot.
  for (const Tensor* state : states) {
    const int64_t len = state->size(1), row = state->numel() / (state->size(0) * len);
    const Tensor flat = state->view(Shape{state->size(0) * len, row});
    copy_tensor(flat.rows(from * len, from * len + positions), flat.rows(to * len, to * len + positions));
  }
}

}  // namespace kiln
