// The engine's C++ kernels for CPU decode and prompt chunks (native.py), AVX2 CPUs (AVX512-VNNI
// for q4_linear).
//
// One loop over the decoder layers (own::layer_loop: Llama's layer with the variants of the model
// families in layer_ops.py: sandwich norms, q/k norms, GELU or SiLU, a residual multiplier, a RoPE
// table per layer or none, partial RoPE) with the operations between the products computed here,
// and two backends of its products and attention: decode_own, the rows of one decode step of the
// lean forward (fused_decode.py; int4 or oneDNN fp32/bf16 products, each row's attention
// over its own keys), and prompt_own, the prompt chunks' layers (fused_prompt.py; bf16 block
// products or the decode blocks times int8 rows, the prompt attention our own by blocks of keys on
// AVX-512, else batched ATen products). q4_linear: the layers' int4 products (Q4_1 groups times
// int8 rows, AVX512-VNNI or AVX2). q8_rows / q8_linear: Q8_0 blocks times int8 / fp32 rows. What goes is the Python around ~60 small ATen calls a layer
// (argument parsing, torch-function checks, tensor wrappers): at one row a step is ~1,800 of
// them, and on a CPU that plumbing cost more than the int4 products did. The embeddings, RoPE's
// tables, the final norm and the head's dispatch stay in Python.

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#ifdef CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#endif

using at::Tensor;
using torch::indexing::Slice;

namespace {

// The LoRA deltas of one forward, in the order of the products they add to: entry e adds to
// product slot[e] (4i + k for layer i's k-th product, ascending), columns [offset[e], + size[e]),
// rows rows[e] (all rows where empty).
struct Lora {
  const std::vector<int64_t>& slot;
  const std::vector<int64_t>& offset;
  const std::vector<int64_t>& size;
  const std::vector<Tensor>& a;
  const std::vector<c10::optional<Tensor>>& a_bias;
  const std::vector<Tensor>& b;
  const std::vector<c10::optional<Tensor>>& b_bias;
  const std::vector<double>& scale;
  const std::vector<c10::optional<Tensor>>& rows;
  size_t next = 0;

  bool adds_to(int64_t product) const { return next < slot.size() && slot[next] == product; }
};

// ragged.invariant_attention for queries [B, H, W, d] over key/value views [B, Hkv, L, d]
Tensor attention(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& bias, double scale,
                 int64_t key_block) {
  const int64_t batch = query.size(0), heads = query.size(1), width = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), length = key.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t pairs = batch * kv_heads, rows = group * width;
  Tensor scores = at::baddbmm(bias, query.reshape({pairs, rows, dim}), key.reshape({pairs, length, dim}).transpose(1, 2),
                              1, scale);
  Tensor weights = at::softmax(scores, -1);
  Tensor values = value.reshape({pairs, length, dim});
  Tensor out = at::bmm(weights.index({Slice(), Slice(), Slice(0, key_block)}), values.index({Slice(), Slice(0, key_block)}));
  for (int64_t start = key_block; start < length; start += key_block) {
    out.baddbmm_(weights.index({Slice(), Slice(), Slice(start, start + key_block)}),
                 values.index({Slice(), Slice(start, start + key_block)}));
  }
  return out.view({batch, heads, width, dim});
}

}  // namespace

#ifdef CPU_CAPABILITY_AVX2
// ------------------------------------------------------------------------------------------------
// The operations between the products (add + RMSNorm, RoPE + the KV write, a decode row's
// attention over its own keys, SiLU * up, LoRA rows), AVX2 vectors through ATen's Vectorized,
// rows in parallel through at::parallel_for (an OpenMP loop inlined from ATen's header: the
// module is built with -fopenmp and runs on torch's own OpenMP runtime and threads). A decode
// layer is then 4 products instead of ~60 ATen calls. Not the Python loop's bits (its own sums; within ~1e-5 of them), but every row's numbers
// depend only on that row: the same alone as in any batch.

namespace own {

using Vec = at::vec::Vectorized<float>;
using VecB = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t W = Vec::size();  // 8 floats
constexpr int64_t WB = VecB::size();  // 16 bf16: the widths below are multiples of it

inline float hsum(const Vec& v) {
  float lanes[W];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t i = 0; i < W; ++i) {
    sum += lanes[i];
  }
  return sum;
}

inline void to_bf16(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += WB) {
    at::vec::convert_float_bfloat16(Vec::loadu(src + i), Vec::loadu(src + i + W)).store(dst + i);
  }
}

inline void to_f32(float* dst, const at::BFloat16* src, int64_t n) {
  for (int64_t i = 0; i < n; i += WB) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(VecB::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + W);
  }
}

// fp16 (F16C): converted exactly to fp32; from fp32 rounded to nearest even, as torch casts
inline void to_f32(float* dst, const at::Half* src, int64_t n) {
  for (int64_t i = 0; i < n; i += W) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
}

inline void to_f16(at::Half* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += W) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// row t of a product's output (bf16 from the kernel, or fp32 once a bias or LoRA was added) as
// fp32: a pointer into it, or into scratch
inline const float* row_f32(const Tensor& out, int64_t t, float* scratch) {
  const int64_t n = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    return out.data_ptr<float>() + t * n;
  }
  to_f32(scratch, out.data_ptr<at::BFloat16>() + t * n, n);
  return scratch;
}

// a product's output rows: one tensor (bf16 from the kernel, or fp32 with a bias or LoRA added), or
// the bf16 blocks of a blocked product in order, `block` rows each (no copy into one tensor)
struct ProductRows {
  std::vector<Tensor> parts;
  int64_t block;

  static ProductRows of(const Tensor& out) { return {{out}, std::max<int64_t>(out.size(0), 1)}; }

  const float* row(int64_t t, float* scratch) const { return row_f32(parts[t / block], t % block, scratch); }
};

// RMSNorm(x) * weight of one row of n
inline void norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  Vec acc(0.f);
  for (int64_t i = 0; i < n; i += W) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  const Vec r(1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += W) {
    (Vec::loadu(x + i) * r * Vec::loadu(weight + i)).store(out + i);
  }
}

// x += delta (a product's row), the branch's output: first its own norm (delta_norm: sandwich
// norms, else null) and its multiplier (scale: Granite's residual multiplier, else 1); then
// h = RMSNorm(x) * weight, as fp32 and bf16 (h16 null: fp32 only; weight null: x only)
inline void add_norm(float* x, const float* delta, const float* delta_norm, float scale, const float* weight,
                     int64_t n, float eps, float* h32, at::BFloat16* h16) {
  if (delta != nullptr && delta_norm != nullptr) {
    // the normed branch into h32, free until the norm of x below writes it
    norm_row(delta, delta_norm, n, eps, h32);
    delta = h32;
  }
  Vec acc(0.f);
  for (int64_t i = 0; i < n; i += W) {
    Vec v = Vec::loadu(x + i);
    if (delta != nullptr) {
      v = scale == 1.f ? v + Vec::loadu(delta + i) : at::vec::fmadd(Vec::loadu(delta + i), Vec(scale), v);
      v.store(x + i);
    }
    acc = at::vec::fmadd(v, v, acc);
  }
  if (weight == nullptr) {
    return;
  }
  const Vec r(1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += W) {
    (Vec::loadu(x + i) * r * Vec::loadu(weight + i)).store(h32 + i);
  }
  if (h16 != nullptr) {
    to_bf16(h16, h32, n);
  }
}

// RoPE of one head over its first `rotary` dimensions: out = x * cos + roll(x, rotary/2) * sin (sin's
// first half negated), the other dimensions (a partial RoPE's) as they are
template <int64_t D>
inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t rotary) {
  const int64_t half = rotary / 2;
  int64_t c = 0;
  for (; c < rotary; c += W) {
    const float* partner = c < half ? x + c + half : x + c - half;
    at::vec::fmadd(Vec::loadu(x + c), Vec::loadu(cos + c), Vec::loadu(partner) * Vec::loadu(sin + c)).store(out + c);
  }
  for (; c < D; c += W) {
    Vec::loadu(x + c).store(out + c);
  }
}

// What a layer does to a query or key head of one token before attention: its RMSNorm (q/k-norm
// families; norm null: none), then RoPE over `rotary` dimensions (cos null: a layer without RoPE)
struct Head {
  const float* norm;
  float eps;
  const float* cos;  // the token's row of the layer's table
  const float* sin;
  int64_t rotary;

  template <int64_t D>
  void apply(const float* x, float* out) const {
    float normed[D];
    if (norm != nullptr) {
      norm_row(x, norm, D, eps, normed);
      x = normed;
    }
    if (cos != nullptr) {
      rope<D>(x, cos, sin, out, rotary);
    } else {
      std::memcpy(out, x, D * sizeof(float));
    }
  }
};

