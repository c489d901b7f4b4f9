//! The README's library example: DNAS multi-head self-attention over a padded batch, with the
//! explaining-away diagnostics. `cargo run --release --example quickstart`.

use probattn::diagnostics::{explained_away_fraction, received_mass, EXPLAINED_AWAY_EPS};
use probattn::{Masks, MhaConfig, MhaInput, MultiHeadAttention, Variant};
use tch::{nn, Device, Kind, Tensor};

fn main() -> probattn::Result<()> {
    tch::manual_seed(0);
    for variant in [Variant::Softmax, Variant::Dnas] {
        let vs = nn::VarStore::new(Device::Cpu);
        let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(512, 8).with_variant(variant))?;
        let x = Tensor::randn([4, 20, 512], (Kind::Float, Device::Cpu)) * 4.0; // (B, S, E)
        let pad = Tensor::zeros([4, 20], (Kind::Bool, Device::Cpu)); // true = padding
        let _ = pad.get(1).narrow(0, 15, 5).fill_(1); // the second sequence has 15 tokens
        let input = MhaInput::self_attention(&x)
            .with_masks(Masks { key_padding: Some(&pad), query_padding: Some(&pad), ..Default::default() })
            .with_weights();
        let out = mha.forward_t(&input, true)?;
        let weights = out.weights.expect("asked for weights"); // (B, H, S, S), per head
        let counted = pad.logical_not().view([4, 1, 20]); // real tokens only
        let away = explained_away_fraction(&received_mass(&weights), Some(&counted), EXPLAINED_AWAY_EPS)?;
        println!("{variant}: context {:?}, {:.1}% of keys explained away", out.context.size(), 100.0 * away);
    }
    Ok(())
}
