//! `ep_fast::path_group`: either path's CPU group, one endpoint per rank in rank order.

use ep_reference::{Config, CpuOptions, Mode, Path};

#[test]
fn each_path_builds_one_endpoint_per_rank_in_rank_order() {
    let cfg = Config::new(3, 6, 4, 64, 2, Mode::Bf16).unwrap();
    for path in [Path::PerExpert, Path::Batched] {
        let g = ep_fast::path_group(path, &cfg, CpuOptions::default()).unwrap();
        assert_eq!(g.len(), 3, "{path}");
        for (i, r) in g.iter().enumerate() {
            assert_eq!(r.rank(), i, "{path}");
        }
    }
}