// The KV slabs hold the plan's kv_dtype: the model's (fp32, or bf16 for a bf16 model), or fp16 /
// bf16 where asked (half the cache's bytes, which decode reads whole every step); a narrow slab's
// keys and values are what the Python loop writes, rounded the same way. 8 values as fp32 lanes:
// a bf16's bits are the top half of its fp32, an fp16 widens exactly (F16C)
inline Vec load8(const float* p) { return Vec::loadu(p); }
inline Vec load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
}
inline Vec load8(const at::Half* p) {
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// a head's D fp32 values into a slab (rounded to nearest even for bf16, as torch's cast)
template <int64_t D>
inline void store_head(float* dst, const float* src) { std::memcpy(dst, src, D * sizeof(float)); }
template <int64_t D>
inline void store_head(at::BFloat16* dst, const float* src) { to_bf16(dst, src, D); }
template <int64_t D>
inline void store_head(at::Half* dst, const float* src) { to_f16(dst, src, D); }

// token's key (RoPE'd) and value of key/value head kv_head written at position of k_row/v_row
template <int64_t D, typename S>
inline void write_kv(const float* qkv, const Head& k_head, S* k_row, S* v_row, int64_t position,
                     int64_t heads, int64_t kv_head, int64_t kv_heads) {
  if constexpr (std::is_same_v<S, float>) {
    k_head.apply<D>(qkv + (heads + kv_head) * D, k_row + position * D);
  } else {
    float key[D];
    k_head.apply<D>(qkv + (heads + kv_head) * D, key);
    store_head<D>(k_row + position * D, key);
  }
  store_head<D>(v_row + position * D, qkv + (heads + kv_heads + kv_head) * D);
}

// one (token, key/value head) of a decode step: RoPE of its key and query heads, the key and
// value written at the token's position of its slab row, and each query head's softmax over
// the row's keys 0..position times their values
template <int64_t D, typename S>
void attend(const float* qkv, const Head& q_head, const Head& k_head, S* k_row, S* v_row, int64_t length,
            int64_t first_head, int64_t group, int64_t heads, int64_t kv_head, int64_t kv_heads, float scale,
            float* out, bool write = true) {
  // k_row/v_row: [capacity, D] of this slab row and head; the new key goes to length - 1 (unless
  // the caller wrote it already: write false)
  if (write) {
    write_kv<D, S>(qkv, k_head, k_row, v_row, length - 1, heads, kv_head, kv_heads);
  }
  float q[8][D];
  for (int64_t h = 0; h < group; ++h) {
    q_head.apply<D>(qkv + (first_head + h) * D, q[h]);
  }
  std::vector<float> weights(group * length);
  // N keys at a time (KEYS, then one for the rest): independent FMA chains (one chain per key and
  // head waits on the FMA's latency); each dot product still sums its columns in the same order,
  // so the same numbers
  auto score = [&](int64_t j, auto keys) {
    constexpr int64_t N = decltype(keys)::value;
    Vec acc[N][8];
    for (int64_t u = 0; u < N; ++u) {
      for (int64_t h = 0; h < group; ++h) {
        acc[u][h] = Vec(0.f);
      }
    }
    for (int64_t c = 0; c < D; c += W) {
      Vec k[N];
      for (int64_t u = 0; u < N; ++u) {
        k[u] = load8(k_row + (j + u) * D + c);
      }
      for (int64_t h = 0; h < group; ++h) {
        const Vec qc = Vec::loadu(q[h] + c);
        for (int64_t u = 0; u < N; ++u) {
          acc[u][h] = at::vec::fmadd(qc, k[u], acc[u][h]);
        }
      }
    }
    for (int64_t u = 0; u < N; ++u) {
      for (int64_t h = 0; h < group; ++h) {
        weights[h * length + j + u] = hsum(acc[u][h]) * scale;
      }
    }
  };
  constexpr int64_t KEYS = 4;
  int64_t j = 0;
  for (; j + KEYS <= length; j += KEYS) {
    score(j, std::integral_constant<int64_t, KEYS>{});
  }
  for (; j < length; ++j) {
    score(j, std::integral_constant<int64_t, 1>{});
  }
  for (int64_t h = 0; h < group; ++h) {
    float* w = weights.data() + h * length;
    float top = w[0];
    for (int64_t j = 1; j < length; ++j) {
      top = std::max(top, w[j]);
    }
    const Vec vtop(top);
    Vec acc(0.f);
    int64_t j = 0;
    for (; j + W <= length; j += W) {
      const Vec e = (Vec::loadu(w + j) - vtop).exp();
      e.store(w + j);
      acc = acc + e;
    }
    float total = hsum(acc);
    if (j < length) {
      const Vec e = (Vec::loadu(w + j, length - j) - vtop).exp();
      float tail[W];
      e.store(tail);
      for (int64_t i = 0; i < length - j; ++i) {
        w[j + i] = tail[i];
        total += tail[i];
      }
    }
    const float inv = 1.f / total;
    float* o = out + (first_head + h) * D;
    // COLS vectors of the output at a time, each its own chain over the keys in key order (the
    // same sums as one vector at a time, without waiting on one FMA chain)
    constexpr int64_t VECS = D / W, COLS = VECS < 8 ? VECS : 8;
    for (int64_t c0 = 0; c0 < VECS; c0 += COLS) {
      Vec sum[COLS];
      for (int64_t u = 0; u < COLS; ++u) {
        sum[u] = Vec(0.f);
      }
      for (int64_t k = 0; k < length; ++k) {
        const Vec wk(w[k]);
        const S* v = v_row + k * D + c0 * W;
        for (int64_t u = 0; u < COLS; ++u) {
          sum[u] = at::vec::fmadd(wk, load8(v + u * W), sum[u]);
        }
      }
      for (int64_t u = 0; u < COLS; ++u) {
        (sum[u] * Vec(inv)).store(o + (c0 + u) * W);
      }
    }
  }
}

// rows [0, n) in parallel, a few at a time (one row runs on the calling thread)
template <typename F>
inline void rows(int64_t n, const F& f) {
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      f(t);
    }
  });
}

// The LoRA deltas that add to product `index`, row by row: out[t, offset:offset+size] +=
// scale * (B (A x[t] + a_bias) + b_bias) for each row t of the entry's adapter. A is [rank, in];
// B comes transposed, [rank, size] (fused_decode passes it so). Each row's delta is computed on
// its own, so it is the same whatever rows share the step (no fixed-size row blocks needed).
void add_lora(int64_t index, const Tensor& x, Tensor& out, Lora& lora) {
  const int64_t in = x.size(1), width = out.size(1), tokens = x.size(0);
  const float* x_p = x.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  while (lora.adds_to(index)) {
    const size_t e = lora.next++;
    const Tensor& a = lora.a[e];
    const Tensor& bt = lora.b[e];
    TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat && a.is_contiguous() &&
                    bt.is_contiguous() && a.size(1) == in && bt.size(0) == a.size(0) && bt.size(1) == lora.size[e],
                "decode_own: a LoRA entry's A [rank, in] and B transposed [rank, size] must be contiguous fp32");
    const int64_t rank = a.size(0), offset = lora.offset[e], size = lora.size[e];
    const float scale = static_cast<float>(lora.scale[e]);
    const float* a_p = a.data_ptr<float>();
    const float* bt_p = bt.data_ptr<float>();
    const float* ab = lora.a_bias[e].has_value() ? lora.a_bias[e]->data_ptr<float>() : nullptr;
    const float* bb = lora.b_bias[e].has_value() ? lora.b_bias[e]->data_ptr<float>() : nullptr;
    const auto& r = lora.rows[e];
    const int64_t count = r.has_value() ? r->size(0) : tokens;
    const int64_t* rows_p = r.has_value() ? r->data_ptr<int64_t>() : nullptr;
    rows(count, [&](int64_t i) {
      const int64_t t = rows_p != nullptr ? rows_p[i] : i;
      const float* xr = x_p + t * in;
      std::vector<float> u(rank);
      for (int64_t k = 0; k < rank; ++k) {
        Vec acc(0.f);
        for (int64_t c = 0; c < in; c += W) {
          acc = at::vec::fmadd(Vec::loadu(a_p + k * in + c), Vec::loadu(xr + c), acc);
        }
        u[k] = hsum(acc) + (ab != nullptr ? ab[k] : 0.f);
      }
      float* o = o_p + t * width + offset;
      int64_t c = 0;
      for (; c + W <= size; c += W) {
        Vec acc = bb != nullptr ? Vec::loadu(bb + c) : Vec(0.f);
        for (int64_t k = 0; k < rank; ++k) {
          acc = at::vec::fmadd(Vec(u[k]), Vec::loadu(bt_p + k * size + c), acc);
        }
        at::vec::fmadd(acc, Vec(scale), Vec::loadu(o + c)).store(o + c);
      }
      for (; c < size; ++c) {
        float acc = bb != nullptr ? bb[c] : 0.f;
        for (int64_t k = 0; k < rank; ++k) {
          acc += u[k] * bt_p[k * size + c];
        }
        o[c] += acc * scale;
      }
    });
  }
}

// ---- int4 products of our own: Q4_1 weights times int8 activations (AVX512-VNNI or AVX2) -------
// llama.cpp's Q4_1 x Q8_1 product. A weight is q * scale + min (q 0..15 in groups of 32 inputs, an
// fp32 scale and min per group: GGUF's Q4_1 values exactly); each row's group of 32 inputs is
// quantised to int8 (d = max|x| / 127), so a group's sum of q * xq is an exact int32 (vpdpbusd:
// 64 products an instruction, 4x fp32's 16 a lane-wide FMA; AVX2 below), and the row's output is
// sum over groups of d * (scale * sum(q * xq) + min * sum(xq)). Each row is computed alone, in a
// fixed order: the same numbers alone as in any batch. Layout (quantized_linear.Int4Blocks):
// w [N/16, K/4, 32] uint8, per tile of 16 outputs and pair p of quads (8 inputs), byte 4c + i holds
// output c's input 8p + i (low nibble) and 8p + 4 + i (high): a mask and a shift make two quads'
// vpdpbusd operands, with no widening shuffle (1-row products 15% faster in cache, 16 rows 4%,
// on 2 Zen 4 cores); sm [N/16, S * 640] bytes (MB 2)
// or [N/16, S * 384] (MB 1), per tile and super-block of 8 groups (S of them, the last padded): 16
// fp32 bases of the scales, 16 of the mins, then per group 16 multipliers of the scales and 16 of
// the mins, fp16 (MB 2) or int8 (MB 1). A group's scale is base * multiplier in fp32 (exact where
// the layout was made from a file: Q4_0/Q4_1's fp16 values times fp16 1, Q4_K's fp16 d times its
// 6-bit integers as int8), so the sums are the ones of fp32 scales and mins, at 5.25 bits a
// weight (fp16) or 4.75 (int8) instead of 6: a one-row step reads every byte once.

constexpr int64_t Q4_GROUP = 32;  // quantized_linear.INT4_GROUP
constexpr int64_t Q4_TILE = 16;   // outputs a tile: one vector of fp32 lanes
constexpr int64_t Q4_SUPER = 8;   // groups a super-block (quantized_linear.Q4_SUPER)
// a super-block's bytes with multipliers of MB bytes: 640 (fp16), 384 (int8)
constexpr int64_t q4_super_bytes(int mb) { return 2 * Q4_TILE * 4 + Q4_SUPER * 2 * Q4_TILE * mb; }
// rows a pass over a tile's weights (their int32 sums in registers): 8 for decode rows; 16 from
// 32 rows on (prompt chunks), where the unpacked weights and the scales serve twice the rows
// (the fp32 totals, touched once a group, partly spilled): 6-12% faster at 32-256 rows on a
// 2-core Xeon, and 7-35% slower at 16 decode rows (a pass's rows and weights outgrow L1). Each
// row's numbers are the same either way.
constexpr int64_t Q4_ROWS = 8;
constexpr int64_t Q4_ROWS_PROMPT = 16;
constexpr int64_t Q4_ROWS_AVX2 = 4;  // the same with AVX2's 16 registers

