#include "train/pipeline_layout.h"

#include "core/error.h"

namespace kiln::pipeline {
namespace {

class ReplicaPipeline final : public dist::Communicator {
 public:
  ReplicaPipeline(dist::Communicator& group, const Layout& layout)
      : group_(group), layout_(layout), replica_(layout.replica_of(group.rank())) {
    KILN_CHECK(group.world_size() == layout.stages * layout.replicas, "dist.pipeline_stages",
               "{} ranks for {} stages x {} replicas", group.world_size(), layout.stages, layout.replicas);
  }

  int rank() const override { return layout_.stage_of(group_.rank()); }
  int world_size() const override { return layout_.stages; }
  Device device() const override { return group_.device(); }
  std::string_view backend() const override { return group_.backend(); }

  void send(const void* data, int64_t bytes, int peer, int tag, std::string_view what) override {
    group_.send(data, bytes, layout_.rank_of(peer, replica_), tag, what);
  }
  void recv(void* data, int64_t bytes, int peer, int tag, std::string_view what) override {
    group_.recv(data, bytes, layout_.rank_of(peer, replica_), tag, what);
  }

  void all_reduce(void*, int64_t, DType, dist::ReduceOp, std::string_view what) override { refuse(what); }
  void broadcast(void*, int64_t, int, std::string_view what) override { refuse(what); }
  void all_gather(void*, int64_t, std::string_view what) override { refuse(what); }
  void reduce_scatter(void*, int64_t, DType, dist::ReduceOp, std::string_view what) override { refuse(what); }

 private:
  [[noreturn]] static void refuse(std::string_view what) {
    fail("pipeline", "'{}': a replica's pipeline view has point-to-point only; collectives run on the whole group",
         what);
  }

  dist::Communicator& group_;
  const Layout layout_;
  const int replica_;
};

}  // namespace

std::unique_ptr<dist::Communicator> replica_pipeline(dist::Communicator& group, const Layout& layout) {
  return std::make_unique<ReplicaPipeline>(group, layout);
}

}  // namespace kiln::pipeline
