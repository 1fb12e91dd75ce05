// Block-scaled HiCache: the page chunks of one transfer, payload and scales, in
// one launch.
//
// A host page is one span of `host_stride` bytes. Each layer of a page has
// four parts (K payload, K scales, V payload, V scales); a part is moved as
// `heads` chunks of `bytes` (one, or one per KV head for a heads-major host
// page). Chunk h of part c of device page d starts at
//   device_base[layer][c] + d * device_page_stride[c] + h * device_head_stride[c]
// and is `bytes / row_bytes` rows of `row_bytes`, `device_row_stride` apart
// (one row when the device keeps the chunk contiguous). On the host it is
// contiguous, at host_base[layer][c] + p * host_stride + h * host_head_stride[c].
// A transfer names pages by their token indices (whole pages, each one aligned
// run); this kernel reads each page's first token index itself, so nothing is
// gathered or uploaded per transfer.
//
// Indices on the GPU are read by the kernel and checked there: a page that is
// not one aligned run is not moved, and its side and first token go to two
// pinned words the pool reads before its next transfer (reading them here would
// synchronise every transfer). Indices on the CPU (a staged backup's host side,
// both sides with --hicache-io-backend direct) are checked here, before the
// first launch, and passed by value in the launch parameters.

#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>

#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/utils.cuh>

#include <dlpack/dlpack.h>

#include <algorithm>
#include <cstdint>

namespace sglang_mxfp8_hicache {

using namespace sglang;

inline constexpr uint32_t kParts = 4;        // K payload, K scales, V payload, V scales
inline constexpr uint32_t kTableWidth = 8;   // per layer: device bases, then host bases
inline constexpr uint32_t kWarpLanes = 32;
// Pages per launch whose indices travel by value: 2 x 128 x 8 B of the 4 KiB of
// kernel parameters every CUDA version accepts.
inline constexpr uint32_t kMaxParamPages = 128;

template <uint32_t kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = uint32_t;
};
template <>
struct VecOf<2> {
  using type = uint16_t;
};
template <>
struct VecOf<1> {
  using type = uint8_t;
};

// The shape of one part's chunks (see the top of this file).
struct PartShape {
  int64_t device_page_stride;
  int64_t device_head_stride;
  int64_t device_row_stride;
  int64_t host_head_stride;
  uint32_t bytes;
  uint32_t row_bytes;
  uint32_t units;  // copy units per chunk
};

inline constexpr int64_t kPartFields = 6;  // bytes, row_bytes, then the four strides

// What every launch of one pool and direction shares.
struct ChunkShape {
  const uint64_t* __restrict__ tables;  // [num_layers][8]
  int64_t* __restrict__ refused;        // 2 pinned words: side (1 device, 2 host), first token
  int64_t host_stride;                  // bytes per host page
  PartShape parts[kParts];
  uint32_t units_per_head;  // of one layer: the units of its four parts
  uint32_t heads;           // chunks per part and layer
  uint32_t num_layers;
  uint32_t page_size;
};

template <uint32_t kMaxPages>
struct ChunkParams {
  ChunkShape shape;
  const void* __restrict__ host_indices;    // token indices on the GPU, or null
  const void* __restrict__ device_indices;  // token indices on the GPU, or null
  uint32_t num_pages;
  int64_t host_pages[kMaxPages];    // page numbers, when host_indices is null
  int64_t device_pages[kMaxPages];  // page numbers, when device_indices is null
};

// The page number of page `page` of a transfer from its GPU token indices, or
// -1 if they are not one aligned run. Checks the first, the last and one more
// token of the page, chosen by `probe`, so that a page's work items between
// them check most of its tokens.
template <typename T>
SGL_DEVICE int64_t gpu_page(const void* indices, uint32_t page, uint32_t probe, uint32_t page_size) {
  const T* tokens = static_cast<const T*>(indices) + static_cast<int64_t>(page) * page_size;
  const int64_t start = tokens[0];
  const int64_t last = tokens[page_size - 1];
  const uint32_t j = probe % page_size;
  const int64_t at_j = tokens[j];
  const bool aligned = start >= 0 && start % page_size == 0 && last == start + page_size - 1 && at_j == start + j;
  return aligned ? start / page_size : -1;
}

SGL_DEVICE void refuse_page(const ChunkShape& shape, int64_t side, int64_t first_token) {
  volatile int64_t* refused = shape.refused;
  refused[1] = first_token;
  refused[0] = side;
}

