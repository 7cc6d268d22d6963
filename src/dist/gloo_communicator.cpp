#include "dist/gloo_communicator.h"

#include "core/error.h"

#include <fmt/format.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kiln::dist {

namespace {

// Gloo's view of kiln's rendezvous store, its keys under a prefix.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStore& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = store_.get(prefix_ + key);
    return {value.begin(), value.end()};
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) store_.get(prefix_ + key);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override { wait(keys); }

 private:
  TcpStore& store_;
  std::string prefix_;
};

template <typename T>
void reduce_into(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  if (op == ReduceOp::sum)
    for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  else
    for (size_t i = 0; i < n; ++i) o[i] = std::max(x[i], y[i]);
}

template <typename T>
void run_all_reduce(const std::shared_ptr<gloo::Context>& context, uint32_t tag, std::chrono::milliseconds timeout,
                    void* data, int64_t count, ReduceOp op) {
  gloo::AllreduceOptions opts(context);
  opts.setOutput(static_cast<T*>(data), static_cast<size_t>(count));
  opts.setReduceFunction([op](void* out, const void* a, const void* b, size_t n) { reduce_into<T>(out, a, b, n, op); });
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

// Gloo's reduce-scatter (recursive halving and doubling, its only one) is of its older
// algorithm interface: made per call on the context, whose own slot counter keeps its
// slots apart from the tagged collectives' (whose slots carry a prefix in their high
// bits), bounded by the context's timeout (dist.timeout, set when it connected). That
// counter is an int, advanced by 4 W (W - 1) per call: about 44 million calls at 4 ranks,
// 2 million at 32, over a communicator's life (GlooCommunicator::reduce_scatter checks). It leaves
// this rank's reduced chunk at the start of the buffer; it moves to the rank's own chunk.
template <typename T>
void run_reduce_scatter(const std::shared_ptr<gloo::Context>& context, void* data, int64_t count_per_rank,
                        ReduceOp op) {
  const int ranks = context->size;
  auto* elements = static_cast<T*>(data);
  const std::vector<int> counts(static_cast<size_t>(ranks), static_cast<int>(count_per_rank));
  gloo::ReduceScatterHalvingDoubling<T> algorithm(
      context, {elements}, static_cast<int>(count_per_rank * ranks), counts,
      op == ReduceOp::sum ? gloo::ReductionFunction<T>::sum : gloo::ReductionFunction<T>::max);
  algorithm.run();
  if (context->rank != 0)
    std::memmove(elements + count_per_rank * context->rank, elements, static_cast<size_t>(count_per_rank) * sizeof(T));
}

// Gloo's collectives take slot prefixes 0x01..0x08 (gloo/types.h); point to point uses
// its own, so a tag never meets a collective's slot.
constexpr uint8_t kPointToPointSlotPrefix = 0x40;

uint64_t p2p_slot(int tag) { return gloo::Slot::build(kPointToPointSlotPrefix, static_cast<uint32_t>(tag)); }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

struct GlooCommunicator::PostedSend {
  std::vector<unsigned char> bytes;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;  // over `bytes`
  int peer = 0, tag = 0;
  std::string what;
  std::chrono::steady_clock::time_point posted;
};

GlooCommunicator::GlooCommunicator(TcpStore& store, const GlooEndpoint& endpoint, int rank, int world_size,
                                   std::chrono::milliseconds timeout, RankProgress& progress)
    : rank_(rank), world_size_(world_size),
      who_(endpoint.who.empty() ? fmt::format("rank {} of {}", rank, world_size) : endpoint.who), timeout_(timeout),
      progress_(progress) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = endpoint.host;
    attr.iface = endpoint.interface;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(timeout);
    StoreAdapter adapter(store, endpoint.prefix);
    context->connectFullMesh(adapter, device);
    context_ = context;
  } catch (const kiln::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("dist", "{}: Gloo could not connect the ranks: {}", who_, e.what());
  }
}

