// What the op files take from torch: the tensor and the op registration of its stable ABI
// (torch/csrc/stable). Its headers parse in about 2 s, where torch/library.h and
// ATen/core/Tensor.h took 6 (-O3, a 2-core AMD EPYC), and a first start compiles every op
// file on its critical path (build.py). Ops registered through it are boxed: calls from
// Python were boxed anyway, and cost the same (about 2 us each).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <sstream>
#include <stdexcept>

namespace pagellm {

using Tensor = torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Raises the message, its parts streamed in turn, as a RuntimeError in Python.
// (STD_TORCH_CHECK would put the C++ function, file and line before it.)
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

}  // namespace pagellm

// Fails with the message where `condition` does not hold; the message's parts are only
// evaluated then.
#define PAGELLM_CHECK(condition, ...)                    \
  do {                                                   \
    if (!(condition)) ::pagellm::fail(__VA_ARGS__);      \
  } while (false)
