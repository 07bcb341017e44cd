// KDA's token-by-token delta rule (decode steps, verify blocks, short prefills) for fp32 CPU tensors.
//
// Per (sequence, head) the [K, V] state stays in cache while T tokens go through it, each token being
//   e = exp(g_t); recall of k and q by the decayed state: rk = (k*e)^T S, rq = (q*e)^T S (one pass over S);
//   delta = (v_t - rk) * beta_t; o_t = rq + (q.k) delta; S <- e*S + k delta^T.
// The arithmetic of kestrel.models.layers.kda_ops.kda_steps, written as loops instead of five ATen ops a token.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V]; all fp32 and contiguous. One token
// may also come without its T dimension (q, k, g: [B, H, K], v: [B, H, V], beta: [B, H]; o: [B, H, V]).
// keep_t[n]: the state after token keep_t[n] is also written into keep_out[n] ([B, H, K, V], contiguous).
// final_out ([B, H, K, V], contiguous) receives the final state; it may be `state` itself (an in-place step).
// Returns o [B, T, H, V].
at::Tensor kda_steps_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, const at::Tensor& state, const std::vector<int64_t>& keep_t,
                          const std::vector<at::Tensor>& keep_out, const at::Tensor& final_out) {
  const bool one = q.dim() == 3;
  const int64_t B = q.size(0), T = one ? 1 : q.size(1), H = q.size(-2), K = q.size(-1), V = v.size(-1);
  TORCH_CHECK(keep_t.size() == keep_out.size(), "kda_steps_fp32: keep_t and keep_out differ in length");
  auto o = one ? at::empty({B, H, V}, q.options()) : at::empty({B, T, H, V}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = state.data_ptr<float>();
  float* op = o.data_ptr<float>();
  float* fp = final_out.data_ptr<float>();
  std::vector<float*> kept;
  for (const auto& t : keep_out) kept.push_back(t.data_ptr<float>());
  const int64_t KV = K * V;
  if (fp != sp) std::memcpy(fp, sp, sizeof(float) * B * H * KV);  // then every update happens in final_out
  std::vector<float> e(K), rk(V), rq(V), delta(V);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    float* S = fp + bh * KV;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = (b * T + t) * H + h;
      const float *qt = qp + row * K, *kt = kp + row * K, *gt = gp + row * K, *vt = vp + row * V;
      const float bt = bp[row];
      float qk = 0.f;
      for (int64_t i = 0; i < K; ++i) {
        e[i] = std::exp(gt[i]);
        qk += qt[i] * kt[i];
      }
      std::fill(rk.begin(), rk.end(), 0.f);
      std::fill(rq.begin(), rq.end(), 0.f);
      for (int64_t i = 0; i < K; ++i) {
        const float a = kt[i] * e[i], c = qt[i] * e[i];
        const float* s = S + i * V;
        for (int64_t j = 0; j < V; ++j) {
          rk[j] += a * s[j];
          rq[j] += c * s[j];
        }
      }
      float* ot = op + row * V;
      for (int64_t j = 0; j < V; ++j) {
        delta[j] = (vt[j] - rk[j]) * bt;
        ot[j] = rq[j] + qk * delta[j];
      }
      for (int64_t i = 0; i < K; ++i) {
        const float d = e[i], kk = kt[i];
        float* s = S + i * V;
        for (int64_t j = 0; j < V; ++j) s[j] = s[j] * d + kk * delta[j];
      }
      for (size_t n = 0; n < keep_t.size(); ++n)
        if (keep_t[n] == t) std::memcpy(kept[n] + bh * KV, S, sizeof(float) * KV);
    }
  }
  return o;
}
