// The prefill attention's kernel (prefill_attention.cpp), which compiles without torch's
// tensor headers; its op (prefill_attention_op.cpp) checks the tensors and hands their
// pointers over.
#pragma once

#include <cstdint>

#include "attention_operands.h"
#include "cache_types.h"

namespace pagellm::kernels::prefill_attention {

using Shape = AttentionShape;
using Operands = AttentionOperands;  // with the chunks' query_starts and query_lens

constexpr int64_t kTile = 4;  // keys (scores) or head dims (output) per register tile

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands);  // for this library's cache dtypes
}

}  // namespace pagellm::kernels::prefill_attention
