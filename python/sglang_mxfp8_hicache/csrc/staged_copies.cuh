// Block-scaled HiCache: page chunks through device staging and the copy engines.
//
// The SM-driven copy of page_chunks.cuh holds its thread blocks for as long as
// the host link takes to move a transfer's bytes, and every kernel the forward
// pass launches meanwhile waits for those SMs. Here the SMs only move bytes
// within device memory, at HBM speed, and the copy engines cross the link:
//
//   backup: gather the pages' chunks into a staging slot (page_chunks_kernel,
//           with the slot as its host side), then copy each staged page to its
//           host page on the copy lanes;
//   load:   copy each host page's pieces into a slot on the copy lanes, then
//           scatter the slot's chunks to their device pages.
//
// A ring of two slots lets the kernels of one slot overlap the copies of the
// other. Transfers fill a slot one after another, each from where the last
// one ended (staged pages of its own stride, rounded up), and move to the
// other slot when theirs is full: only entering a slot waits for its last
// use (a load's copies for the scatter kernels that read it, a backup's
// gather for the copies out of it), so the layer groups of a load that fit
// in a slot's free bytes wait for no scatter, which beside the forward pass
// waits for SMs. The slot's events, recorded after each chunk, cover its
// whole pass because the ring's calls are ordered on the caller's streams:
// a call from another stream than the last call's first waits for the end
// of that call. Pieces of a staged page are contiguous both in staging
// and in the host page (StagedLayout in page.py); pieces that join on both
// sides (consecutive host pages) move as one copy, and a chunk's copies are
// spread over `lanes` streams, so several copy engines share the small ones.
//
// Ordering: the kernels run on the caller's stream, the copies on the lanes,
// joined by events; a call returns with the caller's stream waiting for every
// copy it issued, so an event recorded on that stream after the call (the
// controller's completion and per-layer events) covers every byte moved. A
// load's copies start where the caller's stream stood at the load's
// begin_load: a load issued in layer groups (loads.py) calls it once, right
// after its first group by SM copies (layer 0, which so has the link to
// itself) or else before its first staged group, so no group's copies wait
// for the scatter kernels of the groups before it (which wait for SMs the
// forward pass holds); entering a slot still waits for the kernels that
// read it.
// Host token indices are on the CPU (their page starts give the copies'
// addresses) and are checked here before anything moves, as are device ones
// on the CPU; device token indices on the GPU are checked by the kernel, which
// moves no chunk of a malformed page: a load leaves that device page as it
// was, a backup writes whatever the slot held to its host page. Either way the
// pool's next transfer raises.

#pragma once

#include "page_chunks.cuh"

#include <cuda_runtime.h>

#include <mutex>
#include <type_traits>
#include <vector>

namespace sglang_mxfp8_hicache {

inline constexpr uint32_t kSlots = 2;
inline constexpr uint32_t kMaxLanes = 8;
inline constexpr int64_t kPieceFields = 3;  // host offset, staged offset, bytes

// The copy side of one staging ring, made once per ring and kept for the
// process: the lanes' streams, and per slot an event on each lane (its copies
// of the slot so far are done) and one on the caller's stream (the kernels
// that read or write the slot so far are done).
struct CopyLanes {
  uint32_t lanes = 0;
  uint32_t slot = 0;  // the slot being filled,
  int64_t fill = 0;   // and its bytes taken
  cudaStream_t streams[kMaxLanes] = {};
  cudaEvent_t copied[kSlots][kMaxLanes] = {};
  cudaEvent_t kernel_done[kSlots] = {};
  cudaEvent_t started = {};  // a load's start on the caller's stream (begin_load)
  cudaEvent_t last_call = {};  // the end of the ring's last call, on its stream
  cudaStream_t last_stream = nullptr;
  bool called = false;
  std::mutex mutex;
};

struct Copy {
  char* dst;
  const char* src;
  size_t bytes;
};

// One batch of copies on `stream`: cudaMemcpyBatchAsync where the runtime and
// the driver have it (CUDA 12.8), else one cudaMemcpyAsync each.
inline void issue_copies(const Copy* copies, size_t count, bool to_host, int device, cudaStream_t stream) {
  if (count == 0) return;
  const auto kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  static const bool batch_driver = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12080;
  }();
  static bool batch_ok = batch_driver;
  if (batch_ok) {
    thread_local std::vector<void*> dsts;
    thread_local std::vector<const void*> srcs;
    thread_local std::vector<size_t> sizes;
    dsts.resize(count);
    srcs.resize(count);
    sizes.resize(count);
    for (size_t i = 0; i < count; ++i) {
      dsts[i] = copies[i].dst;
      srcs[i] = copies[i].src;
      sizes[i] = copies[i].bytes;
    }
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attrs.srcLocHint.type = to_host ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
    attrs.srcLocHint.id = to_host ? device : 0;
    attrs.dstLocHint.type = to_host ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    attrs.dstLocHint.id = to_host ? 0 : device;
    size_t attrs_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err =
        cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), count, &attrs, &attrs_index, 1, stream);
