#include "train/optimizer.h"

#include "train/optimizer_kinds.h"

#include <map>

namespace kiln {

void Optimizer::prepare_device_update(double, ops::DeviceUpdateScalars&) const {
  fail("optimizer", "this optimizer has no update with scalars in device memory");
}
void Optimizer::step_on_device(const ops::DeviceUpdateScalars*) {
  fail("optimizer", "this optimizer has no update with scalars in device memory");
}
void Optimizer::count_update() { fail("optimizer", "this optimizer has no update with scalars in device memory"); }

std::string OptimizerGroup::key() const {
  return roles.empty() ? std::string("optim.name") : fmt::format("optim.{}.optimizer", role_name(roles.front()));
}

namespace {

std::map<std::string, OptimizerTraits>& traits_table() {
  static auto* table = new std::map<std::string, OptimizerTraits>;
  return *table;
}

}  // namespace

OptimizerRegistry& optimizer_registry() {
  static OptimizerRegistry* registry = [] {
    auto* r = new OptimizerRegistry("optimizer");
    auto add = [r](const std::string& name, std::string help, OptimizerTraits traits, OptimizerRegistry::Factory f) {
      r->add(name, std::move(help), std::move(f));
      traits_table()[name] = std::move(traits);
    };
    add("adamw", "Adam with decoupled weight decay",
        {{kTrainedRoles.begin(), kTrainedRoles.end()}, false, [](const OptimConfig& c) { return c.beta1; }, true, true},
        make_adamw_optimizer);
    add("muon", "momentum orthogonalized by Newton-Schulz, for matrices (AdamW for the other roles)",
        {{ParamRole::matrix, ParamRole::expert}, true, [](const OptimConfig& c) { return c.muon.momentum; }, false, false,
         true},
        make_muon_optimizer);
    return r;
  }();
  return *registry;
}

const OptimizerTraits& optimizer_traits(const std::string& name) {
  optimizer_registry();  // registers the traits with the factories
  const auto it = traits_table().find(name);
  KILN_CHECK(it != traits_table().end(), "optimizer", "no optimizer '{}' (known: {})", name,
             optimizer_registry().known());
  return it->second;
}

}  // namespace kiln
