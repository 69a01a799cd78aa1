// The LM head's cross-entropy over one chunk of float32 logits, with its gradient, reading the
// logits once (jax_megamoe/models/losses.py, CE_KERNEL). XLA makes it in two passes over the
// logits (the log-sum-exp reduce, then d_logits), which are ~9 ms of a 16-chunk 30B step on an
// H100 outside any GEMM (benchmarks/RESULTS.md, session 28). Plain C++ interface; enqueues on
// `stream` and returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace megamoe::xent {

// logits [rows, vocab] f32 and targets [rows] int32 ->
//   row_loss [rows] f32: lse(row) - logits[row, target] (NaN for a target outside [0, vocab)),
//   d_logits [rows, vocab] bf16: (exp(logits - lse) - one_hot(target)) / count,
// lse by the rule of losses._logsumexp: maxima equal to the row's (+-inf included) count 1
// unscaled, so an all -inf row gives -inf and a +inf logit +inf. vocab >= 1, count >= 1.
std::string CrossEntropyGrad(const float* logits, const int32_t* targets, int64_t rows,
                             int64_t vocab, int64_t count, void* d_logits, float* row_loss,
                             cudaStream_t stream);

}  // namespace megamoe::xent
