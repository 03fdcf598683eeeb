// The element types a client may send or ask for (kRequestTypes, by their KServe v2 datatype
// strings; common/element_type.h). Their conversions to and from the FP32 rows the workers
// compute on are common/convert.h's.
#pragma once

#include "common/convert.h"
#include "common/element_type.h"

namespace epserve::server {

// FP32, BF16, FP16: the datatypes of input hidden_states and output moe_output.
inline constexpr common::ElementType kRequestTypes[] = {
    common::ElementType::kFp32, common::ElementType::kBf16, common::ElementType::kFp16};

using common::FromFp32;
using common::ToFp32;

}  // namespace epserve::server