#define OWN_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// row x [K] fp32 as int8 quads xq [K], with each group's d and d * sum(xq)
OWN_VNNI inline void quantize_row(const float* x, int64_t k_size, int8_t* xq, float* d_out, float* c_out) {
  for (int64_t g = 0; g < k_size / Q4_GROUP; ++g) {
    const __m512 lo = _mm512_loadu_ps(x + g * Q4_GROUP), hi = _mm512_loadu_ps(x + g * Q4_GROUP + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    // round to nearest even (the default MXCSR mode)
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * Q4_GROUP), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * Q4_GROUP + 16), _mm512_cvtepi32_epi8(qhi));
    d_out[g] = d;
    c_out[g] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

// R rows (xq: their int8 rows as int32 quads, interleaved: quad j of row r at j * R + r; d, c:
// their groups' d and d * sum, group g of row r at g * R + r: one pointer and constant offsets
// for the R rows, where R row pointers spilled the general registers) times one tile of 16
// outputs, into out (ld_out apart)
// BITS 4: the layout above; BITS 8 (q8_rows): w [N/16, K/4, 64] uint8, byte 4c + i of quad j output
// c's input 4j + i as q + 128 (a Q8_0 value 0..255, vpdpbusd's unsigned operand; the min is -128
// times the scale, fp16 multipliers). MB: the multipliers' bytes
template <int MB>
OWN_VNNI inline __m512 multipliers16(const uint8_t* p) {
  if constexpr (MB == 2) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

template <int MB>
inline __m256 multipliers8(const uint8_t* p) {
  if constexpr (MB == 2) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
}

template <int R, int BITS, int MB>
OWN_VNNI void q4_tile(const int32_t* xq, const float* d, const float* c, int64_t groups, const uint8_t* w,
                      const uint8_t* sm, float* out, int64_t ld_out) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
  }
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_si512();
    }
    const uint8_t* wg = w + g * (Q4_GROUP * BITS / 8) * Q4_TILE;
    const int32_t* xg = xq + g * (Q4_GROUP / 4) * R;
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < Q4_GROUP / 4; ++j) {
        const __m512i q = _mm512_loadu_si512(wg + j * 64);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], q, _mm512_set1_epi32(xg[j * R + r]));
        }
      }
    } else {
#pragma GCC unroll 4
      for (int64_t p = 0; p < Q4_GROUP / 8; ++p) {
        const __m512i v = _mm512_loadu_si512(wg + p * 64);
        const __m512i lo = _mm512_and_si512(v, nibbles), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(xg[2 * p * R + r]));
        }
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(xg[(2 * p + 1) * R + r]));
        }
      }
    }
    const uint8_t* sb = sm + (g / Q4_SUPER) * q4_super_bytes(MB);
    const auto* base = reinterpret_cast<const float*>(sb);
    const uint8_t* mult = sb + 2 * Q4_TILE * 4 + (g % Q4_SUPER) * 2 * Q4_TILE * MB;
    const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(base), multipliers16<MB>(mult));
    const __m512 min = _mm512_mul_ps(_mm512_loadu_ps(base + Q4_TILE), multipliers16<MB>(mult + Q4_TILE * MB));
    for (int r = 0; r < R; ++r) {
      const __m512 sums = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), scale);
      total[r] = _mm512_fmadd_ps(sums, _mm512_set1_ps(d[g * R + r]), total[r]);
      total[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(c[g * R + r]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ld_out, total[r]);
  }
}

// The same on AVX2 alone (the module's own target): the same int8 rows (x * (127 / max|x|)
// rounded to nearest even), the same exact int32 sums (maddubs + madd: 15 * 127 * 2 fits int16)
// and the same fp32 operations per output lane, so the same numbers bit for bit as above.
inline void quantize_row_avx2(const float* x, int64_t k_size, int8_t* xq, float* d_out, float* c_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < k_size / Q4_GROUP; ++g) {
    const float* xg = x + g * Q4_GROUP;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    // packs interleave the 128-bit lanes: put each row's 4-byte runs back in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * Q4_GROUP),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    d_out[g] = amax / 127.f;
    c_out[g] = d_out[g] * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

template <int R, int MB>
void q4_tile_avx2(const int32_t* xq, const float* d, const float* c, int64_t groups, const uint8_t* w,
                  const uint8_t* sm, float* out, int64_t ld_out) {
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) {
    total[r][0] = total[r][1] = _mm256_setzero_ps();
  }
  const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    }
    const uint8_t* wg = w + g * (Q4_GROUP / 2) * Q4_TILE;
    const int32_t* xg = xq + g * (Q4_GROUP / 4) * R;
    for (int64_t p = 0; p < Q4_GROUP / 8; ++p) {
      __m256i q[2][2];  // [quad 2p + k][half]
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64 + half * 32));
        q[0][half] = _mm256_and_si256(v, nibbles);
        q[1][half] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
      }
      for (int k = 0; k < 2; ++k) {
        for (int r = 0; r < R; ++r) {
          const __m256i x4 = _mm256_set1_epi32(xg[(2 * p + k) * R + r]);
          for (int half = 0; half < 2; ++half) {
            acc[r][half] =
                _mm256_add_epi32(acc[r][half], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k][half], x4), ones));
          }
        }
      }
    }
    const uint8_t* sb = sm + (g / Q4_SUPER) * q4_super_bytes(MB);
    const auto* base = reinterpret_cast<const float*>(sb);
    const uint8_t* mult = sb + 2 * Q4_TILE * 4 + (g % Q4_SUPER) * 2 * Q4_TILE * MB;
    for (int half = 0; half < 2; ++half) {
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(base + 8 * half), multipliers8<MB>(mult + 8 * MB * half));
      const __m256 min = _mm256_mul_ps(_mm256_loadu_ps(base + Q4_TILE + 8 * half),
                                       multipliers8<MB>(mult + Q4_TILE * MB + 8 * MB * half));
      for (int r = 0; r < R; ++r) {
        const __m256 sums = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][half]), scale);
        total[r][half] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d[g * R + r]), total[r][half]);
        total[r][half] = _mm256_fmadd_ps(min, _mm256_set1_ps(c[g * R + r]), total[r][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ld_out, total[r][0]);
    _mm256_storeu_ps(out + r * ld_out + 8, total[r][1]);
  }
}

using Q4Tile = void (*)(const int32_t*, const float*, const float*, int64_t, const uint8_t*, const uint8_t*, float*,
                        int64_t);

template <int BITS, int MB, int... Rs>
constexpr std::array<Q4Tile, sizeof...(Rs)> q4_tiles(std::integer_sequence<int, Rs...>) {
  return {{&q4_tile<Rs + 1, BITS, MB>...}};
}

template <int MB, int... Rs>
constexpr std::array<Q4Tile, sizeof...(Rs)> q4_tiles_avx2(std::integer_sequence<int, Rs...>) {
  return {{&q4_tile_avx2<Rs + 1, MB>...}};
}

inline bool vnni() {
  static const bool has = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return has;
}

// x [T, K] fp32 times a weight in the layout above (bits: 4 or 8; the multipliers' bytes read from
// sm's size): [T, N] fp32; wide: the AVX512-VNNI kernels, else the AVX2 ones (4 bits only; the
// same numbers)
Tensor block_linear(const char* name, int bits, const Tensor& x_in, const Tensor& w, const Tensor& sm, bool wide) {
  TORCH_CHECK(!wide || vnni(), name, ": this CPU has no AVX512-VNNI");
  TORCH_CHECK(wide || bits == 4, name, ": 8-bit weights need AVX512-VNNI");
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 3 && sm.dim() == 2 && w.scalar_type() == at::kByte &&
                  sm.scalar_type() == at::kByte && w.is_contiguous() && sm.is_contiguous(),
              name, ": x [T, K], w [N/16, K/4, ", 8 * bits, "] uint8, sm [N/16, S * 640 or S * 384] uint8");
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), k_size = x.size(1), tiles = w.size(0), n_size = tiles * Q4_TILE;
  const int64_t groups = k_size / Q4_GROUP, supers = (groups + Q4_SUPER - 1) / Q4_SUPER;
  const int mb = sm.size(1) == supers * q4_super_bytes(1) ? 1 : 2;
  TORCH_CHECK(k_size % Q4_GROUP == 0 && w.size(1) * 4 == k_size && w.size(2) == 8 * bits && sm.size(0) == tiles &&
                  sm.size(1) == supers * q4_super_bytes(mb) && (bits == 4 || mb == 2),
              name, ": shapes x ", x.sizes(), " w ", w.sizes(), " sm ", sm.sizes());
  Tensor out = at::empty({tokens, n_size}, x.options());
  static const auto wide_kernels = q4_tiles<4, 2>(std::make_integer_sequence<int, Q4_ROWS_PROMPT>());
  static const auto wide_i8_kernels = q4_tiles<4, 1>(std::make_integer_sequence<int, Q4_ROWS_PROMPT>());
  static const auto wide8_kernels = q4_tiles<8, 2>(std::make_integer_sequence<int, Q4_ROWS_PROMPT>());
  static const auto avx2_kernels = q4_tiles_avx2<2>(std::make_integer_sequence<int, Q4_ROWS_AVX2>());
  static const auto avx2_i8_kernels = q4_tiles_avx2<1>(std::make_integer_sequence<int, Q4_ROWS_AVX2>());
  const Q4Tile* kernels = !wide        ? (mb == 1 ? avx2_i8_kernels : avx2_kernels).data()
                          : bits == 8  ? wide8_kernels.data()
                          : mb == 1    ? wide_i8_kernels.data()
                                       : wide_kernels.data();
  const int64_t pass = !wide ? Q4_ROWS_AVX2 : tokens >= 2 * Q4_ROWS_PROMPT ? Q4_ROWS_PROMPT : Q4_ROWS;
  const int64_t quads_n = k_size / 4;
  // each row as int8 quads with its groups' d and d * sum, written where q4_tile reads them: the
  // rows of each pass interleaved (row i of a pass of r rows: quad j at j * r + i, group g's d and
  // c at g * r + i)
  Tensor mixed = at::empty({tokens * quads_n}, x.options().dtype(at::kInt));
  Tensor mixed_dc = at::empty({2, tokens * groups}, x.options());
  int32_t* mq = mixed.data_ptr<int32_t>();
  float* md = mixed_dc.data_ptr<float>();
  float* mc = md + tokens * groups;
  const float* x_p = x.data_ptr<float>();
  rows(tokens, [&](int64_t t) {
    std::vector<int32_t> row(quads_n);
    std::vector<float> dc(2 * groups);
    (wide ? quantize_row : quantize_row_avx2)(x_p + t * k_size, k_size, reinterpret_cast<int8_t*>(row.data()),
                                              dc.data(), dc.data() + groups);
    const int64_t start = t / pass * pass, r = std::min(pass, tokens - start), i = t - start;
    for (int64_t j = 0; j < quads_n; ++j) {
      mq[start * quads_n + j * r + i] = row[j];
    }
    for (int64_t g = 0; g < groups; ++g) {
      md[start * groups + g * r + i] = dc[g];
      mc[start * groups + g * r + i] = dc[groups + g];
    }
  });
  const uint8_t* w_p = w.data_ptr<uint8_t>();
  const uint8_t* sm_p = sm.data_ptr<uint8_t>();
  float* o_p = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t t = 0; t < tokens; t += pass) {
        const int64_t r = std::min(pass, tokens - t);
        kernels[r - 1](mq + t * quads_n, md + t * groups, mc + t * groups, groups,
                       w_p + tile * (k_size * bits / 8) * Q4_TILE, sm_p + tile * sm.size(1),
                       o_p + t * n_size + tile * Q4_TILE, n_size);
      }
    }
  });
  return out;
}

