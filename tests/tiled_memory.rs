//! The memory the tile loop holds (`probattn::tiled` on its ATen route, CUDA's route, here on the
//! CPU with the fused kernel off): a forward and backward pass of softmax, DNAS and Sinkhorn-3
//! peaks at a few (tile, S_k) blocks of scores besides O(S) tensors, never near the (S_q, S_k)
//! matrix. Its own test binary: the counting allocator counts the whole process, so no other test
//! may allocate beside this one.

use anyhow::{ensure, Result};
use probattn::memory;
use probattn::tiled::{attend_tiled, Tiled, TiledOptions};
use probattn::Masks;
use tch::{Device, Kind, Tensor};

#[test]
fn the_tile_loop_holds_a_few_blocks_of_scores() -> Result<()> {
    let (b, h, s, d, tile) = (1i64, 2i64, 4096i64, 8i64, 128i64);
    memory::track(Device::Cpu)?;
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    let inputs: Vec<Tensor> = (0..3).map(|_| Tensor::randn([b, h, s, d], opts)).collect();
    let block = (b * h * tile * s * 4) as f64; // one (tile, S_k) block of float32 scores
    let matrix = (b * h * s * s * 4) as f64;
    for (name, plan) in [("softmax", Tiled::softmax()), ("dnas", Tiled::dnas()), ("sinkhorn-3", Tiled::sinkhorn(3))] {
        let leaves: Vec<Tensor> = inputs.iter().map(|t| t.detach().set_requires_grad(true)).collect();
        let options = TiledOptions { fused_cpu: false, ..TiledOptions::new(tile) };
        let (result, peak) = memory::peak_during(Device::Cpu, || -> Result<()> {
            let out = attend_tiled(&leaves[0], &leaves[1], &leaves[2], &Masks::default(), &plan, options)?;
            out.output.sum(Kind::Float).backward();
            Ok(())
        })?;
        result?;
        let blocks = peak as f64 / block;
        eprintln!(
            "{name}: peak {:.2} MiB = {blocks:.2} blocks of scores ({:.3} of the S x S matrix)",
            peak as f64 / 1048576.0,
            peak as f64 / matrix
        );
        // The O(S) tensors (gradients, output, statistics) come to about half a block here, and
        // the loop holds about three blocks at once: 3.4 in all, measured. Before its passes
        // worked in place it held five to six (at S = 2,048, tile 256, H 8).
        ensure!(blocks <= 4.0, "{name}: the forward and backward passes peaked at {blocks:.2} blocks of scores");
    }
    Ok(())
}
