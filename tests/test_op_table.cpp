// The op test table on the CPU (op_table/op_case.h): every case's f64 forward against its
// naive reference and its f32 run against the f64 one, and every small case's backward
// against finite differences. The GPU half is tests/gpu/test_gpu_op_table.cpp.
#include "op_table/op_checks.h"
#include "op_table/op_table.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

using op_test::OpCase;

std::string case_name(const ::testing::TestParamInfo<const OpCase*>& info) { return info.param->id(); }

class OpReference : public ::testing::TestWithParam<const OpCase*> {};
TEST_P(OpReference, MatchesNaiveFp64) { op_test::check_reference(*GetParam()); }
TEST_P(OpReference, F32MatchesF64) { op_test::check_f32_against_f64(*GetParam()); }
INSTANTIATE_TEST_SUITE_P(Ops, OpReference, ::testing::ValuesIn(op_test::cpu_cases()), case_name);

class OpGradient : public ::testing::TestWithParam<const OpCase*> {};
TEST_P(OpGradient, MatchesFiniteDifferences) { op_test::check_gradients(*GetParam()); }
INSTANTIATE_TEST_SUITE_P(Ops, OpGradient, ::testing::ValuesIn(op_test::gradient_cases()), case_name);

}  // namespace
}  // namespace kiln
