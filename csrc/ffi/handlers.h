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
// key/value head, split-KV merged in the same launch), the same two stages and
// "instantiate", which makes the call site's state: its split counters, of
// the FFI type fastattn_decode_counters (registered from the two below).
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeCudaInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DecodeCudaExecute);
XLA_FFI_TypeId* DecodeCountersTypeId();
const XLA_FFI_TypeInfo* DecodeCountersTypeInfo();
