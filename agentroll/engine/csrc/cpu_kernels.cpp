// CPU kernels of the built-in engine (fp32 activations; products over fp32 or bf16 packed
// weights): RMSNorm, SiLU-and-multiply, rotate-half RoPE, attention read straight from the
// paged KV cache, sampling, blocked matrix products (linear, linear_packed) and a whole
// decoder step (decoder_forward).  Loaded by agentroll/engine/kernels.py.
//
// Invariants:
// - Every kernel computes each row (a token, or a (token, kv head) pair for attention) on its
//   own, with loops whose order and vector split depend only on the row's own sizes (hidden
//   size, head dim, number of keys), never on the number of rows or their place in the batch.
//   So a row's result is bit-identical alone or with any other rows, and a query row of a
//   prefill chunk gets exactly what the same position gets as a decode: the batch-invariant
//   mode relies on this.
// - The paged cache: a layer's keys are [blocks, kv heads, head dim, block_size] (a block's
//   keys of one head transposed, so 16 keys' values of one dimension fill one vector) and
//   its values [blocks, kv heads, block_size, head dim]; slot = block * block_size + offset.
//   Attention reads K/V where the block table says and never writes the cache; query row t
//   attends to keys 0 .. lens[t]-1 of table row rows[t] (causality is expressed by lens).
// - exp is fast_exp below: plain float arithmetic (Cephes' range reduction and polynomial,
//   about 1 ulp in float32), vectorised by the compiler; a value's result does not depend on
//   the lane or the loop it is computed in, and exp(-inf) is exactly 0.  Inside the kernels
//   denormals flush to zero (FlushDenormals), the same for every row and every call.
// - Sampling (sample, log_softmax) follows agentroll/engine/sampler.py: the distribution is
//   temperature-scaled, cut to the top-k and the top-p nucleus, and the token is the first
//   whose running probability mass (summed in fixed blocks: scan_mass) exceeds u times the
//   total; log_softmax uses the very same code path, so a rescored logprob equals the
//   sampled one bit for bit.
// - Inputs are checked (dtype, device, layout, shapes, index ranges) before any write; a
//   violation raises (RuntimeError in Python) and leaves every output untouched.

#include <torch/extension.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_i64(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kInt64, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
}

// Flush denormals to zero (FTZ + DAZ) for the guard's lifetime, on this thread.  g++ splits
// loops around fast_exp by the clamp's ranges and computes the out-of-range paths on every
// lane; there g / (1 + exp(88)) underflows to a denormal, and each denormal costs a
// microcode assist: silu_mul was 13x slower without this (measured).  Results that matter
// are never denormal here, so flushing changes no output that is used.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__SSE__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);
#endif
  }
  ~FlushDenormals() {
#if defined(__SSE__)
    _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_ = 0;
};

inline float fast_exp(float x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (in two parts)
  x = x > -88.f ? x : -88.f;
  x = x < 88.f ? x : 88.f;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;  // n = -127 (x <= -88): exp 0
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline float row_max(const float* x, int64_t v) {
  float top = x[0];
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < v; ++i) top = x[i] > top ? x[i] : top;
  return top;
}


}  // namespace

namespace {

// The row loops behind the kernels below and decoder_forward.  Strides are in floats; a row
// is computed the same way whatever the stride, the row count or the caller.

// out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for rows of length n (out may be x).
void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float* out,
                   int64_t out_stride, int64_t rows, int64_t n, float eps) {
  // a decode batch of 16+ rows is shared out (32 rows of 960 took ~55 us on one thread)
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * x_stride;
      const float inv = 1.f / std::sqrt(dot(row, row, n) / static_cast<float>(n) + eps);
      float* o = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (row[i] * inv);
    }
  });
}

// out[r] = silu(gate[r]) * up[r] for rows of length n.
void silu_mul_rows(const float* gate, const float* up, int64_t in_stride, float* out,
                   int64_t out_stride, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate + r * in_stride;
      const float* u = up + r * in_stride;
      float* o = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
    }
  });
}

// Rotate-half RoPE in place on `heads` heads of d values at the start of each of `rows` rows;
// row t takes its angles from row pos[t] of cos/sin ([*, d]), or row t without pos.
void rope_rows(float* x, int64_t stride, int64_t rows, int64_t heads, int64_t d,
               const float* cos, const float* sin, const int64_t* pos) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads;
      float* v = x + t * stride + (i % heads) * d;
      const int64_t at = pos ? pos[t] : t;
      const float* c = cos + at * d;
      const float* s = sin + at * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a * c[j] - b * s[j];
        v[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  });
}

// Row i's keys and values (kvh heads of d, `stride` apart from row to row) into slot
// slots[i] of the paged cache (layout above), rounded to nearest even in a bfloat16 cache.
template <typename T>
void store_kv_rows(const float* k, const float* v, int64_t stride, T* k_cache, T* v_cache,
                   int64_t kvh, int64_t d, int64_t block_size, const int64_t* slots,
                   int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t blk = slots[i] / block_size, off = slots[i] % block_size;
    for (int64_t h = 0; h < kvh; ++h) {
      const float* kr = k + i * stride + h * d;
      const float* vr = v + i * stride + h * d;
      T* kt = k_cache + (blk * kvh + h) * d * block_size + off;
      T* vt = v_cache + ((blk * kvh + h) * block_size + off) * d;
      for (int64_t c = 0; c < d; ++c) {
        kt[c * block_size] = T(kr[c]);
        vt[c] = T(vr[c]);
      }
    }
  }
}

}  // namespace

// out = weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, row by row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "]");
  auto out = torch::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  rms_norm_rows(x.data_ptr<float>(), n, weight.data_ptr<float>(), out.data_ptr<float>(), n, rows,
                n, static_cast<float>(eps));
  return out;
}

// silu(gate) * up, elementwise, row by row.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_f32(gate, "gate");
  check_f32(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have the same shape");
  const int64_t n = gate.size(-1);
  auto out = torch::empty_like(gate);
  const int64_t rows = n ? gate.numel() / n : 0;
  silu_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), n, out.data_ptr<float>(), n, rows, n);
  return out;
}

// Rotate-half RoPE in place: x [T, heads, D], cos/sin [T, D].
torch::Tensor rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim]");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos and sin must be [", t, ", ", d, "]");
  rope_rows(x.data_ptr<float>(), heads * d, t, heads, d, cos.data_ptr<float>(),
            sin.data_ptr<float>(), nullptr);
  return x;
}

namespace {

// Checks the paged caches' shapes against kv heads and head dim: k_cache [NB, KVH, D, BS],
// v_cache [NB, KVH, BS, D]; returns BS.
int64_t check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t kvh,
                     int64_t d) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == kvh && v_cache.size(1) == kvh && k_cache.size(2) == d &&
                  v_cache.size(3) == d && k_cache.size(3) == v_cache.size(2) &&
                  k_cache.size(3) > 0,
              "the caches must be k [blocks, ", kvh, ", ", d, ", block_size] and v [blocks, ",
              kvh, ", block_size, ", d, "], got ", k_cache.sizes(), " and ", v_cache.sizes());
  return k_cache.size(3);
}

}  // namespace

// Slot slots[t] of the caches gets k[t] and v[t]: k, v [T, KVH, D]; k_cache
// [blocks, KVH, D, block_size], v_cache [blocks, KVH, block_size, D].
void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache,
              torch::Tensor v_cache, const torch::Tensor& slots) {
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_i64(slots, "slots", 1);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, KVH, D] alike");
  const int64_t t = k.size(0), kvh = k.size(1), d = k.size(2);
  const int64_t bs = check_caches(k_cache, v_cache, kvh, d), num_slots = k_cache.size(0) * bs;
  TORCH_CHECK(slots.size(0) == t, "slots must have ", t, " entries");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside [0, ", num_slots, ")");
  store_kv_rows(k.data_ptr<float>(), v.data_ptr<float>(), kvh * d, k_cache.data_ptr<float>(),
                v_cache.data_ptr<float>(), kvh, d, bs, sp, t);
}

