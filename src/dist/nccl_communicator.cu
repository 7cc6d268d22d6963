#include "dist/nccl_communicator.h"

#include "core/cuda_context.h"
#include "core/error.h"
#include "dist/collective_watchdog.h"

#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

namespace kiln::dist {

namespace {

// The element type NCCL reduces: an unsigned max reads i32 / i64 as uint32 / uint64.
ncclDataType_t nccl_type(DType dtype, ReduceOp op, std::string_view what) {
  if (op == ReduceOp::max_unsigned) {
    if (dtype == DType::i32) return ncclUint32;
    if (dtype == DType::i64) return ncclUint64;
    fail("dist", "'{}': an unsigned max of {} elements", what, dtype_name(dtype));
  }
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  fail("dist", "all_reduce '{}': no NCCL type for {}", what, dtype_name(dtype));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const ncclUniqueId& id, int rank, int world_size, const ExecContext& exec,
                   std::chrono::milliseconds timeout)
      : rank_(rank), world_size_(world_size), stream_(cuda::stream(exec)), timeout_(timeout) {
    check(ncclCommInitRank(&comm_, world_size, id, rank), "joining the NCCL communicator");
    watchdog_ = std::make_unique<CollectiveWatchdog>(
        timeout, [this](const std::string& what, double waited_s) { timed_out(what, waited_s); });
  }
  ~NcclCommunicator() override {
    watchdog_.reset();  // before the communicator it may abort
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device device() const override { return Device::cuda; }
  std::string_view backend() const override { return "nccl"; }

  void all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) override {
    reduce_on_stream(stream_, data, count, dtype, op, what);
  }

  void all_reduce_on(const ExecContext& exec, void* data, int64_t count, DType dtype, ReduceOp op,
                     std::string_view what) override {
    reduce_on_stream(cuda::stream(exec), data, count, dtype, op, what);
  }

  void broadcast(void* data, int64_t bytes, int root, std::string_view what) override {
    if (bytes == 0) return;
    check(ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, comm_, stream_), what);
    watch_collective(stream_, what);
  }

  void all_gather(void* data, int64_t bytes_per_rank, std::string_view what) override {
    if (bytes_per_rank == 0) return;
    auto* chunks = static_cast<uint8_t*>(data);
    check(ncclAllGather(chunks + rank_ * bytes_per_rank, chunks, static_cast<size_t>(bytes_per_rank), ncclUint8, comm_,
                        stream_),
          what);
    watch_collective(stream_, what);
  }

  // In place: NCCL's reduce-scatter reads every chunk and writes this rank's, which may
  // overlap its input exactly there (recvbuff = sendbuff + rank * recvcount).
  void reduce_scatter(void* data, int64_t count_per_rank, DType dtype, ReduceOp op, std::string_view what) override {
    reduce_scatter_on_stream(stream_, data, count_per_rank, dtype, op, what);
  }

  void reduce_scatter_on(const ExecContext& exec, void* data, int64_t count_per_rank, DType dtype, ReduceOp op,
                         std::string_view what) override {
    reduce_scatter_on_stream(cuda::stream(exec), data, count_per_rank, dtype, op, what);
  }

  // Untested (no multi-GPU machine here). NCCL has no tags: messages between two ranks
  // match in the order they are issued, so `tag` is only checked. Unlike Gloo's, a send is
  // not buffered: beyond NCCL's small-message buffers it waits on the GPU for its receive.
  void send(const void* data, int64_t bytes, int peer, int tag, std::string_view what) override {
    check_peer(peer, tag, what);
    if (bytes == 0) return;
    check(ncclSend(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_, stream_), what);
    watch_collective(stream_, what);
  }

  void recv(void* data, int64_t bytes, int peer, int tag, std::string_view what) override {
    check_peer(peer, tag, what);
    if (bytes == 0) return;
    check(ncclRecv(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_, stream_), what);
    watch_collective(stream_, what);
  }

  void watch(const ExecContext& exec, std::string_view what) override { watch_stream(cuda::stream(exec), what); }

