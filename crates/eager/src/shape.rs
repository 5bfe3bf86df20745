//! `Shape`: the dimensions of a contiguous row-major tensor, kept inline (no heap) up to
//! [`MAX_RANK`] dimensions so that making an op's output costs no allocation for its shape.
//!
//! ```text
//!   Shape { dims: [B, T, D, _], rank: 3 }   element (b, t, d) at ((b·T) + t)·D + d
//!   rows() = B·T   last() = D   numel() = B·T·D
//! ```

use super::error::{Result, shape_err};
use std::fmt;

/// The most dimensions a tensor may have.
pub const MAX_RANK: usize = 4;

/// Dimensions of a contiguous row-major tensor (rank 0 to [`MAX_RANK`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Shape {
    dims: [usize; MAX_RANK],
    rank: u8,
}

impl Shape {
    /// A shape with these dimensions; an error above [`MAX_RANK`] dimensions.
    pub fn new(dims: &[usize]) -> Result<Shape> {
        if dims.len() > MAX_RANK {
            return shape_err(format!("rank {} is above the maximum {MAX_RANK}", dims.len()));
        }
        // Every element count an op derives from the shape (numel, rows, a prefix once the last
        // dimension is dropped) and its bytes must fit: the product of the dimensions, zeros
        // counted as ones, times the element size.
        let fits = dims
            .iter()
            .try_fold(crate::backend::ELEM as usize, |n, &d| n.checked_mul(d.max(1)))
            .is_some_and(|b| u64::try_from(b).is_ok());
        // BROKEN (`shape_unchecked`): overflowing shapes accepted.
        if !fits && !cfg!(tidepool_broken = "shape_unchecked") {
            return shape_err(format!("{dims:?}: the element count overflows"));
        }
        let mut d = [0; MAX_RANK];
        d[..dims.len()].copy_from_slice(dims);
        Ok(Shape { dims: d, rank: dims.len() as u8 })
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank as usize]
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.rank as usize
    }

    /// Number of elements (1 for rank 0).
    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }

    /// The last dimension (1 for rank 0).
    pub fn last(&self) -> usize {
        self.dims().last().copied().unwrap_or(1)
    }

    /// Number of rows when the tensor is seen as `[rows, last]`.
    pub fn rows(&self) -> usize {
        self.dims()[..self.rank().saturating_sub(1)].iter().product()
    }

    /// This shape without its last dimension.
    pub fn drop_last(&self) -> Shape {
        let mut s = *self;
        if s.rank > 0 {
            s.rank -= 1;
            s.dims[s.rank as usize] = 0;
        }
        s
    }

    /// This shape with its last dimension replaced by `n`.
    pub fn with_last(&self, n: usize) -> Shape {
        let mut s = *self;
        if s.rank == 0 {
            s.rank = 1;
        }
        s.dims[s.rank as usize - 1] = n;
        s
    }

    /// The shape with its last two dimensions swapped (rank ≥ 2).
    pub fn transposed(&self) -> Result<Shape> {
        let r = self.rank();
        if r < 2 {
            return shape_err(format!("transpose needs rank ≥ 2, got {self}"));
        }
        let mut s = *self;
        s.dims.swap(r - 1, r - 2);
        Ok(s)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let s = Shape::new(&[2, 3, 4]).unwrap();
        assert_eq!((s.numel(), s.rows(), s.last(), s.rank()), (24, 6, 4, 3));
        assert_eq!(s.drop_last().dims(), &[2, 3]);
        assert_eq!(s.with_last(7).dims(), &[2, 3, 7]);
        assert_eq!(s.transposed().unwrap().dims(), &[2, 4, 3]);
        assert!(Shape::new(&[1; 5]).is_err());
        assert!(Shape::new(&[1 << 32, 1 << 32]).is_err());
        assert!(Shape::new(&[usize::MAX / 2]).is_err(), "elements fit, bytes do not");
        assert!(Shape::new(&[1 << 40, 1 << 40, 0]).is_err(), "its rows would overflow");
        let scalar = Shape::new(&[]).unwrap();
        assert_eq!((scalar.numel(), scalar.rows(), scalar.last()), (1, 1, 1));
        assert!(scalar.transposed().is_err());
    }
}