namespace {

// One query row and kv head of paged_attention; K/V in float32 or bfloat16 (T).
template <typename T>
struct AttendRow {
  const float* q;  // [group, d]: the query heads that share this kv head
  float* out;      // [group, d]
  const T* keys;   // the layer's caches (layout above)
  const T* values;
  const int64_t* table;  // this row's block table
  int64_t len, block_size, kvh, kv, group, d;
  float scale;
};

// Scores, softmax and the weighted sum of values, one query head at a time (without AVX-512,
// or at head dims other than 64 and 128; attend_blocks below otherwise).  D > 0 fixes the
// head dim at compile time, so the output accumulator is a local array the compiler keeps in
// registers across keys (about 2x faster than accumulating in memory at d = 64, measured);
// D = 0 takes it from the job.  The loop order depends only on len and d.
template <int64_t D, typename T>
void attend(const AttendRow<T>& job, std::vector<float>& scores, std::vector<float>& spill) {
  const int64_t d = D > 0 ? D : job.d, len = job.len, bs = job.block_size;
  scores.resize(len);
  float* s = scores.data();
  for (int64_t g = 0; g < job.group; ++g) {
    const float* qv = job.q + g * d;
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
      const T* kt = job.keys + (job.table[p0 / bs] * job.kvh + job.kv) * d * bs;
      const int64_t count = std::min(bs, len - p0);
      float* sb = s + p0;
      std::fill(sb, sb + count, 0.f);
      for (int64_t c = 0; c < d; ++c) {
        const float qc = qv[c];
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) sb[j] += qc * static_cast<float>(kt[c * bs + j]);
      }
      for (int64_t j = 0; j < count; ++j) sb[j] *= job.scale;
    }
    const float top = row_max(s, len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      s[p] = fast_exp(s[p] - top);
      total += s[p];
    }
    const float inv = 1.f / total;
    float fixed[D > 0 ? D : 1];
    float* acc = fixed;
    if constexpr (D == 0) {
      spill.assign(d, 0.f);
      acc = spill.data();
    } else {
      for (int64_t c = 0; c < D; ++c) fixed[c] = 0.f;
    }
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
      const T* value0 = job.values + (job.table[p0 / bs] * job.kvh + job.kv) * bs * d;
      const int64_t count = std::min(bs, len - p0);
      for (int64_t j = 0; j < count; ++j) {
        const T* value = value0 + j * d;
        const float w = s[p0 + j] * inv;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) acc[c] += w * static_cast<float>(value[c]);
      }
    }
    float* o = job.out + g * d;
    for (int64_t c = 0; c < d; ++c) o[c] = acc[c];
  }
}

#if defined(__AVX512F__)
// 16 values as floats (lanes past `lanes` zero): a load, or bfloat16 widened (exact: its
// bits are a float's top half).
inline __m512 load16(const float* x, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, x); }
inline __m512 load16(const at::BFloat16* x, __mmask16 lanes) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) { return load16(x, 0xFFFF); }

// The scores of G query heads (q: G rows of D) against count keys of one block and kv head
// (kt: its keys transposed, [D][bs]), into G rows of s (ld apart): 16 keys a vector, each
// key's products over even and odd dimensions summed in two accumulators (two FMA chains in
// flight per head), then added and scaled.  Every lane, so every key, gets the same
// operations in the same order; the key vector of a dimension is loaded once for the G heads.
template <int64_t D, int64_t G, typename T>
void score_keys(const float* q, const T* kt, int64_t bs, int64_t count, float scale, float* s,
                int64_t ld) {
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, count - j)) - 1u);
    __m512 even[G], odd[G];
    for (int64_t g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 2) {
      const __m512 k0 = load16(kt + c * bs + j, lanes), k1 = load16(kt + (c + 1) * bs + j, lanes);
      for (int64_t g = 0; g < G; ++g) {
        even[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + c]), k0, even[g]);
        odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + c + 1]), k1, odd[g]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(s + g * ld + j, lanes,
                            _mm512_mul_ps(_mm512_add_ps(even[g], odd[g]), sc));
  }
}

// out (G rows of D) += the weights s[g * ld + j] * inv[g] times count values `stride` apart
// from value0: one fused multiply-add per lane, key after key, each value loaded once.
template <int64_t D, int64_t G, typename T>
void weigh_values(const float* s, int64_t ld, const float* inv, const T* value0, int64_t stride,
                  int64_t count, float* out) {
  __m512 acc[G][D / 16];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D / 16; ++c) acc[g][c] = _mm512_loadu_ps(out + g * D + c * 16);
  for (int64_t j = 0; j < count; ++j) {
    const T* value = value0 + j * stride;
    __m512 v[D / 16];
    for (int64_t c = 0; c < D / 16; ++c) v[c] = load16(value + c * 16);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * ld + j] * inv[g]);
      for (int64_t c = 0; c < D / 16; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + g * D + c * 16, acc[g][c]);
}

// A group's heads in passes: of up to kScorePass for the scores (two accumulators a head,
// whatever D), of up to kPass for the weighted sums (4 at d = 64, 2 at 128: D / 16
// accumulators a head); a pass's accumulators stay in the 32 vector registers, and the
// passes depend only on the group size.
constexpr int64_t kScorePass = 4;
template <int64_t D>
constexpr int64_t kPass = D <= 64 ? 4 : 2;

template <int64_t D, typename T>
void score_group(int64_t group, const float* q, const T* kt, int64_t bs, int64_t count,
                 float scale, float* s, int64_t ld) {
  for (int64_t g0 = 0; g0 < group; g0 += kScorePass) {
    const float* qg = q + g0 * D;
    float* sg = s + g0 * ld;
    switch (std::min(kScorePass, group - g0)) {
      case 1: score_keys<D, 1, T>(qg, kt, bs, count, scale, sg, ld); break;
      case 2: score_keys<D, 2, T>(qg, kt, bs, count, scale, sg, ld); break;
      case 3: score_keys<D, 3, T>(qg, kt, bs, count, scale, sg, ld); break;
      default: score_keys<D, kScorePass, T>(qg, kt, bs, count, scale, sg, ld); break;
    }
  }
}

template <int64_t D, typename T>
void weigh_group(int64_t group, const float* s, int64_t ld, const float* inv, const T* value0,
                 int64_t stride, int64_t count, float* out) {
  for (int64_t g0 = 0; g0 < group; g0 += kPass<D>) {
    const float* sg = s + g0 * ld;
    float* og = out + g0 * D;
    switch (std::min(kPass<D>, group - g0)) {
      case 1: weigh_values<D, 1, T>(sg, ld, inv + g0, value0, stride, count, og); break;
      case 2: weigh_values<D, 2, T>(sg, ld, inv + g0, value0, stride, count, og); break;
      case 3: weigh_values<D, 3, T>(sg, ld, inv + g0, value0, stride, count, og); break;
      default: weigh_values<D, kPass<D>, T>(sg, ld, inv + g0, value0, stride, count, og); break;
    }
  }
}

