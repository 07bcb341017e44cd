// KDA's token-by-token delta rule (decode steps, verify blocks, prefills) for fp32 CPU tensors.
//
// Per (sequence, head) the [K, V] state stays in cache while T tokens go through it, each token being
//   e = exp(g_t); recall of k and q by the decayed state: rk = (k*e)^T S, rq = (q*e)^T S (one pass over S);
//   delta = (v_t - rk) * beta_t; o_t = rq + (q.k) delta; S <- e*S + k delta^T.
// The arithmetic of kestrel.models.layers.kda_ops.kda_steps, written as loops instead of five ATen ops a token. With
// the state in L1/L2 this recurrent form also beats the chunked WY form on CPU for long prefills (4x at K = V = 64,
// 2.4x at 128: benchmarks/kda_kernel.py), so prefills take it too.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Scratch of one worker: e = exp(g_t), the recalls of k and q, and delta.
struct Scratch {
  std::vector<float> e, rk, rq, delta;
  Scratch(int64_t K, int64_t V) : e(K), rk(V), rq(V), delta(V) {}
};

// One token through one head's state S [K, V] (in place); writes o_t [V].
inline void kda_token(float* S, const float* qt, const float* kt, const float* gt, const float* vt, float bt,
                      float* ot, int64_t K, int64_t V, Scratch& w) {
  float qk = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    w.e[i] = std::exp(gt[i]);
    qk += qt[i] * kt[i];
  }
  std::fill(w.rk.begin(), w.rk.end(), 0.f);
  std::fill(w.rq.begin(), w.rq.end(), 0.f);
  for (int64_t i = 0; i < K; ++i) {
    const float a = kt[i] * w.e[i], c = qt[i] * w.e[i];
    const float* s = S + i * V;
    for (int64_t j = 0; j < V; ++j) {
      w.rk[j] += a * s[j];
      w.rq[j] += c * s[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    w.delta[j] = (vt[j] - w.rk[j]) * bt;
    ot[j] = w.rq[j] + qk * w.delta[j];
  }
  for (int64_t i = 0; i < K; ++i) {
    const float d = w.e[i], kk = kt[i];
    float* s = S + i * V;
    for (int64_t j = 0; j < V; ++j) s[j] = s[j] * d + kk * w.delta[j];
  }
}

using kestrel_cpu::split;

// conv_w [3C, W] as taps-major [W, 3C], so every tap's channels are contiguous.
std::vector<float> taps_major(const at::Tensor& conv_w) {
  const int64_t D3 = conv_w.size(0), W = conv_w.size(1);
  const float* wp = conv_w.data_ptr<float>();
  std::vector<float> wt(W * D3);
  for (int64_t c = 0; c < D3; ++c)
    for (int64_t j = 0; j < W; ++j) wt[j * D3 + c] = wp[c * W + j];
  return wt;
}

// One token's [q | k | v] (a [3C]) from the W conv input rows x (each [3C], contiguous) ending at it: the depthwise
// conv with its taps in order, SiLU, then q and k L2-normalised per head (eps inside the sqrt, as l2_normalize) and q
// scaled by K^-1/2. Every compiled path (decode, one-sequence segment, prefill) forms q, k, v here, so they agree.
inline void conv_qkv_row(const float* x, const float* wt, float* a, int64_t D3, int64_t W, int64_t H, int64_t K,
                         float eps) {
  for (int64_t c = 0; c < D3; ++c) a[c] = x[c] * wt[c];
  for (int64_t j = 1; j < W; ++j)
    for (int64_t c = 0; c < D3; ++c) a[c] += x[j * D3 + c] * wt[j * D3 + c];
  for (int64_t c = 0; c < D3; ++c) a[c] = a[c] / (1.f + std::exp(-a[c]));
  const float scale = 1.f / std::sqrt(float(K));
  for (int64_t h = 0; h < 2 * H; ++h) {
    float* v = a + h * K;
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += v[i] * v[i];
    const float inv = 1.f / std::sqrt(ss + eps), s = h < H ? scale : 1.f;
    for (int64_t i = 0; i < K; ++i) v[i] = v[i] * inv * s;
  }
}

}  // namespace

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
  split(B * H, B * H * T * KV, [&](int64_t begin, int64_t end) {
    Scratch w(K, V);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* S = fp + bh * KV;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * T + t) * H + h;
        kda_token(S, qp + row * K, kp + row * K, gp + row * K, vp + row * V, bp[row], op + row * V, K, V, w);
        for (size_t n = 0; n < keep_t.size(); ++n)
          if (keep_t[n] == t) std::memcpy(kept[n] + bh * KV, S, sizeof(float) * KV);
      }
    }
  });
  return o;
}

