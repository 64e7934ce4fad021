//! The GPU backend's host side (`ep_benches::timing::run::HostSide`: the oracle's outputs and the
//! expert outputs) costs the memory of the rows the routing sends, not of the L x R*T capacity:
//! measured as this process's peak resident set (its own test binary, one test, so nothing else
//! allocates beside it).

use ep_benches::timing::run::HostSide;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{Config, Mode};

/// A field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = text
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// R = 4, E = 32, T = 256, H = 4096, K = 4, FP8: one rank's y capacity is 64 MiB (E x T rows
/// of 8 KB, above every allocator threshold, so it comes as fresh zeroed pages), 256 MiB over
/// the ranks, recv_x's half of that; the routing sends 4096 rows (32 MiB of y, 16 MiB of
/// recv_x). The host side must grow the resident set by well under the capacity of y alone.
#[test]
fn the_host_side_holds_the_received_rows_not_the_capacity() {
    let cfg = Config::new(4, 32, 256, 4096, 4, Mode::FP8).unwrap();
    let w = Workload::uniform(&cfg, 256, Routing::Random { masked: 0.0 }, 3);
    let before = status_bytes("VmRSS:");
    let host = HostSide::new(&cfg, &w.x, &w.topk_idx, &w.topk_weights).unwrap();
    let peak = status_bytes("VmHWM:");
    let grown = peak.saturating_sub(before);
    let y_capacity: u64 = 4 * 32 * 256 * 4096 * 2;
    let received: u64 = 4 * 256 * 4 * (4096 * 2 + 4096 + 32 * 4 + 4);
    let sent: usize = host
        .want
        .iter()
        .map(|o| o.recv_count.iter().sum::<i32>() as usize)
        .sum();
    assert_eq!(sent, 4 * 256 * 4, "every selection is received once");
    assert!(
        grown < received + y_capacity / 4,
        "the host side grew the resident set by {grown} bytes; the received rows are {received}, \
         the capacity of y alone {y_capacity}"
    );
    assert!(grown > received / 2, "{grown} bytes: nothing measured?");
}
