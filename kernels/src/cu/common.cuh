// common.cuh: types, the rank-address table, memory-ordering primitives, bounded waits, bf16.
// Prepended to every module's source by the Rust side (NVRTC sees one translation unit).
// Compiled with --fmad=false: no multiply-add is contracted unless written as fmaf.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define NTHREADS 512
#define NWARPS (NTHREADS / 32)

// Build variants (`Variant` in kernels/src/variant.rs): the host prepends these defines to
// the source for groups past 32 ranks; a group of at most 32 ranks compiles this file as it is.
//   EP_MASK_WORDS: u32 words of a set of peers (the call's masked peers, the NCCL peers): 1 for
//     R <= 32 (one word in a register), MAX_RANKS / 32 past that (shared-memory words).
//   EP_MAX_LOCAL: entries of the IoTable (ranks of one launch): 32; 1 where a GPU runs one rank
//     (one rank per process: 288 parameter bytes a launch, not 3512); MAX_RANKS past 32 ranks on
//     one GPU (a kernel parameter of 22.5 KB: CUDA 12.1+ takes up to 32764 bytes).
//   EP_MIN_BLOCKS: __launch_bounds__' minimum blocks per SM: 2 when a GPU runs more ranks than it
//     has SMs (every block of a launch must be resident at once), else 1.
#ifndef EP_MASK_WORDS
#define EP_MASK_WORDS 1
#endif
#ifndef EP_MAX_LOCAL
#define EP_MAX_LOCAL 32
#endif
#ifndef EP_MIN_BLOCKS
#define EP_MIN_BLOCKS 1
#endif
// The kernels' rank limit (MAX_RANKS in kernels/src/variant.rs) and the words of the NCCL
// peer mask in KParams (always MAX_RANKS bits: one KParams layout for every variant).
#define MAX_RANKS 256
#define NCCL_WORDS (MAX_RANKS / 32)
// The wide build (R > 32): peer sets in shared memory, per-slot batch positions (a T x R table
// does not fit shared memory at R = 256), destinations found from the K slots.
#define WIDE (EP_MASK_WORDS > 1)
#define HDR_BYTES 80
#define MAX_K 16
#define NO_LOCAL 0xFFFFu

// Phases reported in the error word (match `decode` in kernels/src/runtime/error_word.rs).
#define PH_DISPATCH_SEND 0
#define PH_DISPATCH_RECV 1
#define PH_COMBINE_SEND 2
#define PH_COMBINE_RECV 3

// Layout of the state words of one rank (128 bytes): u32 counters, then u64 epochs.
#define ST_EPOCH64 8    // [kind], in u64 words: calls completed, one per kernel kind (4 kinds)
#define ST_EXIT 4       // [kind]: blocks that left the current call
#define ST_SENT 8       // [kind]: blocks that finished sending in the current call
#define NUM_KINDS 4
#define KIND_BAT_DISPATCH 0
#define KIND_PE_DISPATCH 1
#define KIND_BAT_COMBINE 2
#define KIND_PE_COMBINE 3

// Every device address of one rank. The table (one entry per rank) lives on every GPU; the
// addresses are valid there through peer access (or are local).
struct RankPtrs {
    u64 x;           // bf16 [T*H]
    u64 topk;        // i64 [T*K]
    u64 weights;     // f32 [T*K]
    u64 y;           // bf16 [L*RT*H]
    u64 meta;        // int [4]: [0] = n tokens
    u64 recv_x;      // L*RT rows of xrow bytes
    u64 recv_scales; // L*RT rows of spr*4 bytes
    u64 recv_count;  // int [L]
    u64 layout;      // int [L*R*2] (begin, count)
    u64 src_info;    // int [L*RT]
    u64 out;         // bf16 [T*H]
    u64 row_tk;      // int [L*RT]: t*K+k of each received row (per-expert combine)
    u64 comb_map;    // int [R*T*K]: batch(d->s) position -> y row l*RT+row (batched combine, on d)
    u64 comb_pos;    // int [T*K]: position of (t,k) in batch(owner->me) (batched combine, on s)
    u64 comb_cnt;    // int [R]: selections received from s (rows to send back to s)
    u64 bat_buf;     // R*T entries of entry_bytes (batched dispatch, receive side)
    u64 bat_meta;    // int [R*2]: (tokens, selections) of batch(s->me)
    u64 pe_buf;      // L*R*T entries of pe_entry_bytes (per-expert dispatch, receive side)
    u64 cmb_buf;     // combine, receive side: T*K rows of cmb_row bytes at t*K+k; with NCCL
                     // then R*T*K more of 2H (NCCL rows: batched at T*K + d*T*K + pos, per-expert from T*K)
    u64 sig;         // u64 signal words, see SIG_* below
    u64 state;       // u32 counters and u64 epochs (ST_*)
    u64 bat_cnt;     // int [R*L]: rows of local expert l from source s (batched dispatch, on d)
    // NCCL transport (peers in p.nccl_mask): staging of what goes out, and the received headers.
    u64 snd_buf;     // dispatch: R*T entries (region d = batch me->d); combine: R*T*K rows of 2H
    u64 snd_hdr;     // int [R*(2+L)]: per destination d: tokens, selections, rows per local expert
    u64 rcv_hdr;     // int [R*(2+L)]: the same, received from each source s
    u64 shrink;      // shrink mode: u64 decisions [2*NUM_KINDS][R], then the rank mask int [R]
};