// Sends still in flight leave before the connections close (a step's last gradients: their
// receivers are on their way to them). Bounded by dist.timeout: a send not received by then
// fails, Gloo closes the connections, and the others fail at once.
GlooCommunicator::~GlooCommunicator() {
  {
    std::lock_guard<std::mutex> lock(sends_mutex_);
    closing_ = true;
  }
  sends_changed_.notify_all();
  if (send_waiter_.joinable()) send_waiter_.join();
}

int64_t GlooCommunicator::enter() {
  const int64_t seq = static_cast<int64_t>(tag_) + 1;
  progress_.enter(seq);
  return seq;
}

// Waited out dist.timeout, or a peer's connection broke (a rank died, or a fellow waiter
// timed out first and closed it): either way the line names the rank(s) the collective
// waited for, from every rank's progress record; Gloo's own words only when none is.
void GlooCommunicator::lost(std::string_view what, int64_t seq, std::chrono::steady_clock::time_point entered,
                            const std::exception& e) const {
  const auto waited = std::chrono::steady_clock::now() - entered;
  const RankProgress::Diagnosis found = progress_.diagnose(seq, waited >= timeout_);
  std::string cause;
  if (!found.named) {
    cause = fmt::format(" (Gloo: {})", e.what());
    std::replace(cause.begin(), cause.end(), '\n', ' ');
  }
  const double timeout_s = static_cast<double>(timeout_.count()) / 1000.0;
  if (waited >= timeout_)
    fail("dist", "{}: the collective '{}' (#{}) did not finish within dist.timeout = {} s: {}{}", who_, what, seq,
         timeout_s, found.text, cause);
  fail("dist", "{}: the collective '{}' (#{}) failed after {:.1f} s (dist.timeout = {} s): {}{}", who_, what, seq,
       std::chrono::duration<double>(waited).count(), timeout_s, found.text, cause);
}

void GlooCommunicator::all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) {
  if (count == 0) return;
  KILN_CHECK(op != ReduceOp::max_unsigned || dtype == DType::i32 || dtype == DType::i64, "dist",
             "all_reduce '{}': an unsigned max of {} elements", what, dtype_name(dtype));
  const auto entered = std::chrono::steady_clock::now();
  const int64_t seq = enter();
  try {
    const std::shared_ptr<gloo::Context>& c = context_;
    const uint32_t tag = tag_++;
    switch (dtype) {
      case DType::f32: run_all_reduce<float>(c, tag, timeout_, data, count, op); break;
      case DType::f64: run_all_reduce<double>(c, tag, timeout_, data, count, op); break;
      case DType::i32:
        op == ReduceOp::max_unsigned ? run_all_reduce<uint32_t>(c, tag, timeout_, data, count, ReduceOp::max)
                                     : run_all_reduce<int32_t>(c, tag, timeout_, data, count, op);
        break;
      case DType::i64:
        op == ReduceOp::max_unsigned ? run_all_reduce<uint64_t>(c, tag, timeout_, data, count, ReduceOp::max)
                                     : run_all_reduce<int64_t>(c, tag, timeout_, data, count, op);
        break;
      default: fail("dist", "all_reduce '{}': no Gloo reduction for {}", what, dtype_name(dtype));
    }
    progress_.finish(seq);
  } catch (const kiln::Error&) {
    throw;
  } catch (const std::exception& e) {
    lost(what, seq, entered, e);
  }
}

void GlooCommunicator::broadcast(void* data, int64_t bytes, int root, std::string_view what) {
  if (bytes == 0) return;
  const auto entered = std::chrono::steady_clock::now();
  const int64_t seq = enter();
  try {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(static_cast<uint8_t*>(data), static_cast<size_t>(bytes));
    opts.setRoot(root);
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::broadcast(opts);
    progress_.finish(seq);
  } catch (const kiln::Error&) {
    throw;
  } catch (const std::exception& e) {
    lost(what, seq, entered, e);
  }
}