// kv_count consecutive kv heads (from job.kv) of one query row, with D % 16 == 0: every
// block of the table is visited once, its keys (then values) for all those heads.  Keys
// transposed make a block's scores a few FMAs per key and dimension with no horizontal
// sums: with keys as rows (and 4-key shuffle-tree sums) the arithmetic between a block's
// reads held attention to 15-16 GB/s from DRAM, against 21-23 GB/s this way (measured at
// 32 rows of smollm2-360m on a 2-core EPYC).
template <int64_t D, typename T>
void attend_blocks(const AttendRow<T>& job, int64_t kv_count, std::vector<float>& scores) {
  const int64_t len = job.len, bs = job.block_size, group = job.group;
  const int64_t heads = kv_count * group;
  scores.resize(heads * (len + 1));
  float* s = scores.data();
  float* inv = s + heads * len;
  for (int64_t p0 = 0; p0 < len; p0 += bs) {
    const int64_t blk = job.table[p0 / bs], count = std::min(bs, len - p0);
    for (int64_t k = 0; k < kv_count; ++k)
      score_group<D, T>(group, job.q + k * group * D,
                        job.keys + (blk * job.kvh + job.kv + k) * D * bs, bs, count, job.scale,
                        s + k * group * len + p0, len);
  }
  for (int64_t i = 0; i < heads; ++i) {
    float* si = s + i * len;
    const float top = row_max(si, len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      si[p] = fast_exp(si[p] - top);
      total += si[p];
    }
    inv[i] = 1.f / total;
  }
  std::fill(job.out, job.out + heads * D, 0.f);
  for (int64_t p0 = 0; p0 < len; p0 += bs) {
    const int64_t blk = job.table[p0 / bs], count = std::min(bs, len - p0);
    for (int64_t k = 0; k < kv_count; ++k)
      weigh_group<D, T>(group, s + k * group * len + p0, len, inv + k * group,
                        job.values + (blk * job.kvh + job.kv + k) * bs * D, D, count,
                        job.out + k * group * D);
  }
}
#endif

// Checks that every query row's table row and keys are valid: rows[t] in [0, nr), lens[t] in
// [1, nb * block_size], and the block ids its keys use in [0, num_blocks).
void check_attention_index(const int64_t* tables, int64_t nr, int64_t nb, const int64_t* rows,
                           const int64_t* lens, int64_t t, int64_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < nr, "rows[", i, "] = ", rows[i],
                      " is not a table row");
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= nb * block_size, "lens[", i, "] = ", lens[i],
                      " is outside [1, ", nb * block_size, "]");
    const int64_t used = (lens[i] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = tables[rows[i] * nb + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " is outside [0, ",
                        num_blocks, ")");
    }
  }
}

// The attention of t query rows (h heads of d each, rows q_stride apart; out rows out_stride
// apart) over the paged cache (keys, values: the layout above); indexes checked beforehand.
template <typename T>
void attention_rows(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                    const T* keys, const T* values, const int64_t* tables, int64_t nb,
                    const int64_t* rows, const int64_t* lens, int64_t t, int64_t h, int64_t kvh,
                    int64_t d, int64_t block_size, float scale) {
  const int64_t group = h / kvh;
  // query row `row` against kv head `kv` (and the ones after it): the group's query heads
  // are adjacent
  const auto job_of = [&](int64_t row, int64_t kv) {
    return AttendRow<T>{q + row * q_stride + kv * group * d,
                        out + row * out_stride + kv * group * d,
                        keys,
                        values,
                        tables + rows[row] * nb,
                        lens[row],
                        block_size,
                        kvh,
                        kv,
                        group,
                        d,
                        scale};
  };
#if defined(__AVX512F__)
  if (d == 64 || d == 128) {
    // a row's kv heads together (its blocks read once), or one at a time when there are too
    // few rows to share out; a head's result is the same either way
    const int64_t per = t >= 4 * at::get_num_threads() ? kvh : 1;
    at::parallel_for(0, t * (kvh / per), 1, [&](int64_t begin, int64_t end) {
      FlushDenormals ftz;
      std::vector<float> scores;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i / (kvh / per), kv = i % (kvh / per) * per;
        const AttendRow<T> job = job_of(row, kv);
        if (d == 64) {
          attend_blocks<64, T>(job, per, scores);
        } else {
          attend_blocks<128, T>(job, per, scores);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, t * kvh, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> scores, acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / kvh, kv = i % kvh;
      const AttendRow<T> job = job_of(row, kv);
      if (d == 64) {
        attend<64, T>(job, scores, acc);
      } else if (d == 128) {
        attend<128, T>(job, scores, acc);
      } else {
        attend<0, T>(job, scores, acc);
      }
    }
  });
}

}  // namespace

// Attention of each query row over its own keys in the paged cache.
//   q [T, H, D]; k_cache [blocks, KVH, D, block_size], v_cache [blocks, KVH, block_size, D];
//   tables [R, NB] block ids; rows [T]: the table row of each query; lens [T]: its number of
//   keys (positions 0 .. lens-1).  Returns [T, H, D].  H must be a multiple of KVH (GQA).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& tables,
                              const torch::Tensor& rows, const torch::Tensor& lens,
                              double scale) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_i64(tables, "tables", 2);
  check_i64(rows, "rows", 1);
  check_i64(lens, "lens", 1);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [T, H, D] and k_cache 4-d");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), kvh = k_cache.size(1);
  TORCH_CHECK(kvh > 0 && h % kvh == 0, "heads (", h, ") must be a multiple of kv heads (", kvh, ")");
  const int64_t block_size = check_caches(k_cache, v_cache, kvh, d);
  TORCH_CHECK(rows.size(0) == t && lens.size(0) == t, "rows and lens must have ", t, " entries");
  const int64_t nb = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  check_attention_index(tp, tables.size(0), nb, rp, lp, t, block_size, k_cache.size(0));
  auto out = torch::empty_like(q);
  attention_rows(q.data_ptr<float>(), h * d, out.data_ptr<float>(), h * d,
                 k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, nb, rp, lp, t, h, kvh,
                 d, block_size, static_cast<float>(scale));
  return out;
}

namespace {


inline int64_t first_index_of(const float* x, int64_t v, float value) {
  for (int64_t i = 0; i < v; ++i)
    if (x[i] == value) return i;
  return 0;
}

struct Normalised {
  float top;    // max of the filtered row
  float total;  // sum of e = exp(x - top)
};

// One row of the sampler: x (length v) is filtered in place (temperature, top-k, top-p), and
// e receives exp(x - max); log-probabilities are x - (top + log(total)).
Normalised filter_and_normalise(float* x, float* e, int64_t v, float temperature, int64_t top_k,
                                float top_p, std::vector<int64_t>& order) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (temperature > 0.f && temperature != 1.f) {
#pragma omp simd
    for (int64_t i = 0; i < v; ++i) x[i] = x[i] / temperature;
  }
  if (temperature > 0.f && top_k > 0 && top_k < v) {
    std::copy(x, x + v, e);
    std::nth_element(e, e + (top_k - 1), e + v, std::greater<float>());
    const float kth = e[top_k - 1];
    for (int64_t i = 0; i < v; ++i)
      if (x[i] < kth) x[i] = ninf;
  }
  if (temperature > 0.f && top_p < 1.f) {
    order.resize(v);
    for (int64_t i = 0; i < v; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [x](int64_t a, int64_t b) { return x[a] > x[b]; });
    const float top = x[order[0]];
    float total = 0.f;
    for (int64_t i = 0; i < v; ++i) total += fast_exp(x[order[i]] - top);
    float before = 0.f;  // probability mass of the tokens ranked above this one
    for (int64_t i = 0; i < v; ++i) {
      const float p = fast_exp(x[order[i]] - top) / total;
      if (before >= top_p) x[order[i]] = ninf;  // the first token always stays
      before += p;
    }
  }
  const float top = row_max(x, v);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < v; ++i) {
    e[i] = fast_exp(x[i] - top);
    total += e[i];
  }
  return {top, total};
}

// The first index whose running sum of e exceeds target (v - 1 if none): sums of blocks of
// kScanBlock entries first (vectorised), then one block entry by entry.
constexpr int64_t kScanBlock = 64;

