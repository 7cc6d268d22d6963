#include "op_table/op_table.h"

#include "core/error.h"

#include <cctype>
#include <set>

namespace kiln::op_test {

namespace {

// The table: one row per op family.
using CasesFn = std::vector<OpCase> (*)();
constexpr CasesFn kRows[] = {
    rms_norm_cases,  add_rms_norm_cases, rope_cases,    swiglu_cases,      qkv_split_cases, qkv_prepare_cases,
    attention_cases, linear_cases,       embedding_cases, elementwise_cases, lm_head_cases,   adamw_cases,
    moe_cases,       moe_routing_cases,  dyt_cases,       activation_cases,   gemma_rms_norm_cases,
};

bool valid_name(const std::string& s) {
  for (const char ch : s)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_')) return false;
  return !s.empty();
}

}  // namespace

const std::vector<OpCase>& all_cases() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> all;
    std::set<std::string> ids;
    for (CasesFn row : kRows)
      for (OpCase& c : row()) {
        KILN_CHECK(valid_name(c.id()) && ids.insert(c.id()).second, "op_test", "case id '{}' is not a unique name",
                   c.id());
        KILN_CHECK(c.forward && c.reference, "op_test", "{} needs a forward and a reference", c.id());
        all.push_back(std::move(c));
      }
    return all;
  }();
  return cases;
}

std::vector<const OpCase*> cpu_cases() {
  std::vector<const OpCase*> out;
  for (const OpCase& c : all_cases())
    if (c.cpu) out.push_back(&c);
  return out;
}

std::vector<const OpCase*> gradient_cases() {
  std::vector<const OpCase*> out;
  for (const OpCase& c : all_cases())
    if (c.cpu && c.finite_differences && c.backward) out.push_back(&c);
  return out;
}

std::vector<CudaRun> cuda_runs() {
  std::vector<CudaRun> out;
  for (const OpCase& c : all_cases())
    for (DType p : c.cuda) out.push_back({&c, p});
  return out;
}

void PrintTo(const OpCase* c, std::ostream* os) { *os << c->id(); }
void PrintTo(const CudaRun& r, std::ostream* os) { *os << r.c->id() << " in " << dtype_name(r.precision); }

}  // namespace kiln::op_test