 private:
  void reduce_on_stream(cudaStream_t stream, void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) {
    if (count == 0) return;
    check(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype, op, what),
                        op == ReduceOp::sum ? ncclSum : ncclMax, comm_, stream),
          what);
    watch_collective(stream, what);
  }

  void reduce_scatter_on_stream(cudaStream_t stream, void* data, int64_t count_per_rank, DType dtype, ReduceOp op,
                                std::string_view what) {
    if (count_per_rank == 0) return;
    auto* chunks = static_cast<uint8_t*>(data);
    const size_t chunk_bytes = static_cast<size_t>(count_per_rank) * dtype_size(dtype);
    check(ncclReduceScatter(chunks, chunks + static_cast<size_t>(rank_) * chunk_bytes, static_cast<size_t>(count_per_rank),
                            nccl_type(dtype, op, what), op == ReduceOp::sum ? ncclSum : ncclMax, comm_, stream),
          what);
    watch_collective(stream, what);
  }

  // A collective enqueued outside a capture is watched at once; one inside a captured
  // graph is watched with the graph's launch (watch() after it: an event recorded during
  // a capture is a graph node, not something to query).
  void watch_collective(cudaStream_t stream, std::string_view what) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) == cudaSuccess && capturing != cudaStreamCaptureStatusNone) return;
    watch_stream(stream, what);
  }

  void watch_stream(cudaStream_t stream, std::string_view what) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return;  // unwatched, not failed
    if (cudaEventRecord(event, stream) != cudaSuccess) {
      cudaEventDestroy(event);
      return;
    }
    // The event lives as long as the watchdog polls it.
    std::shared_ptr<CUevent_st> done(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
    watchdog_->watch(std::string(what), [done] { return cudaEventQuery(done.get()) != cudaErrorNotReady; });
  }

  // From the watchdog's thread: the training thread may be blocked in a synchronization
  // that never returns, so the process ends here. Aborting the communicator first frees
  // the GPU and lets the other ranks' NCCL see this one leave.
  [[noreturn]] void timed_out(const std::string& what, double waited_s) {
    std::fprintf(stderr,
                 "kiln: error: [dist] rank %d of %d: the NCCL collective '%s' did not finish within dist.timeout = %g s "
                 "(waited %.1f s): a rank died, hangs or left the run; aborting the communicator\n",
                 rank_, world_size_, what.c_str(), static_cast<double>(timeout_.count()) / 1000.0, waited_s);
    std::fflush(stderr);
    // Bounded: an abort that waits on a stream held up for good must not keep the process.
    auto aborted = std::make_shared<std::atomic<bool>>(false);
    std::thread([comm = comm_, aborted] {
      ncclCommAbort(comm);
      aborted->store(true);
    }).detach();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!aborted->load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::_Exit(1);
  }

  void check_peer(int peer, int tag, std::string_view what) const {
    KILN_CHECK(peer >= 0 && peer < world_size_ && peer != rank_ && tag >= 0, "dist",
               "rank {} of {}: '{}' with rank {} (tag {}): not another rank of the run, or a negative tag", rank_,
               world_size_, what, peer, tag);
  }

  void check(ncclResult_t result, std::string_view what) const {
    if (result == ncclSuccess) return;
    fail("dist", "rank {} of {}: NCCL failed in '{}': {} ({})", rank_, world_size_, what, ncclGetErrorString(result),
         ncclGetLastError(comm_));
  }
  int rank_, world_size_;
  cudaStream_t stream_;  // where its collectives run
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<CollectiveWatchdog> watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& key, int rank,
                                                     int world_size, const ExecContext& exec,
                                                     std::chrono::milliseconds timeout) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // no multicast unless the environment asks for it
  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t made = ncclGetUniqueId(&id);
    KILN_CHECK(made == ncclSuccess, "dist", "ncclGetUniqueId: {}", ncclGetErrorString(made));
    store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    const std::string value = store.get(key);
    KILN_CHECK(value.size() == sizeof(id), "dist", "rendezvous: NCCL id of {} bytes, expected {}", value.size(),
               sizeof(id));
    std::memcpy(&id, value.data(), sizeof(id));
  }
  cuda::stream(exec);  // the stream (and the CUDA context) before NCCL binds to the device
  return std::make_unique<NcclCommunicator>(id, rank, world_size, exec, timeout);
}

}  // namespace kiln::dist
