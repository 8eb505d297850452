//! Rotary position embedding per layer type (docs/MODEL.md §7): NeoX
//! rotate-half within the first `rotary_dims` of each head, frequency
//! denominator = rotated width, dims past it pass through.

use crate::checkpoint::RopeSpec;

pub struct Rope {
    rotary_dims: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(spec: RopeSpec) -> Self {
        let r = spec.rotary_dims;
        // float32 as the HF reference: 1 / theta^(2j / R).
        let theta = spec.theta as f32;
        let inv_freq = (0..r / 2)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / r as f32))
            .collect();
        Rope {
            rotary_dims: r,
            inv_freq,
        }
    }

    pub fn rotary_dims(&self) -> usize {
        self.rotary_dims
    }

    /// cos and sin of the angles at absolute position `pos`, each `rotary_dims / 2` long.
    pub fn angles(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f32;
        self.inv_freq
            .iter()
            .map(|f| {
                let a = p * f;
                (a.cos(), a.sin())
            })
            .unzip()
    }

    /// Rotate one head vector in place.
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dims / 2;
        let (a, rest) = head.split_at_mut(half);
        let b = &mut rest[..half];
        for j in 0..half {
            let (x, y) = (a[j], b[j]);
            a[j] = x * cos[j] - y * sin[j];
            b[j] = y * cos[j] + x * sin[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rotation_leaves_tail_and_uses_rotated_width() {
        let rope = Rope::new(RopeSpec {
            theta: 10000.0,
            rotary_dims: 4,
        });
        // j = 1 frequency must use denominator R = 4: theta^(-2/4) = 0.01.
        assert!((rope.inv_freq[1] - 0.01).abs() < 1e-7);
        let (cos, sin) = rope.angles(3);
        let mut h = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope.apply(&mut h, &cos, &sin);
        // Pairs are (0, 2) and (1, 3): rotate-half, not interleaved.
        let (c0, s0) = (3f32.cos(), 3f32.sin());
        assert!((h[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((h[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
        let (c1, s1) = ((0.03f32).cos(), (0.03f32).sin());
        assert!((h[1] - (2.0 * c1 - 4.0 * s1)).abs() < 1e-6);
        assert_eq!(&h[4..], &[5.0, 6.0]);
    }

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let rope = Rope::new(RopeSpec {
            theta: 5e6,
            rotary_dims: 64,
        });
        let orig: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut h = orig.clone();
        let (c, s) = rope.angles(0);
        rope.apply(&mut h, &c, &s);
        assert_eq!(h, orig);
        let (c, s) = rope.angles(12345);
        rope.apply(&mut h, &c, &s);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = h.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
        assert_eq!(&h[64..], &orig[64..]);
    }
}
