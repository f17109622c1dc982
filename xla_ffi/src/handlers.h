// The XLA FFI handler symbols this module exports through registrations().
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxMxfp4GemmCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMxfp4GemmHipblaslt(XLA_FFI_CallFrame* call_frame);
