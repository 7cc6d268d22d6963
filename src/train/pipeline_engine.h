// Runs one rank's actions of a pipeline schedule (train/pipeline_schedule.h) against the
// stages it holds, moving activations and their gradients between ranks with the
// communicator's send and recv. Model-free: a stage is whatever implements PipelineStage
// (tested with a chain of small dense layers, test_pipeline_engine; kiln's model cut into
// stages is train/pipeline_model_stage.h; the trainer runs it, train/pipeline_trainer_step.h).
//
// The engine owns the buffers that cross a stage boundary, per (micro-batch, stage): the
// input activation received (or handed over from the previous stage on this rank), the
// output it sends on, the output gradient received and the input gradient it sends back.
// Each is freed once used or sent (send copies, dist/communicator.h). What a stage keeps
// between its forward and backward (its saved activations) is the stage's own business.
// Buffers are host memory: the engine runs on the host communicator (Gloo) only.
#pragma once

#include <cstdint>

#include "dist/communicator.h"
#include "train/pipeline_schedule.h"

namespace kiln::pipeline {

// The stages of a model that one rank holds (those with rank_of(stage) == this rank). The
// engine calls each micro-batch's passes in the schedule's order: forward, then
// backward_input, then backward_weight (a whole backward is the latter two in a row).
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Bytes of the activation entering `stage` (unused for stage 0, which reads its own
  // micro-batch) and of its gradient; the same on every rank for a given stage.
  virtual int64_t input_bytes(int stage) const = 0;
  // Bytes of the activation leaving `stage` (unused for the last stage, whose forward ends
  // in the loss): input_bytes(stage + 1).
  virtual int64_t output_bytes(int stage) const = 0;

  // `input`: nullptr on stage 0; `output`: nullptr on the last stage. Keeps what its
  // backward needs.
  virtual void forward(int microbatch, int stage, const void* input, void* output) = 0;
  // The gradient of the stage's input from that of its output. `output_grad`: nullptr on
  // the last stage (the gradient starts at its loss); `input_grad`: nullptr on stage 0.
  virtual void backward_input(int microbatch, int stage, const void* output_grad, void* input_grad) = 0;
  // Adds the micro-batch's weight gradients to the stage's, from what forward and
  // backward_input kept, and drops what it kept for the micro-batch.
  virtual void backward_weight(int microbatch, int stage) = 0;
};

// The tag of the message crossing the boundary between stages `lower` and `lower + 1` for
// `microbatch`: its activation (forward) or its gradient (backward). Unique in a step.
int transfer_tag(int microbatch, int lower, bool gradient, int stages);

// Runs comm.rank()'s action list of `schedule` on `stage`. The communicator's ranks are the
// pipeline's (world size = schedule.ranks). Throws naming the action when the schedule
// uses a buffer it never filled (a forward before its input arrived) or the step ends with
// a buffer unused (an activation received and never run forward).
void run_pipeline_step(const Schedule& schedule, PipelineStage& stage, dist::Communicator& comm);

}  // namespace kiln::pipeline
