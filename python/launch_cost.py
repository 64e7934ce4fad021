"""What a kernel launch costs the host by the size of its parameters, on this machine's GPU.

Our kernels take ``(KParams, IoTable)`` by value: 184 bytes of ``KParams`` and an ``IoTable`` of
``EP_MAX_LOCAL`` entries of 104 bytes (32 entries, 3328 bytes, in the builds a Buffer loads),
3512 bytes a launch, where a Buffer's rank (one rank per process) fills one entry. DeepEP's
launches pass a few hundred bytes. This measures the host time of one launch (what
``cudaLaunchKernel`` costs the calling thread, which the driver's ``cuLaunchKernel`` that
ep-kernels calls is under) for empty kernels whose parameters are that large, and smaller:

    python python/launch_cost.py [--launches 200] [--rounds 50]

Prints one line per layout: the parameter bytes and the median (p10, p90) nanoseconds a launch
held the host. Launches go onto torch's current stream behind a kernel that spins, in rounds of
``--launches`` (few enough that the launch queue never fills, so no launch waits for the GPU),
the stream synchronised between rounds; the first round is not counted. Needs a GPU, torch and
nvcc (``torch.utils.cpp_extension.load_inline`` builds the kernels; tens of seconds, cached).
"""

import argparse
import statistics

DECLARATION = r"""
#include <torch/extension.h>
#include <string>
#include <tuple>
#include <vector>
std::vector<std::tuple<std::string, int64_t, std::vector<double>>> measure(
    torch::Tensor sink, int64_t launches, int64_t rounds);
"""

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

template <int N> struct Blob { unsigned char b[N]; };
using KParams = Blob<184>;                   // sizeof(KParams) (kernels/src/runtime/layout.rs)
template <int E> struct IoTable { unsigned char b[E * 104]; };  // E entries of IoPtrs

// Empty kernels: they read one byte of each parameter so that the compiler keeps them.
template <int N> __global__ void one(Blob<N> p, int* sink) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && p.b[N - 1] == 1) *sink = 1;
}
template <int E> __global__ void two(KParams kp, IoTable<E> t, int* sink) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && kp.b[0] == 1 && t.b[E * 104 - 1] == 1) *sink = 1;
}
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Nanoseconds each of `launches` launches of `f` (its `args`) held this thread, `rounds` rounds
// behind a spinning kernel on the current stream, the first round dropped.
std::vector<double> time_launches(const void* f, void** args, int64_t launches, int64_t rounds) {
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<double> ns;
  for (int64_t r = 0; r < rounds + 1; r++) {
    TORCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "synchronize");
    spin<<<1, 1, 0, s>>>(200000000LL);  // ~0.1 s of cycles: the launches below never wait
    for (int64_t i = 0; i < launches; i++) {
      const auto t0 = std::chrono::steady_clock::now();
      const cudaError_t e = cudaLaunchKernel(f, dim3(132), dim3(512), args, 0, s);
      const auto t1 = std::chrono::steady_clock::now();
      TORCH_CHECK(e == cudaSuccess, "launch: ", cudaGetErrorString(e));
      if (r > 0) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
  }
  TORCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "synchronize");
  return ns;
}

template <int N> std::vector<double> one_param(torch::Tensor sink, int64_t launches,
                                               int64_t rounds) {
  Blob<N> p{};
  int* k = sink.data_ptr<int>();
  void* args[] = {&p, &k};
  return time_launches(reinterpret_cast<const void*>(&one<N>), args, launches, rounds);
}

template <int E> std::vector<double> two_params(torch::Tensor sink, int64_t launches,
                                                int64_t rounds) {
  KParams kp{};
  IoTable<E> t{};
  int* k = sink.data_ptr<int>();
  void* args[] = {&kp, &t, &k};
  return time_launches(reinterpret_cast<const void*>(&two<E>), args, launches, rounds);
}

// (layout, parameter bytes, ns per launch) for every layout measured.
std::vector<std::tuple<std::string, int64_t, std::vector<double>>> measure(
    torch::Tensor sink, int64_t launches, int64_t rounds) {
  std::vector<std::tuple<std::string, int64_t, std::vector<double>>> out;
  auto one_of = [&](auto tag, const char* name) {
    constexpr int N = decltype(tag)::value;
    out.emplace_back(name, N + 8, one_param<N>(sink, launches, rounds));
  };
  auto two_of = [&](auto tag, const char* name) {
    constexpr int E = decltype(tag)::value;
    out.emplace_back(name, 184 + E * 104 + 8, two_params<E>(sink, launches, rounds));
  };
  one_of(std::integral_constant<int, 8>{}, "one 8-byte parameter");
  one_of(std::integral_constant<int, 256>{}, "one 256-byte parameter");
  one_of(std::integral_constant<int, 1024>{}, "one 1024-byte parameter");
  one_of(std::integral_constant<int, 2048>{}, "one 2048-byte parameter");
  one_of(std::integral_constant<int, 4000>{}, "one 4000-byte parameter");
  two_of(std::integral_constant<int, 1>{}, "KParams + IoTable of 1 entry (a process-mode rank)");
  two_of(std::integral_constant<int, 32>{}, "KParams + IoTable of 32 entries (ours now)");
  return out;
}
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=200, help="launches per round")
    p.add_argument("--rounds", type=int, default=50, help="rounds counted")
    a = p.parse_args()
    import torch
    from torch.utils.cpp_extension import load_inline

    m = load_inline(name="ep_dispatch_launch_cost", cpp_sources=DECLARATION, cuda_sources=SOURCE,
                    functions=["measure"], extra_cuda_cflags=["-O2"], verbose=False)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host ns per launch, "
          f"{a.rounds} rounds of {a.launches} (grid 132 x 512, nothing else running)")
    for name, size, ns in m.measure(sink, a.launches, a.rounds):
        q = statistics.quantiles(ns, n=10)
        print(f"{name:52s} {size:5d} B  median {statistics.median(ns):7.0f} ns  "
              f"(p10 {q[0]:.0f}, p90 {q[-1]:.0f})")


if __name__ == "__main__":
    main()
