// The decoder layers of one decode step of the lean forward (fused_decode.py), in C++.
//
// The same ATen operations on the same values, in the same order, as FusedDecode.__call__'s
// loop over the layers: so the same numbers, bit for bit. What goes is the Python around them
// (argument parsing, torch-function checks, tensor wrappers): at one row a step is ~1,800
// small ATen calls, and on a CPU that plumbing cost more than the int4 products did.
// LoRA rows get PEFT's mixed-batch deltas, as the Python loop adds them. The embeddings, RoPE's
// tables, the final norm and the head stay in Python.

#include <torch/extension.h>

#include <vector>

using at::Tensor;
using torch::indexing::Slice;

namespace {

constexpr int64_t LORA_BLOCK = 16;  // lora_rows.BLOCK

// lora_rows.padded: x's rows as [n, in], zero rows added up to a multiple of LORA_BLOCK
Tensor padded(const Tensor& x) {
  Tensor flat = x.reshape({-1, x.size(-1)});
  const int64_t rows = flat.size(0);
  if (rows % LORA_BLOCK == 0) {
    return flat;
  }
  return at::cat({flat, flat.new_zeros({LORA_BLOCK - rows % LORA_BLOCK, flat.size(1)})});
}

// lora_rows.product: padded rows times the weight block by block, so a row's result does not
// depend on the other rows
Tensor blocked_linear(const Tensor& flat, const Tensor& weight, const c10::optional<Tensor>& bias) {
  if (flat.size(0) == LORA_BLOCK) {
    return at::linear(flat, weight, bias);
  }
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < flat.size(0); i += LORA_BLOCK) {
    parts.push_back(at::linear(flat.index({Slice(i, i + LORA_BLOCK)}), weight, bias));
  }
  return at::cat(parts);
}

// The LoRA deltas of one forward, in the order of the products they add to (see decode_layers).
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

  // PEFT's mixed batch on this module's slice of the product (lora_rows.LoraRows.add):
  // lora_B(lora_A(x[rows])) * scaling, added to those rows of the slice. The modules of one
  // product and adapter (q, k and v) share one gather of their rows and one scatter back: the
  // same values as one gather and scatter each
  void add_all(int64_t product, const Tensor& x, Tensor& out) {
    while (adds_to(product)) {
      const auto& r = rows[next];
      Tensor sub = (r.has_value() ? x.index({*r}) : x).to(a[next].scalar_type());
      Tensor flat = padded(sub);
      const int64_t count = sub.numel() / sub.size(-1);
      std::vector<int64_t> shape(sub.sizes().begin(), sub.sizes().end() - 1);
      shape.push_back(-1);
      Tensor target = r.has_value() ? out.index({*r}) : out;
      do {
        Tensor delta = blocked_linear(blocked_linear(flat, a[next], a_bias[next]), b[next], b_bias[next])
                           .index({Slice(0, count)});
        delta = (delta.view(shape) * scale[next]).to(out.scalar_type());
        target.index({Slice(), Slice(offset[next], offset[next] + size[next])}).add_(delta);
        ++next;
      } while (adds_to(product) && same_rows(r, rows[next]));
      if (r.has_value()) {
        out.index_put_({*r}, target);
      }
    }
  }

  static bool same_rows(const c10::optional<Tensor>& x, const c10::optional<Tensor>& y) {
    return x.has_value() == y.has_value() && (!x.has_value() || x->is_same(*y));
  }
};

// one projection's int4 product of the input (aten._weight_int4pack_mm_for_cpu on its bf16
// copy); as fp32 plus its bias and LoRA deltas, or (bf16_ok, neither) as the kernel's bf16 for a
// caller that adds it to fp32 (type promotion widens it exactly: the same sums)
Tensor product(const Tensor& x, const Tensor& x_bf16, const Tensor& packed, const Tensor& scales,
               const c10::optional<Tensor>& bias, int64_t group, bool bf16_ok, int64_t index, Lora& lora) {
  Tensor out = at::_weight_int4pack_mm_for_cpu(x_bf16, packed, group, scales);
  if (bf16_ok && !bias.has_value() && !lora.adds_to(index)) {
    return out;
  }
  out = out.to(at::kFloat);
  if (bias.has_value()) {
    out = out + *bias;
  }
  lora.add_all(index, x, out);
  return out;
}

// ragged.invariant_attention for decode queries [B, H, 1, d] over key/value views [B, Hkv, L, d]
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

