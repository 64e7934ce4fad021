// shrink.cuh: shrink mode (DeepEP's enable_shrink): the rank mask, the blocks' agreement on a lost
// peer, and the lost-peer set a kernel keeps (narrow and wide builds). Compiled after common.cuh
// (the memory ordering, bounded waits and signals it uses) and before fp8.cuh and the families.

// ---------------------------------------------------------------- shrink mode (the rank mask)
// DeepEP's enable_shrink. Each rank keeps a mask word per peer (mask[d] != 0: d is masked) in its
// own `shrink` buffer. A masked peer is neither sent to nor waited for, and every selection that
// names one of its experts counts as -1 (docs/contract.md, "Masked ranks"). With p.shrink a wait
// for a peer that runs out masks that peer instead of recording an error, and the call goes on
// as if the peer were masked from the start of the call.
//
// Agreement. The blocks of a rank wait for the same peer independently; at the timeout's edge one
// block may see the signal while another runs out. So every block's verdict on a peer (arrived,
// or lost) goes through one decision word per (rank, kernel kind, recv|ack, peer): the first
// verdict installed for this call (a CAS from any earlier call's value to (epoch << 1) | lost)
// is the one every block uses. A block that ran out while the agreed verdict is "arrived" waits
// again: the signal is in memory (another block saw it). A lost verdict masks the peer before
// the block goes on, so the block's later waits (the receive after the ack wait) see the mask.
// loom model: gpu_protocol::agree and the masked waits, models shrink_* (mutant gpu_no_agreement).
#define DEC_RECV 0
#define DEC_ACK 1
#define PEER_LOST (-2)
__device__ __forceinline__ u64* shr_decide(const RankPtrs& me, int R, int kind, int which) {
    return (u64*)me.shrink + (u64)(kind * 2 + which) * (u64)R;
}
__device__ __forceinline__ int* shr_mask(const RankPtrs& me, int R) { return (int*)((u64*)me.shrink + (u64)NUM_KINDS * 2 * R); }
__device__ __forceinline__ bool peer_masked(const KParams& p, const RankPtrs& me, int d) {
    return SHRINK(p) && ld_volatile_u32((const u32*)shr_mask(me, p.R) + d) != 0u;
}
// A call's set of gone peers (masked, or lost in this call). R <= 32: one u32 in a register
// (bit d: peer d). Wide (R > 32): EP_MASK_WORDS u32 in shared memory (bit d % 32 of word d / 32).
// Each kernel keeps the live set (blocks add the peers they lose to it) and reads snapshots of it
// taken at block barriers: `gone0` (at entry) and `gone` (after each wait phase).
// loom model: gpu_protocol::shrink (PeerSet, the snapshots; models shrink_* and shrink_wide_*).
#if WIDE
typedef const u32* PeerSet;
__device__ __forceinline__ bool is_gone(const u32* g, int d) { return ((g[d >> 5] >> (d & 31)) & 1u) != 0u; }
#else
typedef u32 PeerSet;
// Whether peer d is in the bit set g (0 whenever shrink is off, so no shift runs past 31).
__device__ __forceinline__ bool is_gone(u32 g, int d) { return g != 0u && ((g >> d) & 1u) != 0u; }
#endif
// Bit d set for every masked peer (the narrow build: R <= 32, the host picks the wide one past).
// The loads out of line (scalar arguments, as report_error_at): shrink mode's, cold in every
// other call, and the loop's unrolled loads would sit in the kernel's start otherwise.
__device__ __noinline__ u32 masked_peers_at(int R, u64 mask) {
    u32 m = 0u;
    for (int d = 0; d < R; d++)
        if (ld_volatile_u32((const u32*)mask + d) != 0u) m |= 1u << d;
    return m;
}
__device__ __forceinline__ u32 masked_peers(const KParams& p, const RankPtrs& me) {
    if (!SHRINK(p)) return 0u;
    return masked_peers_at(p.R, (u64)shr_mask(me, p.R));
}
// The wide build's masked peers, EP_MASK_WORDS words into `out` (one thread).
__device__ __forceinline__ void masked_peers_into(const KParams& p, const RankPtrs& me, u32* out) {
    for (int i = 0; i < EP_MASK_WORDS; i++) out[i] = 0u;
    if (!SHRINK(p)) return;
    for (int d = 0; d < p.R; d++)
        if (ld_volatile_u32((const u32*)shr_mask(me, p.R) + d) != 0u) out[d >> 5] |= 1u << (d & 31);
}
// The sets' shared words, one set per block and kernel kind (as frame.cuh's s_*): the live set,
// and in the wide build the entry snapshot and the latest one. The macros below are how every
// kernel uses them (`p`, `me` and KIND are the kernel's KParams, RankPtrs and kind; GONE_SNAPSHOT
// is a block barrier in the wide build: call it where every thread of the block does, after the
// barrier that ends the phase whose losses it takes).
#if WIDE
template <int KIND>
static __shared__ u32 s_gone[EP_MASK_WORDS];  // the live set
template <int KIND>
static __shared__ u32 s_gone0[EP_MASK_WORDS];  // the snapshot at entry
template <int KIND>
static __shared__ u32 s_gone1[EP_MASK_WORDS];  // the latest snapshot
#define GONE_INIT()                                                           \
    do {                                                                      \
        masked_peers_into(p, me, s_gone<KIND>);                                   \
        for (int i_ = 0; i_ < EP_MASK_WORDS; i_++) s_gone0<KIND>[i_] = s_gone<KIND>[i_]; \
    } while (0)
