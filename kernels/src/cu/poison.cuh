// poison.cuh: what a rank whose group failed sends instead of a call (common.cuh, SIG_POISON).
// Compiled after shrink.cuh (the peer sets) and before fp8.cuh and the families.

// Every block of a failed rank's launch (s_fail: the error word was set when the block started)
// stores the poison of call `epoch` into each signal word this kernel kind owes a peer: peers on
// this rank's NVLink / peer-memory side only (an NCCL peer learns it from the header poison),
// none to a masked peer (it waits for nothing of ours). The send stages only (0, 1): a receive
// half sends nothing. The fault-injection hook (`fault_rank`) stays silent, as it does in a good
// call: it stands for a rank that is gone, not one that knows it failed. Blocks that saw the
// error store the same words with the same value; a block of the launch that did not (the error
// set while the launch ran) never completes the send count without them, so no valid signal of
// this call goes out either. loom model: gpu_protocol::poison::poison_signals.
__device__ __forceinline__ void poison_peers(const KParams& p, const RankPtrs* tab, int kind, int rank, PeerSet gone, u64 epoch) {
    if (p.stage == 2 || rank == p.fault_rank) return;
    const int nl = (kind == KIND_PE_DISPATCH || kind == KIND_PE_COMBINE) ? p.L : 1;
    const u64 w = signal_word(epoch, SIG_POISON);
    for (int i = threadIdx.x; i < p.R * nl; i += NTHREADS) {
        const int d = i / nl;
        if (!via_nccl(p, d) && !is_gone(gone, d)) st_release(p, signal_slot(p, tab, kind, rank, d, i % nl), w);
    }
}
