//! The model on std threads: not a proof (loom's tests are), but it shows the functions run
//! the protocol end to end in the normal build.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::gpu_protocol::block::block_epoch;
use crate::gpu_protocol::dispatch::dispatch_block;
use crate::gpu_protocol::hook::{hook_recv_block, hook_send_block};
use crate::gpu_protocol::host::{ack_word, device_error, DeviceError, Host};
use crate::gpu_protocol::nccl::{
    batched_pack_block, batched_unpack_block, nccl_capacity_exchange, poison_send_headers,
};
use crate::gpu_protocol::orderings::RELAXED;
use crate::gpu_protocol::peers::Build;
use crate::gpu_protocol::shrink::{clean_mask, mask_status};
use crate::gpu_protocol::state::{merged, BlockReport, Group, Input, Kind, Launch, Setup};
use crate::gpu_protocol::words::{
    sig_tag, signal_word, PH_DISPATCH_RECV, SIG_COUNT_BITS, SIG_COUNT_MASK,
};

fn two_calls(kind: Kind) {
    let setup = Setup {
        kind,
        ranks: vec![(0, 2), (1, 1)],
        links: vec![(0, 1)],
        max_tokens: 2,
        local_experts: 2,
        build: Build::Narrow,
    };
    let g = Arc::new(Group::new(setup));
    let kp = Launch {
        timeout: Duration::from_secs(10),
        fault_rank: None,
        bad_input: None,
        shrink: false,
        fail_receive: None,
    };
    let inputs: Vec<Input> = (1..=3)
        .map(|c| Input {
            call: c,
            route: vec![vec![vec![(1, 0)], vec![(1, 1)]], vec![]],
        })
        .collect();
    let rx = {
        let (g, inputs) = (g.clone(), inputs.clone());
        thread::spawn(move || {
            for input in &inputs {
                let rep = dispatch_block(&g, &kp, input, 1, 0);
                assert_eq!(rep.read, g.expected(input, 1), "call {}", input.call);
                assert!(rep.last_out && !rep.call_failed && !rep.failed_outputs);
            }
        })
    };
    for input in &inputs {
        let b1 = {
            let (g, input) = (g.clone(), input.clone());
            thread::spawn(move || dispatch_block(&g, &kp, &input, 0, 1))
        };
        let r0 = dispatch_block(&g, &kp, input, 0, 0);
        let r1 = b1.join().unwrap();
        assert_eq!(r0.epoch, input.call);
        assert!(r0.last_out ^ r1.last_out, "exactly one block is last out");
    }
    rx.join().unwrap();
}

#[test]
fn batched_two_blocks_three_calls_std() {
    for _ in 0..50 {
        two_calls(Kind::Batched);
    }
}

#[test]
fn per_expert_two_blocks_three_calls_std() {
    for _ in 0..50 {
        two_calls(Kind::PerExpert);
    }
}

/// The receive hook's split (batched dispatch over NVLink), three calls: per rank and call the
/// send half's blocks, then the receive half's.
#[test]
fn hook_split_two_blocks_three_calls_std() {
    for _ in 0..50 {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 2), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts: 1,
            build: Build::Narrow,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_secs(10),
            fault_rank: None,
            bad_input: None,
            shrink: false,
            fail_receive: None,
        };
        let inputs: Vec<Input> = (1..=3)
            .map(|c| Input {
                call: c,
                route: vec![vec![vec![(1, 0)], vec![(1, 0)]], vec![]],
            })
            .collect();
        let rx = {
            let (g, inputs) = (g.clone(), inputs.clone());
            thread::spawn(move || {
                for input in &inputs {
                    let send = hook_send_block(&g, &kp, input, 1, 0);
                    assert!(send.read.is_empty() && !send.last_out);
                    let recv = hook_recv_block(&g, &kp, 1, 0);
                    assert_eq!(recv.read, g.expected(input, 1), "call {}", input.call);
                    assert!(recv.last_out && recv.epoch == input.call);
                }
            })
        };
        for input in &inputs {
            let b1 = {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || hook_send_block(&g, &kp, &input, 0, 1))
            };
            let s0 = hook_send_block(&g, &kp, input, 0, 0);
            let s1 = b1.join().unwrap();
            assert!(!s0.last_out && !s1.last_out, "a send half counts no exit");
            assert_eq!(
                block_epoch(&g.ranks[0]),
                input.call,
                "stage 1 publishes no epoch"
            );
            let r0: Vec<BlockReport> = (0..2).map(|b| hook_recv_block(&g, &kp, 0, b)).collect();
            assert!(r0
                .iter()
                .all(|r| r.epoch == input.call && r.read.is_empty()));
        }
        rx.join().unwrap();
        assert_eq!(ack_word(&g, 0, 1), 3, "rank 1's receive half acked call 3");
    }
}

