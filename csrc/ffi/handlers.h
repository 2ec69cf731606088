// XLA FFI handlers exported by the extension module.
#pragma once

#include "xla/ffi/api/ffi.h"

// fastattn_attention_fwd_cpu: fused attention forward on the host.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionForwardCpu);
