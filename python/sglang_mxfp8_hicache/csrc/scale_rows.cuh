// MXFP8 HiCache: the K and V scale chunks of one transfer, for a run of layers,
// in one launch.
//
// SGLang's all-layer copy (kvcacheio/hicache.cuh, hicache_transfer_all_layer),
// changed where that kernel makes small transfers cost more than their bytes:
//   - indices are read with a step: a page's scales are cut into chunks the size
//     of `row_tokens` tokens' scales, and chunk i of a transfer starts at token
//     indices[i * row_tokens] times the stride, so no index tensor is gathered;
//   - a backup's host indices may live in pageable CPU memory (where the
//     payload's staged write-back reads them). The wrapper then reads the first
//     token of each page there and passes it by value in the launch parameters,
//     so nothing is uploaded and no buffer has to outlive the launch;
//   - `walk_layers` picks the work split: a worker takes one chunk through
//     every layer (SGLang's shape, kept for backups) or one (chunk, layer)
//     (loads, whose layer groups are short and whose chunks are few).
// The byte copy itself is SGLang's (device::load_vec / device::store_vec).
//
// Both wrappers check on the CPU, before anything is launched, that the
// transfer is whole pages, and a backup's CPU host indices page by page. Index
// values on the GPU are checked by the kernel itself, chunk by chunk: a chunk
// whose page is not one aligned run is not moved, and the first token of that
// page goes to a pinned word the pool reads (reading it here would synchronise).

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

// Pages per backup launch with CPU host indices. 256 page starts are 2 KiB of
// the 4 KiB of kernel parameters every CUDA version accepts; a larger backup
// takes several launches. Backups of a few pages use a 16-page block, and
// transfers that read their host indices on the GPU a 1-entry one, so no
// launch ships kilobytes it ignores.
inline constexpr uint32_t kMaxPagesPerLaunch = 256;
inline constexpr uint32_t kFewPages = 16;

// What every launch of one pool and direction shares.
struct ScaleRowShape {
  // [4, num_layers] layer base addresses: host K, host V, device K, device V.
  const uint64_t* __restrict__ tables;
  int64_t host_stride;    // bytes per token index, host side
  int64_t device_stride;  // bytes per token index, device side
  // Pinned host words: [side (1 device, 2 host), first token of the page] of a
  // page whose GPU indices are not one aligned run; 0 while none was seen.
  // Null: no checks (a bench ablation measures what they cost).
  int64_t* __restrict__ refused;
  uint32_t row_tokens;
  uint32_t rows_per_page;
  uint32_t page_size;
  uint32_t num_layers;
  bool walk_layers;
};

template <uint32_t kMaxPages>
struct ScaleRowParams {
  ScaleRowShape shape;
  const void* __restrict__ host_indices;    // token indices on the GPU, or null
  const void* __restrict__ device_indices;  // token indices on the GPU
  uint32_t num_rows;
  int64_t host_page_starts[kMaxPages];  // first host token of each page, if host_indices is null
};

// Chunk j of a page sits at token page_start + j * row_tokens, on a page that
// starts at a multiple of page_size and (checked by its last chunk) ends
// page_size - 1 tokens later. Every load is issued before the first compare.
struct ChunkIndex {
  int64_t pos;
  int64_t page_start;
  bool aligned;
};

template <typename T>
SGL_DEVICE ChunkIndex read_chunk(const T* indices, const ScaleRowShape& shape, uint32_t page, uint32_t row) {
  const T* page_tokens = indices + static_cast<int64_t>(page) * shape.page_size;
  const bool last_chunk = row + 1 == shape.rows_per_page;
  const int64_t start = page_tokens[0];
  const int64_t pos = page_tokens[row * shape.row_tokens];
  const int64_t last = last_chunk ? int64_t{page_tokens[shape.page_size - 1]} : start + shape.page_size - 1;
  const bool aligned = start >= 0 && start % shape.page_size == 0 &&
                       pos == start + static_cast<int64_t>(row) * shape.row_tokens &&
                       last == start + shape.page_size - 1;
  return {pos, start, aligned};
}

SGL_DEVICE void refuse_page(const ScaleRowShape& shape, int64_t side, int64_t page_start) {
  volatile int64_t* refused = shape.refused;
  refused[1] = page_start;
  refused[0] = side;
}

