// batched.cu: per-destination batched dispatch and combine (docs/contract.md, "Per-destination batched").
//
// Dispatch, on source rank s, for every destination d:
//   every token bound for d is written once (deduplicated) into d's receive region for s, as
//   entry tokpos(t, d): an HDR_BYTES (80) header {src token, selection offset; from byte 16 per
//   slot its local expert on d or 0xFFFF; from byte 48 per slot its index within that expert's
//   rows from s} and the payload (bf16 row, or e4m3 row + scales). The region is contiguous
//   (entries 0..count), i.e. one put; when every block of s has finished its stores (block finish
//   counter), the last one stores the pair's one signal (tag << 24 | count, common.cuh) with release.
// On destination d, block per local expert l: for every source s in order, wait for the signal,
//   scan the batch's headers for l (block prefix sum: batch order = source token order), and copy
//   the matching payloads into rows begin(l, s) + i: the canonical layout.
// Combine, on owner d, for every source s: the rows of every local expert that came from s, in
//   the order of batch(s->d)'s selections, go as one contiguous block into s's receive area for d,
//   then one signal. On s: wait for every owner's signal and reduce each token's slots in k order.
// All ranks of one GPU run in the same launch (blocks_per_rank blocks each), so that they are
// resident together and may wait for one another.

// The kernels are C++ functions in a namespace, as DeepEP's are: profilers show them as
// `ep_batched::dispatch` and `ep_batched::combine`, the names DeepEP's test (tests/utils.py bench_kineto)
// and engines' traces look for. compile.rs loads them by their mangled symbols.
// Each operation's body (dispatch_stage, combine_stage) is a template over the stage: the whole
// call (stage 0), the send half (stage 1: the receive hook's send, NCCL's pack) and the receive
// half (stage 2: the hook's receive, NCCL's unpack). This file is compiled once per stage
// (EP_STAGE, a define the build prepends: Variant::stage in kernels/src/variant.rs), and each
// module's kernels hold only that stage's code, so a half runs a kernel the size of its own work.
// Every module names its kernels alike, so both halves keep the operation's one name, as
// DeepEP's kernels do (its test's profile matches each name to one line of the profiler's
// table); the host launches the module of kp.stage. Each body is a sequence of phases (its
// file's __device__ functions) between the start and the end every kernel shares (frame.cuh).
#ifndef EP_STAGE
#define EP_STAGE 0
#endif
// The receive half (stage 2) of a call whose send half ran before it: thread s < R makes its first
// acquire load of peer s's signal at the start, beside the epoch's, so that a signal already in
// costs no round trip after the prologue (wait_signal_pre). Each phase that takes it works this
// out again (the compiler folds it with the phase's own tests of the thread, given the same R).
// loom: gpu_protocol::preload_signals.
template <int STAGE>
__device__ __forceinline__ bool presig_of(const KParams& p, int R, int tid) {
    return STAGE == 2 && tid < R && !via_nccl(p, tid) && !SHRINK(p);
}
namespace ep_batched {
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) dispatch(KParams p, IoTable iot);
__global__ void __launch_bounds__(NTHREADS, EP_MIN_BLOCKS) combine(KParams p, IoTable iot);
}  // namespace ep_batched

