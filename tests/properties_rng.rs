//! Asking the registry for a variant's properties builds the variant's example, whose parameters
//! (BAM's contextual prior) are drawn from libtorch's CPU generator. The generator is set back
//! afterwards, so a seeded run draws the same numbers whether or not something asked first (the
//! Python package asks at import; BAM's settings ask while a model is built). One test in its own
//! process: any other test drawing numbers at the same time would move the shared generator.

use probattn::normalize::registry::VARIANTS;
use tch::{kind, Tensor};

#[test]
fn asking_for_properties_moves_no_seeded_stream() {
    tch::manual_seed(5);
    let want = Tensor::randn([8], kind::FLOAT_CPU);
    tch::manual_seed(5);
    let mut drew = 0;
    for spec in VARIANTS {
        drew += spec.properties().expect("every entry builds its example").parameters.len();
    }
    assert!(drew > 0, "no example drew parameters, so the test would not see the generator move");
    let got = Tensor::randn([8], kind::FLOAT_CPU);
    assert_eq!(f64::try_from((got - want).abs().max()).unwrap(), 0.0, "the seeded stream moved");
}