// x [T, hidden] fp32 through every decoder layer. Per layer i: norms[2i], norms[2i+1] (input and
// post-attention RMSNorm weights); packed[4i..4i+3], scales[4i..4i+3], biases[4i..4i+3] for
// qkv, o, gate/up, down; k_slabs[i], v_slabs[i]. cos/sin [T, 1, d] (sin's first half negated).
// LoRA: entry e adds to product lora_slot[e] (4i + k, ascending), columns [lora_offset[e],
// + lora_size[e]), rows lora_rows[e] (all rows where empty).
Tensor decode_layers(Tensor x, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& norms,
                     const std::vector<Tensor>& packed, const std::vector<Tensor>& scales,
                     const std::vector<c10::optional<Tensor>>& biases, std::vector<Tensor> k_slabs,
                     std::vector<Tensor> v_slabs, const Tensor& write_slots, const Tensor& write_positions,
                     const Tensor& bias, int64_t decode_view, int64_t decode_len,
                     const c10::optional<Tensor>& decode_rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t intermediate, double eps, double scaling, int64_t group, int64_t key_block,
                     const std::vector<int64_t>& lora_slot, const std::vector<int64_t>& lora_offset,
                     const std::vector<int64_t>& lora_size, const std::vector<Tensor>& lora_a,
                     const std::vector<c10::optional<Tensor>>& lora_a_bias, const std::vector<Tensor>& lora_b,
                     const std::vector<c10::optional<Tensor>>& lora_b_bias, const std::vector<double>& lora_scale,
                     const std::vector<c10::optional<Tensor>>& lora_rows) {
  Lora lora{lora_slot, lora_offset, lora_size, lora_a, lora_a_bias, lora_b, lora_b_bias, lora_scale, lora_rows};
  const int64_t tokens = x.size(0);
  const int64_t hidden = x.size(1);
  const int64_t nq = heads * head_dim, nk = kv_heads * head_dim;
  const int64_t half = head_dim / 2;
  const std::vector<int64_t> shape{hidden};
  const int64_t layers = static_cast<int64_t>(k_slabs.size());
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t p = 4 * i;
    Tensor residual = x;
    Tensor h = at::rms_norm(x, shape, norms[2 * i], eps);
    Tensor qkv = product(h, h.to(at::kBFloat16), packed[p], scales[p], biases[p], group, false, p, lora);
    Tensor qk = qkv.index({Slice(), Slice(0, nq + nk)}).view({tokens, heads + kv_heads, head_dim});
    qk = (qk * cos) + (at::roll(qk, {half}, {-1}) * sin);
    Tensor q = qk.index({Slice(), Slice(0, heads)});
    Tensor k = qk.index({Slice(), Slice(heads)});
    Tensor v = qkv.index({Slice(), Slice(nq + nk)}).view({tokens, kv_heads, head_dim});
    // SlabKVCache.update: the slab rows and positions of this forward's tokens
    k_slabs[i].index_put_({write_slots, Slice(), write_positions}, k);
    v_slabs[i].index_put_({write_slots, Slice(), write_positions}, v);
    // ragged.decode_attention
    Tensor query = q;
    if (decode_rows.has_value()) {
      query = q.new_zeros({decode_view, heads, head_dim}).index_copy_(0, *decode_rows, q);
    }
    Tensor keys = k_slabs[i].index({Slice(0, decode_view), Slice(), Slice(0, decode_len)});
    Tensor values = v_slabs[i].index({Slice(0, decode_view), Slice(), Slice(0, decode_len)});
    Tensor attn = attention(query.unsqueeze(2), keys, values, bias, scaling, key_block).select(2, 0);
    if (decode_rows.has_value()) {
      attn = attn.index_select(0, *decode_rows);
    }
    attn = attn.reshape({tokens, nq});
    x = residual + product(attn, attn.to(at::kBFloat16), packed[p + 1], scales[p + 1], biases[p + 1], group, true,
                           p + 1, lora);
    residual = x;
    h = at::rms_norm(x, shape, norms[2 * i + 1], eps);
    Tensor gate_up = product(h, h.to(at::kBFloat16), packed[p + 2], scales[p + 2], biases[p + 2], group, false, p + 2,
                             lora);
    Tensor act = at::silu(gate_up.index({Slice(), Slice(0, intermediate)})) * gate_up.index({Slice(), Slice(intermediate)});
    x = residual + product(act, act.to(at::kBFloat16), packed[p + 3], scales[p + 3], biases[p + 3], group, true, p + 3,
                           lora);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL: the server's event loop (streaming the last step's tokens) runs beside it,
  // as it ran beside each ATen call of the Python loop
  m.def("decode_layers", &decode_layers, "the lean forward's decoder layers of one decode step",
        py::call_guard<py::gil_scoped_release>());
}