// Offsets (in u64 words) of the signal arrays inside `sig`, given R, L, E.
__device__ __forceinline__ u64* sig_bat(const RankPtrs& p) { return (u64*)p.sig; }               // [R] from s
__device__ __forceinline__ u64* sig_bat_ack(const RankPtrs& p, int R) { return (u64*)p.sig + R; } // [R] from d
__device__ __forceinline__ u64* sig_cb(const RankPtrs& p, int R) { return (u64*)p.sig + 2 * R; }  // [R] from d
__device__ __forceinline__ u64* sig_cb_ack(const RankPtrs& p, int R) { return (u64*)p.sig + 3 * R; }
__device__ __forceinline__ u64* sig_pe_ack(const RankPtrs& p, int R) { return (u64*)p.sig + 4 * R; }
__device__ __forceinline__ u64* sig_pc_ack(const RankPtrs& p, int R) { return (u64*)p.sig + 5 * R; }
__device__ __forceinline__ u64* sig_pe(const RankPtrs& p, int R) { return (u64*)p.sig + 6 * R; }  // [L*R] (l, s)
__device__ __forceinline__ u64* sig_pc(const RankPtrs& p, int R, int L) {                       // [E] expert e
    return (u64*)p.sig + 6 * R + (u64)L * R;
}

// A rank's caller-supplied tensors (the device API): each nonzero address replaces the group's own
// buffer of that name for this call (`IoPtrs` in kernels/src/runtime/layout.rs). `ntok`: an int
// holding the rank's token count (else meta[0]). Passed by value as the kernels' second
// parameter (one entry per rank of this launch), read once per block into shared memory.
// `recv_stats` (int [L]) and `wait_stats` (long long [R]) are the caller's statistics, added to
// when nonzero and never replaced by a buffer of the group's (stats.cuh).
#define MAX_LOCAL EP_MAX_LOCAL
struct IoPtrs {
    u64 x, topk, weights, y, out, recv_x, recv_scales, recv_count, layout, src_info, ntok;
    u64 recv_stats, wait_stats;
};
struct IoTable {
    IoPtrs r[MAX_LOCAL];
};
// The addresses this rank uses in this call: the caller's where given, else the group's own.
__device__ __forceinline__ IoPtrs resolve_io(IoPtrs o, const RankPtrs& me) {
    if (!o.x) o.x = me.x;
    if (!o.topk) o.topk = me.topk;
    if (!o.weights) o.weights = me.weights;
    if (!o.y) o.y = me.y;
    if (!o.out) o.out = me.out;
    if (!o.recv_x) o.recv_x = me.recv_x;
    if (!o.recv_scales) o.recv_scales = me.recv_scales;
    if (!o.recv_count) o.recv_count = me.recv_count;
    if (!o.layout) o.layout = me.layout;
    if (!o.src_info) o.src_info = me.src_info;
    if (!o.ntok) o.ntok = me.meta;
    return o;
}

// Kernel parameters, passed by value (matches `KParams` in kernels/src/runtime/layout.rs).
struct KParams {
    u64 table;        // const RankPtrs* on this GPU
    u64 err;          // u32[8] error word on this GPU
    u64 timeout_ns;
    int R, E, L, T, H, K;
    int fp8, round_scale, ue8m0;
    int rank_base, ranks_here, blocks_per_rank;
    int xrow, spr;           // bytes of a received x row; scale words per row
    int entry_bytes;         // batched entry: header + payload, 16-aligned
    int pe_entry_bytes;      // per-expert entry: header + payload, 16-aligned
    int fault_rank;          // test hook: this rank never signals, dispatch or combine (-1: none)
    int sys_scope;           // 1: ranks on several GPUs (system-scope ordering), 0: one GPU
    int zero_copy;           // 1: combine reads the rows of owners on this GPU in place
    int pad1;
    u64 prof;                // 0, or u64[grid * 8]: %globaltimer stamps per block and phase
    u32 nccl_mask[NCCL_WORDS];  // bit d of word d/32: peer d is reached through NCCL (staging + host send/recv)
    int stage;               // 0: whole call; 1: send side only (pack); 2: receive side only (unpack)
    int pad2;
    u64 err_host;            // u32[8] in mapped pinned host memory: the error word's host mirror
    int trap;                // 1: trap after recording an error (DeepEP's crash), 0: exit cleanly
    int shrink;              // 1: shrink mode: a peer whose wait runs out is masked, not an error
    int scol;                // recv_scales: 0 row-major [L, RT, spr]; 1 DeepEP's column-major
                             // last two dims (word strides RT*spr, 1, RT)
    int refused;             // 1: a call the host refused (its group failed): poison only (poison.cuh)
    int logfmt;              // combine: 1: rows travel in LogFMT-10 (logfmt.cuh), 0: bf16
    int cmb_row;             // combine: cmb_buf's row stride, 2H; with logfmt a raw LogFMT row, G*260
};