Tensor q4_linear(const Tensor& x, const Tensor& w, const Tensor& sm, c10::optional<bool> wide) {
  return block_linear("q4_linear", 4, x, w, sm, wide.value_or(vnni()));
}

// the output head's decode rows: Q8_0 blocks times int8 rows (llama.cpp's Q8_0 x Q8_0), AVX512-VNNI
Tensor q8_rows(const Tensor& x, const Tensor& w, const Tensor& sm) {
  return block_linear("q8_rows", 8, x, w, sm, true);
}

// rows times a oneDNN-packed weight, no bias: mkldnn::_linear_pointwise through the dispatcher (the
// op has no C++ function of its own)
Tensor linear_pointwise(const Tensor& rows, const Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows,
                          packed,
                          c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [T, K] fp32 times a weight oneDNN packed in fp32 (packed_linear.OneDNNPacked): oneDNN's product,
// a lone row computed as the first of two as OneDNNPacked does (its lone-row path gives other last
// bits in some shapes), so a row's numbers do not depend on what shares the step
Tensor onednn_linear(const Tensor& x, const Tensor& packed) {
  const bool lone = x.size(0) == 1;
  Tensor out = linear_pointwise(lone ? at::cat({x, x}) : x, packed);
  return lone ? out.narrow(0, 0, 1) : out;
}

// one projection's product: q4_linear (or q8_rows: 64 bytes a quad) of the fp32 rows h32 where the
// weight is in their layout (3-d); oneDNN's of the rows in the packed weight's dtype (h32, or the bf16 copy h16 for a bf16
// model's weights: bf16 operands, fp32 sums, as the Python loop multiplies them); else
// aten._weight_int4pack_mm_for_cpu on h16. The kernel's output, or fp32 with the bias and the
// LoRA deltas (of h32) added where there are any
Tensor product(const Tensor& h32, const Tensor& h16, const Tensor& packed, const Tensor& scales,
               const c10::optional<Tensor>& bias, int64_t group, int64_t index, Lora& lora) {
  Tensor out = packed.dim() == 3     ? (packed.size(2) == 64 ? q8_rows(h32, packed, scales)
                                                           : q4_linear(h32, packed, scales, c10::nullopt))
               : scales.numel() == 0 ? onednn_linear(packed.scalar_type() == at::kBFloat16 ? h16 : h32, packed)
                                     : at::_weight_int4pack_mm_for_cpu(h16, packed, group, scales);
  if (!bias.has_value() && !lora.adds_to(index)) {
    return out;
  }
  out = out.to(at::kFloat);
  if (bias.has_value()) {
    out.add_(*bias);
  }
  add_lora(index, h32, out, lora);
  return out;
}

// the layer loop's steps between the products, row by row
// x += the product's row (delta: none for the first layer's input); h = the next norm of x
// (delta_norm: the branch's own norm, none where the family has none; scale: its multiplier;
// weight none: no next norm, after the last layer, whose final norm is applied in Python)
inline void residual_norm_rows(Tensor& x, const ProductRows* delta, const c10::optional<Tensor>& delta_norm,
                               float scale, const c10::optional<Tensor>& weight, float eps, Tensor& h32, Tensor& h16) {
  const int64_t hidden = x.size(1);
  float* x_p = x.data_ptr<float>();
  const float* dn = delta_norm.has_value() ? delta_norm->data_ptr<float>() : nullptr;
  const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  rows(x.size(0), [&](int64_t t) {
    std::vector<float> scratch(delta != nullptr ? hidden : 0);
    const float* d = delta != nullptr ? delta->row(t, scratch.data()) : nullptr;
    add_norm(x_p + t * hidden, d, dn, scale, w, hidden, eps, h32.data_ptr<float>() + t * hidden,
             h16.defined() && w != nullptr ? h16.data_ptr<at::BFloat16>() + t * hidden : nullptr);
  });
}

// act = act(gate) * up of gate/up's rows, as fp32 and bf16: SiLU as torch computes it
// (x / (1 + exp(-x))), or GELU's tanh form as torch writes it (0.5 x (1 + tanh(b (x + k x^3))))
inline void act_up_rows(const ProductRows& gate_up, int64_t tokens, bool gelu, Tensor& m32, Tensor& m16) {
  const int64_t intermediate = m32.size(1);
  rows(tokens, [&](int64_t t) {
    std::vector<float> scratch(2 * intermediate);
    const float* gu = gate_up.row(t, scratch.data());
    float* act = m32.data_ptr<float>() + t * intermediate;
    const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f), half(0.5f), one(1.f);
    for (int64_t c = 0; c < intermediate; c += W) {
      const Vec g = Vec::loadu(gu + c);
      const Vec a = gelu ? half * g * (one + (beta * (g + kappa * g * g * g)).tanh()) : g / (one + g.neg().exp());
      (a * Vec::loadu(gu + intermediate + c)).store(act + c);
    }
    if (m16.defined()) {
      to_bf16(m16.data_ptr<at::BFloat16>() + t * intermediate, act, intermediate);
    }
  });
}

// the rows of a32 [T, n] as bf16 into a16 (which may have padding rows after them; undefined: none)
inline void to_bf16_rows(const Tensor& a32, Tensor& a16) {
  if (!a16.defined()) {
    return;
  }
  const int64_t n = a32.size(1);
  rows(a32.size(0), [&](int64_t t) { to_bf16(a16.data_ptr<at::BFloat16>() + t * n, a32.data_ptr<float>() + t * n, n); });
}

// ---- the prompt chunks' products (prompt_own, fused_prompt.py) ---------------------------------
// oneDNN's bf16 products in blocks (quantized_linear.BlockedBF16: each weight's block rows, the
// rows padded with zeros to whole blocks of 64).

constexpr int64_t PROMPT_BLOCK = 64;  // quantized_linear.PROMPT_BLOCK

// rows16 [Tp, in] (bf16, Tp a whole number of PROMPT_BLOCKs) times a BlockedBF16 weight, block by
// block as BlockedBF16.product does: the blocks' bf16 outputs, in order (not joined: a copy of
// every output cost ~14 ms a 256-token forward)
ProductRows blocked_bf16(const Tensor& rows16, const Tensor& packed, int64_t block) {
  std::vector<Tensor> parts;
  const int64_t n = rows16.size(0);
  for (int64_t start = 0; start < n; start += block) {
    parts.push_back(linear_pointwise(rows16.narrow(0, start, std::min(block, n - start)), packed));
  }
  return {parts, block};
}

// one prompt product: the kernel's bf16 blocks, or fp32 [T, out] with its bias and LoRA rows'
// deltas (h32: the input's fp32 rows)
ProductRows prompt_product(const Tensor& h32, const Tensor& h16, const Tensor& packed, int64_t block,
                           const c10::optional<Tensor>& bias, int64_t index, Lora& lora) {
  ProductRows blocks = blocked_bf16(h16, packed, block);
  if (!bias.has_value() && !lora.adds_to(index)) {
    return blocks;
  }
  const int64_t tokens = h32.size(0);
  Tensor out = at::empty({tokens, blocks.parts[0].size(1)}, h32.options());
  for (size_t b = 0; b < blocks.parts.size(); ++b) {
    const int64_t start = static_cast<int64_t>(b) * block;
    if (start < tokens) {
      const int64_t n = std::min(block, tokens - start);
      out.narrow(0, start, n).copy_(blocks.parts[b].narrow(0, 0, n));
    }
  }
  if (bias.has_value()) {
    out.add_(*bias);
  }
  add_lora(index, h32, out, lora);
  return ProductRows::of(out);
}

// ---- the layer loop ----------------------------------------------------------------------------
// x [T, hidden] fp32 through every decoder layer, for decode rows and prompt chunks alike: input
// norm; per layer qkv product, attention, o product, residual + post-attention norm, gate/up
// product, SiLU * up, down product, residual (+ the next layer's input norm). What differs is the
// backend's, Ops (DecodeOps, PromptOps below):
//   bf16_rows(T, n, options): a product's bf16 input rows, [>= T, n] (rows after T are the
//     backend's padding; the steps here write rows < T only), or an undefined tensor where its
//     products take the fp32 rows alone (the steps then write none);
//   product(p, in32, in16): product p (4i + k; k: qkv, o, gate/up, down) of the bf16 rows in16
//     (in32: the same rows in fp32, for LoRA), called in ascending p (the LoRA entries are
//     consumed in that order);
//   attention_rows(i, qkv, a32): layer i's RoPE, key/value writes and attention, its output rows
//     [T, heads * d] fp32 written into a32 or a32 rebound to them (a32 is its scratch until then).
//   norms: 4 a layer (before attention, on its output, before the MLP, on its output; the
//     second and fourth only in families with sandwich norms); residual_scale: the branches'
//     multiplier (Granite's); gelu: the MLP's activation is GELU's tanh form, else SiLU.
template <class Ops>
Tensor layer_loop(Tensor x, const std::vector<c10::optional<Tensor>>& norms, int64_t layers_n,
                  int64_t attention_width, int64_t intermediate, double eps, double residual_scale, bool gelu,
                  Ops& ops) {
  x = x.contiguous().clone();
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const auto f32 = x.options(), bf16 = x.options().dtype(at::kBFloat16);
  Tensor h32 = at::empty({tokens, hidden}, f32), h16 = ops.bf16_rows(tokens, hidden, bf16);
  Tensor a32 = at::empty({tokens, attention_width}, f32), a16 = ops.bf16_rows(tokens, attention_width, bf16);
  Tensor m32 = at::empty({tokens, intermediate}, f32), m16 = ops.bf16_rows(tokens, intermediate, bf16);
  const float fe = static_cast<float>(eps), scale = static_cast<float>(residual_scale);
  const c10::optional<Tensor> none;
  residual_norm_rows(x, nullptr, none, 1.f, norms[0], fe, h32, h16);
  for (int64_t i = 0; i < layers_n; ++i) {
    const int64_t p = 4 * i;
    const ProductRows qkv = ops.product(p, h32, h16);
    ops.attention_rows(i, qkv, a32);
    to_bf16_rows(a32, a16);
    const ProductRows o = ops.product(p + 1, a32, a16);
    residual_norm_rows(x, &o, norms[4 * i + 1], scale, norms[4 * i + 2], fe, h32, h16);
    const ProductRows gate_up = ops.product(p + 2, h32, h16);
    act_up_rows(gate_up, tokens, gelu, m32, m16);
    const ProductRows down = ops.product(p + 3, m32, m16);
    // the residual add, and the next layer's input norm (none after the last)
    residual_norm_rows(x, &down, norms[4 * i + 3], scale, i + 1 == layers_n ? none : norms[4 * i + 4], fe, h32, h16);
  }
  return x;
}