void GlooCommunicator::all_gather(void* data, int64_t bytes_per_rank, std::string_view what) {
  if (bytes_per_rank == 0) return;
  const auto entered = std::chrono::steady_clock::now();
  const int64_t seq = enter();
  try {
    // No input buffer: Gloo gathers in place, taking this rank's chunk from the output.
    gloo::AllgatherOptions opts(context_);
    opts.setOutput(static_cast<uint8_t*>(data), static_cast<size_t>(bytes_per_rank) * static_cast<size_t>(world_size_));
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::allgather(opts);
    progress_.finish(seq);
  } catch (const kiln::Error&) {
    throw;
  } catch (const std::exception& e) {
    lost(what, seq, entered, e);
  }
}


void GlooCommunicator::reduce_scatter(void* data, int64_t count_per_rank, DType dtype, ReduceOp op,
                                     std::string_view what) {
  if (count_per_rank == 0) return;
  KILN_CHECK(op != ReduceOp::max_unsigned, "dist", "reduce_scatter '{}': no unsigned max", what);
  // Gloo's algorithm counts its bytes in an int.
  KILN_CHECK(count_per_rank * world_size_ * static_cast<int64_t>(dtype_size(dtype)) <= std::numeric_limits<int>::max(),
             "dist", "reduce_scatter '{}': {} elements per rank x {} ranks exceed Gloo's 2 GiB per call", what,
             count_per_rank, world_size_);
  // Each call takes 4 W (W - 1) of the context's slots (an int that only grows): refuse
  // plainly before it would overflow, rather than wrap.
  const int64_t slots = 4 * static_cast<int64_t>(world_size_) * (world_size_ - 1);
  KILN_CHECK(reduce_scatter_slots_ + slots <= std::numeric_limits<int>::max(), "dist",
             "reduce_scatter '{}': Gloo's slot counter is spent after {} reduce-scatters at {} ranks; "
             "a larger dist.bucket_mb takes fewer per step",
             what, reduce_scatter_slots_ / std::max<int64_t>(slots, 1), world_size_);
  reduce_scatter_slots_ += slots;
  const auto entered = std::chrono::steady_clock::now();
  const int64_t seq = enter();
  try {
    switch (dtype) {
      case DType::f32: run_reduce_scatter<float>(context_, data, count_per_rank, op); break;
      case DType::f64: run_reduce_scatter<double>(context_, data, count_per_rank, op); break;
      case DType::i32: run_reduce_scatter<int32_t>(context_, data, count_per_rank, op); break;
      case DType::i64: run_reduce_scatter<int64_t>(context_, data, count_per_rank, op); break;
      default: fail("dist", "reduce_scatter '{}': no Gloo reduction for {}", what, dtype_name(dtype));
    }
    progress_.finish(seq);
  } catch (const kiln::Error&) {
    throw;
  } catch (const std::exception& e) {
    lost(what, seq, entered, e);
  }
}

void GlooCommunicator::check_peer(std::string_view verb, std::string_view what, int peer, int tag) const {
  KILN_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "dist",
             "rank {} of {}: cannot {} '{}' with rank {} (another rank of the run, 0..{})", rank_, world_size_, verb,
             what, peer, world_size_ - 1);
  KILN_CHECK(tag >= 0, "dist", "rank {} of {}: {} '{}': a tag must be >= 0, got {}", rank_, world_size_, verb, what,
             tag);
}