template <typename T, bool kHostByValue, bool kDeviceByValue, uint32_t kMaxPages>
SGL_DEVICE bool locate_page(
    const ChunkParams<kMaxPages>& params, uint32_t page, uint32_t probe, int64_t* host_page, int64_t* device_page) {
  const uint32_t page_size = params.shape.page_size;
  if constexpr (kDeviceByValue) {
    *device_page = params.device_pages[page];
  } else {
    *device_page = gpu_page<T>(params.device_indices, page, probe, page_size);
    if (*device_page < 0) {
      const T* tokens = static_cast<const T*>(params.device_indices) + static_cast<int64_t>(page) * page_size;
      refuse_page(params.shape, 1, tokens[0]);
      return false;
    }
  }
  if constexpr (kHostByValue) {
    *host_page = params.host_pages[page];
  } else {
    *host_page = gpu_page<T>(params.host_indices, page, probe, page_size);
    if (*host_page < 0) {
      const T* tokens = static_cast<const T*>(params.host_indices) + static_cast<int64_t>(page) * page_size;
      refuse_page(params.shape, 2, tokens[0]);
      return false;
    }
  }
  return true;
}

// One warp per work item: one unit (kWarpLanes * kVec * kUnroll bytes) of one
// part of one page and layer. Every load of a lane is issued before its stores.
template <
    typename T,
    uint32_t kVec,
    uint32_t kUnroll,
    uint32_t kBlockSize,
    bool kToHost,
    bool kHostByValue,
    bool kDeviceByValue,
    uint32_t kMaxPages>
__global__ __launch_bounds__(kBlockSize) void page_chunks_kernel(const __grid_constant__ ChunkParams<kMaxPages> params) {
  using Vec = typename VecOf<kVec>::type;
  constexpr uint32_t kUnitBytes = kWarpLanes * kVec * kUnroll;
  constexpr uint32_t kWarpsPerBlock = kBlockSize / kWarpLanes;
  const ChunkShape& shape = params.shape;
  const uint32_t lane = threadIdx.x % kWarpLanes;
  const uint32_t units_per_layer = shape.units_per_head * shape.heads;
  const uint64_t units_per_page = uint64_t{units_per_layer} * shape.num_layers;
  const uint64_t num_items = units_per_page * params.num_pages;
  const uint64_t num_warps = uint64_t{gridDim.x} * kWarpsPerBlock;
  for (uint64_t item = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpLanes; item < num_items;
       item += num_warps) {
    const auto page = static_cast<uint32_t>(item / units_per_page);
    const auto in_page = static_cast<uint32_t>(item - page * units_per_page);
    int64_t host_page, device_page;
    if (!locate_page<T, kHostByValue, kDeviceByValue, kMaxPages>(params, page, in_page, &host_page, &device_page)) {
      continue;
    }
    const uint32_t layer = in_page / units_per_layer;
    uint32_t unit = in_page - layer * units_per_layer;
    const uint32_t head = unit / shape.units_per_head;
    unit -= head * shape.units_per_head;
    uint32_t part = 0;
    while (unit >= shape.parts[part].units) {
      unit -= shape.parts[part].units;
      ++part;
    }
    const PartShape& ps = shape.parts[part];
    const uint64_t* table = shape.tables + static_cast<uint64_t>(layer) * kTableWidth;
    auto* device = reinterpret_cast<uint8_t*>(table[part]) + device_page * ps.device_page_stride +
                   head * ps.device_head_stride;
    auto* host = reinterpret_cast<uint8_t*>(table[kParts + part]) + host_page * shape.host_stride +
                 head * ps.host_head_stride;
    const uint32_t base = unit * kUnitBytes + lane * kVec;
    // A vector never straddles two device rows: kVec divides row_bytes.
    const auto device_at = [&](uint32_t offset) {
      const uint32_t row = offset / ps.row_bytes;
      return device + row * ps.device_row_stride + (offset - row * ps.row_bytes);
    };
    Vec values[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint32_t offset = base + k * kWarpLanes * kVec;
      if (offset < ps.bytes) {
        const uint8_t* src = kToHost ? device_at(offset) : host + offset;
        values[k] = *reinterpret_cast<const Vec*>(src);
      }
    }
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint32_t offset = base + k * kWarpLanes * kVec;
      if (offset < ps.bytes) {
        uint8_t* dst = kToHost ? host + offset : device_at(offset);
        *reinterpret_cast<Vec*>(dst) = values[k];
      }
    }
  }
}

template <uint32_t kVec, uint32_t kUnroll, uint32_t kBlockSize>
struct PageChunkKernel {
  static constexpr uint32_t kUnitBytes = kWarpLanes * kVec * kUnroll;
  static constexpr uint32_t kWarpsPerBlock = kBlockSize / kWarpLanes;

