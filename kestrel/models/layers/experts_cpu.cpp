// Routed experts of a small batch (a decode step, a verify block) for fp32 CPU tensors: every (token, expert) pair as
// dot products against the expert's weight rows, in place of a grouped GEMM that visits idle experts and packs
// weights for a handful of rows. The activation between the two halves stays in PyTorch (vectorised tanh/exp).
#include <torch/extension.h>

#include <vector>

namespace {

// Sum of a[i] * b[i] over 16 fixed lanes, then the lanes in order: vectorisable, and the same order on every call.
inline float dot(const float* a, const float* b, int64_t n) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lane[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Flat pair indices (t * k + j) sorted by expert id, tokens in order within an expert: a counting sort.
std::vector<int64_t> pairs_by_expert(const at::Tensor& ids, int64_t num_experts) {
  const int64_t* e = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  std::vector<int64_t> start(num_experts + 1, 0), order(n);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(e[p] >= 0 && e[p] < num_experts, "expert id ", e[p], " out of range");
    ++start[e[p] + 1];
  }
  for (int64_t x = 0; x < num_experts; ++x) start[x + 1] += start[x];
  for (int64_t p = 0; p < n; ++p) order[start[e[p]]++] = p;
  return order;
}

}  // namespace

// x [T, D], ids [T, k] (int64), w [E, O, D] (gate|up stacked) -> (rows [P, O] in expert order, order [P]: each
// row's flat pair index t * k + j).
std::vector<at::Tensor> expert_pairs_up_fp32(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w) {
  const int64_t k = ids.size(1), E = w.size(0), O = w.size(1), D = w.size(2);
  const auto order = pairs_by_expert(ids, E);
  const int64_t P = order.size();
  auto rows = at::empty({P, O}, x.options());
  auto order_t = at::empty({P}, ids.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t* e = ids.data_ptr<int64_t>();
  float* rp = rows.data_ptr<float>();
  int64_t* op = order_t.data_ptr<int64_t>();
  for (int64_t first = 0; first < P;) {  // one expert's pairs at a time: each weight row serves all of them
    const int64_t ex = e[order[first]];
    int64_t last = first;
    while (last < P && e[order[last]] == ex) ++last;
    const float* we = wp + ex * O * D;
    for (int64_t o = 0; o < O; ++o)
      for (int64_t p = first; p < last; ++p) rp[p * O + o] = dot(we + o * D, xp + (order[p] / k) * D, D);
    for (int64_t p = first; p < last; ++p) op[p] = order[p];
    first = last;
  }
  return {rows, order_t};
}

// h [P, I] (rows in the order `expert_pairs_up_fp32` returned), w [E, D, I], ids [T, k], order [P], weights [T, k]
// -> out [T, D] = sum over each token's pairs, in ascending expert id from zero, of weight * (w[e] h).
at::Tensor expert_pairs_down_fp32(const at::Tensor& h, const at::Tensor& w, const at::Tensor& ids,
                                  const at::Tensor& order, const at::Tensor& weights) {
  const int64_t T = ids.size(0), k = ids.size(1), D = w.size(1), I = w.size(2), P = h.size(0);
  auto out = at::zeros({T, D}, h.options());
  const float *hp = h.data_ptr<float>(), *wp = w.data_ptr<float>(), *gp = weights.data_ptr<float>();
  const int64_t *e = ids.data_ptr<int64_t>(), *op = order.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  std::vector<float> y(D);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t pair = op[p], t = pair / k;
    const float* we = wp + e[pair] * D * I;
    const float g = gp[pair];
    for (int64_t d = 0; d < D; ++d) y[d] = dot(we + d * I, hp + p * I, I);
    float* ot = outp + t * D;
    for (int64_t d = 0; d < D; ++d) ot[d] += g * y[d];
  }
  return out;
}
