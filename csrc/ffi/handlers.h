// XLA FFI handlers exported by the extension module.
#pragma once

#include "xla/ffi/api/ffi.h"

// fastattn_attention_cpu: fused attention on the host.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCpu);
// fastattn_attention_cpu_backward: its gradients dQ, dK, dV on the host.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCpuBackward);
// fastattn_attention_cuda, platform CUDA: every CUDA kernel. "instantiate"
// makes the call site's state, of the FFI type fastattn_cuda_site
// (registered from the two functions below); "initialize" loads the kernel
// and plans its launch; "execute" launches it.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCudaInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCudaExecute);
// fastattn_attention_cuda_backward: the backward kernels, with the same
// instantiate stage and state type.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCudaBackwardInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCudaBackwardExecute);
XLA_FFI_TypeId* CudaSiteStateTypeId();
const XLA_FFI_TypeInfo* CudaSiteStateTypeInfo();
// fastattn_attention_ascend_sim, platform cpu: the Ascend kernel on PTO-ISA's
// CPU simulator; fastattn_attention_ascend: the same kernel on an NPU (ACL).
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionAscendSim);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionAscend);