  template <typename T, bool kToHost, bool kHostByValue, bool kDeviceByValue, uint32_t kMaxPages>
  static void launch(const ChunkParams<kMaxPages>& params, int64_t max_blocks, cudaStream_t stream) {
    const uint64_t items =
        uint64_t{params.shape.units_per_head} * params.shape.heads * params.shape.num_layers * params.num_pages;
    if (items == 0) {
      return;
    }
    const auto blocks = static_cast<uint32_t>(
        std::min<uint64_t>(host::div_ceil(items, uint64_t{kWarpsPerBlock}), static_cast<uint64_t>(max_blocks)));
    host::LaunchKernel(blocks, kBlockSize, stream)(
        page_chunks_kernel<T, kVec, kUnroll, kBlockSize, kToHost, kHostByValue, kDeviceByValue, kMaxPages>, params);
  }

  // Page numbers of CPU token indices, each page checked to be one aligned run.
  static void cpu_pages(
      const tvm::ffi::TensorView indices, int64_t first, int64_t count, int64_t page_size, int64_t* out, const char* what) {
    using namespace host;
    RuntimeCheck(indices.dtype().bits == 64, what, ": token indices on the CPU must be int64");
    const auto* tokens = static_cast<const int64_t*>(indices.data_ptr());
    for (int64_t p = 0; p < count; ++p) {
      const auto* page = tokens + (first + p) * page_size;
      const int64_t start = page[0];
      RuntimeCheck(
          start >= 0 && start % page_size == 0 && page[page_size - 1] == start + page_size - 1,
          what,
          ": page ",
          first + p,
          " is not one aligned run of ",
          page_size,
          " tokens (it starts at token ",
          start,
          ")");
      out[p] = start / page_size;
    }
  }

  template <typename T, bool kToHost>
  static void dispatch(
      ChunkShape shape,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      int64_t num_pages,
      int64_t max_blocks,
      DLDevice gpu,
      const char* what) {
    const auto on_cpu = [](const tvm::ffi::TensorView t) {
      return t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost;
    };
    const bool host_cpu = on_cpu(host_indices);
    const bool device_cpu = on_cpu(device_indices);
    const cudaStream_t stream = host::LaunchKernel::resolve_device(gpu);
    const int64_t page_size = shape.page_size;
    if (!host_cpu && !device_cpu) {
      host::RuntimeCheck(
          host_indices.device().device_id == device_indices.device().device_id &&
              host_indices.dtype() == device_indices.dtype(),
          what,
          ": token indices on the GPU must share one device and dtype");
      ChunkParams<1> params{.shape = shape};
      params.host_indices = host_indices.data_ptr();
      params.device_indices = device_indices.data_ptr();
      params.num_pages = static_cast<uint32_t>(num_pages);
      launch<T, kToHost, false, false>(params, max_blocks, stream);
      return;
    }
    // Every CPU-side page is checked before the first launch: a refused
    // transfer moves nothing.
    const auto check_all = [&](const tvm::ffi::TensorView t) {
      int64_t scratch[kMaxParamPages];
      for (int64_t first = 0; first < num_pages; first += kMaxParamPages) {
        cpu_pages(t, first, std::min<int64_t>(num_pages - first, kMaxParamPages), page_size, scratch, what);
      }
    };
    if (host_cpu) check_all(host_indices);
    if (device_cpu) check_all(device_indices);
    ChunkParams<kMaxParamPages> params{.shape = shape};
    params.host_indices = host_cpu ? nullptr : host_indices.data_ptr();
    params.device_indices = device_cpu ? nullptr : device_indices.data_ptr();
    for (int64_t first = 0; first < num_pages; first += kMaxParamPages) {
      const int64_t count = std::min<int64_t>(num_pages - first, kMaxParamPages);
      params.num_pages = static_cast<uint32_t>(count);
      if (host_cpu) cpu_pages(host_indices, first, count, page_size, params.host_pages, what);
      if (device_cpu) cpu_pages(device_indices, first, count, page_size, params.device_pages, what);
      if (!host_cpu) {
        params.host_indices = static_cast<const T*>(host_indices.data_ptr()) + first * page_size;
      }
      if (!device_cpu) {
        params.device_indices = static_cast<const T*>(device_indices.data_ptr()) + first * page_size;
      }
      if (host_cpu && device_cpu) {
        launch<T, kToHost, true, true>(params, max_blocks, stream);
      } else if (host_cpu) {
        launch<T, kToHost, true, false>(params, max_blocks, stream);
      } else {
        launch<T, kToHost, false, true>(params, max_blocks, stream);
      }
    }
  }