// Where chunk i sits on both sides, or false (and the page reported) if one of
// its GPU-indexed pages is not one aligned run. Without a `refused` word (a
// bench ablation) nothing is checked.
template <typename T, bool kHostStarts, uint32_t kMaxPages>
SGL_DEVICE bool locate_chunk(const ScaleRowParams<kMaxPages>& params, uint32_t i, int64_t* host_pos, int64_t* device_pos) {
  const ScaleRowShape& shape = params.shape;
  const uint32_t page = i / shape.rows_per_page;
  const uint32_t row = i - page * shape.rows_per_page;
  const auto device = read_chunk(static_cast<const T*>(params.device_indices), shape, page, row);
  *device_pos = device.pos;
  bool host_aligned = true;
  int64_t host_start;
  if constexpr (kHostStarts) {
    host_start = params.host_page_starts[page];  // checked on the CPU
    *host_pos = host_start + static_cast<int64_t>(row) * shape.row_tokens;
  } else {
    const auto host = read_chunk(static_cast<const T*>(params.host_indices), shape, page, row);
    *host_pos = host.pos;
    host_start = host.page_start;
    host_aligned = host.aligned;
  }
  if (shape.refused == nullptr || (device.aligned && host_aligned)) {
    return true;
  }
  refuse_page(shape, device.aligned ? 2 : 1, device.aligned ? host_start : device.page_start);
  return false;
}

// K and V of one chunk and layer: one worker's copy.
template <int64_t kRowBytes, uint32_t kLanesPerWorker, bool kToHost>
SGL_DEVICE void copy_scale_chunk(const ScaleRowShape& shape, int64_t host_pos, int64_t device_pos, uint32_t layer) {
  using namespace device;
  const uint32_t num_layers = shape.num_layers;
  const uint64_t* tables = shape.tables + layer;
  const int64_t host_offset = host_pos * shape.host_stride;
  const int64_t device_offset = device_pos * shape.device_stride;
  const auto host_k = reinterpret_cast<void*>(tables[0] + host_offset);
  const auto host_v = reinterpret_cast<void*>(tables[num_layers] + host_offset);
  const auto device_k = reinterpret_cast<void*>(tables[2 * num_layers] + device_offset);
  const auto device_v = reinterpret_cast<void*>(tables[3 * num_layers] + device_offset);
  // Both loads before either store, as in hicache_transfer_all_layer.
  const auto vec_k = load_vec<kRowBytes, kLanesPerWorker>(kToHost ? device_k : host_k);
  const auto vec_v = load_vec<kRowBytes, kLanesPerWorker>(kToHost ? device_v : host_v);
  store_vec<kRowBytes, kLanesPerWorker>(kToHost ? host_k : device_k, vec_k);
  store_vec<kRowBytes, kLanesPerWorker>(kToHost ? host_v : device_v, vec_v);
}

template <
    typename T,
    int64_t kRowBytes,
    uint32_t kUnroll,
    uint32_t kBlockQuota,
    uint32_t kBlockSize,
    bool kToHost,
    bool kHostStarts,
    uint32_t kMaxPages>
__global__ __launch_bounds__(kBlockSize, 1) void scale_rows_all_layer(
    const __grid_constant__ ScaleRowParams<kMaxPages> params) {
  constexpr uint32_t kLanesPerWorker = device::copy_lanes_per_worker<kUnroll>();
  constexpr uint32_t kWorkersPerBlock = kBlockSize / kLanesPerWorker;
  constexpr uint32_t kNumWorkers = kWorkersPerBlock * kBlockQuota;
  constexpr auto locate = locate_chunk<T, kHostStarts, kMaxPages>;
  constexpr auto copy = copy_scale_chunk<kRowBytes, kLanesPerWorker, kToHost>;

  const ScaleRowShape& shape = params.shape;
  const uint32_t num_layers = shape.num_layers;
  const uint32_t work_id = blockIdx.x * kWorkersPerBlock + threadIdx.x / kLanesPerWorker;
  int64_t host_pos, device_pos;
  if (shape.walk_layers) {
    for (uint32_t i = work_id; i < params.num_rows; i += kNumWorkers) {
      if (locate(params, i, &host_pos, &device_pos)) {
        for (uint32_t layer = 0; layer < num_layers; ++layer) {
          copy(shape, host_pos, device_pos, layer);
        }
      }
    }
  } else {
    // The layers of a chunk on neighbouring workers: no worker chains one PCIe
    // round trip per layer.
    const uint32_t num_items = params.num_rows * num_layers;
    for (uint32_t item = work_id; item < num_items; item += kNumWorkers) {
      const uint32_t i = item / num_layers;
      if (locate(params, i, &host_pos, &device_pos)) {
        copy(shape, host_pos, device_pos, item - i * num_layers);
      }
    }
  }
}