// Prefill of several sequences packed end to end (no padding): q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]
// (q, k, v: heads and channels contiguous, rows at any stride: views of `kda_conv_qkv_fp32`'s output);
// sequence s owns rows starts[s] .. starts[s + 1) and starts from states[s] ([S, H, K, V]). Segment i of
// sequence seg_seq[i] ends after its row seg_row[i] (absolute; starts[seq] - 1 for an empty one at the start): the
// state there goes to out_states[i]. Returns o [N, H, V].
at::Tensor kda_varlen_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const at::Tensor& states, const std::vector<int64_t>& starts,
                           const std::vector<int64_t>& seg_seq, const std::vector<int64_t>& seg_row,
                           const at::Tensor& out_states) {
  const int64_t N = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2), S = states.size(0);
  TORCH_CHECK(int64_t(starts.size()) == S + 1, "kda_varlen_fp32: starts must have one entry per sequence + 1");
  TORCH_CHECK(seg_seq.size() == seg_row.size(), "kda_varlen_fp32: seg_seq and seg_row differ in length");
  auto o = at::empty({N, H, V}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = states.data_ptr<float>();
  float *op = o.data_ptr<float>(), *xp = out_states.data_ptr<float>();
  const int64_t KV = K * V, qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);  // rows may be strided
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ends(S);  // per sequence: (row, segment), in order
  for (size_t i = 0; i < seg_seq.size(); ++i) ends[seg_seq[i]].emplace_back(seg_row[i], int64_t(i));
  split(S * H, N * H * KV, [&](int64_t begin, int64_t end) {
    Scratch w(K, V);
    std::vector<float> state(KV);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / H, h = sh % H;
      float* St = state.data();
      std::memcpy(St, sp + sh * KV, sizeof(float) * KV);
      size_t next = 0;
      const auto& mine = ends[s];
      while (next < mine.size() && mine[next].first < starts[s]) {  // empty segments before the first row
        std::memcpy(xp + (mine[next].second * H + h) * KV, St, sizeof(float) * KV);
        ++next;
      }
      for (int64_t row = starts[s]; row < starts[s + 1]; ++row) {
        const int64_t r = row * H + h;
        kda_token(St, qp + row * qs + h * K, kp + row * ks + h * K, gp + r * K, vp + row * vs + h * V, bp[r],
                  op + r * V, K, V, w);
        while (next < mine.size() && mine[next].first == row) {
          std::memcpy(xp + (mine[next].second * H + h) * KV, St, sizeof(float) * KV);
          ++next;
        }
      }
    }
  });
  return o;
}

// One sequence's new tokens (a verify block or a short prompt alone in its step) from its pool slots to its pool
// slots, everything between the projections and the output norm in one call: the depthwise causal conv over
// [cached conv inputs; mixed], SiLU, q and k L2-normalised per head (q scaled by K^-1/2), the delta rule, and every
// state written where it lives. mixed [T, 3C] (unit column stride); conv_w [3C, W]; g [T, H, K]; beta [T, H];
// conv_pool [slots, 3C, W - 1]; rec_pool [slots, H, K, K]. The committed states are read from `slot`; the states
// after all T tokens go to `store_slot` (which may be `slot`), those after snap_offsets[i] tokens to snap_slots[i].
// Returns o [T, H, K].
at::Tensor kda_segment_fp32(const at::Tensor& mixed, const at::Tensor& conv_w, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& conv_pool, const at::Tensor& rec_pool,
                            int64_t slot, int64_t store_slot, const std::vector<int64_t>& snap_offsets,
                            const std::vector<int64_t>& snap_slots, double eps) {
  const int64_t T = mixed.size(0), D3 = mixed.size(1), W = conv_w.size(1), keep = W - 1;
  const int64_t H = g.size(1), K = g.size(2), C = D3 / 3, KK = K * K;
  TORCH_CHECK(C == H * K, "kda_segment_fp32: conv width ", D3, " is not 3 * heads * head_dim");
  TORCH_CHECK(snap_offsets.size() == snap_slots.size(), "kda_segment_fp32: snapshot offsets and slots differ");
  const int64_t row_stride = mixed.stride(0);
  const float *mp = mixed.data_ptr<float>(), *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *cp = conv_pool.data_ptr<float>(), *rp = rec_pool.data_ptr<float>();
  const int64_t conv_slot = D3 * keep;
  // x: the conv run, [keep + T, 3C]: the cached inputs (stored channel-major) then the new tokens.
  std::vector<float> x((keep + T) * D3), act(T * D3);
  for (int64_t c = 0; c < D3; ++c)
    for (int64_t j = 0; j < keep; ++j) x[j * D3 + c] = cp[slot * conv_slot + c * keep + j];
  for (int64_t t = 0; t < T; ++t) std::memcpy(&x[(keep + t) * D3], mp + t * row_stride, sizeof(float) * D3);
  const auto wt = taps_major(conv_w);
  for (int64_t t = 0; t < T; ++t) conv_qkv_row(&x[t * D3], wt.data(), &act[t * D3], D3, W, H, K, float(eps));
  // Conv states: the run's window after m tokens is rows m .. m + keep - 1 (stored channel-major).
  auto write_conv = [&](int64_t m, int64_t dst) {
    for (int64_t c = 0; c < D3; ++c)
      for (int64_t j = 0; j < keep; ++j) cp[dst * conv_slot + c * keep + j] = x[(m + j) * D3 + c];
  };
  for (size_t i = 0; i < snap_offsets.size(); ++i) write_conv(snap_offsets[i], snap_slots[i]);
  write_conv(T, store_slot);
  auto o = at::empty({T, H, K}, g.options());
  float* op = o.data_ptr<float>();
  float* S0 = rp + store_slot * H * KK;
  if (store_slot != slot) std::memcpy(S0, rp + slot * H * KK, sizeof(float) * H * KK);
  Scratch w(K, K);
  for (int64_t h = 0; h < H; ++h) {
    float* S = S0 + h * KK;
    for (size_t i = 0; i < snap_offsets.size(); ++i)  // a snapshot before any new token: the committed state
      if (snap_offsets[i] == 0) std::memcpy(rp + (snap_slots[i] * H + h) * KK, S, sizeof(float) * KK);
    for (int64_t t = 0; t < T; ++t) {
      const float* a = &act[t * D3];
      kda_token(S, a + h * K, a + C + h * K, gp + (t * H + h) * K, a + 2 * C + h * K, bp[t * H + h],
                op + (t * H + h) * K, K, K, w);
      for (size_t i = 0; i < snap_offsets.size(); ++i)
        if (snap_offsets[i] == t + 1) std::memcpy(rp + (snap_slots[i] * H + h) * KK, S, sizeof(float) * KK);
    }
  }
  return o;
}

