//! Retired: `ep-bench` is the one program that times the GPU (issue 9 item 7). This stub only
//! says where each of its features went, and exits 2 without running anything (so a script
//! that still calls it fails loudly instead of passing on a check that did not run).

use std::process::ExitCode;

const WHERE: &str = "\
ep-gpu-check is retired: ep-bench is the one entry point for GPU timing. Its features:
  verify + time EP1/EP2/EP8 on one GPU   ep-bench --backend gpu --ranks R            (R = 1, 2, 8; --experts, --iters, --warmup as before)
  graph and stream timing                ep-bench --backend gpu --ranks R --timing graph | --timing stream
  EP2/EP8 over two GPUs                  ep-bench --backend gpu --ranks R --gpus 2
  phase profile (%globaltimer)           ep-bench --backend gpu --ranks R --profile
  wire bytes / messages / signals        the table of every ep-bench run (msgs d/c, wire MB d/c, signals)
  CUPTI kernel time, receive-hook split  printed by every GPU run of ep-bench
  one process per rank                   ep-bench --nprocs N (or ep-gpu-mp, the per-rank process binary)
Not carried over: the H200 byte-floor columns (kernels/RESULTS.md keeps the figures).";

fn main() -> ExitCode {
    eprintln!("{WHERE}");
    ExitCode::from(2)
}
