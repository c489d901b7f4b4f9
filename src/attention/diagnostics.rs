//! Diagnostics of attention weights: how much attention each key receives, and how many keys are
//! "explained away" (Ding et al. 2020, Sec. 2 and Fig. 1).

use tch::{Kind, Tensor};

use crate::mask::check_broadcastable;
use crate::Result;

/// The paper's threshold: a key is ε-explained-away when it receives less than ε = 1e-8.
pub const EXPLAINED_AWAY_EPS: f64 = 1e-8;

/// The mass each key receives, `Σ_i π_ij`: `(B, H, S_q, S_k)` weights give `(B, H, S_k)`.
pub fn received_mass(weights: &Tensor) -> Tensor {
    weights.sum_dim_intlist(&[-2i64][..], false, weights.kind())
}

/// The fraction of keys whose received mass is below `eps`, counting only the keys that
/// `counted` marks `true` (broadcastable to `mass`; `None`: all keys).
pub fn explained_away_fraction(mass: &Tensor, counted: Option<&Tensor>, eps: f64) -> Result<f64> {
    let below = mass.lt(eps);
    let (below, total) = match counted {
        Some(c) => {
            check_broadcastable("counted", c, &mass.size())?;
            let c = c.to_kind(Kind::Bool).expand_as(mass);
            (below.logical_and(&c), c.sum(Kind::Int64))
        }
        None => (below, Tensor::from(mass.numel() as i64)),
    };
    let total = i64::try_from(&total)?;
    if total == 0 {
        return Ok(0.0);
    }
    Ok(i64::try_from(&below.sum(Kind::Int64))? as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_counts_only_the_marked_keys() {
        let mass = Tensor::from_slice(&[1.0f64, 1e-9, 0.0, 2.0]).view([1, 1, 4]);
        assert_eq!(explained_away_fraction(&mass, None, EXPLAINED_AWAY_EPS).unwrap(), 0.5);
        let counted = Tensor::from_slice(&[true, true, false, true]).view([1, 1, 4]);
        let f = explained_away_fraction(&mass, Some(&counted), EXPLAINED_AWAY_EPS).unwrap();
        assert!((f - 1.0 / 3.0).abs() < 1e-15);
        let mass = Tensor::from_slice(&[0.5f64, 0.5]).view([1, 1, 2, 1]).expand([1, 1, 2, 3], false);
        assert_eq!(received_mass(&mass).size(), vec![1, 1, 3]);
    }
}
