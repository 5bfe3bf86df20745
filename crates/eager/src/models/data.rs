//! Seeded random numbers ([`Rng`], SplitMix64) and a synthetic classification data set
//! ([`Clusters`]): `classes` Gaussian clusters in `dim` dimensions, so a small MLP learns it in a
//! few steps and every run with the same seed sees the same numbers.

/// SplitMix64: small, fast, and good enough for initial weights and synthetic data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.uniform()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// `n` normal values times `std`.
    pub fn normals(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| std * self.normal()).collect()
    }

    /// An integer in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A classification data set: row `i` of `inputs` (`samples × dim`) belongs to class
/// `labels[i]`.
#[derive(Clone, Debug)]
pub struct Clusters {
    /// Features, row-major `samples × dim`.
    pub inputs: Vec<f32>,
    /// Class of each sample, as f32 (what the cross-entropy op takes).
    pub labels: Vec<f32>,
    /// Features per sample.
    pub dim: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Clusters {
    /// `samples` points around `classes` random centres (spread 1) with noise `noise`.
    pub fn new(samples: usize, dim: usize, classes: usize, noise: f32, seed: u64) -> Clusters {
        let mut rng = Rng::new(seed);
        let centres = rng.normals(classes * dim, 1.0);
        let mut inputs = Vec::with_capacity(samples * dim);
        let mut labels = Vec::with_capacity(samples);
        for _ in 0..samples {
            let c = rng.below(classes);
            inputs.extend((0..dim).map(|j| centres[c * dim + j] + noise * rng.normal()));
            labels.push(c as f32);
        }
        Clusters { inputs, labels, dim, classes }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether it has no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Batch `i` of `batch` samples (wrapping around): (inputs, labels).
    pub fn batch(&self, i: usize, batch: usize) -> (Vec<f32>, Vec<f32>) {
        let n = self.len();
        let mut x = Vec::with_capacity(batch * self.dim);
        let mut y = Vec::with_capacity(batch);
        for j in 0..batch {
            let s = (i * batch + j) % n;
            x.extend_from_slice(&self.inputs[s * self.dim..(s + 1) * self.dim]);
            y.push(self.labels[s]);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_and_in_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..100 {
            let u = a.uniform();
            assert_eq!(u, b.uniform());
            assert!((0.0..1.0).contains(&u));
        }
        let d = Clusters::new(10, 3, 4, 0.1, 1);
        assert_eq!((d.len(), d.inputs.len()), (10, 30));
        assert!(d.labels.iter().all(|&l| l < 4.0 && l.fract() == 0.0));
        let (x, y) = d.batch(3, 4); // samples 12..16 wrap to 2..6
        assert_eq!((x.len(), y), (12, d.labels[2..6].to_vec()));
    }
}