int64_t scan_mass(const float* e, int64_t v, float target) {
  float cum = 0.f;
  for (int64_t b = 0; b < v; b += kScanBlock) {
    const int64_t n = std::min(kScanBlock, v - b);
    float block = 0.f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = 0; i < n; ++i) block += e[b + i];
    if (cum + block > target) {
      for (int64_t i = 0; i < n; ++i) {
        cum += e[b + i];
        if (cum > target) return b + i;
      }
      return b + n - 1;  // rounding: the block's entries summed one by one stay <= target
    }
    cum += block;
  }
  return v - 1;
}

// z.top + log(z.total): the log-normaliser; a token's logprob is x[token] minus this, in sample
// and in log_softmax alike.
inline float log_normaliser(const Normalised& z) { return z.top + std::log(z.total); }

// Per-row filter parameters; null pointers mean temperature 1, no top-k, no top-p.
struct RowFilters {
  const float* temperature = nullptr;
  const int64_t* top_k = nullptr;
  const float* top_p = nullptr;
};

// fn(r, x, e, z) for every row r of logits [n, v], after filter_and_normalise with row r's
// filters (x: the filtered row, e: exp(x - max), z: their max and sum); each thread reuses
// its buffers across its rows.
template <typename Fn>
void for_each_normalised_row(const float* logits, int64_t n, int64_t v, RowFilters f, Fn fn) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> x(v), e(v);
    std::vector<int64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      std::copy(logits + r * v, logits + (r + 1) * v, x.begin());
      const float temperature = f.temperature ? f.temperature[r] : 1.f;
      const int64_t top_k = f.top_k ? f.top_k[r] : 0;
      const float top_p = f.top_p ? f.top_p[r] : 1.f;
      const Normalised z =
          filter_and_normalise(x.data(), e.data(), v, temperature, top_k, top_p, order);
      fn(r, x.data(), e.data(), z);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name, int64_t n, torch::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == n,
              name, " must be a CPU ", type, " tensor of ", n, " entries");
}

}  // namespace

// One token per row of logits [n, V]: row r is filtered by temperature[r], top_k[r] (0: off)
// and top_p[r], and the token is the first whose running mass exceeds u[r] times the total
// (temperature 0: the argmax).  Returns (tokens int64 [n], logprobs float32 [n]): the
// log-probability of each token under the distribution it was drawn from.
std::tuple<torch::Tensor, torch::Tensor> sample(const torch::Tensor& logits,
                                                const torch::Tensor& temperature,
                                                const torch::Tensor& top_k,
                                                const torch::Tensor& top_p, const torch::Tensor& u) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab]");
  const int64_t n = logits.size(0), v = logits.size(1);
  check_rows(temperature, "temperature", n, torch::kFloat32);
  check_rows(top_k, "top_k", n, torch::kInt64);
  check_rows(top_p, "top_p", n, torch::kFloat32);
  check_rows(u, "u", n, torch::kFloat32);
  auto tokens = torch::empty({n}, torch::kInt64);
  auto logprobs = torch::empty({n}, torch::kFloat32);
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* out = logprobs.data_ptr<float>();
  for_each_normalised_row(lp, n, v, {tp, kp, pp}, [&](int64_t r, const float* x, const float* e,
                                                     const Normalised& z) {
    const int64_t best = first_index_of(x, v, z.top);
    int64_t chosen = best;
    if (tp[r] > 0.f) {
      chosen = scan_mass(e, v, up[r] * z.total);
      if (std::isinf(x[chosen])) chosen = best;  // rounding at the top of the mass
    }
    tok[r] = chosen;
    out[r] = x[chosen] - log_normaliser(z);
  });
  return {tokens, logprobs};
}

// uniform(seeds[i], steps[i]) of sampler.py in float32: splitmix64 over the pair (seeds are
// the Python seed mod 2^64, passed as int64 bits).
torch::Tensor uniform(const torch::Tensor& seeds, const torch::Tensor& steps) {
  check_i64(seeds, "seeds", 1);
  check_i64(steps, "steps", 1);
  TORCH_CHECK(seeds.size(0) == steps.size(0), "seeds and steps must have the same length");
  const int64_t n = seeds.size(0);
  auto out = torch::empty({n}, torch::kFloat32);
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* tp = steps.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = static_cast<uint64_t>(sp[i]) * 0x9E3779B97F4A7C15ull +
                 static_cast<uint64_t>(tp[i] + 1) * 0xD1B54A32D192ED03ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    op[i] = static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0);  // / 2^53
  }
  return out;
}

// log_softmax over the last dim of [n, V], by the sampler's own arithmetic (temperature 1,
// no filter): what `sample` reports for a token is exactly what this gives for it.
torch::Tensor log_softmax(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab]");
  const int64_t n = logits.size(0), v = logits.size(1);
  auto out = torch::empty_like(logits);
  const float* lp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_normalised_row(lp, n, v, {}, [&](int64_t r, const float* x, const float*,
                                             const Normalised& z) {
    const float lse = log_normaliser(z);
    float* o = op + r * v;
#pragma omp simd
    for (int64_t i = 0; i < v; ++i) o[i] = x[i] - lse;
  });
  return out;
}

namespace {

// Products: C[m, n] = A[m, k] @ B[k, n] (+ C when accumulating), row-major with leading
// dimensions.  Where oneDNN's brgemm micro-kernels run (x86 with AVX2 or better, oneDNN on),
// the product is cut into blocks of kGemmRows rows (or the caller's tile), kGemmCols columns
// and kGemmDepth of the inner dimension, each one brgemm call: a block of B (512 KB) stays in
// a core's L2 while every row block uses it.  Measured on this machine's AVX-512 cores at 32
// rows: 2.0-2.5x MKL's sgemm, from the tiny model's [128, 256] to [4096, 4096] weights, since
// MKL packs B on every call and runs its AVX2 kernels on AMD CPUs.  Elsewhere one sgemm call.
// A block's arithmetic depends only on its shape, so with fixed row tiles (tile > 0) a row's
// result does not depend on the other rows.
constexpr int64_t kGemmRows = 64, kGemmCols = 256, kGemmDepth = 512;

bool brgemm_runs() {
  static const bool isa = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("avx2");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  return isa && at::globalContext().userEnabledMkldnn();
}

void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
          int64_t m, int64_t n, int64_t k, bool accumulate, int64_t tile) {
  if (m == 0 || n == 0) return;
  if (!brgemm_runs()) {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    const auto at_a = torch::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, f32);
    const auto at_b = torch::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, f32);
    auto at_c = torch::from_blob(c, {m, n}, {ldc, 1}, f32);
    if (accumulate) {
      at_c.addmm_(at_a, at_b);
    } else {
      at::mm_out(at_c, at_a, at_b);
    }
    return;
  }
  const int64_t rows = tile > 0 ? tile : kGemmRows;
  const int64_t col_blocks = (n + kGemmCols - 1) / kGemmCols;
  at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t n0 = cb * kGemmCols, nn = std::min(kGemmCols, n - n0);
      for (int64_t k0 = 0; k0 < k; k0 += kGemmDepth) {
        const int64_t kk = std::min(kGemmDepth, k - k0);
        for (int64_t m0 = 0; m0 < m; m0 += rows) {
          at::native::cpublas::brgemm(std::min(rows, m - m0), nn, kk, lda, ldb, ldc,
                                      accumulate || k0 > 0, a + m0 * lda + k0,
                                      b + k0 * ldb + n0, c + m0 * ldc + n0, false);
        }
      }
    }
  });
}

// Packed weights: a product's matrix [k, n] stored as column panels of kPackCols columns,
// each panel [k, kPackCols] contiguous (the last one may be narrower), panel after panel.
// A decode step reads every weight once; a panel streams from memory in one sequential run,
// where a panel of the row-major matrix is k short runs a whole row apart.  Measured here on
// one core at 4 rows over 32 layers' [960, 5120]: 23-26 GB/s against 12-13 GB/s row-major;
// at 32-64 rows, compute-bound, 100-110 against 80-95 GFLOP/s.  Columns [c0, c1) with c0 a
// multiple of kPackCols are the contiguous range [c0 * k, c1 * k) of the packed values: a
// projection's part of a fused weight is a slice.
constexpr int64_t kPackCols = 32, kPackDepth = 4096;

