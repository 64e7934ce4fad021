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

// A failed rank's combine rows for its NCCL peers. They cross the network without a signal or a
// header (the host's exchange, enqueued before the failure was known, sends whatever is staged),
// so the staged rows are the poison themselves: bf16 NaN (0x7FFF) in every row the exchange can
// send a peer (T * min(K, L) from its staging region, capacity or exact sizes), which the peer's
// reduction turns into the failed combine's NaN outputs, never finite wrong values. (Its error
// reaches that peer's host only by its own bound: this rank makes no later exchange.) The
// rank's blocks share the stores.
__device__ __forceinline__ void poison_nccl_rows(const KParams& p, const RankPtrs& me, PeerSet gone, int bid) {
    if (p.stage == 2 || !any_nccl(p)) return;
    const u64 elems = (u64)p.T * (u64)(p.K < p.L ? p.K : p.L) * (u64)p.H;
    for (int s = 0; s < p.R; s++) {
        if (!via_nccl(p, s) || is_gone(gone, s)) continue;
        u16* rows = (u16*)me.snd_buf + (u64)s * p.T * p.K * p.H;
        for (u64 i = (u64)bid * NTHREADS + threadIdx.x; i < elems; i += (u64)p.blocks_per_rank * NTHREADS) rows[i] = (u16)0x7FFFu;
    }
}
