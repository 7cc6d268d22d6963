// Runs a pipeline schedule (train/pipeline_schedule.h) on paper: each rank takes its
// actions in order, each costing a given time, and waits where a receive's data has not
// arrived. It checks the schedule -- every micro-batch's forward, input gradient and weight
// gradient exactly once per stage, each after what it depends on, every send received --
// finds deadlocks, and reports the step's length, each rank's idle share (the bubble) and
// how many micro-batches' activations each rank holds at most.
//
// Transfers: a send is posted and its rank goes on at once (an isend); the data reaches the
// other rank `transfer` after the send was posted, and the send completes when its matching
// receive is reached. A receive waits for that data. So a rank stuck on a receive whose
// send its peer never reaches (both ranks receiving first, say) is a deadlock.
#pragma once

#include <string>
#include <vector>

#include "train/pipeline_schedule.h"

namespace kiln::pipeline {

// Time of one action on one stage. A whole backward (ActionKind::kBackward) costs
// backward_input + backward_weight.
struct Costs {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  double transfer = 0;  // from a send's post to its data being at the receiver
};

struct Simulation {
  bool ok = false;         // ran to the end, every check passed
  bool deadlock = false;   // some ranks could not go on (`problem` says which, on what)
  std::string problem;     // one line; empty when ok
  double makespan = 0;     // when the last rank finished
  std::vector<double> busy;             // per rank: time spent computing
  std::vector<double> bubble_fraction;  // per rank: idle / makespan
  double bubble = 0;                    // all ranks' idle / (ranks x makespan)
  // Per rank: the most (micro-batch, stage) pairs at once whose forward ran and whose
  // weight gradient did not (a whole backward releases its pair; B alone does not, as W
  // still reads the saved inputs).
  std::vector<int> peak_in_flight;
};

Simulation simulate(const Schedule& schedule, const Costs& costs = {});

}  // namespace kiln::pipeline