// Where row r of local expert l (row l * RT + r of the rank's RT-row blocks) of recv_scales
// keeps its words: word w at p[w * step].
struct ScaleRow {
    u32* p;
    u64 step;
};
__device__ __forceinline__ ScaleRow scale_row(const KParams& p, void* scales, u64 l, u64 r) {
    const u64 RT = (u64)p.R * (u64)p.T;
    if (!p.scol) return {(u32*)scales + (l * RT + r) * (u64)p.spr, 1};
    return {(u32*)scales + l * RT * (u64)p.spr + r, RT};
}
// The same for row `row` = l * RT + r (l found by a division: where the caller has no l).
__device__ __forceinline__ ScaleRow scale_row(const KParams& p, void* scales, u64 row) {
    if (!p.scol) return {(u32*)scales + row * (u64)p.spr, 1};
    const u64 RT = (u64)p.R * (u64)p.T;
    const u64 l = row / RT;
    return {(u32*)scales + l * RT * (u64)p.spr + (row - l * RT), RT};
}
// n / d for n >= 0, d >= 1, from rcp = 1.0f / d (computed once): the float quotient, corrected
// to the exact one (the float is off by at most one while n / d < 2^23; the loops keep it exact
// past that).
__device__ __forceinline__ int div_rcp(int n, int d, float rcp) {
    int q = __float2int_rz((float)n * rcp);
    while (q > 0 && q * d > n) q--;
    while ((q + 1) * d <= n) q++;
    return q;
}

// The plain build (EP_PLAIN, kernels/src/variant.rs): no peer is reached through NCCL and shrink mode
// is off, so their code is compiled out; the host launches it only for such a group.
#ifndef EP_PLAIN
#define EP_PLAIN 0
#endif
#if EP_PLAIN
#define SHRINK(p) false
#else
#define SHRINK(p) ((p).shrink != 0)
#endif
// Is peer d reached through NCCL (its data goes through this rank's staging buffers)?
__device__ __forceinline__ bool via_nccl(const KParams& p, int d) {
#if EP_PLAIN
    return false;
#elif WIDE
    return ((p.nccl_mask[d >> 5] >> (d & 31)) & 1u) != 0u;
#else
    return ((p.nccl_mask[0] >> d) & 1u) != 0u;
#endif
}
// Is any peer reached through NCCL?
__device__ __forceinline__ bool any_nccl(const KParams& p) {
#if EP_PLAIN
    return false;
#elif WIDE
    u32 a = 0u;
#pragma unroll
    for (int i = 0; i < NCCL_WORDS; i++) a |= p.nccl_mask[i];
    return a != 0u;
#else
    return p.nccl_mask[0] != 0u;
#endif
}
#define HDR_WORDS(L) (2 + (L))

// The phase profile (kernels/src/runtime/profile.rs PROF_SLOTS): thread 0 of every block stamps
// %globaltimer into slot i (< PROF_SLOTS) of its block's row. Slots 0..8 are the coarse phases
// each kernel documents; 8.. the finer ones of the batched kernels (profile.rs says which).
#define PROF_SLOTS 16
#define PROF(i) \
    if (p.prof && threadIdx.x == 0) ((u64*)p.prof)[blockIdx.x * PROF_SLOTS + (i)] = globaltimer();

