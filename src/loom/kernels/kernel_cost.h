// What a kernel invocation costs: floating-point operations and bytes moved to and from memory.
// Every kernel declares these so traces can report achieved FLOP/s and bandwidth (roofline), and so
// HFU can be computed from what actually ran (recompute included).
#pragma once

namespace loom::kernels {

struct KernelCost {
  double flops = 0;
  double bytes = 0;
};

}  // namespace loom::kernels