#if defined(__AVX512F__)
// A few rows (M <= kSmallRows) times one full panel [k, 32]: the product is a stream of the
// panel, so it runs as one loop over k, two vectors of the panel a step, with every row's
// accumulators in registers.  Each output sums its k products in order, one fused
// multiply-add each, from zero; accumulating adds C at the end (the same bits as oneDNN's
// brgemm here, checked).  Against one brgemm call per panel, at 4 rows over smollm2-360m's
// weights: 1.10x (1.04-1.16), 31 GB/s where a streaming sum over the same tensors read 28.5;
// prefetching the panel 1 or 4 KB ahead in software was slower than not.
constexpr int64_t kSmallRows = 8;
template <int64_t M>
void small_rows_panel(const float* a, int64_t lda, const float* panel, int64_t k, float* c,
                      int64_t ldc, bool accumulate) {
  __m512 acc[M][2];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* b = panel + i * kPackCols;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    for (int64_t r = 0; r < M; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + i]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    float* o = c + r * ldc;
    if (accumulate) {
      acc[r][0] = _mm512_add_ps(_mm512_loadu_ps(o), acc[r][0]);
      acc[r][1] = _mm512_add_ps(_mm512_loadu_ps(o + 16), acc[r][1]);
    }
    _mm512_storeu_ps(o, acc[r][0]);
    _mm512_storeu_ps(o + 16, acc[r][1]);
  }
}

void small_rows(const float* a, int64_t lda, const float* panel, int64_t k, float* c,
                int64_t ldc, int64_t m, bool accumulate) {
  switch (m) {
    case 1: small_rows_panel<1>(a, lda, panel, k, c, ldc, accumulate); break;
    case 2: small_rows_panel<2>(a, lda, panel, k, c, ldc, accumulate); break;
    case 3: small_rows_panel<3>(a, lda, panel, k, c, ldc, accumulate); break;
    case 4: small_rows_panel<4>(a, lda, panel, k, c, ldc, accumulate); break;
    case 5: small_rows_panel<5>(a, lda, panel, k, c, ldc, accumulate); break;
    case 6: small_rows_panel<6>(a, lda, panel, k, c, ldc, accumulate); break;
    case 7: small_rows_panel<7>(a, lda, panel, k, c, ldc, accumulate); break;
    default: small_rows_panel<8>(a, lda, panel, k, c, ldc, accumulate); break;
  }
}
#endif

// C[m, n] (+)= A[m, k] @ packed B: as gemm, on panels of kPackCols columns and at most
// kPackDepth of depth, each one brgemm call per row block.
void gemm_packed(const float* a, int64_t lda, const float* packed, float* c, int64_t ldc,
                 int64_t m, int64_t n, int64_t k, bool accumulate, int64_t tile) {
  if (m == 0 || n == 0) return;
  const int64_t panels = (n + kPackCols - 1) / kPackCols;
  if (!brgemm_runs()) {  // gemm's torch product, panel by panel ([k, nn] row-major each)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPackCols, nn = std::min(kPackCols, n - n0);
      gemm(a, lda, packed + n0 * k, nn, c + n0, ldc, m, nn, k, accumulate, tile);
    }
    return;
  }
  const int64_t rows = tile > 0 ? tile : kGemmRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPackCols, nn = std::min(kPackCols, n - n0);
      const float* panel = packed + n0 * k;
#if defined(__AVX512F__)
      // a few rows, outside the batch-invariant mode (whose fixed tiles stay on brgemm)
      if (tile == 0 && m <= kSmallRows && nn == kPackCols) {
        small_rows(a, lda, panel, k, c + n0, ldc, m, accumulate);
        continue;
      }
#endif
      for (int64_t k0 = 0; k0 < k; k0 += kPackDepth) {
        const int64_t kk = std::min(kPackDepth, k - k0);
        for (int64_t m0 = 0; m0 < m; m0 += rows) {
          at::native::cpublas::brgemm(std::min(rows, m - m0), nn, kk, lda, nn, ldc,
                                      accumulate || k0 > 0, a + m0 * lda + k0, panel + k0 * nn,
                                      c + m0 * ldc + n0, false);
        }
      }
    }
  });
}

// bf16 products: weights packed in bfloat16 panels (pack_weight_bf16), activations rounded
// to bfloat16 per product, accumulation in float32 (oneDNN's brgemm on AVX512-BF16).  Each
// panel is [k / 2, nn, 2]: pairs of rows interleaved (the "VNNI" layout the bf16 dot-product
// instructions read).
bool bf16_runs() {
  static const bool isa = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("avx512_bf16");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  return isa && brgemm_runs();
}

void gemm_packed_bf16(const float* a, int64_t lda, const at::BFloat16* packed, float* c,
                      int64_t ldc, int64_t m, int64_t n, int64_t k, bool accumulate,
                      int64_t tile) {
  if (m == 0 || n == 0) return;
  // the activations in bfloat16, rounded to nearest even like torch's conversion, in a
  // buffer the calling thread keeps (a step's products would otherwise map and fault in
  // fresh pages for each one)
  thread_local std::vector<at::BFloat16> buffer;
  if (static_cast<int64_t>(buffer.size()) < m * k) buffer.resize(m * k);
  at::BFloat16* const a16 = buffer.data();  // the workers below see this thread's buffer
  for (int64_t r = 0; r < m; ++r) {
    const float* src = a + r * lda;
    at::BFloat16* dst = a16 + r * k;
    for (int64_t i = 0; i < k; ++i) dst[i] = at::BFloat16(src[i]);
  }
  const int64_t rows = tile > 0 ? tile : kGemmRows;
  const int64_t panels = (n + kPackCols - 1) / kPackCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPackCols, nn = std::min(kPackCols, n - n0);
      const at::BFloat16* panel = packed + n0 * k;
      for (int64_t k0 = 0; k0 < k; k0 += kPackDepth) {
        const int64_t kk = std::min(kPackDepth, k - k0);
        for (int64_t m0 = 0; m0 < m; m0 += rows) {
          at::native::cpublas::brgemm(std::min(rows, m - m0), nn, kk, k, nn, ldc,
                                      accumulate || k0 > 0, a16 + m0 * k + k0,
                                      panel + k0 * nn, c + m0 * ldc + n0, true);
        }
      }
    }
  });
}

// out[r] += bias for rows of n values.
void add_bias(float* out, int64_t stride, const float* bias, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] += bias[i];
  }
}

bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

// out = x @ w (+ bias), or out += x @ w (+ bias) when accumulating: x [m, k] contiguous, w
// [k, n] with contiguous rows (row stride w.stride(0)), out [m, n] contiguous.
void linear_into(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w,
                 const torch::Tensor& bias, int64_t tile, bool accumulate = false) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(1);
  gemm(x.data_ptr<float>(), k, w.data_ptr<float>(), w.stride(0), out.data_ptr<float>(), n, m, n,
       k, accumulate, tile);
  if (present(bias)) add_bias(out.data_ptr<float>(), n, bias.data_ptr<float>(), m, n);
}

// As linear_into, over a packed weight of n columns (x's k rows).
void linear_packed_into(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                        int64_t n, const torch::Tensor& bias, int64_t tile,
                        bool accumulate = false) {
  const int64_t m = x.size(0), k = x.size(1);
  if (packed.scalar_type() == torch::kBFloat16) {
    gemm_packed_bf16(x.data_ptr<float>(), k, packed.data_ptr<at::BFloat16>(),
                     out.data_ptr<float>(), n, m, n, k, accumulate, tile);
  } else {
    gemm_packed(x.data_ptr<float>(), k, packed.data_ptr<float>(), out.data_ptr<float>(), n, m,
                n, k, accumulate, tile);
  }
  if (present(bias)) add_bias(out.data_ptr<float>(), n, bias.data_ptr<float>(), m, n);
}

}  // namespace

