// frame.cuh: the start and the end that the dispatch and combine kernels share (batched_*.cu,
// per_expert.cu): the block's view of its rank's call, the wait for the peers' acknowledgements
// of the previous call, and what the last block of a rank to leave does. Compiled after the
// other headers and before the families.

// The block's copy of its rank's call, in shared memory, one set per kernel kind (KIND: the
// kernel's KIND_*, a define of its .cu file; in the functions below their template parameter):
// written by thread 0 at the start (frame_start), read by every thread after the start's barrier
// (frame_open). Variables, not functions that return them, so that the compiler sees every use:
// a word no kernel reads is not kept, and one only ever stored as 0 is folded away.
template <int KIND>
static __shared__ IoPtrs s_io;  // the addresses of this call (resolve_io)
template <int KIND>
static __shared__ u64 s_epoch;  // this call's epoch: the kernel kind's calls completed, plus one
template <int KIND>
static __shared__ int s_n;  // the rank's token count
template <int KIND>
static __shared__ int s_bad;  // dispatch: the token count was bad (read_ntok)
template <int KIND>
static __shared__ int s_fail;  // the group failed before this block started, or the host refused the call

// One rank's call as one of its blocks sees it, passed to every phase of a kernel: the rank, the
// block, the addresses, the shared-memory carve-up, and (from frame_open) the epoch, the token
// count and the gone peers.
struct Call {
    const RankPtrs* tab;  // every rank's addresses (KParams::table)
    const RankPtrs& me;   // this rank's
    u32* state;           // this rank's counters and epochs (ST_*)
    const IoPtrs& io;     // s_io
    Smem sm;              // the dynamic shared memory (carve)
    int rank, bid;        // this rank, and this block among its blocks_per_rank
    u64 epoch;
    int n;
    PeerSet gone0;  // masked before this block started: not routed to, not waited for
    PeerSet gone;   // ... and the peers lost in this call so far (GONE_SNAPSHOT)
};
template <int KIND>
__device__ __forceinline__ Call call_of(const KParams& p) {
    extern __shared__ int smem_raw[];
    const RankPtrs* tab = (const RankPtrs*)p.table;
    const int rank = p.rank_base + blockIdx.x / p.blocks_per_rank;
    const int bid = blockIdx.x % p.blocks_per_rank;
    return Call{tab, tab[rank], (u32*)tab[rank].state, s_io<KIND>, carve(p, smem_raw), rank, bid, 0ull, 0, PeerSet(), PeerSet()};
}

// Where frame_start takes the rank's token count from.
#define NTOK_CALLER 0  // the call's input (a dispatch): `ntok`, checked by read_ntok
#define NTOK_HANDLE 1  // the dispatch's, kept in meta[0] (a combine)
#define NTOK_NONE 2    // nowhere: 0 (the batched receive half reads no routing)
// Thread 0's part of the start: whether the group failed already, the call's addresses, its
// epoch, the token count, the masked peers. The kernel's own early loads may go before or after
// it; frame_open's barrier ends both.
template <int KIND>
__device__ __forceinline__ void frame_start(const KParams& p, const IoTable& iot, const Call& c, int ntok) {
    if (threadIdx.x != 0) return;
    const RankPtrs& me = c.me;  // GONE_INIT's
    const int fail = p.refused || failed(p);  // the group failed before this block started: poison (poison.cuh)
    const IoPtrs io = resolve_io(iot.r[c.rank - p.rank_base], me);
    const u64 epoch = ld_epoch(c.state, KIND) + 1ull;
    // The 8-byte words first: the compiler lays the words out in the order it meets them.
    s_io<KIND> = io;
    s_epoch<KIND> = epoch;
    s_fail<KIND> = fail;
    if (ntok != NTOK_HANDLE) s_bad<KIND> = 0;
    s_n<KIND> = ntok == NTOK_CALLER ? read_ntok(p, io, c.rank, &s_bad<KIND>) : ntok == NTOK_HANDLE ? ((const int*)me.meta)[0] : 0;
    GONE_INIT();
}
// Every thread, after the start: the start's barrier, then the call's epoch, token count and
// gone peers (the masked ones) from shared memory. Profile stamp p0.
template <int KIND>
__device__ __forceinline__ void frame_open(const KParams& p, Call& c) {
    __syncthreads();
    c.epoch = s_epoch<KIND>;
    c.n = s_n<KIND>;
    c.gone0 = GONE0();
    c.gone = c.gone0;
    PROF(0);
}