#else
    size_t fail_index = 0;
    const cudaError_t err = cudaMemcpyBatchAsync(
        dsts.data(),
        const_cast<void**>(srcs.data()),
        sizes.data(),
        count,
        &attrs,
        &attrs_index,
        1,
        &fail_index,
        stream);
#endif
    if (err == cudaSuccess) return;
    host::RuntimeCheck(
        err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver,
        "block-scaled HiCache: cudaMemcpyBatchAsync failed: ",
        cudaGetErrorString(err));
    (void)cudaGetLastError();
    batch_ok = false;
  }
#endif
  for (size_t i = 0; i < count; ++i) {
    host::RuntimeDeviceCheck(cudaMemcpyAsync(copies[i].dst, copies[i].src, copies[i].bytes, kind, stream));
  }
}

// Staged pages of `stride` bytes that lie wholly in slot `slot`.
inline int64_t slot_pages(int64_t slot, int64_t slot_bytes, int64_t stride) {
  return (slot + 1) * slot_bytes / stride - (slot * slot_bytes + stride - 1) / stride;
}

template <uint32_t kVec, uint32_t kUnroll, uint32_t kBlockSize>
struct StagedPageChunks {
  using Kernel = PageChunkKernel<kVec, kUnroll, kBlockSize>;

  // Makes the copy side of a ring on the current device; its address goes to
  // handle[0] (a CPU int64 tensor), for every later transfer through the ring.
  static void create_lanes(const tvm::ffi::TensorView handle, const int64_t lanes) {
    using namespace host;
    TensorMatcher({1}).with_dtype<int64_t>().with_device<kDLCPU>().verify(handle);
    RuntimeCheck(lanes >= 1 && lanes <= kMaxLanes, "block-scaled HiCache: 1 to ", kMaxLanes, " copy lanes");
    auto* state = new CopyLanes();  // kept for the process, as the ring's staging is
    state->lanes = static_cast<uint32_t>(lanes);
    for (uint32_t j = 0; j < state->lanes; ++j) {
      RuntimeDeviceCheck(cudaStreamCreateWithFlags(&state->streams[j], cudaStreamNonBlocking));
      for (uint32_t s = 0; s < kSlots; ++s) {
        RuntimeDeviceCheck(cudaEventCreateWithFlags(&state->copied[s][j], cudaEventDisableTiming));
      }
    }
    for (uint32_t s = 0; s < kSlots; ++s) {
      RuntimeDeviceCheck(cudaEventCreateWithFlags(&state->kernel_done[s], cudaEventDisableTiming));
    }
    RuntimeDeviceCheck(cudaEventCreateWithFlags(&state->started, cudaEventDisableTiming));
    RuntimeDeviceCheck(cudaEventCreateWithFlags(&state->last_call, cudaEventDisableTiming));
    *static_cast<int64_t*>(handle.data_ptr()) = reinterpret_cast<int64_t>(state);
  }