// A zero-filled contiguous tensor whose memory the kernel may back with 2 MB pages
// (madvise(MADV_HUGEPAGE) on an anonymous mapping aligned to 2 MB, before any page is
// touched): weights and KV blocks are read in long runs, and with 4 KB pages each run
// crosses a page (a TLB miss, a stop of the hardware prefetcher) every 4 KB.  Every page is
// touched here: faulted in lazily, a fresh engine's K/V stores took 7.2 ms a step, not 1.6.
// Small tensors, and hosts without mmap, get torch::zeros.  The mapping is unmapped with
// the last tensor sharing its storage, handing every page back at once.
torch::Tensor huge_zeros(const std::vector<int64_t>& sizes, torch::ScalarType dtype) {
  const auto opts = torch::TensorOptions().dtype(dtype);
  int64_t numel = 1;
  for (const int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "huge_zeros: negative size ", s);
    numel *= s;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes >= kHuge) {
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge + kHuge;  // room to align
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const auto addr = reinterpret_cast<uintptr_t>(base);
      void* data = reinterpret_cast<void*>((addr + kHuge - 1) / kHuge * kHuge);
      madvise(data, len - kHuge, MADV_HUGEPAGE);  // advice only: 4 KB pages if refused
      // fault every page in now, not at its first write inside a decode step
      std::memset(data, 0, bytes);
      return torch::from_blob(
          data, sizes, [base, len](void*) { munmap(base, len); }, opts);
    }
  }
#endif
  return torch::zeros(sizes, opts);
}

// wt [k, n] (any strides: a transposed weight W.t() is read column by column) as a packed
// weight: float32 [k * n], panels of kPackCols columns (see gemm_packed).
torch::Tensor pack_weight(const torch::Tensor& wt) {
  TORCH_CHECK(wt.device().is_cpu() && wt.scalar_type() == torch::kFloat32 && wt.dim() == 2,
              "pack_weight: wt must be a CPU float32 [k, n] tensor");
  const int64_t k = wt.size(0), n = wt.size(1), s0 = wt.stride(0), s1 = wt.stride(1);
  auto out = huge_zeros({k * n}, torch::kFloat32);
  const float* src = wt.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, (n + kPackCols - 1) / kPackCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPackCols, nn = std::min(kPackCols, n - n0);
      float* panel = dst + n0 * k;
      if (s1 == 1) {
        for (int64_t r = 0; r < k; ++r)
          std::memcpy(panel + r * nn, src + r * s0 + n0, nn * sizeof(float));
      } else {  // one source column (a row of W when s0 == 1) at a time
        for (int64_t c = 0; c < nn; ++c) {
          const float* col = src + (n0 + c) * s1;
          for (int64_t r = 0; r < k; ++r) panel[r * nn + c] = col[r * s0];
        }
      }
    }
  });
  return out;
}

// wt [k, n] (float32 or bfloat16, any strides; k even) as a bf16 packed weight: bfloat16
// [k * n], panels of kPackCols columns, each [k / 2, nn, 2] (see gemm_packed_bf16).
torch::Tensor pack_weight_bf16(const torch::Tensor& wt) {
  TORCH_CHECK(bf16_runs(), "pack_weight_bf16: this CPU has no AVX512-BF16 brgemm (bf16_runs())");
  TORCH_CHECK(wt.device().is_cpu() && wt.dim() == 2 &&
                  (wt.scalar_type() == torch::kFloat32 || wt.scalar_type() == torch::kBFloat16),
              "pack_weight_bf16: wt must be a CPU float32 or bfloat16 [k, n] tensor");
  TORCH_CHECK(wt.size(0) % 2 == 0, "pack_weight_bf16: k must be even, got ", wt.size(0));
  const auto w = wt.to(torch::kBFloat16);  // exact for bfloat16 input, rounded for float32
  const int64_t k = w.size(0), n = w.size(1), s0 = w.stride(0), s1 = w.stride(1);
  auto out = huge_zeros({k * n}, torch::kBFloat16);
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, (n + kPackCols - 1) / kPackCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPackCols, nn = std::min(kPackCols, n - n0);
      at::BFloat16* panel = dst + n0 * k;
      for (int64_t c = 0; c < nn; ++c) {
        const at::BFloat16* col = src + (n0 + c) * s1;
        for (int64_t r = 0; r < k; ++r) panel[(r / 2) * nn * 2 + c * 2 + (r % 2)] = col[r * s0];
      }
    }
  });
  return out;
}

// x [m, k] @ W (+ bias [n]) where packed is pack_weight(W) or pack_weight_bf16(W) of n
// columns (or a slice of one starting at a panel boundary).  tile as for linear.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias, int64_t tile) {
  check_f32(x, "x");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() &&
                  (packed.scalar_type() == torch::kFloat32 ||
                   packed.scalar_type() == torch::kBFloat16),
              "linear_packed: packed must be a contiguous CPU float32 or bfloat16 tensor");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 1 && n > 0 && packed.numel() == x.size(1) * n,
              "linear_packed: x must be [m, k] and packed [k * n] with n = ", n, ", got ",
              x.sizes(), " and ", packed.sizes());
  const int64_t m = x.size(0);
  TORCH_CHECK(tile >= 0 && (tile == 0 || m % tile == 0), "rows (", m,
              ") must be a multiple of tile (", tile, ")");
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [", n, "]");
  }
  auto out = torch::empty({m, n}, x.options());
  linear_packed_into(out, x, packed, n, bias.value_or(torch::Tensor()), tile);
  return out;
}

// x [m, k] @ wt [k, n] (+ bias [n]): a linear layer over its transposed weight, by the
// blocked products above (tile > 0: on row tiles of that size, for the batch-invariant mode;
// the caller pads the rows to whole tiles).  wt may be a column slice of a wider matrix (rows
// of contiguous values, any row stride): a projection's part of a fused weight.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wt,
                     const c10::optional<torch::Tensor>& bias, int64_t tile) {
  check_f32(x, "x");
  TORCH_CHECK(wt.device().is_cpu() && wt.scalar_type() == torch::kFloat32,
              "wt must be a CPU float32 tensor");
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && x.size(1) == wt.size(0),
              "x must be [m, k] and wt [k, n], got ", x.sizes(), " and ", wt.sizes());
  TORCH_CHECK(wt.stride(1) == 1 && wt.stride(0) >= wt.size(1),
              "wt must have contiguous rows (a transposed weight, or a column slice of one)");
  const int64_t m = x.size(0), n = wt.size(1);
  TORCH_CHECK(tile >= 0 && (tile == 0 || m % tile == 0), "rows (", m,
              ") must be a multiple of tile (", tile, ")");
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [", n, "]");
  }
  auto out = torch::empty({m, n}, x.options());
  linear_into(out, x, wt, bias.value_or(torch::Tensor()), tile);
  return out;
}

