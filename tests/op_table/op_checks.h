// The checks of the op table (op_case.h), each reporting through gtest with the case,
// the tensor and the worst element in the message.
#pragma once

#include "op_table/op_case.h"

namespace kiln::op_test {

// (a) The CPU f64 forward against the case's naive reference, then the CPU f32 forward
// and backward against the f64 ones (same inputs, rounded to f32 for both).
void check_reference(const OpCase& c);
void check_f32_against_f64(const OpCase& c);

// (b) Every input gradient of the f64 backward against central finite differences of
// L = sum over outputs with a gradient spec of out * dout.
void check_gradients(const OpCase& c);

// (c) The CUDA run in `precision` (f32 or bf16) against the CPU f64 run on the same
// values: poisoned outputs, guards, tolerances, same_bits, invariants, and (when the
// case is deterministic) a second run's bytes. check_device is the same on any device
// (the harness's own tests run it on the CPU).
void check_cuda(const OpCase& c, DType precision);
void check_device(const OpCase& c, DType precision, Device device);

}  // namespace kiln::op_test