// What both backends read of a step's rows: LoRA's deltas, each layer's RoPE tables ([T, 1, rotary]
// contiguous; none: a layer without RoPE) and q/k norms (2 a layer; none: no q/k norms), the
// key/value slabs, each token's slot and position, and the attention's heads and scaling.
struct StepRows {
  Lora& lora;
  const std::vector<c10::optional<Tensor>>& cos;
  const std::vector<c10::optional<Tensor>>& sin;
  const std::vector<c10::optional<Tensor>>& qk_norms;
  int64_t rotary;
  float eps;
  const std::vector<Tensor>& k_slabs;
  const std::vector<Tensor>& v_slabs;
  const Tensor& slots;
  const Tensor& positions;
  int64_t heads;
  int64_t kv_heads;
  double scaling;

  // what layer i does to token t's query heads (key false) or key heads before attention
  Head head(int64_t i, int64_t t, bool key) const {
    const auto& norm = qk_norms[2 * i + (key ? 1 : 0)];
    const auto& c = cos[i];
    return {norm.has_value() ? norm->data_ptr<float>() : nullptr, eps,
            c.has_value() ? c->data_ptr<float>() + t * rotary : nullptr,
            c.has_value() ? sin[i]->data_ptr<float>() + t * rotary : nullptr, rotary};
  }
};

// The decode rows' backend (decode_own): int4 or oneDNN (fp32 or bf16) products, one row a token,
// each token attending its own slab row's keys 0..position (attend: its key and value written there
// first); S: the slabs' element type (float or at::BFloat16, the model's)
template <int64_t D, typename S>
struct DecodeOps : StepRows {
  const std::vector<Tensor>& packed;
  const std::vector<Tensor>& scales;
  const std::vector<c10::optional<Tensor>>& biases;
  int64_t group;
  // each layer's sliding window (0: full attention): a token attends keys > its position - window
  const std::vector<int64_t>& windows;
  // several tokens of one slot (a draft verified, prompt_lookup.py): every token's key and value
  // are written before any token attends, so each sees those of the tokens before it
  bool shared_slots = false;

  // q4_linear's layout (3-d) quantises the fp32 rows itself, oneDNN's fp32 products take them as
  // they are: no bf16 copies to make (torch's int4 kernel and oneDNN's bf16 weights take them)
  Tensor bf16_rows(int64_t tokens, int64_t n, const at::TensorOptions& options) const {
    const bool fp32_rows = packed.front().dim() == 3 ||
                           (scales.front().numel() == 0 && packed.front().scalar_type() == at::kFloat);
    return fp32_rows ? Tensor() : at::empty({tokens, n}, options);
  }

  ProductRows product(int64_t p, const Tensor& in32, const Tensor& in16) {
    return ProductRows::of(own::product(in32, in16, packed[p], scales[p], biases[p], group, p, lora));
  }

  void attention_rows(int64_t i, const ProductRows& qkv, Tensor& a32) const {
    const int64_t tokens = a32.size(0), nq = heads * D, width = (heads + 2 * kv_heads) * D, per_kv = heads / kv_heads;
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    const int64_t* pos_p = positions.data_ptr<int64_t>();
    S* k_slab = k_slabs[i].data_ptr<S>();
    S* v_slab = v_slabs[i].data_ptr<S>();
    float* out = a32.data_ptr<float>();
    const int64_t capacity = k_slabs[i].size(2);
    const int64_t slab_row = kv_heads * capacity * D;
    if (shared_slots) {
      rows(tokens, [&](int64_t t) {
        std::vector<float> scratch(width);
        const float* r = qkv.row(t, scratch.data());
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t offset = slot_p[t] * slab_row + g * capacity * D;
          write_kv<D, S>(r, head(i, t, true), k_slab + offset, v_slab + offset, pos_p[t], heads, g, kv_heads);
        }
      });
    }
    at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(width);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / kv_heads, g = task % kv_heads;
        // a windowed layer's keys start past the window: the row's view from there (its own key
        // written at the same position of the slab)
        const int64_t first = windows[i] > 0 ? std::max<int64_t>(0, pos_p[t] + 1 - windows[i]) : 0;
        const int64_t offset = slot_p[t] * slab_row + g * capacity * D + first * D;
        attend<D, S>(qkv.row(t, scratch.data()), head(i, t, false), head(i, t, true), k_slab + offset, v_slab + offset,
                  pos_p[t] + 1 - first, g * per_kv, per_kv, heads, g, kv_heads, static_cast<float>(scaling), out + t * nq,
                  !shared_slots);
      }
    });
  }
};

// ---- the prompt chunks' attention, our own (AVX-512) ---------------------------------------------
// Flash-style: per block of up to PA_TOKENS consecutive tokens of one prompt and key/value head,
// its query heads' rows attend the keys in blocks of PA_KEYS at fixed positions (0, 64, ...) with
// an online softmax, so no score matrix, bias, key gather or second softmax pass is made (ATen's
// path above: a third of its time around the two products), and key blocks past a block's last
// position or before a window are skipped. Rows are the vector lanes: the queries transposed
// once a block ([D][rows], scaled), each key's score is a broadcast of its D values times them,
// each row's softmax and sums are its own lane's, each row's output its own accumulators, all
// in a fixed order: a row's numbers do not depend on the other rows of its block, on the block's
// size, or on the step's other prompts. Masked keys weigh exactly 0.

constexpr int64_t PA_KEYS = 64;    // keys a block (kv_cache.CAPACITY_BLOCK: slab capacities are whole blocks)
constexpr int64_t PA_TOKENS = 32;  // query tokens a block (times the query heads of a key/value head)
constexpr int64_t PA_KEY_TILE = 4;  // keys a pass of the score kernel

#define OWN_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

inline bool avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}

// exp(x) for x <= 0 (a score minus its row's maximum): 2^n * p(f), Cephes' expf polynomial
OWN_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// scores st [PA_KEY_TILE][ld] of PA_KEY_TILE keys (rows of D, ld_k apart) for NV vectors of rows
// from the transposed queries qt [D][ld]: st[k][r] = sum over d in order of key[k][d] * qt[d][r]
template <int64_t D, int NV>
OWN_AVX512 inline void score_tile(const float* keys, int64_t ld_k, const float* qt, int64_t ld, float* st) {
  __m512 acc[PA_KEY_TILE][NV];
  for (int k = 0; k < PA_KEY_TILE; ++k) {
    for (int v = 0; v < NV; ++v) {
      acc[k][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v) {
      q[v] = _mm512_loadu_ps(qt + d * ld + 16 * v);
    }
    for (int k = 0; k < PA_KEY_TILE; ++k) {
      const __m512 key = _mm512_set1_ps(keys[k * ld_k + d]);
      for (int v = 0; v < NV; ++v) {
        acc[k][v] = _mm512_fmadd_ps(key, q[v], acc[k][v]);
      }
    }
  }
  for (int k = 0; k < PA_KEY_TILE; ++k) {
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(st + k * ld + 16 * v, acc[k][v]);
    }
  }
}

// o[r] = o[r] * alpha[r] + sum over keys k < n in order of p[k][r] * value[k], for R rows from row r0
template <int64_t D, int R>
OWN_AVX512 inline void value_tile(const float* pt, int64_t ld, int64_t r0, const float* values, int64_t n,
                                  const float* alpha, float* o) {
  constexpr int64_t NV = D / 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
    for (int64_t v = 0; v < NV; ++v) {
      acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + r) * D + 16 * v), a);
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    // the rows' weights of key k once (not a broadcast load per product: loads would bound it)
    __m512 weight[R];
    for (int r = 0; r < R; ++r) {
      weight[r] = _mm512_set1_ps(pt[k * ld + r0 + r]);
    }
    for (int64_t v = 0; v < NV; ++v) {
      const __m512 value = _mm512_loadu_ps(values + k * D + 16 * v);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm512_fmadd_ps(weight[r], value, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t v = 0; v < NV; ++v) {
      _mm512_storeu_ps(o + (r0 + r) * D + 16 * v, acc[r][v]);
    }
  }
}

// value_tile for rows [r0, r0 + count) in tiles of R (a row's sums the same in any tile)
template <int64_t D, int R>
OWN_AVX512 void value_rows(const float* pt, int64_t ld, int64_t r0, int64_t count, const float* values, int64_t n,
                           const float* alpha, float* o) {
  int64_t r = r0;
  for (; r + R <= r0 + count; r += R) {
    value_tile<D, R>(pt, ld, r, values, n, alpha, o);
  }
  if constexpr (R > 1) {
    if (r < r0 + count) {
      value_rows<D, R - 1>(pt, ld, r, r0 + count - r, values, n, alpha, o);
    }
  }
}

