//! Sinkhorn-N attention: N alternating normalizations, each key over the queries then each query
//! over the keys, in the log domain (Ding et al. 2020, Sec. 3; Sinkhorn 1964). N = 1 is DNAS;
//! as N grows the weights approach a doubly-stochastic matrix (square, unmasked scores).

use super::Normalizer;
use crate::{Error, Result};

/// N log-domain Sinkhorn sweeps (column, then row), N >= 1.
#[derive(Debug, Clone, Copy)]
pub struct Sinkhorn {
    iterations: u32,
}

impl Sinkhorn {
    pub fn new(iterations: u32) -> Result<Self> {
        if iterations == 0 {
            return Err(Error::Config("sinkhorn needs at least one iteration (sinkhorn-1 is DNAS)".into()));
        }
        Ok(Self { iterations })
    }

    pub fn iterations(&self) -> u32 {
        self.iterations
    }
}

impl Normalizer for Sinkhorn {
    fn name(&self) -> String {
        format!("sinkhorn-{}", self.iterations)
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::sinkhorn(self.iterations))
    }
}