// The waiter of peer d's acknowledgement of the previous call (wait_acks): thread `first` + d,
// for a peer on this rank's NVLink side (an NCCL peer needs none: the stream orders the previous
// call's unpack before this call's transfers), in the stages that send (0 and 1). With
// `preload` its first acquire load of the word is made here, so that its latency overlaps the
// rest of the start. loom: gpu_protocol::preload_acks, model batched_consecutive_calls.
struct AckWaiter {
    int peer;
    bool waits;
    u64 v0;  // the first load (0: none made)
};
template <int KIND>
__device__ __forceinline__ AckWaiter ack_waiter(const KParams& p, const Call& c, int stage, int first, bool preload) {
    AckWaiter a;
    a.peer = (int)threadIdx.x - first;
    a.waits = a.peer >= 0 && a.peer < p.R && stage != 2 && !via_nccl(p, a.peer);
    a.v0 = 0;
    if (preload && a.waits) a.v0 = ld_acquire(p, ack_words(c.me, p.R, KIND) + a.peer);
    return a;
}
// The previous call's data must have been consumed by every peer before this call overwrites its
// buffers: the waiter waits until peer d's acknowledgement word holds the previous epoch (none
// where its first load showed it already). In shrink mode a masked peer is not waited for, and
// one whose wait runs out is lost now (agreed by every block). Returns this thread's verdict
// (nonzero: the wait failed, reported); the caller reduces it over the block.
// loom: gpu_protocol::sender_wait_acks, models batched_consecutive_calls, per_expert_consecutive_calls.
template <int KIND>
__device__ __forceinline__ int wait_acks(const KParams& p, const Call& c, int phase, const AckWaiter& a) {
    const RankPtrs& me = c.me;
    const int d = a.peer;
    u64* word = ack_words(me, p.R, KIND) + d;
    int bad = 0;
    if (a.waits && SHRINK(p)) {
        // loom: gpu_protocol::wait_peer_ack (agreement), models shrink_*.
        if (!is_gone(c.gone0, d)) {
            const int r = wait_peer_ack(peer_wait(p, me, KIND, DEC_ACK, c.rank, d, phase), word, c.epoch - 1ull, c.epoch);
            if (r == PEER_LOST) GONE_ADD(d);
            else bad = !r;
        }
    } else if (a.waits && a.v0 < c.epoch - 1ull)
        bad = !wait_ack(p, word, c.epoch - 1ull, c.epoch, c.rank, d, phase);
    return bad;
}

// The exit count of a kernel's end (frame_end): every block counts itself out (count_in), and
// the last of its rank's blocks to leave publishes the acknowledgements and the epoch, then
// resets the counter. Every block also brings into the exit counter whether it saw the group
// failed (`fail_start`: s_fail, the error word at its start; or the error word at its end,
// loaded by thread 0 before its count-in, so that the load overlaps the drain of the block's
// stores that the count-in's release waits for): bit 16 and up count
// those blocks, so the last block out knows whether any block of this rank saw the call fail
// (*call_failed) without loading the error word once more after the count. An error recorded
// after every block of the rank had checked did not stop this rank's call: its outputs are whole.
// loom model: gpu_protocol::last_block_out; covered by loom_gpu_protocol.rs
// batched_one_sender_two_receivers (mutants gpu_exit_release, gpu_exit_acquire).
#define EXIT_FAILED (1u << 16)
__device__ __forceinline__ bool last_block_out(const KParams& p, u32* state, int kind, bool fail_start, bool* call_failed) {
    __shared__ int s_last, s_failed;
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool f = fail_start || failed(p);
        const u32 old = count_in(p, state + ST_EXIT + kind, f ? 1u + EXIT_FAILED : 1u);
        s_last = ((old & (EXIT_FAILED - 1u)) == (u32)p.blocks_per_rank - 1u);
        s_failed = f || old >= EXIT_FAILED;
    }
    __syncthreads();
    *call_failed = s_failed != 0;
    return s_last != 0;
}