// The depthwise causal conv, SiLU and q/k L2 norms of a prefill's tokens from the varlen conv layout:
// x [L, 3C] (each sequence's cached conv inputs then its new tokens), conv_w [3C, W]; output row i is the conv over
// x rows out_rows[i] .. out_rows[i] + W - 1. Returns [N, 3C] = [q (scaled by K^-1/2) | k | v], per head q and k
// L2-normalised (eps inside the sqrt, as l2_normalize).
at::Tensor kda_conv_qkv_fp32(const at::Tensor& x, const at::Tensor& conv_w, const at::Tensor& out_rows, int64_t H,
                             double eps) {
  const int64_t D3 = x.size(1), W = conv_w.size(1), N = out_rows.size(0), C = D3 / 3, K = C / H;
  TORCH_CHECK(C == H * K && D3 == 3 * C, "kda_conv_qkv_fp32: conv width ", D3, " is not 3 * heads * head_dim");
  auto out = at::empty({N, D3}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* rows = out_rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const auto wt = taps_major(conv_w);
  split(N, N * D3 * 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      conv_qkv_row(xp + rows[i] * D3, wt.data(), op + i * D3, D3, W, H, K, float(eps));
  });
  return out;
}

// A decode step of B sequences whose states are pool views updated in place (`KDAAttention.decode_in_place`): per
// sequence the same arithmetic as `kda_segment_fp32` at T = 1 (conv taps in order, SiLU, q/k norms, one token of the
// delta rule), so a decode step and a one-token verify block leave the same bits. mixed [B, 3C] (unit column stride);
// conv_w [3C, W]; g [B, H, K]; beta [B, H]; conv_state [B, 3C, W - 1] and rec_state [B, H, K, K], both contiguous and
// written in place. Returns o [B, H, K].
at::Tensor kda_decode_fp32(const at::Tensor& mixed, const at::Tensor& conv_w, const at::Tensor& g,
                           const at::Tensor& beta, const at::Tensor& conv_state, const at::Tensor& rec_state,
                           double eps) {
  const int64_t B = mixed.size(0), D3 = mixed.size(1), W = conv_w.size(1), keep = W - 1;
  const int64_t H = g.size(1), K = g.size(2), C = D3 / 3, KK = K * K;
  TORCH_CHECK(C == H * K, "kda_decode_fp32: conv width ", D3, " is not 3 * heads * head_dim");
  const int64_t row_stride = mixed.stride(0);
  const float *mp = mixed.data_ptr<float>(), *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *cp = conv_state.data_ptr<float>(), *rp = rec_state.data_ptr<float>();
  const auto wt = taps_major(conv_w);
  auto o = at::empty({B, H, K}, g.options());
  float* op = o.data_ptr<float>();
  split(B, B * H * KK * 3, [&](int64_t begin, int64_t end) {
    std::vector<float> x(W * D3), a(D3);
    Scratch w(K, K);
    for (int64_t b = begin; b < end; ++b) {
      float* conv = cp + b * D3 * keep;
      for (int64_t c = 0; c < D3; ++c)
        for (int64_t j = 0; j < keep; ++j) x[j * D3 + c] = conv[c * keep + j];
      std::memcpy(&x[keep * D3], mp + b * row_stride, sizeof(float) * D3);
      conv_qkv_row(x.data(), wt.data(), a.data(), D3, W, H, K, float(eps));
      for (int64_t c = 0; c < D3; ++c)  // the window moves on by one input
        for (int64_t j = 0; j < keep; ++j) conv[c * keep + j] = x[(j + 1) * D3 + c];
      for (int64_t h = 0; h < H; ++h)
        kda_token(rp + (b * H + h) * KK, &a[h * K], &a[C + h * K], gp + (b * H + h) * K, &a[2 * C + h * K],
                  bp[b * H + h], op + (b * H + h) * K, K, K, w);
    }
  });
  return o;
}
