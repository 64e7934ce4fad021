//! GPU tests: both paths bit-identical to the oracle. A custom runner (`harness = false`): each
//! test needs a CUDA GPU (some two) and NVRTC; where they are missing it prints
//! `SKIPPED: <test>: <reason>` and is counted as skipped, never as passed. The summary line gives
//! passed / failed / skipped, and the process fails when a test failed. Tests run one at a time
//! (a launch occupies every multiprocessor). Arguments: an optional name filter; cargo's flags
//! (`--nocapture`, `--test-threads=N`, ...) are accepted and ignored.

use ep_test_runner as runner;

mod common;
mod device;
mod errors;
mod graphs;
mod nccl;
mod paths;
mod wide;

use device::*;
use errors::*;
use graphs::*;
use nccl::*;
use paths::*;
use wide::*;

/// (name, GPUs needed, test)
const TESTS: &[(&str, usize, fn())] = &[
    (
        "gpu_r1_both_paths_equal_oracle",
        1,
        gpu_r1_both_paths_equal_oracle,
    ),
    (
        "gpu_virtual_r2_r4_r8_both_paths_equal_oracle",
        1,
        gpu_virtual_r2_r4_r8_both_paths_equal_oracle,
    ),
    (
        "gpu_scales_column_major_equal_oracle",
        1,
        gpu_scales_column_major_equal_oracle,
    ),
    (
        "gpu_two_gpus_r2_r4_both_paths_equal_oracle",
        2,
        gpu_two_gpus_r2_r4_both_paths_equal_oracle,
    ),
    (
        "gpu_skewed_routing_all_tokens_to_one_expert",
        1,
        gpu_skewed_routing_all_tokens_to_one_expert,
    ),
    (
        "gpu_standard_setting_r1_r2_r8_equal_oracle",
        1,
        gpu_standard_setting_r1_r2_r8_equal_oracle,
    ),
    (
        "gpu_1000_consecutive_calls_on_the_same_buffers",
        1,
        gpu_1000_consecutive_calls_on_the_same_buffers,
    ),
    (
        "gpu_fp8_cast_is_bit_identical_to_the_cpu",
        1,
        gpu_fp8_cast_is_bit_identical_to_the_cpu,
    ),
    (
        "gpu_stalled_peer_times_out_with_rank_peer_phase_call",
        1,
        gpu_stalled_peer_times_out_with_rank_peer_phase_call,
    ),
    (
        "gpu_bad_inputs_are_typed_errors",
        1,
        gpu_bad_inputs_are_typed_errors,
    ),
    (
        "gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle",
        1,
        gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle,
    ),
    (
        "gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle",
        2,
        gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle,
    ),
    (
        "gpu_nccl_bad_input_is_a_typed_error_both_sizes",
        1,
        gpu_nccl_bad_input_is_a_typed_error_both_sizes,
    ),
    (
        "gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes",
        2,
        gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes,
    ),
    (
        "gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays",
        1,
        gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays,
    ),
    (
        "gpu_nccl_two_gpus_device_api_capacity_equals_oracle",
        2,
        gpu_nccl_two_gpus_device_api_capacity_equals_oracle,
    ),
    (
        "gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle",
        1,
        gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle,
    ),
    (
        "gpu_device_api_two_gpus_r2_r4_equal_oracle",
        2,
        gpu_device_api_two_gpus_r2_r4_equal_oracle,
    ),
    (
        "gpu_device_api_checks_stream_and_shapes_on_the_host",
        1,
        gpu_device_api_checks_stream_and_shapes_on_the_host,
    ),
    (
        "gpu_device_bad_input_typed_error_no_stray_write",
        1,
        gpu_device_bad_input_typed_error_no_stray_write,
    ),
    (
        "gpu_graph_dispatch_expert_combine_1000_replays",
        1,
        gpu_graph_dispatch_expert_combine_1000_replays,
    ),
    (
        "gpu_graph_with_receive_hook_split_1000_replays",
        1,
        gpu_graph_with_receive_hook_split_1000_replays,
    ),
    (
        "gpu_epochs_past_2_32_and_the_signal_tag_wrap",
        1,
        gpu_epochs_past_2_32_and_the_signal_tag_wrap,
    ),
    (
        "gpu_rank_ep_process_mode_equals_oracle",
        1,
        gpu_rank_ep_process_mode_equals_oracle,
    ),
    (
        "gpu_error_reaches_the_next_call_without_a_sync",
        1,
        gpu_error_reaches_the_next_call_without_a_sync,
    ),
    (
        "gpu_trap_on_error_ends_the_context_and_still_names_the_error",
        1,
        gpu_trap_on_error_ends_the_context_and_still_names_the_error,
    ),
    (
        "gpu_shrink_masks_a_lost_peer_and_the_group_goes_on",
        1,
        gpu_shrink_masks_a_lost_peer_and_the_group_goes_on,
    ),
    (
        "gpu_virtual_r64_r128_r256_both_paths_all_modes_equal_oracle",
        1,
        gpu_virtual_r64_r128_r256_both_paths_all_modes_equal_oracle,
    ),
    (
        "gpu_virtual_r64_standard_h_k_equal_oracle",
        1,
        gpu_virtual_r64_standard_h_k_equal_oracle,
    ),
    (
        "gpu_device_api_r64_r256_all_modes_equal_oracle",
        1,
        gpu_device_api_r64_r256_all_modes_equal_oracle,
    ),
    (
        "gpu_shrink_r64_masks_peers_past_the_first_word",
        1,
        gpu_shrink_r64_masks_peers_past_the_first_word,
    ),
];

fn main() {
    if std::env::var_os(TRAP_CHILD).is_some() {
        trap_child();
    }
    let mut runner = runner::Runner::new("gpu tests");
    for &(name, gpus, test) in TESTS {
        let probe = runner::probe(gpus, name.contains("nccl"));
        runner.run(name, probe, || {
            test();
            runner::Verdict::Ok(String::new())
        });
    }
    runner.finish()
}