// The rows of one block: tokens[0..n_tokens) (consecutive positions of one slab row) times the
// per_kv query heads of key/value head g (row i * per_kv + j: token i's head g * per_kv + j) from
// q_all [T, nq] (after RoPE), attending keys/values k_rows, v_rows ([capacity, D] of the slab row
// and head) from position max(0, pos + 1 - window) (window 0: from 0) to pos; each row's output
// written over its query in out_all (the block's own rows: no other task reads them); fp32 rows
// (a 16-bit slab's widened exactly by PromptOps::attend_own first)
template <int64_t D>
OWN_AVX512 void attend_prompt_block(const float* q_all, int64_t nq, const int64_t* tokens, int64_t n_tokens,
                                    const int64_t* pos_p, int64_t g, int64_t per_kv, const float* k_rows,
                                    const float* v_rows, int64_t window, float scale, float* out_all) {
  const int64_t rows = n_tokens * per_kv, ld = (rows + 15) / 16 * 16, vectors = ld / 16;
  constexpr int64_t VALUE_ROWS = D >= 128 ? 3 : D == 64 ? 6 : 8;  // accumulators: 24 (D 128, 64), 16, 8
  std::vector<float> qt(D * ld, 0.f), st(PA_KEYS * ld), o(rows * D, 0.f);
  std::vector<float> m(ld, -std::numeric_limits<float>::infinity()), l(ld, 0.f), alpha(ld, 1.f);
  // each row's first and last key (a padding row: none)
  std::vector<int32_t> lo(ld, std::numeric_limits<int32_t>::max()), hi(ld, -1);
  int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
  for (int64_t i = 0; i < n_tokens; ++i) {
    const int64_t t = tokens[i], pos = pos_p[t];
    const int64_t from = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
    first = std::min(first, from);
    last = std::max(last, pos);
    for (int64_t j = 0; j < per_kv; ++j) {
      const int64_t r = i * per_kv + j;
      const float* q = q_all + t * nq + (g * per_kv + j) * D;
      for (int64_t d = 0; d < D; ++d) {
        qt[d * ld + r] = q[d] * scale;
      }
      lo[r] = static_cast<int32_t>(from);
      hi[r] = static_cast<int32_t>(pos);
    }
  }
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  float pad[PA_KEY_TILE * D];
  for (int64_t kb = first / PA_KEYS * PA_KEYS; kb <= last; kb += PA_KEYS) {
    const int64_t n = std::min(PA_KEYS, last + 1 - kb);
    const float* k_block = k_rows + kb * D;
    const float* v_block = v_rows + kb * D;
    // scores st[k][r] of the block's keys, PA_KEY_TILE at a time (the last tile's keys past n: zeros)
    for (int64_t k0 = 0; k0 < n; k0 += PA_KEY_TILE) {
      const float* keys = k_block + k0 * D;
      if (k0 + PA_KEY_TILE > n) {
        std::memset(pad, 0, sizeof(pad));
        std::memcpy(pad, keys, (n - k0) * D * sizeof(float));
        keys = pad;
      }
      for (int64_t v0 = 0; v0 < vectors; v0 += 4) {
        const float* q = qt.data() + 16 * v0;
        float* s = st.data() + k0 * ld + 16 * v0;
        switch (std::min<int64_t>(4, vectors - v0)) {
          case 1: score_tile<D, 1>(keys, D, q, ld, s); break;
          case 2: score_tile<D, 2>(keys, D, q, ld, s); break;
          case 3: score_tile<D, 3>(keys, D, q, ld, s); break;
          default: score_tile<D, 4>(keys, D, q, ld, s); break;
        }
      }
    }
    // the online softmax, 16 rows a vector: st becomes each key's weight (0 where masked)
    for (int64_t r = 0; r < ld; r += 16) {
      const __m512i row_lo = _mm512_loadu_si512(lo.data() + r), row_hi = _mm512_loadu_si512(hi.data() + r);
      __m512 block_max = minus_inf;
      std::array<__mmask16, PA_KEYS> keep;
      for (int64_t k = 0; k < n; ++k) {
        const __m512i at_ = _mm512_set1_epi32(static_cast<int32_t>(kb + k));
        keep[k] = _mm512_cmp_epi32_mask(at_, row_lo, _MM_CMPINT_NLT) & _mm512_cmp_epi32_mask(at_, row_hi, _MM_CMPINT_LE);
        block_max = _mm512_mask_max_ps(block_max, keep[k], block_max, _mm512_loadu_ps(st.data() + k * ld + r));
      }
      const __m512 old_max = _mm512_loadu_ps(m.data() + r), new_max = _mm512_max_ps(old_max, block_max);
      // a row with no key yet keeps 0 as its maximum (its weights are all 0, its sums still 0)
      const __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ), new_max,
                                                _mm512_setzero_ps());
      const __m512 a = exp512(_mm512_sub_ps(old_max, shift));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < n; ++k) {
        float* s = st.data() + k * ld + r;
        const __m512 p = _mm512_maskz_mov_ps(keep[k], exp512(_mm512_sub_ps(_mm512_loadu_ps(s), shift)));
        _mm512_storeu_ps(s, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_storeu_ps(l.data() + r, _mm512_fmadd_ps(_mm512_loadu_ps(l.data() + r), a, sum));
      _mm512_storeu_ps(m.data() + r, new_max);
      _mm512_storeu_ps(alpha.data() + r, a);
    }
    value_rows<D, VALUE_ROWS>(st.data(), ld, 0, rows, v_block, n, alpha.data(), o.data());
  }
  for (int64_t i = 0; i < n_tokens; ++i) {
    for (int64_t j = 0; j < per_kv; ++j) {
      const int64_t r = i * per_kv + j;
      float* out = out_all + tokens[i] * nq + (g * per_kv + j) * D;
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      for (int64_t v = 0; v < D / 16; ++v) {
        _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + 16 * v), inv));
      }
    }
  }
}

// The prompt chunks' backend (prompt_own): bf16 block products (their input rows padded with
// zeros to whole blocks), or the decode blocks times int8 rows (q4_linear's or q8_rows' layout,
// 3-d: the fp32 rows alone), and the attention ragged's prefill_attention as ATen calls (batched
// products: a prompt's rows attend many keys each) once every key of the chunks is written. S: the
// slabs' element type (float, at::Half or at::BFloat16: the keys and values rounded as written).
template <int64_t D, typename S>
struct PromptOps : StepRows {
  const std::vector<Tensor>& packed;
  const std::vector<int64_t>& blocks;
  const std::vector<Tensor>& scales;
  const std::vector<c10::optional<Tensor>>& biases;
  const Tensor& prefill_slots;
  const Tensor& gather;
  const Tensor& valid;
  // each layer's bias (a windowed layer's masks the keys past its window)
  const std::vector<Tensor>& attention_biases;
  int64_t width;
  int64_t prefill_len;
  int64_t key_block;
  // each layer's sliding window (0: full attention), for the own attention
  const std::vector<int64_t>& windows;
  // attend with attend_prompt_block (AVX-512), else with ragged's prefill_attention as ATen calls
  bool own_attention;

  // the padding rows zero once (the loop's steps write rows < T); none for the int8 rows' kernels
  Tensor bf16_rows(int64_t tokens, int64_t n, const at::TensorOptions& options) const {
    if (packed.front().dim() == 3) {
      return Tensor();
    }
    const int64_t padded = (tokens + PROMPT_BLOCK - 1) / PROMPT_BLOCK * PROMPT_BLOCK;
    return at::zeros({padded, n}, options);
  }

  ProductRows product(int64_t p, const Tensor& in32, const Tensor& in16) {
    if (packed[p].dim() == 3) {
      return ProductRows::of(own::product(in32, in16, packed[p], scales[p], biases[p], 0, p, lora));
    }
    return prompt_product(in32, in16, packed[p], blocks[p], biases[p], p, lora);
  }

  // attend_prompt_block over blocks of up to PA_TOKENS consecutive tokens of one slab row, each
  // key/value head of a block a task; q: the queries [T, heads * D], overwritten by the outputs
  void attend_own(int64_t i, int64_t tokens, float* q) const {
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    const int64_t* pos_p = positions.data_ptr<int64_t>();
    std::vector<int64_t> ids(tokens), starts;
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      if (t == 0 || t - starts.back() == PA_TOKENS || slot_p[t] != slot_p[t - 1] || pos_p[t] != pos_p[t - 1] + 1) {
        starts.push_back(t);
      }
    }
    starts.push_back(tokens);
    const int64_t blocks_n = static_cast<int64_t>(starts.size()) - 1;
    // the rows the blocks read, fp32: the slabs' own, or a 16-bit slab's slots widened once a layer
    // (up to each slot's last position here; widening a block's keys for each block of queries
    // that reads them made a 1,500-token prompt 8% slower than fp32)
    const float* k_rows = nullptr;
    const float* v_rows = nullptr;
    int64_t capacity = k_slabs[i].size(2);
    std::vector<int64_t> row_of;  // a slot's row in the widened copy (16-bit slabs)
    if constexpr (std::is_same_v<S, float>) {
      k_rows = k_slabs[i].data_ptr<float>();
      v_rows = v_slabs[i].data_ptr<float>();
    } else {
      std::vector<int64_t> slot_ids, lasts;
      row_of.assign(k_slabs[i].size(0), -1);
      for (int64_t t = 0; t < tokens; ++t) {
        if (row_of[slot_p[t]] < 0) {
          row_of[slot_p[t]] = static_cast<int64_t>(slot_ids.size());
          slot_ids.push_back(slot_p[t]);
          lasts.push_back(pos_p[t]);
        }
        lasts[row_of[slot_p[t]]] = std::max(lasts[row_of[slot_p[t]]], pos_p[t]);
      }
      const int64_t span = *std::max_element(lasts.begin(), lasts.end()) + 1, n_rows = slot_ids.size() * kv_heads;
      // kept across layers and steps (a fresh allocation a layer faulted its pages in again): one
      // layer's keys and values of the longest prompt seen, in fp32
      static thread_local std::vector<float> wide;
      wide.resize(std::max<size_t>(wide.size(), 2 * n_rows * span * D));
      const S* k_slab = k_slabs[i].data_ptr<S>();
      const S* v_slab = v_slabs[i].data_ptr<S>();
      float* w = wide.data();
      at::parallel_for(0, n_rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t slot = slot_ids[r / kv_heads], g = r % kv_heads, n = (lasts[r / kv_heads] + 1) * D;
          const int64_t from = (slot * kv_heads + g) * k_slabs[i].size(2) * D;
          to_f32(w + r * span * D, k_slab + from, n);
          to_f32(w + (n_rows + r) * span * D, v_slab + from, n);
        }
      });
      k_rows = w;
      v_rows = w + n_rows * span * D;
      capacity = span;
    }
    // the blocks with the most keys first, each thread taking the next task when done with one (a
    // prompt's later blocks attend more keys: contiguous halves of the tasks left one thread
    // most of the work)
    std::vector<int64_t> order(blocks_n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return pos_p[starts[a + 1] - 1] > pos_p[starts[b + 1] - 1];
    });
    std::atomic<int64_t> next{0};
    const int64_t tasks = blocks_n * kv_heads;
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
      for (int64_t task = next++; task < tasks; task = next++) {
        const int64_t b = order[task / kv_heads], g = task % kv_heads, start = starts[b];
        const int64_t row = std::is_same_v<S, float> ? slot_p[start] : row_of[slot_p[start]];
        const int64_t offset = (row * kv_heads + g) * capacity * D;
        attend_prompt_block<D>(q, heads * D, ids.data() + start, starts[b + 1] - start, pos_p, g, heads / kv_heads,
                               k_rows + offset, v_rows + offset, windows[i], static_cast<float>(scaling), q);
      }
    });
  }

  void attention_rows(int64_t i, const ProductRows& qkv, Tensor& a32) const {
    const int64_t tokens = a32.size(0), nq = heads * D, chunks = prefill_slots.size(0);
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    const int64_t* pos_p = positions.data_ptr<int64_t>();
    S* k_slab = k_slabs[i].data_ptr<S>();
    S* v_slab = v_slabs[i].data_ptr<S>();
    float* q_p = a32.data_ptr<float>();
    const int64_t capacity = k_slabs[i].size(2);
    // RoPE of each token's query heads (into a32: free until the attention's rows replace it)
    // and key heads, its key and value written at its slot and position: every key of the
    // chunks is there before any query attends
    rows(tokens, [&](int64_t t) {
      std::vector<float> scratch((heads + 2 * kv_heads) * D);
      const float* r = qkv.row(t, scratch.data());
      const Head q_head = head(i, t, false), k_head = head(i, t, true);
      for (int64_t h = 0; h < heads; ++h) {
        q_head.apply<D>(r + h * D, q_p + t * nq + h * D);
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t row = (slot_p[t] * kv_heads + g) * capacity * D;
        write_kv<D, S>(r, k_head, k_slab + row, v_slab + row, pos_p[t], heads, g, kv_heads);
      }
    });
    if (own_attention) {
      attend_own(i, tokens, q_p);
      return;  // a32 holds the attention's rows
    }
    // ragged.prefill_attention
    Tensor qp = a32.view({tokens, heads, D}).index_select(0, gather).view({chunks, width, heads, D}).transpose(1, 2);
    Tensor keys = k_slabs[i].narrow(2, 0, prefill_len).index_select(0, prefill_slots).to(at::kFloat);
    Tensor values = v_slabs[i].narrow(2, 0, prefill_len).index_select(0, prefill_slots).to(at::kFloat);
    a32 = attention(qp, keys, values, attention_biases[i], scaling, key_block)
              .transpose(1, 2)
              .reshape({chunks * width, heads, D})
              .index_select(0, valid)
              .reshape({tokens, nq})
              .contiguous();
  }
};

