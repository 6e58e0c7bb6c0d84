// A packed layer's activation (swiglu_limit, swiglu_alpha) and expert biases: a new blob
// holding the same weights, with the header's GluSpec set and the biases appended.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kt::ops {

// packed: a blob of any format. swiglu_limit, swiglu_alpha: finite, >= 0 (0: off;
// formats/packed_header.h GluSpec). gate_bias, up_bias [E, I] and down_bias [E, H]: any
// float dtype (stored fp32); None is zero; all None: no biases (the blob's old ones are
// dropped). Raises ValueError for a bad blob, value or bias shape. The weights are copied
// (a memory-mapped gguf blob's too).
at::Tensor set_activation(const at::Tensor& packed, double swiglu_limit, double swiglu_alpha,
                          const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                          const std::optional<at::Tensor>& down_bias);

}  // namespace kt::ops