  // A load begins: the lanes' later copies wait for the work the caller's
  // stream (on `on_device`'s GPU) holds now, such as the events it waits on.
  static void begin_load(const tvm::ffi::TensorView on_device, const int64_t lanes_handle) {
    host::RuntimeCheck(lanes_handle != 0, "block-scaled HiCache load: no staging ring");
    auto& state = *reinterpret_cast<CopyLanes*>(lanes_handle);
    std::lock_guard<std::mutex> lock(state.mutex);
    const cudaStream_t stream = host::LaunchKernel::resolve_device(on_device.device());
    host::RuntimeDeviceCheck(cudaEventRecord(state.started, stream));
    for (uint32_t j = 0; j < state.lanes; ++j) {
      host::RuntimeDeviceCheck(cudaStreamWaitEvent(state.streams[j], state.started, 0));
    }
  }

  // One chunk's copies, spread over the lanes by bytes: lane j takes bytes
  // [j * total / lanes, (j + 1) * total / lanes) of the chunk's copies in order,
  // cut where the share ends.
  static void spread(const std::vector<Copy>& copies, size_t total, CopyLanes& state, bool to_host, int device) {
    thread_local std::vector<Copy> share;
    size_t at = 0, offset = 0;  // the next copy, and how much of it is issued
    for (uint32_t j = 0; j < state.lanes; ++j) {
      const size_t end = (j + 1 == state.lanes) ? total : total / state.lanes * (j + 1);
      size_t done = total / state.lanes * j;
      share.clear();
      while (done < end && at < copies.size()) {
        const Copy& c = copies[at];
        const size_t take = std::min(c.bytes - offset, end - done);
        share.push_back(Copy{c.dst + offset, c.src + offset, take});
        done += take;
        offset += take;
        if (offset == c.bytes) {
          ++at;
          offset = 0;
        }
      }
      issue_copies(share.data(), share.size(), to_host, device, state.streams[j]);
    }
  }

