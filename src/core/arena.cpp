#include "core/arena.h"

#include "core/device_memory.h"
#include "core/error.h"

#include <sys/mman.h>

#include <algorithm>
#include <utility>

namespace kiln {

namespace {
size_t aligned(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }
}  // namespace

HostPages::HostPages(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("memory", "cannot map {} bytes on the host", bytes_);
  data_ = p;
}

HostPages::~HostPages() { release(); }

HostPages::HostPages(HostPages&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

HostPages& HostPages::operator=(HostPages&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void HostPages::release() {
  if (data_) munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

void Arena::reserve(Tensor& tensor, DType dtype, Shape shape) {
  KILN_CHECK(!allocated(), "arena", "{}: reserve after allocate", name_);
  tensor.set_meta(dtype, device_, shape);
  entries_.push_back({&tensor, planned_bytes_});
  planned_bytes_ += aligned(tensor.nbytes());
}

void Arena::allocate() {
  KILN_CHECK(!allocated(), "arena", "{}: allocated twice", name_);
  if (device_ == Device::cpu) {
    host_ = HostPages(planned_bytes_);  // zeros already
  } else {
    storage_ = Storage(device_, planned_bytes_);
    device_memset_zero(storage_.data(), device_, storage_.bytes());
  }
  char* base = static_cast<char*>(this->base());
  for (const Entry& e : entries_) e.tensor->bind(base + e.offset);
}

void Arena::bind_shared(void* base) {
  KILN_CHECK(!allocated(), "arena", "{}: bound twice", name_);
  KILN_CHECK(base != nullptr, "arena", "{}: bound to null", name_);
  shared_base_ = base;
  for (const Entry& e : entries_) e.tensor->bind(static_cast<char*>(base) + e.offset);
}

size_t Arena::offset_of(size_t entry) const {
  KILN_CHECK(entry <= entries_.size(), "arena", "{}: entry {} of {}", name_, entry, entries_.size());
  return entry == entries_.size() ? planned_bytes_ : entries_[entry].offset;
}

void Arena::bind_entries(size_t first, size_t last, void* region) {
  KILN_CHECK(allocated(), "arena", "{}: entries bound elsewhere before the arena is", name_);
  KILN_CHECK(first <= last && last <= entries_.size(), "arena", "{}: entries [{}, {}) of {}", name_, first, last,
             entries_.size());
  char* own = static_cast<char*>(shared_base_ != nullptr ? shared_base_ : base());
  char* start = region != nullptr ? static_cast<char*>(region) : own + offset_of(first);
  for (size_t i = first; i < last; ++i) entries_[i].tensor->bind(start + (entries_[i].offset - offset_of(first)));
}

size_t Workspace::footprint(DType dtype, Shape shape) {
  return aligned(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
}

void Workspace::reserve_peak(size_t bytes, Level level) {
  KILN_CHECK(storage_.data() == nullptr, "workspace", "reserve after allocate");
  size_t& peak = level == Level::outer ? peak_outer_ : level == Level::inner ? peak_inner_ : peak_gemm_;
  if (bytes > peak) peak = bytes;
}

void Workspace::allocate() {
  storage_ = Storage(device_, planned_bytes());
  device_memset_zero(storage_.data(), device_, storage_.bytes());
}

Tensor Workspace::Scope::take(DType dtype, Shape shape) {
  const size_t bytes = footprint(dtype, shape);
  KILN_CHECK(ws_.storage_.data() != nullptr, "workspace", "used before allocate");
  KILN_CHECK(ws_.offset_ + bytes <= ws_.planned_bytes(), "workspace",
             "request of {} bytes exceeds the planned peak {} (offset {}): a module under-declared its need",
             bytes, ws_.planned_bytes(), ws_.offset_);
  Tensor t(static_cast<char*>(ws_.storage_.data()) + ws_.offset_, dtype, ws_.device_, shape);
  ws_.offset_ += bytes;
  return t;
}

}  // namespace kiln