namespace {

// decoder_forward's weights: three model tensors, then kPerLayer per layer, in this order.
// Absent optional tensors (biases, Qwen3's q/k norms) are passed as empty tensors.
enum ModelWeight : int64_t { kEmbed, kFinalNorm, kHeadT, kModelWeights };

// decoder_forward's timed regions (decoder_regions() gives their names, in this order).
enum Region : int64_t {
  kRegSetup,      // checks, buffers, embedding
  kRegNorm,       // input and post-attention RMSNorms
  kRegQkv,        // the fused QKV product
  kRegRope,       // q/k norms, RoPE and the K/V writes into the caches
  kRegAttention,  // attention over the paged caches
  kRegOProj,      // the output product (with the residual add)
  kRegGateUp,     // the fused gate/up product
  kRegAct,        // SiLU-and-multiply
  kRegDown,       // the down product (with the residual add)
  kRegHead,       // the final norm and the LM head
  kRegions
};
const char* const kRegionNames[kRegions] = {"setup",  "norm",    "qkv", "rope_kv",
                                           "attention", "o_proj", "gate_up", "act",
                                           "down",   "lm_head"};

// Adds the seconds since the last mark to timings[region] when timings is given (profiling);
// otherwise does nothing.
class RegionClock {
 public:
  explicit RegionClock(double* timings) : timings_(timings), last_(now()) {}
  void mark(Region region) {
    if (timings_ == nullptr) return;
    const auto t = now();
    timings_[region] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  double* timings_;
  std::chrono::steady_clock::time_point last_;
};
enum LayerWeight : int64_t {
  kInNorm,    // [d]
  kQkvT,      // [d, (h + 2 kvh) hd]: q, k and v projections side by side, packed
  kQkvBias,   // [(h + 2 kvh) hd] or empty
  kQNorm,     // [hd] or empty
  kKNorm,     // [hd] or empty
  kOT,        // [h hd, d], packed
  kOBias,     // [d] or empty
  kPostNorm,  // [d]
  kGateUpT,   // [d, 2 i]: gate and up projections side by side, packed
  kDownT,     // [i, d], packed
  kPerLayer
};

void check_weight(const torch::Tensor& t, const char* name, int64_t layer,
                  std::initializer_list<int64_t> shape) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 &&
                  t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
              "decoder_forward: weight ", name, " of layer ", layer, " must be a contiguous CPU ",
              "float32 tensor of shape ", at::IntArrayRef(shape), ", got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

// A packed [k, n] weight: float32 [k * n].
void check_packed(const torch::Tensor& t, const char* name, int64_t layer, int64_t k, int64_t n,
                  torch::ScalarType type) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == type &&
                  t.is_contiguous() && t.dim() == 1 && t.numel() == k * n,
              "decoder_forward: weight ", name, " of layer ", layer, " must be a packed CPU ",
              type, " [", k, " x ", n, "] weight (pack_weight or pack_weight_bf16, all alike), ",
              "got ", t.defined() ? t.scalar_type() : type, " ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

void check_optional(const torch::Tensor& t, const char* name, int64_t layer, int64_t n) {
  if (present(t)) check_weight(t, name, layer, {n});
}

}  // namespace

// The whole decoder over T new tokens: embedding, every layer (RMSNorm, fused QKV product,
// optional q/k norms, RoPE, K/V written to the paged caches, attention over them, output
// product added to the residual, RMSNorm, fused gate/up product, SiLU-and-multiply, down
// product added to the residual), the final norm and the LM head on the rows in logit_rows.
// Returns float32 logits [len(logit_rows), vocab].
//   token_ids, positions, slots, rows, lens [T] int64: token t sits at position positions[t],
//   its K/V go to cache slot slots[t], and it attends to keys 0 .. lens[t]-1 of table row
//   rows[t] of tables [R, NB] (so a prefill chunk is causal by its lens).
//   cos, sin [P, hd]: RoPE angles by position.  weights: see ModelWeight / LayerWeight.
//   tile > 0: every product runs on tiles of that many rows (zero-padded), the batch-invariant
//   mode; 0: on gemm's own row blocks.
//   timings: empty, or float64 [len(decoder_regions())] to which each region's seconds are
//   added (profiling; the clock is read only then).
// Every row is computed on its own by the same loops as the kernels above; products are the
// only cross-row operations and their rounding depends on the tile shape alone when tile > 0.
// Indexes and shapes are checked before anything is written.
torch::Tensor decoder_forward(const torch::Tensor& token_ids, const torch::Tensor& positions,
                              const torch::Tensor& slots, const torch::Tensor& tables,
                              const torch::Tensor& rows, const torch::Tensor& lens,
                              const torch::Tensor& logit_rows, const torch::Tensor& cos,
                              const torch::Tensor& sin, const std::vector<torch::Tensor>& weights,
                              const std::vector<torch::Tensor>& k_caches,
                              const std::vector<torch::Tensor>& v_caches, int64_t num_heads,
                              int64_t num_kv_heads, int64_t block_size, double eps, double scale,
                              int64_t tile, const torch::Tensor& timings) {
  TORCH_CHECK(timings.numel() == 0 || (timings.device().is_cpu() &&
                                       timings.scalar_type() == torch::kFloat64 &&
                                       timings.is_contiguous() && timings.numel() == kRegions),
              "timings must be empty or a contiguous CPU float64 tensor of ", kRegions,
              " values");
  RegionClock clock(timings.numel() ? timings.data_ptr<double>() : nullptr);
  check_i64(token_ids, "token_ids", 1);
  check_i64(positions, "positions", 1);
  check_i64(slots, "slots", 1);
  check_i64(tables, "tables", 2);
  check_i64(rows, "rows", 1);
  check_i64(lens, "lens", 1);
  check_i64(logit_rows, "logit_rows", 1);
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t t = token_ids.size(0);
  TORCH_CHECK(positions.size(0) == t && slots.size(0) == t && rows.size(0) == t &&
                  lens.size(0) == t,
              "positions, slots, rows and lens must have ", t, " entries");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == kModelWeights + layers * kPerLayer,
              "decoder_forward: expected ", kModelWeights + layers * kPerLayer, " weights and ",
              layers, " v caches");
  const auto& embed = weights[kEmbed];
  TORCH_CHECK(embed.dim() == 2, "embed must be [vocab, d]");
  const int64_t vocab = embed.size(0), d = embed.size(1);
  const int64_t h = num_heads, kvh = num_kv_heads;
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0,
              "cos and sin must be [positions, head_dim] alike");
  const int64_t hd = cos.size(1), max_pos = cos.size(0);
  const int64_t qkv_n = (h + 2 * kvh) * hd;
  TORCH_CHECK(embed.device().is_cpu() && embed.is_contiguous() &&
                  (embed.scalar_type() == torch::kFloat32 ||
                   embed.scalar_type() == torch::kBFloat16),
              "decoder_forward: embed must be a contiguous CPU float32 or bfloat16 tensor");
  check_weight(weights[kFinalNorm], "final_norm", -1, {d});
  // products in bfloat16 when the packed weights are (every one alike), else float32
  const auto packed_type = weights[kHeadT].scalar_type() == torch::kBFloat16 ? torch::kBFloat16
                                                                             : torch::kFloat32;
  check_packed(weights[kHeadT], "lm_head", -1, d, vocab, packed_type);
  TORCH_CHECK(layers > 0 && weights[kModelWeights + kDownT].dim() == 1,
              "decoder_forward: no layers");
  const int64_t inter = weights[kModelWeights + kDownT].numel() / d;
  TORCH_CHECK(block_size > 0, "block_size must be > 0");
  const int64_t kv_row = kvh * hd;
  int64_t num_slots = -1;
  // the K/V caches: float32, or bfloat16 (every layer alike)
  const auto kv_type = k_caches.empty() ? torch::kFloat32 : k_caches[0].scalar_type();
  TORCH_CHECK(kv_type == torch::kFloat32 || kv_type == torch::kBFloat16,
              "kv caches must be float32 or bfloat16, got ", kv_type);
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kModelWeights + l * kPerLayer;
    check_weight(w[kInNorm], "input_layernorm", l, {d});
    check_packed(w[kQkvT], "qkv", l, d, qkv_n, packed_type);
    check_optional(w[kQkvBias], "qkv_bias", l, qkv_n);
    check_optional(w[kQNorm], "q_norm", l, hd);
    check_optional(w[kKNorm], "k_norm", l, hd);
    check_packed(w[kOT], "o_proj", l, h * hd, d, packed_type);
    check_optional(w[kOBias], "o_bias", l, d);
    check_weight(w[kPostNorm], "post_attention_layernorm", l, {d});
    check_packed(w[kGateUpT], "gate_up", l, d, 2 * inter, packed_type);
    check_packed(w[kDownT], "down", l, inter, d, packed_type);
    for (const auto* cache : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(cache->device().is_cpu() && cache->is_contiguous() &&
                      cache->scalar_type() == kv_type,
                  "kv cache of layer ", l, " must be a contiguous CPU ", kv_type, " tensor");
      TORCH_CHECK(cache->numel() % kv_row == 0 && cache->numel() / kv_row % block_size == 0,
                  "kv cache of layer ", l, " must hold whole blocks of ", block_size, " x ",
                  kvh, " x ", hd, " values");
      TORCH_CHECK(num_slots < 0 || cache->numel() / kv_row == num_slots,
                  "kv caches must all have the same size");
      num_slots = cache->numel() / kv_row;
    }
  }
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* lr = logit_rows.data_ptr<int64_t>();
  const int64_t n_logits = logit_rows.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < vocab, "token id ", tok[i], " is outside [0, ", vocab, ")");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " is outside [0, ", max_pos,
                ")");
    TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "slot ", sl[i], " is outside [0, ", num_slots, ")");
  }
  for (int64_t i = 0; i < n_logits; ++i)
    TORCH_CHECK(lr[i] >= 0 && lr[i] < t, "logit row ", lr[i], " is outside [0, ", t, ")");
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t nb = tables.size(1);
  check_attention_index(tp, tables.size(0), nb, rp, lp, t, block_size, num_slots / block_size);

  // rows are padded to a whole number of tiles; padding rows stay zero wherever only the t
  // real rows are computed, and never reach the caches or the logits
  const int64_t m = tile > 0 ? (t + tile - 1) / tile * tile : t;
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  auto hidden = torch::zeros({m, d}, opts);
  auto x = torch::zeros({m, d}, opts);
  auto qkv = torch::empty({m, qkv_n}, opts);
  auto attn = torch::zeros({m, h * hd}, opts);
  auto gate_up = torch::empty({m, 2 * inter}, opts);
  auto act = torch::zeros({m, inter}, opts);
  float* hp = hidden.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  float* qp = qkv.data_ptr<float>();
  if (embed.scalar_type() == torch::kFloat32) {
    const float* ep = embed.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) std::memcpy(hp + i * d, ep + tok[i] * d, d * sizeof(float));
  } else {
    const at::BFloat16* ep = embed.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < d; ++j) hp[i * d + j] = static_cast<float>(ep[tok[i] * d + j]);
  }
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);
  clock.mark(kRegSetup);
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kModelWeights + l * kPerLayer;
    rms_norm_rows(hp, d, w[kInNorm].data_ptr<float>(), xp, d, t, d, feps);
    clock.mark(kRegNorm);
    linear_packed_into(qkv, x, w[kQkvT], qkv_n, w[kQkvBias], tile);
    clock.mark(kRegQkv);
    float* kp = qp + h * hd;
    float* vp = kp + kvh * hd;
    if (present(w[kQNorm]) && present(w[kKNorm])) {
      // per head: rows of hd values; q heads then k heads sit at the start of each token row
      for (int64_t i = 0; i < t; ++i) {
        rms_norm_rows(qp + i * qkv_n, hd, w[kQNorm].data_ptr<float>(), qp + i * qkv_n, hd, h, hd,
                      feps);
        rms_norm_rows(kp + i * qkv_n, hd, w[kKNorm].data_ptr<float>(), kp + i * qkv_n, hd, kvh,
                      hd, feps);
      }
    }
    rope_rows(qp, qkv_n, t, h, hd, cos.data_ptr<float>(), sin.data_ptr<float>(), pos);
    rope_rows(kp, qkv_n, t, kvh, hd, cos.data_ptr<float>(), sin.data_ptr<float>(), pos);
    if (kv_type == torch::kFloat32) {
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      store_kv_rows(kp, vp, qkv_n, kc, vc, kvh, hd, block_size, sl, t);
      clock.mark(kRegRope);
      attention_rows(qp, qkv_n, attn.data_ptr<float>(), h * hd, kc, vc, tp, nb, rp, lp, t, h,
                     kvh, hd, block_size, fscale);
    } else {
      at::BFloat16* kc = k_caches[l].data_ptr<at::BFloat16>();
      at::BFloat16* vc = v_caches[l].data_ptr<at::BFloat16>();
      store_kv_rows(kp, vp, qkv_n, kc, vc, kvh, hd, block_size, sl, t);
      clock.mark(kRegRope);
      attention_rows(qp, qkv_n, attn.data_ptr<float>(), h * hd, kc, vc, tp, nb, rp, lp, t, h,
                     kvh, hd, block_size, fscale);
    }
    clock.mark(kRegAttention);
    linear_packed_into(hidden, attn, w[kOT], d, w[kOBias], tile, true);  // the residual add
    clock.mark(kRegOProj);
    rms_norm_rows(hp, d, w[kPostNorm].data_ptr<float>(), xp, d, t, d, feps);
    clock.mark(kRegNorm);
    linear_packed_into(gate_up, x, w[kGateUpT], 2 * inter, torch::Tensor(), tile);
    clock.mark(kRegGateUp);
    const float* gp = gate_up.data_ptr<float>();
    silu_mul_rows(gp, gp + inter, 2 * inter, act.data_ptr<float>(), inter, t, inter);
    clock.mark(kRegAct);
    linear_packed_into(hidden, act, w[kDownT], d, torch::Tensor(), tile, true);
    clock.mark(kRegDown);
  }
  // the final norm of the rows whose logits are wanted, then the head
  const int64_t n_pad = tile > 0 ? (n_logits + tile - 1) / tile * tile : n_logits;
  auto picked = torch::zeros({n_pad, d}, opts);
  float* pp = picked.data_ptr<float>();
  const float* fw = weights[kFinalNorm].data_ptr<float>();
  for (int64_t i = 0; i < n_logits; ++i) rms_norm_rows(hp + lr[i] * d, d, fw, pp + i * d, d, 1, d, feps);
  auto logits = torch::empty({n_pad, vocab}, opts);
  linear_packed_into(logits, picked, weights[kHeadT], vocab, torch::Tensor(), tile);
  clock.mark(kRegHead);
  return n_pad == n_logits ? logits : logits.narrow(0, 0, n_logits).contiguous();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "agentroll CPU kernels: see agentroll/engine/kernels.py";
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("store_kv", &store_kv, "write k and v into their cache slots");
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache");
  m.def("sample", &sample, "one token per row, with its logprob");
  m.def("uniform", &uniform, "the sampler's counter-based uniforms, in float32");
  m.def("log_softmax", &log_softmax, "log_softmax by the sampler's arithmetic");
  m.def("linear", &linear, "x @ wt (+ bias) by blocked brgemm products",
        py::call_guard<py::gil_scoped_release>());
  m.def("huge_zeros", &huge_zeros, "a zeroed tensor in memory advised for 2 MB pages");
  m.def("pack_weight", &pack_weight, "wt [k, n] as a packed weight (panels of columns)");
  m.def("pack_weight_bf16", &pack_weight_bf16, "wt [k, n] as a bfloat16 packed weight");
  m.def("bf16_products", &bf16_runs, "whether bfloat16 products (pack_weight_bf16) run here");
  m.def("linear_packed", &linear_packed, "x @ W (+ bias) over pack_weight(W)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decoder_forward", &decoder_forward, "the whole decoder over a step's tokens",
        py::call_guard<py::gil_scoped_release>());
  m.def("decoder_regions", [] {
    return std::vector<std::string>(kRegionNames, kRegionNames + kRegions);
  }, "the names of decoder_forward's timed regions, in order");
}