/// The receive hook's split with a bad receiver: rank 1's send half reports its routing and
/// publishes nothing; its receive half finds its group failed (`s_fail`), reads nothing, and
/// publishes the epoch and its ack to rank 0.
#[test]
fn hook_split_bad_input_receiver_reads_nothing_but_acks_std() {
    let setup = Setup {
        kind: Kind::Batched,
        ranks: vec![(0, 1), (1, 1)],
        links: vec![(0, 1)],
        max_tokens: 1,
        local_experts: 1,
        build: Build::Narrow,
    };
    let g = Group::new(setup);
    let kp = Launch {
        timeout: Duration::from_millis(50),
        fault_rank: None,
        bad_input: None,
        shrink: false,
        fail_receive: None,
    };
    let bad = Launch {
        bad_input: Some(1),
        ..kp
    };
    let input = Input {
        call: 1,
        route: vec![vec![vec![(1, 0)]], vec![]],
    };
    let s0 = hook_send_block(&g, &kp, &input, 0, 0);
    assert!(s0.failed_wait.is_none() && !s0.poisoned);
    let s1 = hook_send_block(&g, &bad, &input, 1, 0);
    assert!(s1.bad_input && s1.poisoned && !s1.last_out);
    assert!(!s1.failed_outputs, "the send half writes no outputs");
    assert_eq!(ack_word(&g, 0, 1), 0, "the send half acks nothing");
    assert_eq!(
        block_epoch(&g.ranks[1]),
        1,
        "the send half publishes no epoch"
    );
    let r1 = hook_recv_block(&g, &bad, 1, 0);
    assert!(r1.read.is_empty() && r1.last_out && r1.failed_wait.is_none());
    assert!(
        r1.failed_start && r1.failed_outputs,
        "the receive half writes the failed call's outputs"
    );
    assert!(
        !r1.preload_taken,
        "a failed group's receive half reads no signal"
    );
    assert_eq!(ack_word(&g, 0, 1), 1, "the receive half acks call 1");
    assert_eq!(block_epoch(&g.ranks[1]), 2, "and publishes epoch 1");
    let mut host = Host::default();
    assert_eq!(host.sync(&g), Err(DeviceError::BadInput { rank: 1 }));
}

#[test]
fn fault_rank_times_out_and_the_host_refuses_the_next_call() {
    let setup = Setup {
        kind: Kind::Batched,
        ranks: vec![(0, 1), (0, 2)],
        links: vec![(0, 1)],
        max_tokens: 1,
        local_experts: 1,
        build: Build::Narrow,
    };
    let g = Arc::new(Group::new(setup));
    let kp = Launch {
        timeout: Duration::from_millis(50),
        fault_rank: Some(0),
        bad_input: None,
        shrink: false,
        fail_receive: None,
    };
    let input = Input {
        call: 1,
        route: vec![vec![vec![(1, 0)]], vec![]],
    };
    let blocks: Vec<_> = [(0, 0), (1, 0), (1, 1)]
        .into_iter()
        .map(|(r, b)| {
            let (g, input) = (g.clone(), input.clone());
            thread::spawn(move || dispatch_block(&g, &kp, &input, r, b))
        })
        .collect();
    let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
    assert!(reps[1].failed_wait.is_some() && reps[2].failed_wait.is_some());
    assert!(
        reps[1..].iter().any(|r| r.last_out && r.failed_outputs),
        "rank 1's last block out writes the failed call's outputs"
    );
    let mut host = Host::default();
    let want = DeviceError::Timeout {
        rank: 1,
        peer: 0,
        phase: PH_DISPATCH_RECV,
        call: 1,
    };
    assert_eq!(host.sync(&g), Err(want));
    assert_eq!(host.check_usable(), Err(want));
}

#[test]
fn tags_are_never_zero_and_wrap_once_per_2_40_minus_1_calls() {
    let m = (1u64 << 40) - 1;
    assert_eq!(sig_tag(0), 1);
    assert_eq!(sig_tag(1), 2);
    assert_eq!(sig_tag(m - 1), m, "the largest tag");
    assert_eq!(sig_tag(m), 1, "the wrap");
    assert_eq!(sig_tag(m + 1), 2);
    assert_eq!(sig_tag(u64::MAX), u64::MAX % m + 1);
    for e in [1, m - 1, m, m + 1, u64::MAX] {
        assert_ne!(sig_tag(e), 0);
        assert_ne!(sig_tag(e), sig_tag(e - 1), "consecutive calls differ");
    }
    let w = signal_word(m - 1, 5);
    assert_eq!(
        (w >> SIG_COUNT_BITS, w & SIG_COUNT_MASK),
        (m, 5),
        "tag fills the top 40 bits"
    );
}

