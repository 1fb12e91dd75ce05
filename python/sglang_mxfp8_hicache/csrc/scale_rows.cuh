// MXFP8 HiCache: every layer's K and V scale rows of one transfer, in one launch.
//
// SGLang's all-layer copy (kvcacheio/hicache.cuh, hicache_transfer_all_layer)
// with two differences, both to take the per-transfer index preparation off the
// CPU:
//   - indices are read with a step: a scale row is `row_tokens` tokens, and row
//     i of a transfer starts at token indices[i * row_tokens];
//   - a backup's host indices live in pageable CPU memory (where the payload's
//     staged write-back reads them). The wrapper reads the first token of each
//     page there and passes it by value in the launch parameters, so nothing is
//     uploaded and no buffer has to outlive the launch.
// The byte copy itself is SGLang's (device::load_vec / device::store_vec).

#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>

#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/utils.cuh>

#include <kvcacheio/hicache.cuh>

#include <dlpack/dlpack.h>

#include <algorithm>
#include <cstdint>

namespace sglang_mxfp8_hicache {

using namespace sglang;

// Pages per backup launch. 256 page starts are 2 KiB of the 4 KiB of kernel
// parameters every CUDA version accepts; a larger backup takes several launches.
inline constexpr uint32_t kMaxPagesPerLaunch = 256;

struct ScaleRowParams {
  // [4, num_layers] layer base addresses: host K, host V, device K, device V.
  const uint64_t* __restrict__ tables;
  const void* __restrict__ host_indices;    // load: token indices on the GPU
  const void* __restrict__ device_indices;  // token indices on the GPU
  int64_t host_stride;                      // bytes per token index, host side
  int64_t device_stride;                    // bytes per token index, device side
  uint32_t row_tokens;
  uint32_t rows_per_page;
  uint32_t num_rows;
  uint32_t num_layers;
  int64_t host_page_starts[kMaxPagesPerLaunch];  // backup: first host token of each page
};

template <typename T, int64_t kRowBytes, uint32_t kUnroll, uint32_t kBlockQuota, uint32_t kBlockSize, bool kToHost>
__global__ __launch_bounds__(kBlockSize, 1) void scale_rows_all_layer(const __grid_constant__ ScaleRowParams params) {
  using namespace device;
  constexpr uint32_t kLanesPerWorker = copy_lanes_per_worker<kUnroll>();
  constexpr uint32_t kWorkersPerBlock = kBlockSize / kLanesPerWorker;
  constexpr uint32_t kNumWorkers = kWorkersPerBlock * kBlockQuota;

  const uint32_t num_layers = params.num_layers;
  const auto host_k = params.tables;
  const auto host_v = host_k + num_layers;
  const auto device_k = host_v + num_layers;
  const auto device_v = device_k + num_layers;

  const uint32_t work_id = blockIdx.x * kWorkersPerBlock + threadIdx.x / kLanesPerWorker;
  for (uint32_t i = work_id; i < params.num_rows; i += kNumWorkers) {
    const int64_t device_pos = static_cast<const T*>(params.device_indices)[i * params.row_tokens];
    int64_t host_pos;
    if constexpr (kToHost) {
      const uint32_t page = i / params.rows_per_page;
      const uint32_t row = i - page * params.rows_per_page;
      host_pos = params.host_page_starts[page] + static_cast<int64_t>(row) * params.row_tokens;
    } else {
      host_pos = static_cast<const T*>(params.host_indices)[i * params.row_tokens];
    }
    const int64_t host_offset = host_pos * params.host_stride;
    const int64_t device_offset = device_pos * params.device_stride;
    for (uint32_t layer = 0; layer < num_layers; ++layer) {
      const auto host_k_row = reinterpret_cast<void*>(host_k[layer] + host_offset);
      const auto host_v_row = reinterpret_cast<void*>(host_v[layer] + host_offset);
      const auto device_k_row = reinterpret_cast<void*>(device_k[layer] + device_offset);
      const auto device_v_row = reinterpret_cast<void*>(device_v[layer] + device_offset);
      const auto src_k = kToHost ? device_k_row : host_k_row;
      const auto src_v = kToHost ? device_v_row : host_v_row;
      const auto dst_k = kToHost ? host_k_row : device_k_row;
      const auto dst_v = kToHost ? host_v_row : device_v_row;
      // Both loads before either store, as in hicache_transfer_all_layer.
      const auto vec_k = load_vec<kRowBytes, kLanesPerWorker>(src_k);
      const auto vec_v = load_vec<kRowBytes, kLanesPerWorker>(src_v);
      store_vec<kRowBytes, kLanesPerWorker>(dst_k, vec_k);
      store_vec<kRowBytes, kLanesPerWorker>(dst_v, vec_v);
    }
  }
}

template <int64_t kRowBytes, uint32_t kUnroll, uint32_t kBlockQuota, uint32_t kBlockSize>
struct ScaleRowKernel {
  static constexpr uint32_t kWorkersPerBlock = kBlockSize / device::copy_lanes_per_worker<kUnroll>();

