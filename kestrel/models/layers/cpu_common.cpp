// What the CPU kernel files share. load_inline compiles every `*_cpu.cpp` source as ONE translation unit, this file
// first (cpu_kernels.SOURCES), so the others use these helpers without a header; a header would also escape the
// source hash that decides when the extension is rebuilt.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kestrel_cpu {

constexpr int kLanes = 16;

// The 16 lanes summed as a tree: halves, quarters, eighths, then the last pair (the order of AVX-512's reduce_add,
// which the vector paths use). A fixed order, and no 16-add dependency chain per output.
inline float lane_sum(const float* lane) {
  float h[8], q[4];
  for (int j = 0; j < 8; ++j) h[j] = lane[j] + lane[j + 8];
  for (int j = 0; j < 4; ++j) q[j] = h[j] + h[j + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// sum of a[i] * b[i]: 16 lane partial sums of fused multiply-adds, the lanes summed as a tree, then the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#else
  float lane[kLanes] = {0.f};
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = std::fma(a[i + j], b[i + j], lane[j]);
  s = lane_sum(lane);
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// Runs fn(begin, end) over [0, n) on torch's intra-op threads (at::parallel_for: its OpenMP pool, no threads of our
// own to fight its spinning workers) when the work (multiply-adds, roughly) pays for a parallel region (a prefill, a
// large decode batch), else inline (a decode step or verify block of a few sequences).
template <typename F>
void split(int64_t n, int64_t work, const F& fn, int64_t grain = 1) {
  if (work < (int64_t(1) << 19)) {
    fn(0, n);
    return;
  }
  at::parallel_for(0, n, grain, fn);
}

template <int N, typename F>
inline void remainder_block(int64_t left, int64_t at, const F& fn) {
  if constexpr (N > 0) {
    if (left == N)
      fn(std::integral_constant<int, N>{}, at);
    else
      remainder_block<N - 1>(left, at, fn);
  }
}

// fn(size, at) over [0, count) in blocks of Block, then one block of the remainder; `size` is a compile-time
// std::integral_constant, so fn can pick a register tile of exactly that many rows.
template <int Block, typename F>
inline void in_blocks(int64_t count, const F& fn) {
  int64_t at = 0;
  for (; at + Block <= count; at += Block) fn(std::integral_constant<int, Block>{}, at);
  remainder_block<Block - 1>(count - at, at, fn);
}

}  // namespace kestrel_cpu