// The outputs of a call that failed (docs/contract.md, "A failed call"), written by the last
// block of a rank to leave when a block of the rank saw the device's error word set (an error of
// this rank, or of another whose failure stopped this rank's waits: last_block_out): nothing of an earlier call passes for this
// call's. Dispatch: every count and (begin, count) pair 0, so no row is presented as received.
// Combine: every element of the n output rows NaN (bf16 0x7FFF), which no weighted sum of the
// contract produces from finite inputs without being flagged by any check the caller makes.
// Out of line with scalar arguments (cold; see report_error_at).
__device__ __noinline__ void fail_dispatch_at(int L, int R, u64 io_count, u64 io_layout, u64 my_count, u64 my_layout) {
    for (int i = threadIdx.x; i < L; i += NTHREADS) {
        ((int*)io_count)[i] = 0;
        ((int*)my_count)[i] = 0;
    }
    for (int i = threadIdx.x; i < L * R * 2; i += NTHREADS) {
        ((int*)io_layout)[i] = 0;
        ((int*)my_layout)[i] = 0;
    }
}
__device__ __noinline__ void fail_combine_at(u64 out, u64 elems) {
    for (u64 i = threadIdx.x; i < elems; i += NTHREADS) ((u16*)out)[i] = (u16)0x7FFFu;
}
__device__ __forceinline__ void fail_dispatch_outputs(const KParams& p, const IoPtrs& io, const RankPtrs& me) {
    fail_dispatch_at(p.L, p.R, io.recv_count, io.layout, me.recv_count, me.layout);
}
__device__ __forceinline__ void fail_combine_outputs(const KParams& p, const IoPtrs& io, int n) {
    fail_combine_at(io.out, (u64)n * (u64)p.H);
}

// The end of every kernel but a send half's (stage 1, which leaves all of it to its receive
// half: no exit count), in every block: the exit count (last_block_out); then in the last
// block of the rank to leave: a failed call's defined outputs (above), or a good dispatch's
// recv_stats; this call's epoch; and the acknowledgement to every peer on this rank's NVLink side
// (none to a masked peer; NCCL peers need none: the stream orders this call's unpack before the
// next call's transfers into the same buffers). Profile stamps p4 and p5, and in the batched
// kernels the last block out's p13 (the failure check done) and p12 (epoch and acks stored).
template <int KIND>
__device__ __forceinline__ void frame_end(const KParams& p, const Call& c, int stage) {
    const RankPtrs& me = c.me;  // MASKED_AT_END's and END_MASKED's
    const bool dispatch = KIND == KIND_BAT_DISPATCH || KIND == KIND_PE_DISPATCH;
    const bool batched = KIND == KIND_BAT_DISPATCH || KIND == KIND_BAT_COMBINE;
    PROF(4);
    // The send half publishes nothing at its end (its receive half does): no exit count.
    if (stage == 1) return;
    bool call_failed;
    const bool last_out = last_block_out(p, c.state, KIND, s_fail<KIND>, &call_failed);
    PROF(5);
    if (last_out && call_failed) {
        if (dispatch) fail_dispatch_outputs(p, c.io, me);
        else fail_combine_outputs(p, c.io, c.n);
    } else if (dispatch && last_out && c.io.recv_stats)
        add_recv_stats(p.L, c.io.recv_stats, me.recv_count);
    if (batched && last_out) PROF(13);
    if (last_out && threadIdx.x == 0) {
        MASKED_AT_END();  // shrink: no ack to a masked peer
        for (int s = 0; s < p.R; s++)
            // loom: gpu_protocol::finish (the ack), models batched_consecutive_calls, batched_one_sender_two_receivers,
            // per_expert_consecutive_calls; shrink_* (no ack to a masked peer). The combines' acks are the same code.
            if (!via_nccl(p, s) && !END_MASKED(s)) st_release(p, ack_words(c.tab[s], p.R, KIND) + c.rank, c.epoch);
        // Read by this rank's next launch of the kind only, which starts after this one ends
        // (stream order): stored after the acks, so that their release does not wait for it.
        ((u64*)c.state)[ST_EPOCH64 + KIND] = c.epoch;
    }
    // The exit counter's reset, for the next launch of the kind (stream order, as the epoch).
    if (last_out && threadIdx.x == 0) c.state[ST_EXIT + KIND] = 0u;
    if (batched && last_out) PROF(12);
}
