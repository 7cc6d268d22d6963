#include "dist/gloo_communicator.h"

#include "core/error.h"

#include <fmt/format.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>

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

}  // namespace

GlooCommunicator::GlooCommunicator(TcpStore& store, const GlooEndpoint& endpoint, int rank, int world_size,
                                   std::chrono::milliseconds timeout, RankProgress& progress)
    : rank_(rank), world_size_(world_size), timeout_(timeout), progress_(progress) {
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
    fail("dist", "rank {} of {}: Gloo could not connect the ranks: {}", rank, world_size, e.what());
  }
}

GlooCommunicator::~GlooCommunicator() = default;

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
    fail("dist", "rank {} of {}: the collective '{}' (#{}) did not finish within dist.timeout = {} s: {}{}", rank_,
         world_size_, what, seq, timeout_s, found.text, cause);
  fail("dist", "rank {} of {}: the collective '{}' (#{}) failed after {:.1f} s (dist.timeout = {} s): {}{}", rank_,
       world_size_, what, seq, std::chrono::duration<double>(waited).count(), timeout_s, found.text, cause);
}

void GlooCommunicator::all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) {
  if (count == 0) return;
  const auto entered = std::chrono::steady_clock::now();
  const int64_t seq = enter();
  try {
    const std::shared_ptr<gloo::Context>& c = context_;
    const uint32_t tag = tag_++;
    switch (dtype) {
      case DType::f32: run_all_reduce<float>(c, tag, timeout_, data, count, op); break;
      case DType::f64: run_all_reduce<double>(c, tag, timeout_, data, count, op); break;
      case DType::i32: run_all_reduce<int32_t>(c, tag, timeout_, data, count, op); break;
      case DType::i64: run_all_reduce<int64_t>(c, tag, timeout_, data, count, op); break;
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

}  // namespace kiln::dist
