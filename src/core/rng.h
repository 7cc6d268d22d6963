// Deterministic random numbers: splitmix64 streams. The whole state is one integer, so
// it saves and restores exactly (checkpoints, resume).
#pragma once

#include <cmath>
#include <cstdint>

namespace kiln {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(seed) {}

  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller; one value per call keeps the state simple).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }

  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }

  // An independent stream derived from this seed and a label (e.g. a layer index).
  static Rng derive(uint64_t seed, uint64_t stream) {
    Rng r(seed ^ (stream * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull));
    r.next_u64();
    return r;
  }

 private:
  uint64_t state_;
};

}  // namespace kiln
