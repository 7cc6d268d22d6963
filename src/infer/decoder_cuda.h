// The GPU side of the Decoder (infer/decoder.h) that is not an op (its CUDA graphs are
// core/step_graphs.h; the modules' fused decode kernels are ops/decode/decode_kernels.h):
// the greedy argmax of logits rows on the device (so a greedy step copies back one id per
// row instead of a row of logits). No CUDA headers here: decoder.cpp includes this in CUDA
// builds only (definitions in decoder_cuda.cu).
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// out[i] = the lowest index of the largest value of row i of logits [rows, vocab] (fp32,
// device), as the sampler's greedy pick (and torch.argmax). Enqueued on the stream.
void argmax_rows_f32(const ExecContext& ctx, const float* logits, int64_t rows, int64_t vocab, int32_t* out);

// A chained greedy step's bookkeeping (Decoder::greedy_chain): history[*counter] = ids
// [rows], ++*counter; with `advance`, also tokens = ids and ++positions (the next step's
// inputs); without, *counter = 0 (the chain's last record). Enqueued on the stream.
void record_greedy_ids(const ExecContext& ctx, const int32_t* ids, int64_t rows, int32_t* history, int32_t* counter, bool advance,
                       int32_t* tokens, int32_t* positions);

}  // namespace kiln::cuda