#[test]
fn bad_input_rank_skips_its_sends_acks_and_the_host_names_it() {
    let setup = Setup {
        kind: Kind::Batched,
        ranks: vec![(0, 1), (1, 1)],
        links: vec![(0, 1)],
        max_tokens: 1,
        local_experts: 1,
        build: Build::Narrow,
    };
    let g = Arc::new(Group::new(setup));
    let kp = Launch {
        timeout: Duration::from_millis(50),
        fault_rank: None,
        bad_input: Some(1),
        shrink: false,
        fail_receive: None,
    };
    let input = Input {
        call: 1,
        route: vec![vec![vec![(1, 0)]], vec![]],
    };
    let blocks: Vec<_> = [0, 1]
        .into_iter()
        .map(|r| {
            let (g, input) = (g.clone(), input.clone());
            thread::spawn(move || dispatch_block(&g, &kp, &input, r, 0))
        })
        .collect();
    let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
    assert!(reps[1].bad_input && reps[1].read.is_empty() && reps[1].last_out);
    assert!(reps[1].failed_outputs && !reps[0].failed_outputs);
    assert_eq!(
        g.ranks[0].ack[1].load(RELAXED),
        1,
        "the bad rank acks call 1"
    );
    let mut host = Host::default();
    assert_eq!(host.sync(&g), Err(DeviceError::BadInput { rank: 1 }));
    assert_eq!(host.check_usable(), Err(DeviceError::BadInput { rank: 1 }));
}

#[test]
fn shrink_lost_rank_is_masked_not_reported_and_clean_takes_it_back() {
    let setup = Setup {
        kind: Kind::Batched,
        ranks: vec![(0, 1), (1, 2)],
        links: vec![(0, 1)],
        max_tokens: 2,
        local_experts: 1,
        build: Build::Narrow,
    };
    let g = Arc::new(Group::new(setup));
    let input = |call| Input {
        call,
        route: vec![vec![vec![(1, 0)], vec![(1, 0)]], vec![]],
    };
    let run = |kp: Launch, input: &Input| -> Vec<BlockReport> {
        let blocks: Vec<_> = [(0, 0), (1, 0), (1, 1)]
            .into_iter()
            .map(|(r, b)| {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, r, b))
            })
            .collect();
        blocks.into_iter().map(|b| b.join().unwrap()).collect()
    };
    // Call 1: rank 0 never signals; rank 1's blocks run out and agree that it is lost.
    let lossy = Launch {
        timeout: Duration::from_millis(50),
        fault_rank: Some(0),
        bad_input: None,
        shrink: true,
        fail_receive: None,
    };
    let reps = run(lossy, &input(1));
    for r in &reps[1..] {
        assert_eq!((r.gone.flat(), r.failed_wait), (0b01, None));
        assert!(r.read.is_empty());
    }
    assert_eq!(Host::default().sync(&g), Ok(()), "a lost peer is no error");
    assert_eq!(mask_status(&g, 1), [true, false]);
    assert_eq!(ack_word(&g, 0, 1), 0, "no ack to a masked peer");
    // Every rank cleans; call 2 starts from epoch 0 again and takes rank 0 back.
    clean_mask(&g);
    let good = Launch {
        timeout: Duration::from_secs(10),
        fault_rank: None,
        ..lossy
    };
    let c2 = input(2);
    let reps = run(good, &c2);
    for r in &reps {
        assert_eq!((r.epoch, r.gone.flat(), r.failed_wait), (1, 0, None));
    }
    assert_eq!(merged(&reps[1..]), g.expected(&c2, 1));
    assert_eq!(ack_word(&g, 0, 1), 1);
}

/// One capacity-mode call, blocks one after the other (the loom model runs them at once).
fn capacity_call(g: &Group, kp: &Launch, input: &Input) -> Vec<BlockReport> {
    for r in 0..g.ranks.len() {
        poison_send_headers(g, r);
    }
    for r in 0..g.ranks.len() {
        batched_pack_block(g, kp, input, r, 0);
    }
    nccl_capacity_exchange(g);
    (0..g.ranks.len())
        .map(|r| batched_unpack_block(g, kp, r, 0))
        .collect()
}

#[test]
fn capacity_poisoned_header_of_a_bad_sender_is_taken_for_its_failure() {
    let setup = Setup {
        kind: Kind::Batched,
        ranks: vec![(0, 1), (1, 1)],
        links: vec![(0, 1)],
        max_tokens: 2,
        local_experts: 1,
        build: Build::Narrow,
    };
    let g = Group::new(setup);
    let kp = Launch {
        timeout: Duration::from_secs(10),
        fault_rank: None,
        bad_input: None,
        shrink: false,
        fail_receive: None,
    };
    let c1 = Input {
        call: 1,
        route: vec![vec![vec![(1, 0)], vec![(1, 0)]], vec![]],
    };
    let rx = capacity_call(&g, &kp, &c1);
    assert_eq!(merged(&rx[1..]), g.expected(&c1, 1));
    let c2 = Input { call: 2, ..c1 };
    let bad = Launch {
        bad_input: Some(0),
        ..kp
    };
    let rx = capacity_call(&g, &bad, &c2);
    assert!(rx[1].read.is_empty(), "stale rows taken: {:?}", rx[1].read);
    assert_eq!(
        device_error(&g, 1),
        Some(DeviceError::PeerFailed {
            rank: 1,
            peer: 0,
            call: 2
        })
    );
    assert_eq!(
        Host::default().sync(&g),
        Err(DeviceError::BadInput { rank: 0 })
    );
}
