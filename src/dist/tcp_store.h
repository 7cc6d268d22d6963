// The rendezvous of a multi-process run: a key-value store served by rank 0 at
// MASTER_ADDR:MASTER_PORT, through which the ranks swap what their collective libraries
// need to connect (Gloo's addresses, NCCL's unique id) and the checks made at start.
// Small values, a few per run, and each rank's progress record (dist/rank_progress.h),
// rewritten once a second; the collectives themselves never pass through it.
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace kiln::dist {

class TcpStore {
 public:
  // `serve`: this process (rank 0) listens on `port` and serves every rank. Every rank,
  // rank 0 too, then connects to host:port, retrying until `timeout` (the server may not
  // be up yet). Throws kiln::Error naming the address on failure.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits for the key to be set (by any rank), up to the timeout; throws naming the key.
  std::string get(const std::string& key);

  // A key's value as it is now, without waiting for it to be set, with how long ago it was
  // set (rank 0's clock: the ranks' clocks are never compared) and whether the connection
  // that set it has closed since. Never throws: the store's own failure is the status.
  struct Peek {
    enum Status { found, absent, timed_out, lost } status = lost;
    std::string value;
    std::chrono::milliseconds age{0};
    bool writer_gone = false;
  };
  Peek peek(const std::string& key);

  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  class Server;
  void send_all(const void* data, size_t bytes, const std::string& key);
  void receive_all(void* data, size_t bytes, const std::string& key);
  std::string address_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Server> server_;
  int socket_ = -1;
};

}  // namespace kiln::dist