  template <typename T, bool kToHost>
  static void run(
      const ChunkShape& shape,
      CopyLanes& state,
      const std::vector<int64_t>& host_pages,
      const std::vector<int64_t>& device_pages,
      const T* device_tokens,
      const int64_t* pieces,
      int64_t num_pieces,
      char* stage_base,
      int64_t stage_stride,
      int64_t slot_bytes,
      char* host_base,
      int64_t host_stride,
      int64_t max_blocks,
      DLDevice gpu) {
    const auto num_pages = static_cast<int64_t>(host_pages.size());
    const bool device_by_value = device_tokens == nullptr;
    const cudaStream_t stream = host::LaunchKernel::resolve_device(gpu);
    thread_local std::vector<Copy> copies;
    bool used[kSlots] = {};
    if (state.called && state.last_stream != stream) {
      host::RuntimeDeviceCheck(cudaStreamWaitEvent(stream, state.last_call, 0));
    }
    // Staged pages of this stride: the first at or after `fill` in the slot,
    // and the end of the slot.
    const auto first_page = [&] { return (state.slot * slot_bytes + state.fill + stage_stride - 1) / stage_stride; };
    const auto end_page = [&] { return (state.slot + 1) * slot_bytes / stage_stride; };
    for (int64_t first = 0; first < num_pages;) {
      if (first_page() >= end_page()) {
        state.slot = (state.slot + 1) % kSlots;
        state.fill = 0;
      }
      const uint32_t slot = state.slot;
      const bool entering = state.fill == 0;
      const int64_t staged_first = first_page();
      const int64_t count = std::min(num_pages - first, end_page() - staged_first);
      used[slot] = true;
      copies.clear();
      size_t total = 0;
      for (int64_t p = 0; p < count; ++p) {
        char* host_page = host_base + host_pages[first + p] * host_stride;
        char* staged_page = stage_base + (staged_first + p) * stage_stride;
        for (int64_t i = 0; i < num_pieces; ++i) {
          const int64_t* piece = pieces + i * kPieceFields;
          char* host_at = host_page + piece[0];
          char* staged_at = staged_page + piece[1];
          const auto bytes = static_cast<size_t>(piece[2]);
          char* dst = kToHost ? host_at : staged_at;
          const char* src = kToHost ? staged_at : host_at;
          if (!copies.empty() && copies.back().dst + copies.back().bytes == dst &&
              copies.back().src + copies.back().bytes == src) {
            copies.back().bytes += bytes;
          } else {
            copies.push_back(Copy{dst, src, bytes});
          }
          total += bytes;
        }
      }
      const auto launch_kernel = [&] {
        for (int64_t sub = 0; sub < count; sub += kMaxParamPages) {
          const int64_t n = std::min<int64_t>(count - sub, kMaxParamPages);
          ChunkParams<kMaxParamPages> params{.shape = shape};
          params.num_pages = static_cast<uint32_t>(n);
          params.host_indices = nullptr;
          for (int64_t p = 0; p < n; ++p) {
            params.host_pages[p] = staged_first + sub + p;
          }
          if (device_by_value) {
            params.device_indices = nullptr;
            for (int64_t p = 0; p < n; ++p) {
              params.device_pages[p] = device_pages[first + sub + p];
            }
            Kernel::template launch<T, kToHost, true, true>(params, max_blocks, stream);
          } else {
            params.device_indices = device_tokens + (first + sub) * shape.page_size;
            Kernel::template launch<T, kToHost, true, false>(params, max_blocks, stream);
          }
        }
      };
      if constexpr (kToHost) {
        // The slot is free once the lanes' copies out of its last use are done.
        for (uint32_t j = 0; entering && j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaStreamWaitEvent(stream, state.copied[slot][j], 0));
        }
        launch_kernel();
        host::RuntimeDeviceCheck(cudaEventRecord(state.kernel_done[slot], stream));
        for (uint32_t j = 0; j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaStreamWaitEvent(state.streams[j], state.kernel_done[slot], 0));
        }
        spread(copies, total, state, true, gpu.device_id);
        for (uint32_t j = 0; j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaEventRecord(state.copied[slot][j], state.streams[j]));
        }
      } else {
        // The slot is free once the kernels that read its last use are done.
        for (uint32_t j = 0; entering && j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaStreamWaitEvent(state.streams[j], state.kernel_done[slot], 0));
        }
        spread(copies, total, state, false, gpu.device_id);
        for (uint32_t j = 0; j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaEventRecord(state.copied[slot][j], state.streams[j]));
          host::RuntimeDeviceCheck(cudaStreamWaitEvent(stream, state.copied[slot][j], 0));
        }
        launch_kernel();
        host::RuntimeDeviceCheck(cudaEventRecord(state.kernel_done[slot], stream));
      }
      state.fill = (staged_first + count) * stage_stride - slot * slot_bytes;
      first += count;
    }
    if constexpr (kToHost) {
      for (uint32_t s = 0; s < kSlots; ++s) {
        if (!used[s]) continue;
        for (uint32_t j = 0; j < state.lanes; ++j) {
          host::RuntimeDeviceCheck(cudaStreamWaitEvent(stream, state.copied[s][j], 0));
        }
      }
    }
    host::RuntimeDeviceCheck(cudaEventRecord(state.last_call, stream));
    state.last_stream = stream;
    state.called = true;
  }

  // Moves whole pages of the layers in `tables` between host pages and device
  // pages through the staging ring of `lanes` (create_lanes); a load's copies
  // start after the lanes' last begin_load.
  // tables, refused, parts, heads: as PageChunkKernel::transfer, with the
  //   staged page 0 of the ring as the host side (its bases) and
  //   `stage_stride` as its page stride;
  // host_indices: CPU int64 token indices, whole pages (their page numbers
  //   times host_stride from host_base address the host pages);
  // device_indices: token indices on the GPU (int32 or int64) or the CPU (int64);
  // pieces: [n, 3] CPU int64, each (host offset, staged offset, bytes) of a
  //   page (StagedLayout); slot_bytes: each of the ring's two slots, from
  //   stage_base, holds at least one staged page (StagingRing.slot_pages).
  static void transfer(
      const tvm::ffi::TensorView tables,
      const tvm::ffi::TensorView refused,
      const tvm::ffi::TensorView host_indices,
      const tvm::ffi::TensorView device_indices,
      const tvm::ffi::TensorView parts,
      const int64_t heads,
      const int64_t page_size,
      const int64_t stage_base,
      const int64_t stage_stride,
      const int64_t slot_bytes,
      const tvm::ffi::TensorView pieces,
      const int64_t host_base,
      const int64_t host_stride,
      const int64_t lanes_handle,
      const bool to_host,
      const int64_t max_blocks) {
    using namespace host;
    const char* what = to_host ? "block-scaled HiCache backup" : "block-scaled HiCache load";
    auto N = SymbolicSize{"indices length"};
    auto P = SymbolicSize{"pieces"};
    TensorMatcher({N}).with_dtype<int64_t>().with_device<kDLCPU, kDLCUDAHost>().verify(host_indices);
    TensorMatcher({N}).with_dtype<int32_t, int64_t>().verify(device_indices);
    TensorMatcher({P, kPieceFields}).with_dtype<int64_t>().with_device<kDLCPU>().verify(pieces);
    RuntimeCheck(page_size > 0, what, ": page_size must be positive");
    RuntimeCheck(N.unwrap() % page_size == 0, what, ": ", N.unwrap(), " token indices are not whole pages of ", page_size);
    RuntimeCheck(
        stage_stride > 0 && slot_pages(0, slot_bytes, stage_stride) > 0 &&
            slot_pages(1, slot_bytes, stage_stride) > 0 && lanes_handle != 0,
        what,
        ": no staging ring");
    const ChunkShape shape = Kernel::make_shape(tables, refused, parts, heads, stage_stride, page_size, max_blocks, what);
    const int64_t num_pages = N.unwrap() / page_size;
    if (num_pages == 0) return;
    // Every CPU-side page is checked before anything moves.
    std::vector<int64_t> host_pages(num_pages), device_pages;
    Kernel::cpu_pages(host_indices, 0, num_pages, page_size, host_pages.data(), what);
    const auto device_type = device_indices.device().device_type;
    const bool device_cpu = device_type == kDLCPU || device_type == kDLCUDAHost;
    if (device_cpu) {
      device_pages.resize(num_pages);
      Kernel::cpu_pages(device_indices, 0, num_pages, page_size, device_pages.data(), what);
    }
    auto& state = *reinterpret_cast<CopyLanes*>(lanes_handle);
    std::lock_guard<std::mutex> lock(state.mutex);
    const auto* piece_fields = static_cast<const int64_t*>(pieces.data_ptr());
    auto* stage = reinterpret_cast<char*>(stage_base);
    auto* host_pool = reinterpret_cast<char*>(host_base);
    const auto go = [&](auto tag, auto to_host_tag) {
      using T = decltype(tag);
      constexpr bool kToHost = decltype(to_host_tag)::value;
      const T* tokens = device_cpu ? nullptr : static_cast<const T*>(device_indices.data_ptr());
      run<T, kToHost>(
          shape,
          state,
          host_pages,
          device_pages,
          tokens,
          piece_fields,
          P.unwrap(),
          stage,
          stage_stride,
          slot_bytes,
          host_pool,
          host_stride,
          max_blocks,
          tables.device());
    };
    const bool int32_tokens = !device_cpu && device_indices.dtype().bits == 32;
    if (to_host) {
      int32_tokens ? go(int32_t{}, std::true_type{}) : go(int64_t{}, std::true_type{});
    } else {
      int32_tokens ? go(int32_t{}, std::false_type{}) : go(int64_t{}, std::false_type{});
    }
  }
};

}  // namespace sglang_mxfp8_hicache
