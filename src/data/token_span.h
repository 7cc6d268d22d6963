// TokenSpan: a read-only view of one document's tokens, stored as int32 (tokenized in
// memory, kiln/llm.c uint32 shards) or uint16 (llm.c GPT-2 shards, kiln shards of small
// vocabularies), so memory-mapped shards are packed without a converted copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

namespace kiln {

class TokenSpan {
  static int32_t load(const void* data, int width, size_t i) {
    return width == 2 ? static_cast<int32_t>(static_cast<const uint16_t*>(data)[i]) : static_cast<const int32_t*>(data)[i];
  }

 public:
  class iterator {
   public:
    using iterator_category = std::random_access_iterator_tag;
    using value_type = int32_t;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = int32_t;

    iterator() = default;
    iterator(const void* data, int width, size_t i) : data_(data), width_(width), i_(i) {}
    int32_t operator*() const { return load(data_, width_, i_); }
    int32_t operator[](difference_type n) const {
      return load(data_, width_, static_cast<size_t>(static_cast<difference_type>(i_) + n));
    }
    iterator& operator++() { ++i_; return *this; }
    iterator operator++(int) { iterator t = *this; ++i_; return t; }
    iterator& operator--() { --i_; return *this; }
    iterator operator--(int) { iterator t = *this; --i_; return t; }
    iterator& operator+=(difference_type n) { i_ = static_cast<size_t>(static_cast<difference_type>(i_) + n); return *this; }
    iterator& operator-=(difference_type n) { return *this += -n; }
    friend iterator operator+(iterator a, difference_type n) { return a += n; }
    friend iterator operator+(difference_type n, iterator a) { return a += n; }
    friend iterator operator-(iterator a, difference_type n) { return a -= n; }
    friend difference_type operator-(const iterator& a, const iterator& b) {
      return static_cast<difference_type>(a.i_) - static_cast<difference_type>(b.i_);
    }
    friend bool operator==(const iterator& a, const iterator& b) { return a.i_ == b.i_; }
    friend auto operator<=>(const iterator& a, const iterator& b) { return a.i_ <=> b.i_; }

   private:
    const void* data_ = nullptr;
    int width_ = 4;
    size_t i_ = 0;
  };

  TokenSpan() = default;
  TokenSpan(std::span<const int32_t> s) : data_(s.data()), size_(s.size()), width_(4) {}  // NOLINT: implicit
  TokenSpan(const std::vector<int32_t>& v) : TokenSpan(std::span<const int32_t>(v)) {}   // NOLINT: implicit
  TokenSpan(const uint16_t* p, size_t n) : data_(p), size_(n), width_(2) {}
  // uint32 storage: ids are checked below the vocabulary size (< 2^31) when a shard is
  // opened, so they read as int32.
  TokenSpan(const uint32_t* p, size_t n) : data_(p), size_(n), width_(4) {}

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int width() const { return width_; }  // bytes per stored token: 2 or 4
  const void* data() const { return data_; }

  int32_t operator[](size_t i) const { return load(data_, width_, i); }
  iterator begin() const { return iterator(data_, width_, 0); }
  iterator end() const { return iterator(data_, width_, size_); }

  TokenSpan subspan(size_t offset, size_t count) const {
    TokenSpan s = *this;
    s.data_ = static_cast<const char*>(data_) + offset * static_cast<size_t>(width_);
    s.size_ = count;
    return s;
  }
  // Calls f with a std::span of the stored element type (uint16_t or int32_t), so hot
  // loops branch on the width once, not per token.
  template <typename F>
  decltype(auto) visit(F&& f) const {
    if (width_ == 2) return f(std::span<const uint16_t>(static_cast<const uint16_t*>(data_), size_));
    return f(std::span<const int32_t>(static_cast<const int32_t*>(data_), size_));
  }

 private:
  const void* data_ = nullptr;
  size_t size_ = 0;
  int width_ = 4;
};

}  // namespace kiln
