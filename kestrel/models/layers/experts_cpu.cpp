// Routed experts of a small or medium batch (decode steps, verify blocks) for fp32 CPU tensors: the (token, expert)
// pairs grouped by expert, and every weight row of an expert dotted with all of that expert's rows at once (each
// weight row read once per call), in place of a grouped GEMM that visits idle experts and packs weights for a
// handful of rows. The activation between the two halves stays in PyTorch (vectorised tanh/exp).
//
// Every dot product has one fixed summation order (16 lanes, then the lanes as a tree), whatever the batch, the
// blocking or the thread split: a token's output never depends on the other tokens of its batch.
#include <torch/extension.h>

#include <vector>

namespace {

using kestrel_cpu::kLanes;
using kestrel_cpu::lane_sum;

constexpr int kRowBlock = 6;     // rows of one expert multiplied together (kept in registers)
constexpr int kWeightBlock = 4;  // weight rows multiplied together: a tile of 4 x 6 accumulators

// out[r + m * out_stride] = sum over i of w[r * w_stride + i] * rows[m][i], for NW weight rows and M rows: every
// product is 16 lane partial sums of fused multiply-adds, then the lanes as a tree, then the tail, so a value never
// depends on the tile it was computed in (or on the batch, or the thread split). The tile shares every load of a
// weight row among M rows and every load of a row among NW weight rows.
template <int NW, int M>
inline void tile(const float* w, int64_t w_stride, const float* const* rows, int64_t n, float* out,
                 int64_t out_stride) {
  int64_t i = 0;
  float sums[NW][M];
#if defined(__AVX512F__)
  __m512 acc[NW][M];
  for (int r = 0; r < NW; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    __m512 wv[NW];
    for (int r = 0; r < NW; ++r) wv[r] = _mm512_loadu_ps(w + r * w_stride + i);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(rows[m] + i);
      for (int r = 0; r < NW; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < NW; ++r)
    for (int m = 0; m < M; ++m) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);  // the tree of lane_sum
#else
  for (int r = 0; r < NW; ++r)
    for (int m = 0; m < M; ++m) {
      float lane[kLanes] = {0.f};
      for (int64_t c = 0; c + kLanes <= n; c += kLanes)
        for (int j = 0; j < kLanes; ++j) lane[j] = std::fma(w[r * w_stride + c + j], rows[m][c + j], lane[j]);
      sums[r][m] = lane_sum(lane);
    }
  i = n - n % kLanes;
#endif
  for (int r = 0; r < NW; ++r)
    for (int m = 0; m < M; ++m) {
      float s = sums[r][m];
      for (int64_t t = i; t < n; ++t) s = std::fma(w[r * w_stride + t], rows[m][t], s);
      out[r + m * out_stride] = s;
    }
}

// Any number of rows against NW weight rows: tiles of kRowBlock rows, then one tile of the remainder.
template <int NW>
inline void tile_rows(const float* w, int64_t w_stride, const float* const* rows, int64_t count, int64_t n,
                      float* out, int64_t out_stride) {
  kestrel_cpu::in_blocks<kRowBlock>(count, [&](auto m, int64_t at) {
    tile<NW, decltype(m)::value>(w, w_stride, rows + at, n, out + at * out_stride, out_stride);
  });
}

// Flat pair indices (t * k + j) sorted by expert id, tokens in order within an expert: a counting sort. `start` gets
// each expert's first position (num_experts + 1 entries).
std::vector<int64_t> pairs_by_expert(const at::Tensor& ids, int64_t num_experts, std::vector<int64_t>& start) {
  const int64_t* e = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  start.assign(num_experts + 1, 0);
  std::vector<int64_t> order(n);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(e[p] >= 0 && e[p] < num_experts, "expert id ", e[p], " out of range");
    ++start[e[p] + 1];
  }
  for (int64_t x = 0; x < num_experts; ++x) start[x + 1] += start[x];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < n; ++p) order[next[e[p]]++] = p;
  return order;
}

