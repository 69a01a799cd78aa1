// MEGAMOE_HOST_DEVICE: a function compiled for the host and, under nvcc, for the device too, so
// that the CPU handlers and the kernels share one definition.
#pragma once

#ifdef __CUDACC__
#define MEGAMOE_HOST_DEVICE __host__ __device__
#else
#define MEGAMOE_HOST_DEVICE
#endif