#define GONE0() ((PeerSet)s_gone0<KIND>)
#define GONE_LIVE() ((PeerSet)s_gone<KIND>)
#define GONE_ADD(d) atomicOr(&s_gone<KIND>[(d) >> 5], 1u << ((d) & 31))
#define GONE_SNAPSHOT(g)                                                                \
    do {                                                                                \
        if (threadIdx.x < EP_MASK_WORDS) s_gone1<KIND>[threadIdx.x] = s_gone<KIND>[threadIdx.x]; \
        __syncthreads();                                                                \
        g = s_gone1<KIND>;                                                                  \
    } while (0)
__device__ __forceinline__ bool gone_differs(const u32* a, const u32* b) {
    u32 x = 0u;
    for (int i = 0; i < EP_MASK_WORDS; i++) x |= a[i] ^ b[i];
    return x != 0u;
}
__device__ __forceinline__ bool gone_any(const u32* a) {
    u32 x = 0u;
    for (int i = 0; i < EP_MASK_WORDS; i++) x |= a[i];
    return x != 0u;
}
// The finish's look at the mask (no acknowledgement to a masked peer): per peer, when it acks.
#define MASKED_AT_END() (void)0
#define END_MASKED(s) peer_masked(p, me, (s))
#else
template <int KIND>
static __shared__ u32 s_gone;  // the live set
#define GONE_INIT() (s_gone<KIND> = masked_peers(p, me))
#define GONE0() s_gone<KIND>
#define GONE_LIVE() s_gone<KIND>
#define GONE_ADD(d) atomicOr(&s_gone<KIND>, 1u << (d))
#define GONE_SNAPSHOT(g) (g = s_gone<KIND>)
__device__ __forceinline__ bool gone_differs(u32 a, u32 b) { return a != b; }
__device__ __forceinline__ bool gone_any(u32 a) { return a != 0u; }
#define MASKED_AT_END() const u32 masked = masked_peers(p, me)
#define END_MASKED(s) is_gone(masked, (s))
#endif
// The verdict of this call on one peer: the first installed wins (see above). Returns 1: lost.
__device__ __noinline__ int agree_at(u64 word, u64 mask_word, u64 epoch, int lost) {
    u64* w = (u64*)word;
    const u64 mine = (epoch << 1) | (u64)lost;
    u64 old = *(volatile u64*)w;
    while ((old >> 1) < epoch) {
        const u64 prev = atomicCAS((unsigned long long*)w, (unsigned long long)old, (unsigned long long)mine);
        if (prev == old) {
            old = mine;
            break;
        }
        old = prev;
    }
    const int final_lost = (int)(old & 1ull);
    if (final_lost) atomicExch((int*)mask_word, 1);
    return final_lost;
}
__device__ __forceinline__ int agree(const KParams& p, const RankPtrs& me, int kind, int which, int peer, u64 epoch, int lost) {
    return agree_at((u64)(shr_decide(me, p.R, kind, which) + peer), (u64)(shr_mask(me, p.R) + peer), epoch, lost);
}
// The waits of shrink mode, out of line with scalar arguments (cold: only with p.shrink; a
// __noinline__ function taking the KParams by reference would copy them to the stack).
struct PeerWait {
    u64 err, err_host, timeout_ns;
    u64 mask_word, decide_word;  // this rank's mask[peer] and decision word for (kind, which, peer)
    int sys_scope, trap;
    int rank, peer, phase;
};
__device__ __forceinline__ PeerWait peer_wait(const KParams& p, const RankPtrs& me, int kind, int which, int rank, int peer, int phase) {
    PeerWait w;
    w.err = p.err;
    w.err_host = p.err_host;
    w.timeout_ns = p.timeout_ns;
    w.mask_word = (u64)(shr_mask(me, p.R) + peer);
    w.decide_word = (u64)(shr_decide(me, p.R, kind, which) + peer);
    w.sys_scope = p.sys_scope;
    w.trap = p.trap;
    w.rank = rank;
    w.peer = peer;
    w.phase = phase;
    return w;
}
__device__ __forceinline__ u64 pw_load(const PeerWait& w, const u64* a) { return w.sys_scope ? ld_acquire_sys(a) : ld_acquire_gpu(a); }
// Waits for `nw` signal words of one peer (addr0 + i * stride) to carry this call's tag, then
// agrees on the verdict (see "Agreement" above). Proposes "arrived" only when every word the
// peer owes this rank in this call is there, so that a block whose own wait ran out can always
// wait again once "arrived" is agreed. Returns the count of word `mine` (0 when mine < 0), -1
// on an error (this block's or the device's), or PEER_LOST (the peer is masked now).
__device__ __noinline__ long long wait_peer_signals(PeerWait w, const u64* addr0, u64 stride, int nw, int mine, u64 epoch) {
    const u64 tag = sig_tag(epoch);
    int lost = ld_volatile_u32((const u32*)w.mask_word) != 0u;
    const u64 t0 = globaltimer();
    u32 spins = 0;
    long long cmine = 0;
    for (int i = 0; i < nw && !lost; i++) {
        const u64* a = addr0 + (u64)i * stride;
        while (true) {
            const u64 v = pw_load(w, a);
            // A poisoned signal (common.cuh SIG_POISON): the peer's group failed, it is lost now.
            if (is_poison(v)) {
                lost = 1;
                break;
            }
            if ((v >> SIG_COUNT_BITS) == tag) {
                if (i == mine) cmine = (long long)(v & SIG_COUNT_MASK);
                break;
            }
            if ((++spins & 63u) == 0u) {
                if (ld_volatile_u32((const u32*)w.err) != 0u) return -1;
                if (ld_volatile_u32((const u32*)w.mask_word) != 0u || globaltimer() - t0 > w.timeout_ns) {
                    lost = 1;
                    break;
                }
            }
        }
    }
    if (agree_at(w.decide_word, w.mask_word, epoch, lost)) return PEER_LOST;
    // Agreed "arrived" after this block ran out: every word is in memory (bounded all the same).
    for (int i = 0; i < nw && lost; i++) {
        const u64* a = addr0 + (u64)i * stride;
        const u64 t1 = globaltimer();
        u32 n = 0;
        while (true) {
            const u64 v = pw_load(w, a);
            if (is_poison(v)) {
                // A later call's poison over this call's signal: the words are not all here.
                report_error_at(w.err, w.err_host, w.trap, ERR_PEER_FAILED, (u32)w.rank, (u32)w.peer, (u32)w.phase, (u32)epoch, 0u,
                                (u32)(epoch >> 32));
                return -1;
            }
            if ((v >> SIG_COUNT_BITS) == tag) {
                if (i == mine) cmine = (long long)(v & SIG_COUNT_MASK);
                break;
            }
            if ((++n & 63u) == 0u) {
                if (ld_volatile_u32((const u32*)w.err) != 0u) return -1;
                const u64 now = globaltimer();
                if (now - t1 > w.timeout_ns) {
                    report_error_at(w.err, w.err_host, w.trap, ERR_TIMEOUT, (u32)w.rank, (u32)w.peer, (u32)w.phase, (u32)epoch,
                                    (u32)((now - t1) / 1000ull), (u32)(epoch >> 32));
                    return -1;
                }
            }
        }
    }
    return cmine;
}
// wait_ack under shrink: 1 (acknowledged), 0 (an error), or PEER_LOST (masked now).
__device__ __noinline__ int wait_peer_ack(PeerWait w, const u64* addr, u64 need, u64 call) {
    int lost = ld_volatile_u32((const u32*)w.mask_word) != 0u;
    const u64 t0 = globaltimer();
    u32 spins = 0;
    while (!lost) {
        if (pw_load(w, addr) >= need) break;
        if ((++spins & 63u) == 0u) {
            if (ld_volatile_u32((const u32*)w.err) != 0u) return 0;
            if (ld_volatile_u32((const u32*)w.mask_word) != 0u || globaltimer() - t0 > w.timeout_ns) lost = 1;
        }
    }
    if (agree_at(w.decide_word, w.mask_word, call, lost)) return PEER_LOST;
    const u64 t1 = globaltimer();
    u32 n = 0;
    while (lost && pw_load(w, addr) < need) {
        if ((++n & 63u) == 0u) {
            if (ld_volatile_u32((const u32*)w.err) != 0u) return 0;
            const u64 now = globaltimer();
            if (now - t1 > w.timeout_ns) {
                report_error_at(w.err, w.err_host, w.trap, ERR_TIMEOUT, (u32)w.rank, (u32)w.peer, (u32)w.phase, (u32)call,
                                (u32)((now - t1) / 1000ull), (u32)(call >> 32));
                return 0;
            }
        }
    }
    return 1;
}