template <int64_t kRowBytes, uint32_t kUnroll, uint32_t kBlockQuota, uint32_t kBlockSize>
struct ScaleRowKernel {
  static constexpr uint32_t kWorkersPerBlock = kBlockSize / device::copy_lanes_per_worker<kUnroll>();

  template <typename T, bool kToHost, bool kHostStarts, uint32_t kMaxPages>
  static void launch(const ScaleRowParams<kMaxPages>& params, DLDevice device) {
    const uint64_t num_items = uint64_t{params.num_rows} * params.shape.num_layers;
    host::RuntimeCheck(num_items < (uint64_t{1} << 32), "MXFP8 scale rows: too many rows for one launch");
    const uint64_t num_workers = params.shape.walk_layers ? params.num_rows : num_items;
    if (num_workers == 0) {
      return;
    }
    const auto num_blocks =
        static_cast<uint32_t>(std::min<uint64_t>(host::div_ceil(num_workers, uint64_t{kWorkersPerBlock}), kBlockQuota));
    host::LaunchKernel(num_blocks, kBlockSize, device)(
        scale_rows_all_layer<T, kRowBytes, kUnroll, kBlockQuota, kBlockSize, kToHost, kHostStarts, kMaxPages>, params);
  }

  // Host indices on the CPU: each page's first token in the launch parameters.
  template <uint32_t kMaxPages, typename T>
  static void launch_backup_from_page_starts(
      const ScaleRowShape& shape,
      const int64_t* host_tokens,
      const T* device_tokens,
      int64_t num_pages,
      int64_t page_size,
      DLDevice device) {
    ScaleRowParams<kMaxPages> params{.shape = shape};
    for (int64_t first = 0; first < num_pages; first += kMaxPages) {
      const auto pages = std::min<int64_t>(num_pages - first, kMaxPages);
      for (int64_t p = 0; p < pages; ++p) {
        params.host_page_starts[p] = host_tokens[(first + p) * page_size];
      }
      params.device_indices = device_tokens + first * page_size;
      params.num_rows = static_cast<uint32_t>(pages * shape.rows_per_page);
      launch<T, true, true>(params, device);
    }
  }

  // Shared checks of both directions; returns the shape of the launch.
  static ScaleRowShape check(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const int64_t host_stride,
      const int64_t device_stride,
      const int64_t row_tokens,
      const int64_t page_size,
      const bool walk_layers,
      const char* what) {
    using namespace host;
    auto L = SymbolicSize{"num_layers"};
    auto N = SymbolicSize{"indices length"};
    TensorMatcher({4, L}).with_dtype<uint64_t>().with_device<kDLGPU>().verify(tables);
    TensorMatcher({N}).with_dtype<int32_t, int64_t>().with_device<kDLGPU>().verify(device_indices);
    TensorMatcher({N}).with_dtype<int32_t, int64_t>().verify(host_indices);
    auto R = SymbolicSize{"refused words"};
    TensorMatcher({R}).with_dtype<int64_t>().with_device<kDLCPU, kDLCUDAHost>().verify(refused);
    RuntimeCheck(R.unwrap() == 2 || R.unwrap() == 0, what, ": `refused` holds two words (none: no checks)");
    RuntimeCheck(row_tokens > 0 && page_size > 0 && page_size % row_tokens == 0, what, ": chunks must tile a page");
    RuntimeCheck(
        N.unwrap() % page_size == 0,
        what,
        ": ",
        N.unwrap(),
        " token indices are not whole pages of ",
        page_size,
        " tokens");
    return ScaleRowShape{
        .tables = static_cast<const uint64_t*>(tables.data_ptr()),
        .host_stride = host_stride,
        .device_stride = device_stride,
        .refused = refused.numel() == 0 ? nullptr : static_cast<int64_t*>(refused.data_ptr()),
        .row_tokens = static_cast<uint32_t>(row_tokens),
        .rows_per_page = static_cast<uint32_t>(page_size / row_tokens),
        .page_size = static_cast<uint32_t>(page_size),
        .num_layers = static_cast<uint32_t>(L.unwrap()),
        .walk_layers = walk_layers,
    };
  }

