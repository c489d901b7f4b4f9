//! Learnable parameters that a caller may hand in. Each module creates its parameters with
//! [`param`]: when the path already holds a tensor of that name, that very tensor is used (its
//! autograd identity included), so that a caller who owns the parameters (the Python package,
//! whose `nn.Parameter`s must receive the gradients) puts them under the path first with
//! `tch::nn::Path::add` and then builds the module on it. Otherwise a new variable is made.

use tch::nn;

use crate::error::{Error, Result};

/// The variable `name` under `p`: the tensor already there (which must have shape `dims`), else a
/// new one of that shape from `init`.
pub fn param(p: &nn::Path, name: &str, dims: &[i64], init: nn::Init) -> Result<tch::Tensor> {
    if let Some(given) = p.get(name) {
        if given.size() != dims {
            return Err(Error::Shape(format!("parameter {} has shape {:?}, expected {dims:?}", p.path(name), given.size())));
        }
        return Ok(given);
    }
    Ok(p.var(name, dims, init))
}

#[cfg(test)]
mod tests {
    use tch::{nn, Device, Kind, Tensor};

    use crate::{MhaConfig, MhaInput, MultiHeadAttention, Variant};

    #[test]
    fn given_parameters_are_used_as_they_are_and_receive_the_gradients() {
        let vs = nn::VarStore::new(Device::Cpu);
        let logit = Tensor::from_slice(&[0.5f32, -1.0]).set_requires_grad(true);
        let _ = vs.root().add("hybrid_logit", logit.shallow_clone(), false);
        let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(8, 2).with_variant(Variant::Hnas)).unwrap();
        let x = Tensor::randn([2, 3, 8], (Kind::Float, Device::Cpu));
        mha.forward_t(&MhaInput::self_attention(&x), false).unwrap().context.sum(Kind::Float).backward();
        let grad = logit.grad();
        assert!(grad.defined() && f64::try_from(grad.abs().sum(Kind::Float)).unwrap() > 0.0, "the given logit got no gradient");
        // The projections were made, as before, beside the given tensor.
        assert!(vs.variables().contains_key("in_proj_weight"));
    }

    #[test]
    fn a_given_parameter_of_the_wrong_shape_is_named() {
        let vs = nn::VarStore::new(Device::Cpu);
        let _ = vs.root().add("hybrid_logit", Tensor::zeros([3], (Kind::Float, Device::Cpu)), false);
        let err = MultiHeadAttention::new(&vs.root(), MhaConfig::new(8, 2).with_variant(Variant::Hnas)).unwrap_err().to_string();
        assert!(err.contains("parameter hybrid_logit has shape [3], expected [2]"), "{err}");
    }
}