// ---------------------------------------------------------------- memory ordering
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Signals and fences at the narrowest scope that covers every rank: the GPU when all ranks share
// one device, the system when peers sit on other GPUs (NVLink peer memory).
__device__ __forceinline__ u64 ld_acquire(const KParams& p, const u64* a) {
    return p.sys_scope ? ld_acquire_sys(a) : ld_acquire_gpu(a);
}
__device__ __forceinline__ void st_release(const KParams& p, u64* a, u64 v) {
    if (p.sys_scope) st_release_sys(a, v);
    else st_release_gpu(a, v);
}
// Release fence of one thread after a __syncthreads: by cumulativity it orders every store the
// block made before the barrier ahead of this thread's later signal or counter update.
// loom model: verify/src/gpu_protocol/orderings.rs mirrors every fence_rel (fence(AcqRel)); the
// mutants gpu_counter_release/_acquire and gpu_exit_release/_acquire drop one half of one of them.
__device__ __forceinline__ void fence_rel(const KParams& p) {
    if (p.sys_scope) asm volatile("fence.acq_rel.sys;" ::: "memory");
    else asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// A block's count-in on one of its rank's counters (ST_SENT, ST_EXIT): thread 0's atomic add,
// after a __syncthreads, with release and acquire semantics at the fence's scope. The release
// half publishes every store and read the block made before the barrier (cumulativity, as
// fence_rel) to the block whose add completes the count; the acquire half gives that block the
// earlier blocks' (their adds are read-modify-writes of one release sequence). One round trip
// where a fence_rel, the add and a second fence_rel took three.
// loom model: verify/src/gpu_protocol/orderings.rs SENT_ADD and EXIT_ADD (fetch_add(AcqRel));
// the mutants gpu_counter_release/_acquire and gpu_exit_release/_acquire drop one half.
__device__ __forceinline__ u32 count_in(const KParams& p, u32* word, u32 add) {
    u32 old;
    if (p.sys_scope) asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(word), "r"(add) : "memory");
    else asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(word), "r"(add) : "memory");
    return old;
}
__device__ __forceinline__ u32 ld_volatile_u32(const u32* p) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------- errors and bounded waits
// err[0]: the error code (0 = ok, ERR_*); the words after it by code (decoded in
// kernels/src/runtime/error_word.rs):
//   ERR_TIMEOUT:      [1] waiting rank, [2] peer, [3] phase, [4] call (low), [5] waited us, [6] call (high)
//   ERR_EXPERT_RANGE: [1] rank, [2] token, [3] slot, [4] value (low), [5] value (high), [6] E
//   ERR_DUP_EXPERT:   [1] rank, [2] token, [3] second slot, [4] expert, [6] first slot
//   ERR_TOKENS:       [1] rank, [2] token count, [6] T
//   ERR_PEER_DATA:    [1] rank, [2] peer, [3] field (PF_*), [4] value, [6] limit
//   ERR_PEER_FAILED:  [1] rank, [2] peer, [3] phase, [4] call (low), [6] call (high): the peer
//                     published that its group failed (a poisoned signal or header, below)
// [7] is the claim word: the first error wins, later ones only see the code.
#define ERR_TIMEOUT 1
#define ERR_EXPERT_RANGE 2
#define ERR_DUP_EXPERT 3
#define ERR_TOKENS 4
#define ERR_PEER_DATA 5
#define ERR_PEER_FAILED 6
// Peer-supplied fields that are bounded before use (ERR_PEER_DATA's field).
#define PF_BATCH_TOKENS 0
#define PF_EXPERT_ROWS 1
#define PF_HDR_LOCAL 2
#define PF_HDR_INDEX 3
#define PF_HDR_TOKEN 4
#define PF_HDR_SEL 5
#define PF_SELECTIONS 6
#define PF_PE_COUNT 7
#define PF_PE_TOKEN 8
#define PF_PE_SLOT 9
__device__ __forceinline__ bool failed(const KParams& p) {
    return ld_volatile_u32((const u32*)p.err) != 0;
}
// loom model: gpu_protocol::report_error and failed; covered by loom_gpu_protocol.rs (fault_timeout_*, bad_input_*)
// Out of line: it sits in the cold branches of hot loops.
// The claim winner also writes the host mirror (p.err_host, mapped pinned memory): the words
// first, a system fence, then the code, so a host that reads a nonzero code with acquire
// ordering reads the words of that error. The host polls the mirror at the entry of every call
// without synchronising any stream (kernels/src/runtime/error_word.rs). Plain stores only: device
// atomics on host memory are not atomic on every platform, and one writer needs none.
// (Scalar arguments: a __noinline__ function taking the KParams by reference would copy them to
// the stack in every kernel.)
__device__ __noinline__ void report_error_at(u64 err, u64 err_host, int trap, u32 code, u32 a, u32 b, u32 c, u32 d, u32 e, u32 f) {
    u32* w = (u32*)err;
    if (atomicCAS(w + 7, 0u, 1u) == 0u) {
        w[1] = a;
        w[2] = b;
        w[3] = c;
        w[4] = d;
        w[5] = e;
        w[6] = f;
        __threadfence_system();
        atomicExch(w, code);
        volatile u32* h = (volatile u32*)err_host;
        if (h) {
            h[1] = a;
            h[2] = b;
            h[3] = c;
            h[4] = d;
            h[5] = e;
            h[6] = f;
            h[7] = 1u;
            __threadfence_system();
            h[0] = code;
            __threadfence_system();
        }
    } else {
        // Lost the claim: the winner raises the code right after its six words, with no wait
        // in between. Wait for it (bounded: 100 us of %globaltimer; the word is the channel
        // every report goes through, so a wait that runs out has nothing left to report), so
        // that whoever reported sees failed(p) from here on: last_block_out counts a block as
        // failed by what it sees. loom: gpu_protocol::report_error (the loser's wait).
        const u64 t0 = globaltimer();
        while (ld_volatile_u32(w) == 0u && globaltimer() - t0 < 100000ull) {
        }
    }
    // Opt-in (GpuOptions::trap_on_error): the host mirror above survives the trap, so the host
    // still names the error after the context is lost.
    if (trap) __trap();
}
__device__ __forceinline__ void report_error(const KParams& p, u32 code, u32 a, u32 b, u32 c, u32 d, u32 e, u32 f) {
    report_error_at(p.err, p.err_host, p.trap, code, a, b, c, d, e, f);
}
// loom model: gpu_protocol::report_timeout; covered by loom_gpu_protocol.rs
__device__ void report_timeout(const KParams& p, int rank, int peer, int phase, u64 call, u64 waited) {
    report_error(p, ERR_TIMEOUT, (u32)rank, (u32)peer, (u32)phase, (u32)call, (u32)(waited / 1000ull), (u32)(call >> 32));
}
// A peer-supplied `value` of `field` outside [0, limit]: reported, and the caller skips its use.
// loom model: gpu_protocol::peer_bad; covered by loom_gpu_protocol.rs capacity_bad_input_sender_header_poisoned
__device__ __forceinline__ bool peer_bad(const KParams& p, int rank, int peer, int field, long long value, long long limit) {
    if (value >= 0 && value <= limit) return false;
    report_error(p, ERR_PEER_DATA, (u32)rank, (u32)peer, (u32)field, (u32)value, 0u, (u32)limit);
    return true;
}

