// Graceful stop on SIGTERM / SIGINT: the handler only records the signal; the trainer
// reads it at the next step boundary, saves a checkpoint and exits 0, so a preempted or
// interrupted run resumes where it stopped (`kiln train CONFIG --resume`).
//
// The handler is one-shot (SA_RESETHAND): a second Ctrl-C or SIGTERM terminates at once,
// as the user (or a scheduler's escalation) expects. While installed, SIGXFSZ is ignored
// so a file-size limit (ulimit -f) makes a write fail with EFBIG, reported like a full
// disk, instead of killing the process without a word.
#pragma once

#include <csignal>

namespace kiln {

class StopSignals {
 public:
  StopSignals();   // installs the handlers (one instance at a time)
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal received since installation, or 0.
  int received() const;
  static const char* name(int signal);

 private:
  struct sigaction old_term_, old_int_, old_xfsz_;
};

}  // namespace kiln