// the per-layer arguments of decode_own / prompt_own: 4 norms (the first and third always), 2 q/k
// norms, one RoPE table pair a layer, each contiguous fp32 of its width
inline void check_layers(const std::vector<c10::optional<Tensor>>& cos, const std::vector<c10::optional<Tensor>>& sin,
                         const std::vector<c10::optional<Tensor>>& norms,
                         const std::vector<c10::optional<Tensor>>& qk_norms, size_t layers, int64_t rotary,
                         int64_t head_dim, const char* caller) {
  TORCH_CHECK(cos.size() == layers && sin.size() == layers && norms.size() == 4 * layers &&
                  qk_norms.size() == 2 * layers,
              caller, ": a RoPE table pair, 4 norms and 2 q/k norms a layer");
  TORCH_CHECK(rotary > 0 && rotary <= head_dim && rotary % WB == 0, caller, ": rotary dims ", rotary,
              " must be a multiple of 16 up to the head's");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(norms[4 * i].has_value() && norms[4 * i + 2].has_value(), caller, ": layer ", i,
                " needs its norms before attention and the MLP");
    TORCH_CHECK(cos[i].has_value() == sin[i].has_value(), caller, ": layer ", i, ": cos and sin together");
    if (cos[i].has_value()) {
      TORCH_CHECK(cos[i]->is_contiguous() && sin[i]->is_contiguous() && cos[i]->size(-1) == rotary &&
                      cos[i]->scalar_type() == at::kFloat,
                  caller, ": layer ", i, "'s RoPE tables must be contiguous fp32 [T, 1, ", rotary, "]");
    }
    for (const auto& n : {norms[4 * i], norms[4 * i + 1], norms[4 * i + 2], norms[4 * i + 3], qk_norms[2 * i],
                          qk_norms[2 * i + 1]}) {
      TORCH_CHECK(!n.has_value() || (n->is_contiguous() && n->scalar_type() == at::kFloat), caller,
                  ": norm weights must be contiguous fp32");
    }
  }
}

// f(std::integral_constant<int64_t, D>()) for the head dims the kernels are built for
template <class F>
Tensor with_head_dim(int64_t head_dim, const char* caller, const F& f) {
  switch (head_dim) {
    case 16:
      return f(std::integral_constant<int64_t, 16>());
    case 32:
      return f(std::integral_constant<int64_t, 32>());
    case 64:
      return f(std::integral_constant<int64_t, 64>());
    case 128:
      return f(std::integral_constant<int64_t, 128>());
    default:
      TORCH_CHECK(false, caller, ": head_dim must be 16, 32, 64 or 128, not ", head_dim);
  }
}

// ---- the output head in Q8_0 blocks: int8 weights, one fp32 scale per 32 inputs of a row ----
// Tiles of 32 outputs: q [N/32, K, 32] int8 and d [N/32, K/32, 32] fp32, so one input k of a tile
// is 32 consecutive bytes and its outputs are the vector lanes (no horizontal sums).

constexpr int64_t Q8_BLOCK = 32;

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// R rows, one block of 32 inputs, one tile: acc[r][v] += d[v] * sum_k q[k][v] * x[r][k], one FMA
// chain per vector of 8 outputs and row. The weights widened here (FromBuffer false) or already
// in wbuf (the same values): the same operations for a row whatever R is, so its logits are the
// same whatever rows share the call
template <int64_t R, bool FromBuffer>
inline void q8_block(const int8_t* q, const float* wbuf, const float* x, int64_t x_stride, const float* d,
                     __m256* acc) {
  __m256 p[R][4];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < 4; ++v) {
      p[r][v] = _mm256_setzero_ps();
    }
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < Q8_BLOCK; ++k) {
    __m256 w[4];
    for (int64_t v = 0; v < 4; ++v) {
      w[v] = FromBuffer ? _mm256_loadu_ps(wbuf + k * 32 + v * 8) : widen8(q + k * 32 + v * 8);
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256 bx = _mm256_broadcast_ss(x + r * x_stride + k);
      for (int64_t v = 0; v < 4; ++v) {
        p[r][v] = _mm256_fmadd_ps(w[v], bx, p[r][v]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < 4; ++v) {
      acc[r * 4 + v] = _mm256_fmadd_ps(_mm256_loadu_ps(d + v * 8), p[r][v], acc[r * 4 + v]);
    }
  }
}

}  // namespace own

// x [T, K] fp32 times a weight [N, K] in Q8_0 blocks (the weight is q * d block by block), as fp32
// [T, N]; q and d in tiles (above). Memory-bound at a few rows: about half the bytes of a bf16
// weight, and GGUF's Q8_0 values exactly (bf16 rounds them).
Tensor q8_linear(const Tensor& x_in, const Tensor& q, const Tensor& d) {
  constexpr int64_t B = own::Q8_BLOCK;
  TORCH_CHECK(x_in.dim() == 2 && q.dim() == 3 && d.dim() == 3 && q.size(2) == 32 && d.size(2) == 32,
              "q8_linear: x [T, K], q [N/32, K, 32], d [N/32, K/32, 32]");
  TORCH_CHECK(q.scalar_type() == at::kChar && d.scalar_type() == at::kFloat, "q8_linear: q int8, d fp32");
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), k_size = x.size(1), tiles = q.size(0), n_size = tiles * 32;
  TORCH_CHECK(q.size(1) == k_size && k_size % B == 0 && d.size(1) == k_size / B && d.size(0) == tiles &&
                  q.is_contiguous() && d.is_contiguous(),
              "q8_linear: shapes x ", x.sizes(), " q ", q.sizes(), " d ", d.sizes());
  Tensor out = at::empty({tokens, n_size}, x.options());
  const float* x_p = x.data_ptr<float>();
  const int8_t* q_p = q.data_ptr<int8_t>();
  const float* d_p = d.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const int64_t blocks = k_size / B;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(B * 32);
    std::vector<__m256> accbuf(tokens * 4);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int8_t* qt = q_p + tile * k_size * 32;
      const float* dt = d_p + tile * blocks * 32;
      if (tokens == 1) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < blocks; ++b) {
          own::q8_block<1, false>(qt + b * B * 32, nullptr, x_p + b * B, k_size, dt + b * 32, acc);
        }
        for (int64_t v = 0; v < 4; ++v) {
          _mm256_storeu_ps(o_p + tile * 32 + v * 8, acc[v]);
        }
        continue;
      }
      std::fill(accbuf.begin(), accbuf.end(), _mm256_setzero_ps());
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* qb = qt + b * B * 32;
        for (int64_t i = 0; i < B * 32; i += 8) {
          _mm256_storeu_ps(wbuf.data() + i, own::widen8(qb + i));
        }
        int64_t t = 0;
        for (; t + 2 <= tokens; t += 2) {
          own::q8_block<2, true>(nullptr, wbuf.data(), x_p + t * k_size + b * B, k_size, dt + b * 32,
                                 accbuf.data() + t * 4);
        }
        if (t < tokens) {
          own::q8_block<1, true>(nullptr, wbuf.data(), x_p + t * k_size + b * B, k_size, dt + b * 32,
                                 accbuf.data() + t * 4);
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t v = 0; v < 4; ++v) {
          _mm256_storeu_ps(o_p + t * n_size + tile * 32 + v * 8, accbuf[t * 4 + v]);
        }
      }
    }
  });
  return out;
}