// ---------------------------------------------------------------- epochs and signals
// Epochs are u64 (calls of one kind since the group was built: they never wrap). A signal word is
// (tag << 24) | count with tag = epoch mod (2^40 - 1) + 1: never 0 (the zeroed initial words carry
// tag 0), and consecutive calls have different tags, so a signal left by the previous call is never
// taken for the current one (every call rewrites every signal word it waits on). Counts are below
// 2^24 (the host checks T*K < 2^24). Acknowledgements carry the whole u64 epoch.
#define SIG_COUNT_BITS 24
#define SIG_COUNT_MASK ((1ull << SIG_COUNT_BITS) - 1ull)
__device__ __forceinline__ u64 sig_tag(u64 epoch) { return epoch % ((1ull << 40) - 1ull) + 1ull; }
__device__ __forceinline__ u64 ld_epoch(const u32* state, int kind) {
    u64 v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"((const u64*)state + ST_EPOCH64 + kind) : "memory");
    return v;
}
// A failed rank's signal (docs/contract.md, "A failure never spreads as data"). A rank whose
// group has recorded an error (its device's error word, read once per block at kernel start:
// `s_fail`) sends no data and no valid signal in any later kernel, those already enqueued behind
// the failing one included: it stores this poison, tagged with its call, in every signal word
// the call owes a peer, then ends as a failed call (its epoch and acks as ever, so nobody waits
// for them). The count field all ones is never a count (the host keeps T*K below 2^24 - 1).
// A receiver that finds a poison with any tag (the words start at 0, and only a failed group
// stores one) reports ERR_PEER_FAILED and ends its call as failed, within a poll, instead of
// waiting out its bound; in shrink mode the peer is lost (masked) at once.
// loom model: gpu_protocol::poison (poison_signals, is_poison), model failed_rank_poisons_enqueued_calls.
#define SIG_POISON SIG_COUNT_MASK
__device__ __forceinline__ bool is_poison(u64 v) { return (v & SIG_COUNT_MASK) == SIG_POISON && (v >> SIG_COUNT_BITS) != 0ull; }
// NCCL capacity mode's header poison (runtime/nccl/plan.rs POISON_HDR): a token count no good pack writes.
#define HDR_POISON 0x7FFFFFFF
__device__ void report_peer_failed(const KParams& p, int rank, int peer, int phase, u64 call) {
    report_error(p, ERR_PEER_FAILED, (u32)rank, (u32)peer, (u32)phase, (u32)call, 0u, (u32)(call >> 32));
}
// Waits until the signal word carries this call's tag. Returns its count, or -1 on timeout
// (reported), on a poisoned signal (reported: the peer failed), or when another wait already
// failed. loom model: gpu_protocol::wait_signal (tag wrap: *_tag_wrap; poison: failed_rank_*).
__device__ long long wait_signal(const KParams& p, const u64* addr, u64 epoch, int rank, int peer, int phase) {
    u64 t0 = globaltimer();
    u32 spins = 0;
    const u64 tag = sig_tag(epoch);
    while (true) {
        u64 v = ld_acquire(p, addr);
        if ((v >> SIG_COUNT_BITS) == tag && (v & SIG_COUNT_MASK) != SIG_POISON) return (long long)(v & SIG_COUNT_MASK);
        if (is_poison(v)) {
            report_peer_failed(p, rank, peer, phase, epoch);
            return -1;
        }
        if ((++spins & 63u) == 0u) {
            if (failed(p)) return -1;
            u64 now = globaltimer();
            if (now - t0 > p.timeout_ns) {
                report_timeout(p, rank, peer, phase, epoch, now - t0);
                return -1;
            }
        }
    }
}
// wait_signal whose first acquire load of `addr` (v0) was made early, at kernel start: a signal
// of this call already in is taken from it, without a further round trip (the acquire orders
// every later load of this thread after it, as in wait_signal); else the wait as ever. A stale
// word (an earlier call's tag) or the poison go to wait_signal, which loads the word again.
// loom model: gpu_protocol::preload_signals (mutant gpu_preload_relaxed).
// Does signal word v carry call `epoch`'s tag and a count (not the poison)?
__device__ __forceinline__ bool sig_in(u64 v, u64 epoch) { return (v >> SIG_COUNT_BITS) == sig_tag(epoch) && (v & SIG_COUNT_MASK) != SIG_POISON; }
__device__ __forceinline__ long long wait_signal_pre(const KParams& p, const u64* addr, u64 v0, u64 epoch, int rank, int peer, int phase) {
    if (sig_in(v0, epoch)) return (long long)(v0 & SIG_COUNT_MASK);
    return wait_signal(p, addr, epoch, rank, peer, phase);
}
// Waits until an acknowledgement word is at least `need` (the peer has consumed call need).
// loom model: gpu_protocol::wait_ack; covered by loom_gpu_protocol.rs batched_consecutive_calls
__device__ bool wait_ack(const KParams& p, const u64* addr, u64 need, u64 call, int rank, int peer, int phase) {
    u64 t0 = globaltimer();
    u32 spins = 0;
    while (true) {
        u64 v = ld_acquire(p, addr);
        if (v >= need) return true;
        if ((++spins & 63u) == 0u) {
            if (failed(p)) return false;
            u64 now = globaltimer();
            if (now - t0 > p.timeout_ns) {
                report_timeout(p, rank, peer, phase, call, now - t0);
                return false;
            }
        }
    }
}
__device__ __forceinline__ u64 signal_word(u64 epoch, u32 count) { return (sig_tag(epoch) << SIG_COUNT_BITS) | ((u64)count & SIG_COUNT_MASK); }
// Where peer d keeps this rank's signal of a call of `kind` (local expert l of the per-expert kinds).
__device__ __forceinline__ u64* signal_slot(const KParams& p, const RankPtrs* tab, int kind, int rank, int d, int l) {
    if (kind == KIND_BAT_DISPATCH) return sig_bat(tab[d]) + rank;
    if (kind == KIND_BAT_COMBINE) return sig_cb(tab[d], p.R) + rank;
    if (kind == KIND_PE_DISPATCH) return sig_pe(tab[d], p.R) + (u64)l * p.R + rank;
    return sig_pc(tab[d], p.R, p.L) + (u64)rank * p.L + l;
}

