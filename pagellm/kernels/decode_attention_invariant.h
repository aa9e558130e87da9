// The batch-invariant decode attention's kernel (decode_attention_invariant.cpp), which
// compiles without torch's tensor headers; its op (decode_attention_invariant_op.cpp) checks
// the tensors and hands their pointers over.
#pragma once

#include <cstdint>

#include "attention_operands.h"
#include "cache_types.h"

namespace pagellm::kernels::decode_attention_invariant {

using Shape = AttentionShape;
using Operands = AttentionOperands;  // a query per request: no query_starts, query_lens

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands);  // for this library's cache dtypes
}

}  // namespace pagellm::kernels::decode_attention_invariant
