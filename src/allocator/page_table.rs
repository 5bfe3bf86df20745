//! A range's page table (expandable segments): the physical allocation ("chunk") under each
//! mapped page, found in O(1) by page index from the range's base.
//!
//! ```text
//!  pages   [0][1][2][3][4][5]  ·  ·  [8][9]        slots: one u32 per page, 0 = unmapped,
//!  slots    1  1  2  2  2  3   0  0   4  4                else 1 + the chunk's index
//!  chunks  [ c1 ][   c2   ][c3]      [ c4 ]        (one physical allocation each; freed
//!                                                   entries reused)
//! ```
//!
//! A page costs four bytes and a chunk one entry, so recording a growth writes a few words per
//! page and the table grows by doubling, rarely (a growth of one 2 MiB page per step of a
//! training loop touches it once per step).

use crate::device::PhysHandle;

/// One physical allocation mapped into a range: `pages` pages from `lo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Chunk {
    /// The physical allocation.
    pub(super) handle: PhysHandle,
    /// The address of its first page.
    pub(super) lo: u64,
    /// Its pages.
    pub(super) pages: u64,
}

/// The chunk under each mapped page of a range. See the module docs.
pub(super) struct PageTable {
    base: u64,
    page: u64,
    /// Per page from `base`: 0 where unmapped, else 1 + the index of its chunk in `chunks`.
    slots: Vec<u32>,
    chunks: Vec<Chunk>,
    /// Indices of `chunks` entries no longer used.
    free: Vec<u32>,
    /// Mapped pages.
    len: usize,
}

/// Pages the table makes room for at its first insert (a 2 KiB table).
const FIRST_SLOTS: usize = 512;

/// Chunks the table makes room for at its first insert (mlp_train's large range holds 27: one
/// allocation instead of five as the list doubles).
const FIRST_CHUNKS: usize = 32;

impl PageTable {
    pub(super) fn new(base: u64, page: u64) -> PageTable {
        PageTable { base, page, slots: Vec::new(), chunks: Vec::new(), free: Vec::new(), len: 0 }
    }

    #[inline]
    fn index(&self, va: u64) -> usize {
        ((va - self.base) / self.page) as usize
    }

    /// Records chunk `c` over its pages (none of them mapped).
    pub(super) fn insert(&mut self, c: Chunk) {
        let (i, n) = (self.index(c.lo), c.pages as usize);
        let k = match self.free.pop() {
            Some(k) => {
                self.chunks[k as usize] = c;
                k
            }
            None => {
                if self.chunks.capacity() == 0 {
                    self.chunks.reserve(FIRST_CHUNKS);
                }
                self.chunks.push(c);
                (self.chunks.len() - 1) as u32
            }
        };
        if i >= self.slots.len() {
            // At or above the top (a range growing): the new pages are appended.
            if self.slots.capacity() == 0 {
                self.slots.reserve(FIRST_SLOTS.max(i + n));
            }
            self.slots.resize(i, 0);
            self.slots.extend(std::iter::repeat_n(k + 1, n));
        } else {
            if i + n > self.slots.len() {
                self.slots.resize(i + n, 0);
            }
            for slot in &mut self.slots[i..i + n] {
                debug_assert_eq!(*slot, 0, "page mapped twice");
                *slot = k + 1;
            }
        }
        self.len += n;
    }

    /// Forgets the chunk starting at `lo`.
    pub(super) fn remove(&mut self, lo: u64) -> Option<Chunk> {
        let i = self.index(lo);
        let k = self.slots.get(i).copied().filter(|&k| k != 0)? - 1;
        let c = self.chunks[k as usize];
        debug_assert_eq!(c.lo, lo, "a chunk is removed whole");
        for slot in &mut self.slots[i..i + c.pages as usize] {
            *slot = 0;
        }
        self.len -= c.pages as usize;
        if self.len == 0 {
            *self = PageTable::new(self.base, self.page);
        } else {
            self.free.push(k);
        }
        Some(c)
    }

    /// The chunk under the page at `va`.
    #[inline]
    pub(super) fn get(&self, va: u64) -> Option<Chunk> {
        match self.slots.get(self.index(va)) {
            Some(&k) if k != 0 => Some(self.chunks[k as usize - 1]),
            _ => None,
        }
    }

    /// The chunks lying wholly inside the mapped pages `[a, z)` (page-aligned), in address
    /// order.
    pub(super) fn whole_chunks(&self, a: u64, z: u64) -> impl Iterator<Item = Chunk> + '_ {
        let mut va = a;
        std::iter::from_fn(move || {
            while va < z {
                let c = self.get(va).expect("a mapped page");
                va = c.lo + c.pages * self.page;
                if c.lo >= a && va <= z {
                    return Some(c);
                }
            }
            None
        })
    }

    /// Whether the page at `va` is mapped.
    pub(super) fn contains(&self, va: u64) -> bool {
        self.get(va).is_some()
    }

    /// Mapped pages.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// No page mapped.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every chunk mapped, in no particular order.
    pub(super) fn chunks(&self) -> Vec<Chunk> {
        let mut unused = vec![false; self.chunks.len()];
        self.free.iter().for_each(|&k| unused[k as usize] = true);
        self.chunks.iter().zip(unused).filter(|(_, u)| !u).map(|(c, _)| *c).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x4000_0000;
    const P: u64 = 0x1000;

    fn chunk(h: u64, page: u64, pages: u64) -> Chunk {
        Chunk { handle: PhysHandle(h), lo: BASE + page * P, pages }
    }

    #[test]
    fn pages_find_their_chunk_and_freed_entries_are_reused() {
        let mut t = PageTable::new(BASE, P);
        assert!(t.is_empty());
        assert_eq!(t.get(BASE), None);
        let (a, b, c) = (chunk(1, 0, 2), chunk(2, 2, 3), chunk(3, 8, 2));
        for x in [a, b, c] {
            t.insert(x);
        }
        assert_eq!(t.len(), 7);
        let under: Vec<_> = (0..11).map(|p| t.get(BASE + p * P + 7).map(|c| c.handle.0)).collect();
        let want = [1, 1, 2, 2, 2, 0, 0, 0, 3, 3, 0].map(|h| (h != 0).then_some(h));
        assert_eq!(under, want);
        assert!(t.contains(BASE + 9 * P) && !t.contains(BASE + 5 * P));
        // Far beyond the table: unmapped, no panic.
        assert_eq!(t.get(BASE + 1_000_000 * P), None);
        assert_eq!(t.remove(BASE + 2 * P), Some(b));
        assert_eq!(t.remove(BASE + 2 * P), None);
        assert_eq!((t.len(), t.get(BASE + 3 * P)), (4, None));
        // The freed entry serves the next chunk.
        let d = chunk(4, 5, 1);
        t.insert(d);
        assert_eq!(t.chunks.len(), 3);
        assert_eq!(t.get(BASE + 5 * P), Some(d));
        for x in [a, c, d] {
            assert_eq!(t.remove(x.lo), Some(x));
        }
        assert!(t.is_empty());
        assert!(t.slots.is_empty() && t.chunks.is_empty() && t.free.is_empty());
    }
}
