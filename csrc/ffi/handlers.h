// XLA FFI handlers exported by the extension module.
#pragma once

#include "xla/ffi/api/ffi.h"

// fastattn_attention_fwd_cpu: fused attention forward on the host.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionForwardCpu);
// fastattn_attention_fwd_cuda, platform CUDA: the "initialize" stage finds or
// builds the kernel, the "execute" stage launches it.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionForwardCudaInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionForwardCudaExecute);
// fastattn_decode_cuda, platform CUDA: the decode kernel (few query rows per
// key/value head, split-KV merged in the same launch), same two stages.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeCudaInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeCudaExecute);