  // The launch shape of one pool and direction. tables: [layers, 8] uint64 on
  // the GPU (device bases of K payload, K scales, V payload, V scales, then the
  // host bases of the same); refused: 2 pinned int64 words; parts: [4, 6]
  // int64 on the CPU, per part (bytes, row_bytes, device page, head and row
  // strides, host head stride) of its chunks, `heads` of them per part and layer.
  static ChunkShape make_shape(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView parts,
      const int64_t heads,
      const int64_t host_stride,
      const int64_t page_size,
      const int64_t max_blocks,
      const char* what) {
    using namespace host;
    auto L = SymbolicSize{"num_layers"};
    auto R = SymbolicSize{"refused words"};
    TensorMatcher({L, kTableWidth}).with_dtype<uint64_t>().with_device<kDLCUDA>().verify(tables);
    TensorMatcher({R}).with_dtype<int64_t>().with_device<kDLCPU, kDLCUDAHost>().verify(refused);
    TensorMatcher({kParts, kPartFields}).with_dtype<int64_t>().with_device<kDLCPU, kDLCUDAHost>().verify(parts);
    RuntimeCheck(R.unwrap() == 2, what, ": `refused` holds two words");
    RuntimeCheck(page_size > 0 && max_blocks > 0 && heads > 0, what, ": page_size, heads and max_blocks must be positive");
    ChunkShape shape{
        .tables = static_cast<const uint64_t*>(tables.data_ptr()),
        .refused = static_cast<int64_t*>(refused.data_ptr()),
        .host_stride = host_stride,
        .heads = static_cast<uint32_t>(heads),
        .num_layers = static_cast<uint32_t>(L.unwrap()),
        .page_size = static_cast<uint32_t>(page_size),
    };
    shape.units_per_head = 0;
    const auto* fields = static_cast<const int64_t*>(parts.data_ptr());
    for (uint32_t c = 0; c < kParts; ++c) {
      const int64_t* f = fields + c * kPartFields;
      const int64_t bytes = f[0], row_bytes = f[1];
      RuntimeCheck(
          bytes > 0 && row_bytes > 0 && bytes % row_bytes == 0 && row_bytes % kVec == 0 && bytes < (int64_t{1} << 31),
          what,
          ": part ",
          c,
          " is not whole rows of whole vectors (",
          bytes,
          " B in rows of ",
          row_bytes,
          " B)");
      shape.parts[c] = PartShape{
          .device_page_stride = f[2],
          .device_head_stride = f[3],
          .device_row_stride = f[4],
          .host_head_stride = f[5],
          .bytes = static_cast<uint32_t>(bytes),
          .row_bytes = static_cast<uint32_t>(row_bytes),
          .units = static_cast<uint32_t>(div_ceil(bytes, int64_t{kUnitBytes})),
      };
      shape.units_per_head += shape.parts[c].units;
    }
    return shape;
  }

  // Moves whole pages of the layers in `tables` (see make_shape) between host
  // pages and device pages. host_indices / device_indices: whole pages of
  // token indices, on the GPU (int32 or int64, one dtype) or on the CPU (int64).
  static void transfer(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const tvm::ffi::TensorView parts,
      const int64_t heads,
      const int64_t host_stride,
      const int64_t page_size,
      const bool to_host,
      const int64_t max_blocks) {
    using namespace host;
    const char* what = to_host ? "block-scaled HiCache backup" : "block-scaled HiCache load";
    auto N = SymbolicSize{"indices length"};
    TensorMatcher({N}).with_dtype<int32_t, int64_t>().verify(host_indices);
    TensorMatcher({N}).with_dtype<int32_t, int64_t>().verify(device_indices);
    RuntimeCheck(page_size > 0, what, ": page_size must be positive");
    RuntimeCheck(N.unwrap() % page_size == 0, what, ": ", N.unwrap(), " token indices are not whole pages of ", page_size);
    const ChunkShape shape = make_shape(tables, refused, parts, heads, host_stride, page_size, max_blocks, what);
    const int64_t num_pages = N.unwrap() / page_size;
    const bool int32_gpu_indices = device_indices.dtype().bits == 32 || host_indices.dtype().bits == 32;
    if (to_host) {
      int32_gpu_indices ? dispatch<int32_t, true>(shape, host_indices, device_indices, num_pages, max_blocks, tables.device(), what)
                        : dispatch<int64_t, true>(shape, host_indices, device_indices, num_pages, max_blocks, tables.device(), what);
    } else {
      int32_gpu_indices ? dispatch<int32_t, false>(shape, host_indices, device_indices, num_pages, max_blocks, tables.device(), what)
                        : dispatch<int64_t, false>(shape, host_indices, device_indices, num_pages, max_blocks, tables.device(), what);
    }
  }
};

}  // namespace sglang_mxfp8_hicache