// The acknowledgement words of a call of `kind` in rank r's signals: [R], word d is peer d's.
__device__ __forceinline__ u64* ack_words(const RankPtrs& r, int R, int kind) {
    if (kind == KIND_BAT_DISPATCH) return sig_bat_ack(r, R);
    if (kind == KIND_BAT_COMBINE) return sig_cb_ack(r, R);
    if (kind == KIND_PE_DISPATCH) return sig_pe_ack(r, R);
    return sig_pc_ack(r, R);
}

// ---------------------------------------------------------------- bf16
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
// Round to nearest even; NaN -> 0x7FFF (docs/contract.md, numerics/bf16.rs).
__device__ __forceinline__ u16 f32_to_bf16_rne(float f) {
    if (f != f) return (u16)0x7FFF;
    u32 b = __float_as_uint(f);
    u32 lsb = (b >> 16) & 1u;
    return (u16)((b + 0x7FFFu + lsb) >> 16);
}

// ---------------------------------------------------------------- block helpers
// Exclusive prefix of `flag` over the block's threads; returns it and writes the block total to
// *total. All threads must call it. Uses `scratch` (NWARPS+1 ints of shared memory).
__device__ __forceinline__ int block_excl_scan(int flag, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // inclusive warp scan
    int v = flag;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    int base = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < NWARPS; w++) {
        int s = scratch[w];
        if (w < warp) base += s;
        tot += s;
    }
    __syncthreads();
    *total = tot;
    return base + v - flag;
}