  // Host indices on the GPU (every load; a backup without the staged write-back).
  template <bool kToHost>
  static void launch_from_gpu_indices(
      const ScaleRowShape& shape,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const char* what) {
    using namespace host;
    RuntimeCheck(
        host_indices.device().device_type == device_indices.device().device_type &&
            host_indices.device().device_id == device_indices.device().device_id &&
            host_indices.dtype() == device_indices.dtype(),
        what,
        ": host indices on the GPU must share the device indices' device and dtype");
    const auto params = ScaleRowParams<1>{
        .shape = shape,
        .host_indices = host_indices.data_ptr(),
        .device_indices = device_indices.data_ptr(),
        .num_rows = static_cast<uint32_t>(device_indices.shape()[0] / shape.row_tokens),
    };
    if (device_indices.dtype().bits == 32) {
      launch<int32_t, kToHost, false>(params, device_indices.device());
    } else {
      launch<int64_t, kToHost, false>(params, device_indices.device());
    }
  }

  // Device -> host, for the layers in `tables`. host_indices: whole host pages,
  // on the CPU (int64, each page one ascending run from a multiple of
  // page_size, as the host pool allocates them; checked here) or on the GPU.
  static void backup(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const int64_t host_stride,
      const int64_t device_stride,
      const int64_t row_tokens,
      const int64_t page_size,
      const bool walk_layers) {
    using namespace host;
    constexpr auto what = "MXFP8 scale backup";
    const auto shape = check(
        tables,
        refused,
        host_indices,
        device_indices,
        host_stride,
        device_stride,
        row_tokens,
        page_size,
        walk_layers,
        what);
    const auto host_device = host_indices.device().device_type;
    if (host_device != kDLCPU && host_device != kDLCUDAHost) {
      launch_from_gpu_indices<true>(shape, host_indices, device_indices, what);
      return;
    }
    RuntimeCheck(host_indices.dtype().bits == 64, what, ": host indices on the CPU must be int64");
    const auto host_tokens = static_cast<const int64_t*>(host_indices.data_ptr());
    const auto num_pages = device_indices.shape()[0] / page_size;
    // Every page is checked before the first launch, so a refused backup moves no scales.
    for (int64_t p = 0; p < num_pages; ++p) {
      const auto page_tokens = host_tokens + p * page_size;
      const auto start = page_tokens[0];
      RuntimeCheck(
          start >= 0 && start % page_size == 0 && page_tokens[page_size - 1] == start + page_size - 1,
          what,
          ": host page ",
          p,
          " is not one aligned run of ",
          page_size,
          " tokens (it starts at token ",
          start,
          ")");
    }
    const auto device = device_indices.device();
    const auto run = [&](const auto* device_tokens) {
      if (num_pages <= kFewPages) {
        launch_backup_from_page_starts<kFewPages>(shape, host_tokens, device_tokens, num_pages, page_size, device);
      } else {
        launch_backup_from_page_starts<kMaxPagesPerLaunch>(
            shape, host_tokens, device_tokens, num_pages, page_size, device);
      }
    };
    if (device_indices.dtype().bits == 32) {
      run(static_cast<const int32_t*>(device_indices.data_ptr()));
    } else {
      run(static_cast<const int64_t*>(device_indices.data_ptr()));
    }
  }

  // Host -> device, for the layers in `tables`. Both index tensors on the GPU.
  static void load(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const int64_t host_stride,
      const int64_t device_stride,
      const int64_t row_tokens,
      const int64_t page_size,
      const bool walk_layers) {
    constexpr auto what = "MXFP8 scale load";
    const auto shape = check(
        tables,
        refused,
        host_indices,
        device_indices,
        host_stride,
        device_stride,
        row_tokens,
        page_size,
        walk_layers,
        what);
    launch_from_gpu_indices<false>(shape, host_indices, device_indices, what);
  }
};

}  // namespace sglang_mxfp8_hicache