// x [T, hidden] fp32 through every decoder layer. Per layer i: norms[4i..4i+3] (layer_loop's);
// qk_norms[2i], qk_norms[2i+1] (each query / key head's RMSNorm, or none); cos[i], sin[i] (RoPE
// over the first `rotary` dimensions of a head, [T, 1, rotary] contiguous, or none: no RoPE);
// packed[4i..4i+3], scales[4i..4i+3], biases[4i..4i+3] for qkv, o, gate/up, down (int4 in
// q4_linear's or torch's layout; an empty scale: oneDNN's packed weight, fp32 or bf16); k_slabs[i],
// v_slabs[i] (fp32, fp16 or bf16: the runner's KV cache). Each token t attends slab row slots[t], keys 0..positions[t] (its own, written
// there first), or of a layer with a window (windows[i] > 0) only keys > positions[t] - windows[i].
Tensor decode_own(Tensor x, const std::vector<c10::optional<Tensor>>& cos,
                  const std::vector<c10::optional<Tensor>>& sin, const std::vector<c10::optional<Tensor>>& norms,
                  const std::vector<c10::optional<Tensor>>& qk_norms, const std::vector<Tensor>& packed, const std::vector<Tensor>& scales,
                  const std::vector<c10::optional<Tensor>>& biases, const std::vector<Tensor>& k_slabs,
                  const std::vector<Tensor>& v_slabs, const Tensor& slots, const Tensor& positions, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scaling, int64_t group,
                  int64_t rotary, double residual_scale, bool gelu, const std::vector<int64_t>& windows,
                  const std::vector<int64_t>& lora_slot, const std::vector<int64_t>& lora_offset,
                  const std::vector<int64_t>& lora_size, const std::vector<Tensor>& lora_a,
                  const std::vector<c10::optional<Tensor>>& lora_a_bias, const std::vector<Tensor>& lora_b,
                  const std::vector<c10::optional<Tensor>>& lora_b_bias, const std::vector<double>& lora_scale,
                  const std::vector<c10::optional<Tensor>>& lora_rows) {
  Lora lora{lora_slot, lora_offset, lora_size, lora_a, lora_a_bias, lora_b, lora_b_bias, lora_scale, lora_rows};
  TORCH_CHECK(windows.size() == k_slabs.size(), "decode_own: a window a layer (0: full attention)");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= 8, "decode_own: at most 8 query heads a key head");
  own::check_layers(cos, sin, norms, qk_norms, k_slabs.size(), rotary, head_dim, "decode_own");
  TORCH_CHECK(x.size(1) % own::WB == 0 && intermediate % own::WB == 0, "decode_own: widths must be multiples of 16");
  TORCH_CHECK(slots.size(0) == x.size(0) && positions.size(0) == x.size(0), "decode_own: a slot and position a token");
  TORCH_CHECK(!packed.empty() && std::all_of(packed.begin(), packed.end(),
                                             [&](const Tensor& w) { return w.dim() == packed.front().dim(); }),
              "decode_own: every product's weight in one layout (q4_linear's or torch's int4)");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "decode_own: the residual stream x must be fp32");
  const auto slab_type = k_slabs.front().scalar_type();
  TORCH_CHECK(slab_type == at::kFloat || slab_type == at::kBFloat16 || slab_type == at::kHalf,
              "decode_own: the slabs must be fp32, fp16 or bf16");
  for (size_t i = 0; i < k_slabs.size(); ++i) {
    TORCH_CHECK(k_slabs[i].is_contiguous() && v_slabs[i].is_contiguous() && k_slabs[i].size(3) == head_dim,
                "decode_own: the slabs must be contiguous [slots, kv_heads, capacity, head_dim]");
    TORCH_CHECK(k_slabs[i].scalar_type() == slab_type && v_slabs[i].scalar_type() == slab_type,
                "decode_own: every slab in one dtype");
  }
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* pos_p = positions.data_ptr<int64_t>();
  std::vector<int64_t> seen(slot_p, slot_p + x.size(0));
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < k_slabs[0].size(0) && pos_p[t] >= 0 && pos_p[t] < k_slabs[0].size(2),
                "decode_own: token ", t, " at slot ", slot_p[t], " position ", pos_p[t], " is outside the slabs");
  }
  std::sort(seen.begin(), seen.end());
  const bool shared_slots = std::adjacent_find(seen.begin(), seen.end()) != seen.end();
  const float fe = static_cast<float>(eps);
  return own::with_head_dim(head_dim, "decode_own", [&](auto d) {
    auto run = [&](auto slab) {
      own::DecodeOps<decltype(d)::value, decltype(slab)> ops{
          {lora, cos, sin, qk_norms, rotary, fe, k_slabs, v_slabs, slots, positions, heads, kv_heads, scaling},
          packed, scales, biases, group, windows};
      ops.shared_slots = shared_slots;
      return own::layer_loop(x, norms, static_cast<int64_t>(k_slabs.size()), heads * d, intermediate, eps,
                             residual_scale, gelu, ops);
    };
    return slab_type == at::kBFloat16 ? run(at::BFloat16()) : slab_type == at::kHalf ? run(at::Half()) : run(0.f);
  });
}

// The prompt chunks' decoder layers (fused_prompt.py): x [T, hidden] fp32, token t of slab row
// slots[t] at positions[t]; packed/blocks/scales: each product's BlockedBF16 weight and block rows
// (its scales empty), or every product's decode blocks (q4_linear's or q8_rows' packed weight and
// scales; its block rows unused);
// the plan's prompt attention (prefill_slots, gather, valid, each layer's bias expanded per key/value
// head: a windowed layer's masks keys past its window, width, prefill_len); LoRA as decode_own takes it.
Tensor prompt_own(Tensor x, const std::vector<c10::optional<Tensor>>& cos,
                  const std::vector<c10::optional<Tensor>>& sin, const std::vector<c10::optional<Tensor>>& norms,
                  const std::vector<c10::optional<Tensor>>& qk_norms, const std::vector<Tensor>& packed,
                  const std::vector<int64_t>& blocks, const std::vector<Tensor>& scales,
                  const std::vector<c10::optional<Tensor>>& biases, const std::vector<Tensor>& k_slabs,
                  const std::vector<Tensor>& v_slabs, const Tensor& slots, const Tensor& positions,
                  const Tensor& prefill_slots, const Tensor& gather, const Tensor& valid,
                  const std::vector<Tensor>& attention_biases,
                  int64_t width, int64_t prefill_len, int64_t key_block, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t intermediate, double eps, double scaling, int64_t rotary,
                  double residual_scale, bool gelu, const std::vector<int64_t>& windows, bool own_attention,
                  const std::vector<int64_t>& lora_slot, const std::vector<int64_t>& lora_offset,
                  const std::vector<int64_t>& lora_size, const std::vector<Tensor>& lora_a,
                  const std::vector<c10::optional<Tensor>>& lora_a_bias, const std::vector<Tensor>& lora_b,
                  const std::vector<c10::optional<Tensor>>& lora_b_bias, const std::vector<double>& lora_scale,
                  const std::vector<c10::optional<Tensor>>& lora_rows) {
  Lora lora{lora_slot, lora_offset, lora_size, lora_a, lora_a_bias, lora_b, lora_b_bias, lora_scale, lora_rows};
  TORCH_CHECK(x.size(1) % own::WB == 0 && intermediate % own::WB == 0 && (heads * head_dim) % own::WB == 0,
              "prompt_own: widths must be multiples of 16");
  TORCH_CHECK(slots.size(0) == x.size(0) && positions.size(0) == x.size(0), "prompt_own: a slot and position a token");
  TORCH_CHECK(packed.size() == blocks.size() && packed.size() == scales.size() && packed.size() == 4 * k_slabs.size(),
              "prompt_own: four products a layer");
  TORCH_CHECK(attention_biases.size() == k_slabs.size() && windows.size() == k_slabs.size(),
              "prompt_own: an attention bias and a window (0: full attention) a layer");
  TORCH_CHECK(!own_attention || own::avx512(), "prompt_own: the own attention needs AVX-512, which this CPU lacks");
  own::check_layers(cos, sin, norms, qk_norms, k_slabs.size(), rotary, head_dim, "prompt_own");
  const bool int8_rows = packed.front().dim() == 3;
  for (size_t p = 0; p < packed.size(); ++p) {
    TORCH_CHECK((packed[p].dim() == 3) == int8_rows,
                "prompt_own: every product's weight in one kind (bf16 blocks, or int4/Q8_0 blocks)");
    TORCH_CHECK(int8_rows || (blocks[p] > 0 && blocks[p] % own::PROMPT_BLOCK == 0),
                "prompt_own: blocks of a whole number of 64 rows, not ", blocks[p]);
  }
  const auto slab_type = k_slabs.front().scalar_type();
  TORCH_CHECK(slab_type == at::kFloat || slab_type == at::kBFloat16 || slab_type == at::kHalf,
              "prompt_own: the slabs must be fp32, fp16 or bf16");
  for (size_t i = 0; i < k_slabs.size(); ++i) {
    TORCH_CHECK(k_slabs[i].is_contiguous() && v_slabs[i].is_contiguous() && k_slabs[i].size(3) == head_dim &&
                    k_slabs[i].scalar_type() == slab_type && v_slabs[i].scalar_type() == slab_type,
                "prompt_own: the slabs must be contiguous [slots, kv_heads, capacity, head_dim], all of one dtype");
  }
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* pos_p = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < k_slabs[0].size(0) && pos_p[t] >= 0 && pos_p[t] < k_slabs[0].size(2),
                "prompt_own: token ", t, " at slot ", slot_p[t], " position ", pos_p[t], " is outside the slabs");
  }
  const float fe = static_cast<float>(eps);
  return own::with_head_dim(head_dim, "prompt_own", [&](auto d) {
    auto run = [&](auto slab) {
      own::PromptOps<decltype(d)::value, decltype(slab)> ops{
          {lora, cos, sin, qk_norms, rotary, fe, k_slabs, v_slabs, slots, positions, heads, kv_heads, scaling},
          packed, blocks, scales, biases, prefill_slots, gather, valid, attention_biases, width, prefill_len,
          key_block, windows, own_attention};
      return own::layer_loop(x, norms, static_cast<int64_t>(k_slabs.size()), heads * d, intermediate, eps,
                             residual_scale, gelu, ops);
    };
    return slab_type == at::kBFloat16 ? run(at::BFloat16()) : slab_type == at::kHalf ? run(at::Half()) : run(0.f);
  });
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL: the server's event loop (streaming the last step's tokens) runs beside it,
  // as it ran beside each ATen call of the Python loop
#ifdef CPU_CAPABILITY_AVX2
  m.def("q8_linear", &q8_linear, "x times a weight in Q8_0 blocks (int8, an fp32 scale per 32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("q4_linear", &own::q4_linear, "x times a weight in Q4_1 groups, its rows as int8", py::arg("x"),
        py::arg("w"), py::arg("sm"), py::arg("wide") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("q8_rows", &own::q8_rows, "x times a weight in Q8_0 blocks, its rows as int8 (AVX512-VNNI)", py::arg("x"),
        py::arg("w"), py::arg("sm"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_own", &decode_own, "the decoder layers of one decode step, the ops between the products its own",
        py::call_guard<py::gil_scoped_release>());
  m.def("prompt_own", &prompt_own,
        "the decoder layers of prompt chunks, bf16 or int8 rows' products, the ops between them its own",
        py::call_guard<py::gil_scoped_release>());
#endif
}
