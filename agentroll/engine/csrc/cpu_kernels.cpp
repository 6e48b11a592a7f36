// CPU kernels of the built-in engine (fp32): RMSNorm, SiLU-and-multiply, rotate-half RoPE and
// attention read straight from the paged KV cache.  Loaded by agentroll/engine/kernels.py.
//
// Invariants:
// - Every kernel computes each row (a token, or a (token, kv head) pair for attention) on its
//   own, with loops whose order and vector split depend only on the row's own sizes (hidden
//   size, head dim, number of keys), never on the number of rows or their place in the batch.
//   So a row's result is bit-identical alone or with any other rows, and a query row of a
//   prefill chunk gets exactly what the same position gets as a decode: the batch-invariant
//   mode relies on this.
// - Attention reads K/V where the block table says (slot = table[b] * block_size + offset)
//   and never writes the cache; query row t attends to keys 0 .. lens[t]-1 of table row
//   rows[t] (causality is expressed by lens).
// - Transcendentals are scalar libm calls (expf), never a vector approximation whose result
//   could depend on the lane an element lands in.
// - Inputs are checked (dtype, device, layout, shapes, index ranges) before any write; a
//   violation raises (RuntimeError in Python) and leaves every output untouched.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

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

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
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
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      const float inv = 1.f / std::sqrt(dot(row, row, n) / static_cast<float>(n) + feps);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (row[i] * inv);
    }
  });
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
  const float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * n;
      const float* u = upp + r * n;
      float* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// Rotate-half RoPE in place: x [T, heads, D], cos/sin [T, D].
torch::Tensor rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim]");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos and sin must be [", t, ", ", d, "]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* v = xp + i * d;
      const float* c = cp + (i / heads) * d;
      const float* s = sp + (i / heads) * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a * c[j] - b * s[j];
        v[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  });
  return x;
}

// Attention of each query row over its own keys in the paged cache.
//   q [T, H, D]; k_cache / v_cache [slots, KVH, D] (slots = num_blocks * block_size);
//   tables [R, NB] block ids; rows [T]: the table row of each query; lens [T]: its number of
//   keys (positions 0 .. lens-1).  Returns [T, H, D].  H must be a multiple of KVH (GQA).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& tables,
                              const torch::Tensor& rows, const torch::Tensor& lens,
                              int64_t block_size, double scale) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_i64(tables, "tables", 2);
  check_i64(rows, "rows", 1);
  check_i64(lens, "lens", 1);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(),
              "q must be [T, H, D] and the caches [slots, KVH, D]");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t slots = k_cache.size(0), kvh = k_cache.size(1);
  const int64_t nr = tables.size(0), nb = tables.size(1);
  TORCH_CHECK(k_cache.size(2) == d, "head_dim of q and the cache differ");
  TORCH_CHECK(kvh > 0 && h % kvh == 0, "heads (", h, ") must be a multiple of kv heads (", kvh, ")");
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, "bad block_size ", block_size);
  TORCH_CHECK(rows.size(0) == t && lens.size(0) == t, "rows and lens must have ", t, " entries");
  const int64_t num_blocks = slots / block_size;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < nr, "rows[", i, "] = ", rp[i], " is not a table row");
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= nb * block_size, "lens[", i, "] = ", lp[i],
                " is outside [1, ", nb * block_size, "]");
    const int64_t used = (lp[i] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = tp[rp[i] * nb + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " is outside [0, ", num_blocks, ")");
    }
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kvh;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, t * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / kvh, kv = i % kvh, len = lp[row];
      const int64_t* table = tp + rp[row] * nb;
      const float* qrow = qp + (row * h + kv * group) * d;  // the group's heads are adjacent
      float* orow = op + (row * h + kv * group) * d;
      scores.assign(group * len, 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* key = kp + (slot * kvh + kv) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * len + p] = dot(qrow + g * d, key, d) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float top = s[0];
        for (int64_t p = 1; p < len; ++p) top = s[p] > top ? s[p] : top;
        float total = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - top);
          total += s[p];
        }
        const float inv = 1.f / total;
        for (int64_t p = 0; p < len; ++p) s[p] *= inv;
        float* o = orow + g * d;
        for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
      }
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* value = vp + (slot * kvh + kv) * d;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + p];
          float* o = orow + g * d;
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) o[j] += w * value[j];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "agentroll CPU kernels (fp32): see agentroll/engine/kernels.py";
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache");
}
