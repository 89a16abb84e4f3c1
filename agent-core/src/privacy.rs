//! Differential privacy on the device: the update is clipped to an L2 bound and noised with
//! Gaussian noise before it is signed (local DP) or masked (DP-FedAvg's noise split across the
//! devices of a securely aggregated round, so that no party sees the noise-free sum). The
//! randomness is passed in: the shell gives the OS's, tests a seeded one.

use fedfleet_protocol::{DevicePrivacy, TensorBundle};
use rand::RngCore;

/// What [`privatize`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Privatized {
    /// The update's L2 norm as trained.
    pub norm: f64,
    /// The factor (≤ 1) it was scaled by to meet the bound.
    pub scale: f64,
}

/// `delta` clipped to `p.clip_norm` and each coordinate given N(0, `p.noise_stddev`²) noise,
/// as f32 tensors of the same names and shapes (the round's upload dtype is applied after).
pub fn privatize(delta: &TensorBundle, p: &DevicePrivacy, rng: &mut impl RngCore) -> Result<(TensorBundle, Privatized), String> {
    p.validate()?;
    // Each tensor as f32 once: the norm needs them all before any is scaled.
    let tensors: Vec<(&str, &[usize], Vec<f32>)> = delta.iter().map(|(name, t)| (name, t.shape.as_slice(), t.to_f32_vec())).collect();
    let norm = tensors.iter().flat_map(|(_, _, v)| v).map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    if !norm.is_finite() {
        return Err("the update's norm is not finite".into());
    }
    // A hair under the bound, so rounding to f32 cannot push the norm above it.
    let scale = if norm > p.clip_norm { p.clip_norm / norm * (1.0 - 1e-6) } else { 1.0 };
    let mut gaussian = Gaussian::default();
    let mut out = TensorBundle::new();
    for (name, shape, mut values) in tensors {
        for x in &mut values {
            *x = (f64::from(*x) * scale + p.noise_stddev * gaussian.draw(rng)) as f32;
        }
        out.insert_f32(name, shape.to_vec(), values).map_err(|e| e.to_string())?;
    }
    Ok((out, Privatized { norm, scale }))
}

/// Standard normal draws (Box-Muller; the second value of each pair is kept for the next draw).
#[derive(Default)]
struct Gaussian {
    spare: Option<f64>,
}

impl Gaussian {
    fn draw(&mut self, rng: &mut impl RngCore) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        // 53 random bits to (0, 1].
        let mut uniform = || ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let (r, theta) = ((-2.0 * uniform().ln()).sqrt(), std::f64::consts::TAU * uniform());
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn bundle(values: Vec<f32>) -> TensorBundle {
        let mut b = TensorBundle::new();
        let n = values.len();
        b.insert_f32("w", vec![n], values).unwrap();
        b
    }

    #[test]
    fn an_update_is_clipped_to_the_bound_and_noised_with_the_given_spread() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(7);
        let dim = 40_000;
        // Norm 200: scaled to norm 2, no noise.
        let big = bundle(vec![1.0; dim]);
        let clip_only = DevicePrivacy { clip_norm: 2.0, noise_stddev: 0.0, count_once: true };
        let (out, did) = privatize(&big, &clip_only, &mut rng).unwrap();
        assert!((did.norm - 200.0).abs() < 1e-6 && did.scale < 0.0101, "{did:?}");
        let norm = out.flat_f32().iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        assert!(norm <= 2.0 && norm > 1.999, "{norm}");
        // A small update is not scaled; the noise has mean 0 and the given standard deviation.
        let zero = bundle(vec![0.0; dim]);
        let noised = DevicePrivacy { clip_norm: 2.0, noise_stddev: 0.5, count_once: false };
        let (out, did) = privatize(&zero, &noised, &mut rng).unwrap();
        assert_eq!(did.scale, 1.0);
        let v = out.flat_f32();
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / dim as f64;
        let sd = (v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / dim as f64).sqrt();
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((sd - 0.5).abs() < 0.01, "{sd}");
        // Fresh randomness, fresh noise.
        let (again, _) = privatize(&zero, &noised, &mut rng).unwrap();
        assert_ne!(again, out);
    }

    #[test]
    fn bad_parameters_and_non_finite_updates_are_refused() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(1);
        let ok = bundle(vec![1.0, 2.0]);
        for (clip, sd) in [(0.0, 1.0), (f64::NAN, 1.0), (1.0, -1.0), (1.0, f64::INFINITY)] {
            let p = DevicePrivacy { clip_norm: clip, noise_stddev: sd, count_once: false };
            assert!(privatize(&ok, &p, &mut rng).is_err(), "{p:?}");
        }
        let p = DevicePrivacy { clip_norm: 1.0, noise_stddev: 0.0, count_once: false };
        assert!(privatize(&bundle(vec![f32::INFINITY]), &p, &mut rng).unwrap_err().contains("not finite"));
    }
}
