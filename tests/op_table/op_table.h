// The rows of the op test table: every op family and the function that lists its cases
// (cases_<family>.cpp, next to the op's naive reference). A new op is one more function
// here and one more row in op_table.cpp.
#pragma once

#include "op_table/op_case.h"

#include <ostream>
#include <vector>

namespace kiln::op_test {

// Cases whose tensors hold more elements than this run on the GPU only: the CPU code is
// the same for every size, and fp64 references of GPU launch shapes would slow CI.
inline constexpr int64_t kCpuMaxElements = int64_t{1} << 16;

std::vector<OpCase> activation_cases();
std::vector<OpCase> add_rms_norm_cases();
std::vector<OpCase> adamw_cases();
std::vector<OpCase> attention_cases();
std::vector<OpCase> elementwise_cases();
std::vector<OpCase> dyt_cases();
std::vector<OpCase> embedding_cases();
std::vector<OpCase> gemma_rms_norm_cases();
std::vector<OpCase> lm_head_cases();
std::vector<OpCase> linear_cases();
std::vector<OpCase> moe_cases();
std::vector<OpCase> moe_routing_cases();
std::vector<OpCase> qkv_prepare_cases();
std::vector<OpCase> qkv_split_cases();
std::vector<OpCase> rms_norm_cases();
std::vector<OpCase> rope_cases();
std::vector<OpCase> swiglu_cases();

// Every case of every row, built once.
const std::vector<OpCase>& all_cases();

// The cases of each check: the CPU's (a), those with finite differences (b), and the
// (case, precision) pairs of the GPU (c).
std::vector<const OpCase*> cpu_cases();
std::vector<const OpCase*> gradient_cases();
struct CudaRun {
  const OpCase* c;
  DType precision;
};
std::vector<CudaRun> cuda_runs();

// gtest prints parameters by these (a failure's "where GetParam() = ..."): the case's id.
void PrintTo(const OpCase* c, std::ostream* os);
void PrintTo(const CudaRun& r, std::ostream* os);

}  // namespace kiln::op_test
