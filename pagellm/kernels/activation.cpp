// SwiGLU's and GeGLU's activations for CPUs: out = silu(gate) * up (Llama) or
// gelu_tanh(gate) * up (Gemma) over the fused gate/up projection output, in one pass instead
// of three ops. Rounds where the torch ops round: the activation's result to the activation
// dtype, then the product.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "layer_ops.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::activation {
namespace {

using pagellm::exp_nonpositive;
using pagellm::load;
using pagellm::round_to;
using pagellm::store;

// x * sigmoid(x), with e = exp(-|x|) <= 1 so the exponential never overflows.
struct Silu {
  float operator()(float x) const {
    const float e = exp_nonpositive(-std::fabs(x));
    return x * (x >= 0.f ? 1.f : e) / (1.f + e);
  }
};

// GELU's tanh approximation, x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), with
// tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1.
struct GeluTanh {
  float operator()(float x) const {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpositive(-2.f * std::fabs(u));
    const float t = (1.f - e) / (1.f + e);
    return 0.5f * x * (1.f + (u >= 0.f ? t : -t));
  }
};

template <typename T, typename Activation>
void run(T* out, const T* gate_up, int64_t rows, int64_t size, int64_t in_stride,
         Activation activation) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * in_stride;
      const T* up = gate + size;
      T* o = out + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        store(o, i, round_to<T>(activation(load(gate, i))) * load(up, i));
      }
    }
  });
}

// out: [T, I]; gate_up: [T, 2I] with contiguous rows, gate in the first half.
template <typename Activation>
void activation_and_mul(Tensor& out, const Tensor& gate_up, const char* name) {
  PAGELLM_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                    out.is_contiguous() && out.size(0) == gate_up.size(0) &&
                    out.size(1) * 2 == gate_up.size(1) &&
                    out.scalar_type() == gate_up.scalar_type(),
                name, " expects out [T, I] and gate_up [T, 2I] of one dtype");
  const int64_t rows = gate_up.size(0), size = out.size(1), stride = gate_up.stride(0);
  pagellm::dispatch_dtype(gate_up, name, [&](auto tag) {
    using T = decltype(tag);
    run(out.mutable_data_ptr<T>(), gate_up.const_data_ptr<T>(), rows, size, stride,
        Activation{});
  });
}

}  // namespace

void silu_and_mul(Tensor out, const Tensor& gate_up) {
  activation_and_mul<Silu>(out, gate_up, "silu_and_mul");
}

void gelu_tanh_and_mul(Tensor out, const Tensor& gate_up) {
  activation_and_mul<GeluTanh>(out, gate_up, "gelu_tanh_and_mul");
}

}  // namespace pagellm::kernels::activation

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("silu_and_mul", TORCH_BOX(&pagellm::kernels::activation::silu_and_mul));
  m.impl("gelu_tanh_and_mul", TORCH_BOX(&pagellm::kernels::activation::gelu_tanh_and_mul));
}
