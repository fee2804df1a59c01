//! Counter-based randomness: every random number is a hash of its coordinates (seed,
//! prompt, sample, position...), never the next value of a stream. Results therefore do
//! not depend on evaluation order, thread count or which process draws them, and stay
//! bit-stable across dependency upgrades.

/// SplitMix64's finaliser: a bijective mix with full avalanche.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A 64-bit hash of an ordered list of keys.
pub(crate) fn hash(keys: &[u64]) -> u64 {
    keys.iter().fold(0x9e37_79b9_7f4a_7c15, |state, &key| {
        mix(state ^ mix(key.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    })
}

/// A hash of a byte string, for keying on text.
pub(crate) fn hash_bytes(key: u64, bytes: &[u8]) -> u64 {
    bytes
        .chunks(8)
        .fold(hash(&[key, bytes.len() as u64]), |state, chunk| {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            hash(&[state, u64::from_le_bytes(word)])
        })
}

/// Uniform in [0, 1) with 53 random bits.
pub(crate) fn unit(keys: &[u64]) -> f64 {
    (hash(keys) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform integer in [0, bound); `bound` must be non-zero. The modulo bias is below
/// 2^-40 for every bound used here (all under 2^24).
pub(crate) fn below(keys: &[u64], bound: u64) -> u64 {
    hash(keys) % bound
}

/// Standard normal by Box-Muller from two independent uniforms.
pub(crate) fn normal(keys: &[u64]) -> f64 {
    let h = hash(keys);
    let u1 = ((mix(h) >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
    let u2 = (mix(h ^ 0x5851_f42d_4c95_7f2d) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_every_key_and_their_order() {
        let base = hash(&[1, 2, 3]);
        assert_eq!(base, hash(&[1, 2, 3]));
        assert_ne!(base, hash(&[1, 2, 4]));
        assert_ne!(base, hash(&[3, 2, 1]));
        assert_ne!(base, hash(&[1, 2]));
        assert_ne!(hash_bytes(0, b"12+3="), hash_bytes(0, b"12+3=\0"));
    }

    #[test]
    fn uniforms_and_normals_have_the_right_moments() {
        let n = 20_000u64;
        let units: Vec<f64> = (0..n).map(|i| unit(&[7, i])).collect();
        assert!(units.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = units.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");

        let normals: Vec<f64> = (0..n).map(|i| normal(&[9, i])).collect();
        let mean = normals.iter().sum::<f64>() / n as f64;
        let var = normals.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
        assert!(normals.iter().all(|x| x.is_finite()));

        let mut counts = [0u32; 7];
        for i in 0..7000 {
            counts[below(&[3, i], 7) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (850..1150).contains(&c)),
            "{counts:?}"
        );
    }
}