// Waited out dist.timeout, or the connection to the peer broke (it died, or a waiter on
// either side timed out first and Gloo closed every connection).
std::string GlooCommunicator::p2p_failure(std::string_view verb, std::string_view what, int peer, int tag,
                                          std::chrono::steady_clock::time_point posted,
                                          const std::exception& e) const {
  std::string cause = e.what();
  std::replace(cause.begin(), cause.end(), '\n', ' ');
  const double timeout_s = static_cast<double>(timeout_.count()) / 1000.0;
  const double waited = seconds_since(posted);
  const char* partner = verb == "send" ? "to" : "from";
  // The peer may itself have failed on another rank that died: the run's records name the
  // ranks that died or stopped (no collective's own laggards: sequence 0). This marks this
  // rank failed too, so the others do not blame it once it exits.
  const RankProgress::Diagnosis run = progress_.diagnose(0, waited >= timeout_s, false);
  const std::string records = run.named ? "; in the run: " + run.text : std::string();
  if (waited >= timeout_s)
    return fmt::format("{}: the {} '{}' (tag {}) {} rank {} did not finish within dist.timeout = {} s: "
                       "rank {} did not {} it (Gloo: {}){}",
                       who_, verb, what, tag, partner, peer, timeout_s, peer, verb == "send" ? "receive" : "send",
                       cause, records);
  return fmt::format("{}: the {} '{}' (tag {}) {} rank {} failed after {:.1f} s (dist.timeout = {} s): "
                     "the connection broke (Gloo: {}){}",
                     who_, verb, what, tag, partner, peer, waited, timeout_s, cause, records);
}

void GlooCommunicator::throw_if_a_send_failed() {
  std::lock_guard<std::mutex> lock(sends_mutex_);
  if (!send_failure_.empty()) throw Error("[dist] " + send_failure_);
}

void GlooCommunicator::send(const void* data, int64_t bytes, int peer, int tag, std::string_view what) {
  check_peer("send", what, peer, tag);
  throw_if_a_send_failed();
  if (bytes == 0) return;
  auto posted = std::make_unique<PostedSend>();
  posted->bytes.resize(static_cast<size_t>(bytes));
  std::memcpy(posted->bytes.data(), data, static_cast<size_t>(bytes));
  posted->peer = peer;
  posted->tag = tag;
  posted->what = std::string(what);
  posted->posted = std::chrono::steady_clock::now();
  try {
    posted->buffer = context_->createUnboundBuffer(posted->bytes.data(), posted->bytes.size());
    posted->buffer->send(peer, p2p_slot(tag));
  } catch (const std::exception& e) {
    fail("dist", "{}", p2p_failure("send", what, peer, tag, posted->posted, e));
  }
  {
    std::lock_guard<std::mutex> lock(sends_mutex_);
    sends_.push_back(std::move(posted));
    if (!send_waiter_.joinable()) send_waiter_ = std::thread([this] { wait_for_receives(); });
  }
  sends_changed_.notify_all();
}

void GlooCommunicator::wait_for_receives() {
  std::unique_lock<std::mutex> lock(sends_mutex_);
  for (;;) {
    sends_changed_.wait(lock, [&] { return closing_ || !sends_.empty(); });
    if (sends_.empty()) return;  // closing, every send received
    PostedSend* send = sends_.front().get();
    lock.unlock();
    // The wait's clock starts here, at or after the post: a send is failed no sooner than
    // dist.timeout after it was posted.
    std::string failure;
    try {
      send->buffer->waitSend(timeout_);
    } catch (const std::exception& e) {
      failure = p2p_failure("send", send->what, send->peer, send->tag, send->posted, e);
    }
    lock.lock();
    if (!failure.empty()) {
      send_failure_ = failure;
      return;
    }
    sends_.pop_front();
  }
}

void GlooCommunicator::recv(void* data, int64_t bytes, int peer, int tag, std::string_view what) {
  check_peer("receive", what, peer, tag);
  throw_if_a_send_failed();
  if (bytes == 0) return;
  const auto entered = std::chrono::steady_clock::now();
  try {
    auto buffer = context_->createUnboundBuffer(data, static_cast<size_t>(bytes));
    buffer->recv(peer, p2p_slot(tag));
    buffer->waitRecv(timeout_);
  } catch (const std::exception& e) {
    // A send of this rank that timed out closes every connection: that is the cause.
    throw_if_a_send_failed();
    fail("dist", "{}", p2p_failure("receive", what, peer, tag, entered, e));
  }
}

}  // namespace kiln::dist
