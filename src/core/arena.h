// Arenas: memory planned when a model is built, allocated once, never in the step loop.
//
// Build time:  arena.reserve(tensor, dtype, shape) records where a tensor will live.
// Then:        arena.allocate() makes one allocation and binds every reserved tensor.
// Before allocate(), planned_bytes() is exact, which is how `kiln plan` reports memory
// without allocating anything. Reserved Tensor objects must not move (modules are
// heap-allocated and own their tensors as members).
#pragma once

#include "core/tensor.h"

#include <string>
#include <vector>

namespace kiln {

// Host memory of a fresh anonymous mapping: reads as zeros unwritten, holds only pages written
// (ZeRO-2 writes other shards' gradient pages as backward reaches them and gives each back after
// its bucket: never the whole arena at once, not even when allocated; train/sharded_gradients.h).
class HostPages {
 public:
  HostPages() = default;
  explicit HostPages(size_t bytes);
  ~HostPages();
  HostPages(HostPages&& other) noexcept;
  HostPages& operator=(HostPages&& other) noexcept;
  HostPages(const HostPages&) = delete;
  HostPages& operator=(const HostPages&) = delete;
  void* data() const { return data_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class Arena {
 public:
  Arena(std::string name, Device device) : name_(std::move(name)), device_(device) {}

  void reserve(Tensor& tensor, DType dtype, Shape shape);
  size_t planned_bytes() const { return planned_bytes_; }
  void allocate();  // zero-filled (on the host: a fresh mapping, its pages untouched until written)
  // Binds every reserved tensor into memory this arena does not own (at least
  // planned_bytes() long, 256-byte aligned): several arenas whose contents are never
  // needed at the same time share one region (the activations of recomputed blocks).
  void bind_shared(void* base);
  // Reserved tensors are entries in reservation order; entry i lives at offset_of(i)
  // (offset_of(entry_count()) = planned_bytes()).
  size_t entry_count() const { return entries_.size(); }
  size_t offset_of(size_t entry) const;
  // Binds entries [first, last) into `region` instead (entry first at its start, the others
  // as far after it as in the arena), or back into the arena's own memory with `region`
  // null: activation frames move runs of one arena between their regions
  // (model/activation_frames.h).
  void bind_entries(size_t first, size_t last, void* region);
  bool allocated() const { return base() != nullptr || shared_base_ != nullptr; }
  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  // The whole arena as one flat byte range (for bulk zeroing of gradients).
  void* base() const { return host_.data() ? host_.data() : storage_.data(); }

 private:
  struct Entry {
    Tensor* tensor;
    size_t offset;
  };
  std::string name_;
  Device device_;
  std::vector<Entry> entries_;
  size_t planned_bytes_ = 0;
  Storage storage_;  // on a device
  HostPages host_;   // on the host
  void* shared_base_ = nullptr;
};

// Scratch memory shared by all ops: each user declares its peak need at plan time, and at
// run time takes tensors from a bump pointer inside a Scope that releases them on exit.
// Scopes nest: an outer user (a block, the LM head) may hold scratch while an inner user (a
// module inside the block) takes its own, and a GEMM inside that module its operands' copies
// (an FP8 LinearLayer), so the plan is max(outer) + max(inner) + max(gemm needs).
class Workspace {
 public:
  enum class Level { outer, inner, gemm };

  explicit Workspace(Device device) : device_(device) {}

  void reserve_peak(size_t bytes, Level level = Level::inner);
  size_t planned_bytes() const { return peak_outer_ + peak_inner_ + peak_gemm_; }
  void allocate();

  class Scope {
   public:
    explicit Scope(Workspace& ws) : ws_(ws), mark_(ws.offset_) {}
    ~Scope() { ws_.offset_ = mark_; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Tensor take(DType dtype, Shape shape);

   private:
    Workspace& ws_;
    size_t mark_;
  };

  // Bytes a tensor occupies in the workspace, alignment included (for reserve_peak sums).
  static size_t footprint(DType dtype, Shape shape);

 private:
  Device device_;
  size_t peak_outer_ = 0, peak_inner_ = 0, peak_gemm_ = 0;
  size_t offset_ = 0;
  Storage storage_;
};

}  // namespace kiln