// Copies n bytes (n % 16 == 0, both 16-aligned) with one warp.
__device__ __forceinline__ void warp_copy16(u8* dst, const u8* src, int n) {
    const int lane = threadIdx.x & 31;
    int i = lane * 16;
    for (; i + 3 * 512 < n; i += 4 * 512) {
        uint4 a = *(const uint4*)(src + i);
        uint4 b = *(const uint4*)(src + i + 512);
        uint4 c = *(const uint4*)(src + i + 1024);
        uint4 d = *(const uint4*)(src + i + 1536);
        *(uint4*)(dst + i) = a;
        *(uint4*)(dst + i + 512) = b;
        *(uint4*)(dst + i + 1024) = c;
        *(uint4*)(dst + i + 1536) = d;
    }
    for (; i < n; i += 512) *(uint4*)(dst + i) = *(const uint4*)(src + i);
}
// Copies n bytes (n even, 2-aligned) with one warp, 16 bytes at a time where alignment allows.
__device__ __forceinline__ void warp_copy(u8* dst, const u8* src, int n) {
    if (((((u64)dst) | ((u64)src) | (u64)n) & 15ull) == 0ull) {
        warp_copy16(dst, src, n);
    } else if (((((u64)dst) | ((u64)src) | (u64)n) & 3ull) == 0ull) {
        for (int i = (threadIdx.x & 31) * 4; i < n; i += 128) *(u32*)(dst + i) = *(const u32*)(src + i);
    } else {
        for (int i = (threadIdx.x & 31) * 2; i < n; i += 64) *(u16*)(dst + i) = *(const u16*)(src + i);
    }
}

// Routing of one rank, loaded into shared memory: sk[t*K+k] = expert or -1, and place(i, e) for
// every selection i = t*K+k (the caller's own per-selection tallies; e as sk holds it), two
// selections per thread loaded before either is used. With CHECK (dispatch: topk_idx may come
// from the caller's device memory), every index is checked: outside [-1, E) is reported
// (ERR_EXPERT_RANGE with rank, token, slot, value) and read as -1, so nothing indexes with it;
// then, after a block barrier, a repeat within its token (ERR_DUP_EXPERT with rank, token, slot,
// expert, first slot). With `stamps`, profile stamps p6 (routing loaded) and p8 (this thread's
// share of the repeat check done). Returns this thread's verdict (nonzero: it found a bad index):
// the caller reduces it over the block (__syncthreads_or) before any write. Without CHECK no
// barrier is made: the caller makes one before sk is read.
template <bool CHECK, typename Place>
__device__ __forceinline__ int load_topk(const KParams& p, const i64* topk, int n, int* sk, int rank, bool stamps, const Place& place) {
    const int K = p.K;
    int bad = 0;
    auto one = [&](int i, i64 v) {
        int e = (int)v;
        if (CHECK && (v < -1 || v >= (i64)p.E)) {
            report_error(p, ERR_EXPERT_RANGE, (u32)rank, (u32)(i / K), (u32)(i % K), (u32)(unsigned long long)v,
                         (u32)((unsigned long long)v >> 32), (u32)p.E);
            bad = 1;
            e = -1;
        }
        sk[i] = e;
        place(i, e);
    };
    for (int i0 = threadIdx.x; i0 < n * K; i0 += 2 * NTHREADS) {
        const int i1 = i0 + NTHREADS;
        const i64 v0 = topk[i0];
        const i64 v1 = i1 < n * K ? topk[i1] : -1;
        one(i0, v0);
        if (i1 < n * K) one(i1, v1);
    }
    if (!CHECK) return 0;
    __syncthreads();
    if (stamps) PROF(6);  // routing loaded and counted
    // Repeats within a token, from shared memory.
    for (int i = threadIdx.x; i < n * K; i += NTHREADS) {
        const int e = sk[i];
        if (e < 0) continue;
        const int t = i / K, k = i % K;
        for (int j = 0; j < k; j++)
            if (sk[t * K + j] == e) {
                report_error(p, ERR_DUP_EXPERT, (u32)rank, (u32)t, (u32)k, (u32)e, 0u, (u32)j);
                bad = 1;
                break;
            }
    }
    if (stamps) PROF(8);  // thread 0's share of the repeat check done
    return bad;
}
// sdl[i] = (owner rank << 16) | local expert of selection i's expert e, or -1 (one division per
// selection, here only): load_topk's `place` where nothing else is tallied.
struct PlaceOwner {
    int* sdl;
    int L;
    __device__ __forceinline__ void operator()(int i, int e) const { sdl[i] = e >= 0 ? ((e / L) << 16) | (e % L) : -1; }
};
// The rank's token count for this call, from `ntok`; outside [0, T] is reported (ERR_TOKENS) and
// read as 0 with *bad set. Thread 0 only.
__device__ __forceinline__ int read_ntok(const KParams& p, const IoPtrs& io, int rank, int* bad) {
    const int n = *(const int*)io.ntok;
    if (n < 0 || n > p.T) {
        report_error(p, ERR_TOKENS, (u32)rank, (u32)n, 0u, 0u, 0u, (u32)p.T);
        *bad = 1;
        return 0;
    }
    return n;
}

