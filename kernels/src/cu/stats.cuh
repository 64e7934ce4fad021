// stats.cuh: the caller's statistics, DeepEP's `cumulative_local_expert_recv_stats` and
// `*_wait_recv_cost_stats` (IoPtrs::recv_stats, IoPtrs::wait_stats). Neither changes an output;
// with the address zero (not passed) each costs one predicate.

// The receive's wait for source (or owner) `peer` started at `t0` (clock64) and ended now: its
// cycles added to the caller's `wait_stats[peer]` (int64 [R], SM clock cycles as DeepEP counts
// them). Atomic: two calls in flight on two streams may add to one tensor.
__device__ __forceinline__ void add_wait_cost(u64 wait_stats, int peer, long long t0) {
    if (wait_stats)
        atomicAdd((unsigned long long*)wait_stats + peer, (unsigned long long)(clock64() - t0));
}

// The last block out of a good dispatch: this call's row counts (`counts`, the group's copy of
// recv_count, int [L]) added to the caller's `recv_stats` (atomic, as above). A failed call adds
// nothing. The last block out sees every block's stores (last_block_out's acquire).
__device__ __noinline__ void add_recv_stats(int L, u64 recv_stats, u64 counts) {
    for (int l = threadIdx.x; l < L; l += NTHREADS) atomicAdd((int*)recv_stats + l, ((const int*)counts)[l]);
}
