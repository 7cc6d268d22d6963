// Weighted mixtures of data sources (data.sources, docs/data.md "Mixtures").
//
// The schedule is a smooth weighted round-robin over documents, not random sampling: draw
// k goes to the source with the largest deficit (k + 1) * w_s - n_s * W (n_s: documents
// drawn from s so far, W: the sum of weights; ties to the lowest index). After any K
// draws every source has within one document of K * w_s / W, so the proportions are
// exact over every window of W draws when the weights are integers (4:1 gives s0 s0 s1
// s0 s0, repeated), and the schedule is a pure function of (k, n): a StreamState that
// stores them resumes it exactly, with nothing random to replay.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace kiln {

struct DataSource;

// The source of the next draw. `counts[s]`: documents drawn from s so far; `draw`: their
// sum. Sources with `active[s]` false are passed over (empty `active`: all take part).
size_t mixture_pick(std::span<const double> weights, uint64_t draw, std::span<const uint64_t> counts,
                    std::span<const bool> active = {});

// The name a source goes by in logs and messages: its `name`, else its path's last part.
std::string source_name(const DataSource& source);

}  // namespace kiln