// This warp's index among the rank's warps for spreading work units: numbered across the blocks
// first (warp w of block b is w * blocks + b), so that fewer units than warps land on every block
// (SM) alike rather than filling the first blocks and leaving the last idle: the per-SM store
// and load traffic of a phase is then even, and no few SMs do all of a phase's last units.
__device__ __forceinline__ int spread_warp(const KParams& p, int bid) {
    return (int)(threadIdx.x >> 5) * p.blocks_per_rank + bid;
}
// Shared-memory carve-up used by every kernel (the host sizes it the same way).
struct Smem {
    u64* rowp;     // T*K: combine, the address of each selection's row
    int* sk;       // T*K
    int* sdl;      // T*K
    int* tokpos;   // T*R
    int* selpos;   // T*R
    int* tot;      // 2R
    int* scratch;  // 32
    int* m_a;      // NTHREADS
    int* m_b;      // NTHREADS
    int* m_c;      // NTHREADS
    int* bm;       // E*W: bitmap of the tokens selecting each expert (W = ceil(T/32))
    int* pw;       // E*W: selections of the expert in the words before
    int* cls;      // L*R: rows of (l, s)
    int* beg;      // L*R: first row of (l, s)
    int* rcnt;     // entries per source: 80 (R <= 32), R (wide)
#if WIDE
    int* dbm;      // R*W: bitmap of the tokens bound for each destination
    int* dpw;      // R*W: tokens bound for the destination in the words before
    int* spw;      // R*W: selections bound for the destination in the words before
#endif
};
// Per-(token, destination) batch positions: T*R entries indexed t*R+d (R <= 32), or per slot,
// T*K entries indexed t*K+k (wide: a T x R table does not fit shared memory at R = 256).
#if WIDE
#define POS_ENTRIES(p) ((p).T * (p).K)
#else
#define POS_ENTRIES(p) ((p).T * (p).R)
#endif
__device__ __forceinline__ Smem carve(const KParams& p, int* base) {
    Smem s;
    s.rowp = (u64*)base;
    s.sk = base + 2 * p.T * p.K;
    s.sdl = s.sk + p.T * p.K;
    s.tokpos = s.sdl + p.T * p.K;
    s.selpos = s.tokpos + POS_ENTRIES(p);
    s.tot = s.selpos + POS_ENTRIES(p);
    s.scratch = s.tot + 2 * p.R;
    s.m_a = s.scratch + 32;
    s.m_b = s.m_a + NTHREADS;
    s.m_c = s.m_b + NTHREADS;
    const int W = (p.T + 31) / 32;
    s.bm = s.m_c + NTHREADS;
    s.pw = s.bm + p.E * W;
    s.cls = s.pw + p.E * W;
    s.beg = s.cls + p.L * p.R;
    s.rcnt = s.beg + p.L * p.R;
#if WIDE
    s.dbm = s.rcnt + p.R;
    s.dpw = s.dbm + p.R * W;
    s.spw = s.dpw + p.R * W;
#endif
    return s;
}

// Copies `rows` payload rows with the whole block: unit (row, 512-byte chunk), one 16-byte access
// per lane, four units in flight per warp. src_of(m) / dst_of(m) give row m's addresses; n bytes
// per row, n % 16 == 0 and every address 16-aligned (else the caller uses warp_copy).
template <typename Src, typename Dst>
__device__ __forceinline__ void block_copy_rows(int rows, int n, Src src_of, Dst dst_of) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = (n + 511) / 512;
    const int units = rows * chunks;
    for (int u0 = warp * 4; u0 < units; u0 += NWARPS * 4) {
        uint4 v[4];
        bool ok[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int u = u0 + i;
            const int off = (u % chunks) * 512 + lane * 16;
            ok[i] = u < units && off < n;
            if (ok[i]) v[i] = *(const uint4*)(src_of(u / chunks) + off);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int u = u0 + i;
            const int off = (u % chunks) * 512 + lane * 16;
            if (ok[i]) *(uint4*)(dst_of(u / chunks) + off) = v[i];
        }
    }
}
