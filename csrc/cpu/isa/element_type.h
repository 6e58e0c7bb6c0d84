// The element types of the float tensors kt_ops reads and writes (activations, routing
// weights, the outputs, and the Hugging Face weights the packers read): a data-type fact
// shared by formats/ (packers) and kernels/ (MoeArgs), so neither includes the other.
#pragma once

namespace kt::cpu {

enum class ElementType { kF32, kBf16, kF16 };

}  // namespace kt::cpu
