// MLA decode attention in latent space over the paged cache, for fp32 CPU tensors: every decode row reads its own
// history's latents and rope keys straight from the pool through its slot table (no padded [B, L, r] gather), and
// does scores, softmax and the probability-weighted latent sum in one pass per row, its heads together (each cached
// row is loaded once per head group). A row's result depends only on its own history, never on the batch.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

// Named, not anonymous: load_inline compiles every kernel file as one translation unit.
namespace mla_detail {

using kestrel_cpu::dot;
using kestrel_cpu::kLanes;

// Scores of HB heads at one cached row: s[h] = q_lat[h] . c + q_rope[h] . k, one accumulator per head (HB
// independent FMA chains sharing every load of the row), each reduced as a tree.
template <int HB>
inline void head_scores(const float* q_lat, const float* q_rope, int64_t R, int64_t DR, const float* c,
                        const float* k, float* s, int64_t s_stride) {
#if defined(__AVX512F__)
  if (R % kLanes == 0 && DR % kLanes == 0) {
    __m512 acc[HB];
    for (int h = 0; h < HB; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < R; i += kLanes) {
      const __m512 cv = _mm512_loadu_ps(c + i);
      for (int h = 0; h < HB; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q_lat + h * R + i), cv, acc[h]);
    }
    for (int64_t i = 0; i < DR; i += kLanes) {
      const __m512 kv = _mm512_loadu_ps(k + i);
      for (int h = 0; h < HB; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q_rope + h * DR + i), kv, acc[h]);
    }
    for (int h = 0; h < HB; ++h) s[h * s_stride] = _mm512_reduce_add_ps(acc[h]);
    return;
  }
#endif
  for (int h = 0; h < HB; ++h) s[h * s_stride] = dot(q_lat + h * R, c, R) + (DR ? dot(q_rope + h * DR, k, DR) : 0.f);
}

// out[h] += p[h * p_stride] * c for HB heads, 16 latent columns at a time kept in registers across the heads.
template <int HB>
inline void head_values(const float* p, int64_t p_stride, const float* c, float* out, int64_t R) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 pv[HB];
  for (int h = 0; h < HB; ++h) pv[h] = _mm512_set1_ps(p[h * p_stride]);
  for (; i + kLanes <= R; i += kLanes) {
    const __m512 cv = _mm512_loadu_ps(c + i);
    for (int h = 0; h < HB; ++h)
      _mm512_storeu_ps(out + h * R + i, _mm512_fmadd_ps(pv[h], cv, _mm512_loadu_ps(out + h * R + i)));
  }
#endif
  for (int h = 0; h < HB; ++h)
    for (int64_t j = i; j < R; ++j) out[h * R + j] = std::fma(p[h * p_stride], c[j], out[h * R + j]);
}

}  // namespace mla_detail

// q_latent [B, H, r] (q_nope folded through W_UK), q_rope [B, H, dr], latent pool [S, r], rope-key pool [S, dr],
// slots [B, L] (int64: row b's history at positions < lengths[b]), lengths [B] -> [B, H, r]:
// softmax_l(scale * (q_latent . c_l + q_rope . k_l)) . c_l per row and head.
at::Tensor mla_decode_fp32(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& latent,
                           const at::Tensor& rope_key, const at::Tensor& slots, const at::Tensor& lengths,
                           double scale) {
  using namespace mla_detail;
  const int64_t B = q_latent.size(0), H = q_latent.size(1), R = q_latent.size(2), DR = q_rope.size(2);
  TORCH_CHECK(q_latent.is_contiguous() && q_rope.is_contiguous() && lengths.is_contiguous(), "mla_decode_fp32: layout");
  TORCH_CHECK(slots.stride(1) == 1 && latent.stride(1) == 1 && (DR == 0 || rope_key.stride(1) == 1),
              "mla_decode_fp32: slot rows and pool rows must be contiguous");
  const int64_t L = slots.size(1), slot_stride = slots.stride(0);
  const int64_t lat_stride = latent.stride(0), rope_stride = DR ? rope_key.stride(0) : 0;
  auto out = at::zeros({B, H, R}, q_latent.options());
  const float *qp = q_latent.data_ptr<float>(), *qr = q_rope.data_ptr<float>();
  const float *cp = latent.data_ptr<float>(), *kp = rope_key.data_ptr<float>();
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "mla_decode_fp32: length ", lp[b], " outside [1, ", L, "]");
    work += lp[b] * H * (2 * R + DR);
  }
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      const int64_t* sl = sp + b * slot_stride;
      scores.assign(H * n, 0.f);
      const float *ql = qp + b * H * R, *qrb = qr + b * H * DR;
      for (int64_t l = 0; l < n; ++l) {
        const float* c = cp + sl[l] * lat_stride;
        const float* k = kp + sl[l] * rope_stride;
        kestrel_cpu::in_blocks<8>(H, [&](auto hb, int64_t h0) {
          head_scores<decltype(hb)::value>(ql + h0 * R, qrb + h0 * DR, R, DR, c, k, scores.data() + h0 * n + l, n);
        });
      }
      for (float& s : scores) s *= sc;
      for (int64_t h = 0; h < H; ++h) {  // softmax in fp32: max-subtracted exponentials, normalised at the end
        float* s = scores.data() + h * n;
        const float mx = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t l = 0; l < n; ++l) total += (s[l] = std::exp(s[l] - mx));
        const float inv = 1.f / total;
        for (int64_t l = 0; l < n; ++l) s[l] *= inv;
      }
      float* ob = op + b * H * R;
      for (int64_t l = 0; l < n; ++l) {
        const float* c = cp + sl[l] * lat_stride;
        kestrel_cpu::in_blocks<8>(H, [&](auto hb, int64_t h0) {
          head_values<decltype(hb)::value>(scores.data() + h0 * n + l, n, c, ob + h0 * R, R);
        });
      }
    }
  };
  kestrel_cpu::split(B, work, rows);
  return out;
}