  template <typename T, bool kToHost>
  static void launch(const ScaleRowParams& params, DLDevice device) {
    if (params.num_rows == 0) {
      return;
    }
    const auto num_blocks = std::min(host::div_ceil(params.num_rows, kWorkersPerBlock), kBlockQuota);
    host::LaunchKernel(num_blocks, kBlockSize, device)(
        scale_rows_all_layer<T, kRowBytes, kUnroll, kBlockQuota, kBlockSize, kToHost>, params);
  }

  // Device -> host. host_indices: CPU int64 token indices of whole host pages,
  // each page one ascending run from a multiple of page_size (as the host pool
  // allocates them; SGLang's staged write-back reads only each page's first).
  static void backup(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const int64_t host_stride,
      const int64_t device_stride,
      const int64_t row_tokens,
      const int64_t page_size) {
    using namespace host;
    auto L = SymbolicSize{"num_layers"};
    auto N = SymbolicSize{"indices length"};
    auto dtype = SymbolicDType{};
    auto device = SymbolicDevice{};
    TensorMatcher({4, L}).with_dtype<uint64_t>().with_device<kDLGPU>(device).verify(tables);
    TensorMatcher({N}).with_dtype<int32_t, int64_t>(dtype).with_device<kDLGPU>(device).verify(device_indices);
    TensorMatcher({N}).with_dtype<int64_t>().with_device<kDLCPU, kDLGPUHost>().verify(host_indices);
    RuntimeCheck(
        row_tokens > 0 && page_size > 0 && page_size % row_tokens == 0, "MXFP8 scale backup: rows must tile a page");
    RuntimeCheck(N.unwrap() % page_size == 0, "MXFP8 scale backup: indices must be whole pages");

    const auto host_tokens = static_cast<const int64_t*>(host_indices.data_ptr());
    const auto num_pages = N.unwrap() / page_size;
    const auto use_int32 = dtype.unwrap().bits == 32;
    const auto index_bytes = use_int32 ? sizeof(int32_t) : sizeof(int64_t);
    ScaleRowParams params{};
    params.tables = static_cast<const uint64_t*>(tables.data_ptr());
    params.host_stride = host_stride;
    params.device_stride = device_stride;
    params.row_tokens = static_cast<uint32_t>(row_tokens);
    params.rows_per_page = static_cast<uint32_t>(page_size / row_tokens);
    params.num_layers = static_cast<uint32_t>(L.unwrap());
    // Every page is checked before the first launch, so a refused backup moves no scales.
    for (int64_t p = 0; p < num_pages; ++p) {
      const auto page_tokens = host_tokens + p * page_size;
      const auto start = page_tokens[0];
      RuntimeCheck(
          start >= 0 && start % page_size == 0 && page_tokens[page_size - 1] == start + page_size - 1,
          "MXFP8 scale backup: host page ",
          p,
          " is not one aligned run of ",
          page_size,
          " tokens (it starts at token ",
          start,
          ")");
    }
    for (int64_t first = 0; first < num_pages; first += kMaxPagesPerLaunch) {
      const auto pages = std::min<int64_t>(num_pages - first, kMaxPagesPerLaunch);
      for (int64_t p = 0; p < pages; ++p) {
        params.host_page_starts[p] = host_tokens[(first + p) * page_size];
      }
      params.device_indices = static_cast<const char*>(device_indices.data_ptr()) + first * page_size * index_bytes;
      params.num_rows = static_cast<uint32_t>(pages * params.rows_per_page);
      if (use_int32) {
        launch<int32_t, true>(params, device.unwrap());
      } else {
        launch<int64_t, true>(params, device.unwrap());
      }
    }
  }

  // Host -> device, for the layers in `tables`. Both index tensors on the GPU.
  static void load(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const int64_t host_stride,
      const int64_t device_stride,
      const int64_t row_tokens) {
    using namespace host;
    auto L = SymbolicSize{"num_layers"};
    auto N = SymbolicSize{"indices length"};
    auto dtype = SymbolicDType{};
    auto device = SymbolicDevice{};
    TensorMatcher({4, L}).with_dtype<uint64_t>().with_device<kDLGPU>(device).verify(tables);
    TensorMatcher({N})
        .with_dtype<int32_t, int64_t>(dtype)
        .with_device<kDLGPU>(device)
        .verify(host_indices)
        .verify(device_indices);
    RuntimeCheck(row_tokens > 0 && N.unwrap() % row_tokens == 0, "MXFP8 scale load: indices must be whole rows");

    ScaleRowParams params{};
    params.tables = static_cast<const uint64_t*>(tables.data_ptr());
    params.host_indices = host_indices.data_ptr();
    params.device_indices = device_indices.data_ptr();
    params.host_stride = host_stride;
    params.device_stride = device_stride;
    params.row_tokens = static_cast<uint32_t>(row_tokens);
    params.rows_per_page = 1;
    params.num_rows = static_cast<uint32_t>(N.unwrap() / row_tokens);
    params.num_layers = static_cast<uint32_t>(L.unwrap());
    if (dtype.unwrap().bits == 32) {
      launch<int32_t, false>(params, device.unwrap());
    } else {
      launch<int64_t, false>(params, device.unwrap());
    }
  }
};

}  // namespace sglang_mxfp8_hicache