// Y[p, o] = w[e_p, o] . rows[p] for pairs grouped by expert (start: each expert's first pair), the weight's O rows
// split across torch's threads when the call is large enough to pay for a parallel region.
void grouped_rows(const float* wp, int64_t O, int64_t D, const std::vector<int64_t>& start,
                  const std::vector<const float*>& rows, float* yp) {
  const int64_t E = start.size() - 1, P = rows.size();
  auto body = [&](int64_t o_begin, int64_t o_end) {
    for (int64_t ex = 0; ex < E; ++ex) {
      const int64_t first = start[ex], count = start[ex + 1] - first;
      if (!count) continue;
      const float* we = wp + ex * O * D;
      const float* const* xs = rows.data() + first;
      float* ye = yp + first * O;
      int64_t o = o_begin;
      for (; o + kWeightBlock <= o_end; o += kWeightBlock)
        tile_rows<kWeightBlock>(we + o * D, D, xs, count, D, ye + o, O);
      for (; o < o_end; ++o) tile_rows<1>(we + o * D, D, xs, count, D, ye + o, O);
    }
  };
  kestrel_cpu::split(O, P * O * D, body, 4 * kWeightBlock);
}

}  // namespace

// x [T, D], ids [T, k] (int64), w [E, O, D] (gate|up stacked) -> (rows [P, O] in expert order, order [P]: each
// row's flat pair index t * k + j).
std::vector<at::Tensor> expert_pairs_up_fp32(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w) {
  const int64_t k = ids.size(1), E = w.size(0), O = w.size(1), D = w.size(2);
  std::vector<int64_t> start;
  const auto order = pairs_by_expert(ids, E, start);
  const int64_t P = order.size();
  auto rows = at::empty({P, O}, x.options());
  auto order_t = at::empty({P}, ids.options());
  const float* xp = x.data_ptr<float>();
  int64_t* op = order_t.data_ptr<int64_t>();
  std::vector<const float*> inputs(P);
  for (int64_t p = 0; p < P; ++p) {
    inputs[p] = xp + (order[p] / k) * D;
    op[p] = order[p];
  }
  grouped_rows(w.data_ptr<float>(), O, D, start, inputs, rows.data_ptr<float>());
  return {rows, order_t};
}

// h [P, I] (rows in the order `expert_pairs_up_fp32` returned), w [E, D, I], ids [T, k], order [P], weights [T, k]
// -> out [T, D] = sum over each token's pairs, in ascending expert id from zero, of weight * (w[e] h).
at::Tensor expert_pairs_down_fp32(const at::Tensor& h, const at::Tensor& w, const at::Tensor& ids,
                                  const at::Tensor& order, const at::Tensor& weights) {
  const int64_t T = ids.size(0), k = ids.size(1), E = w.size(0), D = w.size(1), I = w.size(2), P = h.size(0);
  const float *hp = h.data_ptr<float>(), *gp = weights.data_ptr<float>();
  const int64_t *e = ids.data_ptr<int64_t>(), *op = order.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  std::vector<const float*> inputs(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(p == 0 || e[op[p - 1]] <= e[op[p]], "expert_pairs_down_fp32: rows not in expert order");
    ++start[e[op[p]] + 1];
    inputs[p] = hp + p * I;
  }
  for (int64_t x = 0; x < E; ++x) start[x + 1] += start[x];
  auto y = at::empty({P, D}, h.options());
  grouped_rows(w.data_ptr<float>(), D, I, start, inputs, y.data_ptr<float>());
  auto out = at::zeros({T, D}, h.options());
  float* outp = out.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {  // ascending expert id per token: rows are in expert order
    const int64_t pair = op[p];
    const float g = gp[pair];
    float* ot = outp + (pair / k) * D;
    const float* yr = yp + p * D;
    for (int64_t d = 0; d < D; ++d) ot[d] += g * yr[d];
  }
  return out;
}
