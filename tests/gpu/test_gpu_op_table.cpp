// The op test table on the GPU (op_table/op_case.h): every case's CUDA run, in fp32 and
// (where the case lists it) bf16 mixed precision, against the CPU f64 run on the same
// values, outputs poisoned and guarded, twice for the bits. Names are
// Ops/OpCuda.MatchesCpu/<op>_<case>_<precision>, so one op or case runs with
// --gtest_filter='*rms_norm_*'. Without a CUDA device every test skips (scripts/gpu_check.sh
// counts a skip as failure).
#include "gpu/gpu_harness.h"
#include "op_table/op_checks.h"
#include "op_table/op_table.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

using op_test::CudaRun;

class OpCuda : public gpu_test::GpuTest, public ::testing::WithParamInterface<CudaRun> {};

TEST_P(OpCuda, MatchesCpu) { op_test::check_cuda(*GetParam().c, GetParam().precision); }

std::string run_name(const ::testing::TestParamInfo<CudaRun>& info) {
  return info.param.c->id() + "_" + std::string(dtype_name(info.param.precision));
}
INSTANTIATE_TEST_SUITE_P(Ops, OpCuda, ::testing::ValuesIn(op_test::cuda_runs()), run_name);

}  // namespace
}  // namespace kiln
