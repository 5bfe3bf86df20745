//! The free blocks of one pool key, by size: a segregated-fit index with a two-level bitmap
//! (TLSF's, as in `rlsf` and `offset-allocator`), whose bins are kept sorted so that the answer
//! is exactly the best fit — the smallest free block ≥ the request, lowest address among equals.
//!
//! ```text
//!  size ──▶ (fl, sl):  fl = octave (log2 size − 3),  sl = the next 4 bits below the top bit
//!
//!  fl_map  0b…0110_0100            bit fl set ⇔ some bin of octave fl holds a block
//!                │││   └─ fl = 2 ──▶ sl_map[2] 0b…0001_0010 ─▶ bins[2][1], bins[2][4]
//!                ││└─ fl = 5 ──────▶ sl_map[5] 0b1000_…_0000 ─▶ bins[5][15]
//!                │└─ fl = 6 ───────▶ sl_map[6] …
//!
//!  bins[fl][sl]: rest [(size, addr, id), …] + last   16 bins per octave, each ≤ 1/16 of its sizes
//!               sorted largest first; `last`, the smallest, held in the bin itself (an octave's
//!               bins are made on first use; a bin is empty when its bit is clear)
//! ```
//!
//! A request of `n` bytes maps to bin `b = bin(n)`. Every block in a bin above `b` is larger
//! than every block of `b`, so the best fit is the smallest entry ≥ `n` of bin `b` if there is
//! one (the bin's last entry when that one fits, else a binary search), else the smallest
//! (last) entry of the next non-empty bin, found with two `trailing_zeros` on the bitmaps.
//! A bin is kept in *descending* order so that the entry the best fit takes is usually its
//! last: a bin of one size (every bin below 16 KiB; same-size whole segments) gives its lowest
//! address, which a hand-out removes with a pop and a LIFO free puts back with a push, no
//! search and no move. That entry is held in the bin itself, the others in a vector (since
//! 2026-12-06): most bins hold one block at a time, and such a bin allocates nothing and is
//! read without following a pointer. Sizes below 2⁴ bytes get one bin each; with the default
//! 512-byte granularity every bin below 16 KiB holds a single size. Bins hold few blocks (a
//! bin spans 6 % of its octave; the most on the real traces is ~80 free 12 MiB segments in
//! one bin, gpt2_train), so a binary search and a short move keep them sorted; nothing
//! allocates once a bin has held as many blocks as it holds.
//!
//! 16 bins per octave, not 32 (since 2026-12-06): a bin's first block allocated its vector
//! then, and with half as many bins a replay touched fewer of them (−0.4 to −1 % instructions
//! per op on the real traces; 8 bins gained 0.2 % more, 4 lost 4 % on vit_train; with the
//! smallest entry in place 8, 16 and 32 bins are within 0.1 % of each other).

/// Bits of the second level: 2^SL_BITS bins per octave.
const SL_BITS: u32 = 4;
/// Bins per octave.
const SL: usize = 1 << SL_BITS;
/// Octaves: sizes below 2^SL_BITS share octave 0 (one bin per size), then one per power of two.
const FL: usize = 64 - SL_BITS as usize + 1;

/// One free block: ordered by (size, address), as the best fit wants. No two free blocks
/// share an address, so (size, address) identifies one: the order compares them as one
/// 128-bit key ([`Entry::order`]), and the id only rides along.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// Its size in bytes.
    pub size: u64,
    /// Its first address.
    pub addr: u64,
    /// Its block id in the pool's slab.
    pub id: usize,
}

impl Entry {
    /// The sort key: size, then address.
    #[inline(always)]
    fn order(&self) -> u128 {
        (u128::from(self.size) << 64) | u128::from(self.addr)
    }
}

impl PartialOrd for Entry {
    #[inline(always)]
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    #[inline(always)]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.order().cmp(&other.order())
    }
}

/// The bin of a size: (octave, bin within the octave). Monotonic in `size`.
#[inline]
fn bin_of(size: u64) -> (usize, usize) {
    if size < SL as u64 {
        return (0, size as usize);
    }
    let top = 63 - size.leading_zeros();
    let fl = (top - SL_BITS + 1) as usize;
    let sl = ((size >> (top - SL_BITS)) as usize) & (SL - 1);
    (fl, sl)
}

/// One bin, sorted largest first: its smallest entry (what a best fit takes) held in place, the
/// others in a vector. A bin is empty exactly when its bit in `sl_map` is clear, and then
/// `last` means nothing and `rest` is empty. Most bins hold one block at a time (58–85 % of
/// insertions on the real traces go into an empty bin), which then costs no allocation and no
/// pointer to follow; the vector is allocated by a bin's first second block.
#[derive(Clone, Debug, Default)]
struct Bin {
    /// The smallest entry (while the bin is not empty).
    last: Entry,
    /// The other entries, largest first (all larger than `last`).
    rest: Vec<Entry>,
}

impl Bin {
    /// The largest entry of a non-empty bin.
    #[inline]
    fn first(&self) -> Entry {
        self.rest.first().copied().unwrap_or(self.last)
    }

    /// Every entry of a non-empty bin, largest first.
    fn entries(&self) -> impl Iterator<Item = &Entry> + '_ {
        self.rest.iter().chain(std::iter::once(&self.last))
    }
}

/// Where an entry sits in its (non-empty) bin.
#[derive(Clone, Copy)]
enum At {
    /// The bin's smallest entry.
    Last,
    /// `rest[i]`.
    Rest(usize),
}

/// Where the entry of key `k` sits in a non-empty bin: its smallest (what a best fit takes)
/// without a search, else found by binary search. (Size and address identify an entry: the id
/// only rides along.)
#[inline(always)]
fn position(bin: &Bin, k: u128) -> Option<At> {
    if bin.last.order() == k {
        return Some(At::Last);
    }
    let at = bin.rest.partition_point(|x| x.order() > k);
    bin.rest.get(at).is_some_and(|x| x.order() == k).then_some(At::Rest(at))
}

/// The bins of one octave.
type Octave = [Bin; SL];

/// The free blocks of one pool key. See the module docs.
#[derive(Clone)]
pub struct FreeIndex {
    /// Bit `fl` set ⇔ `sl_map[fl] != 0`.
    fl_map: u64,
    /// Bit `sl` of `sl_map[fl]` set ⇔ bin (fl, sl) is not empty.
    sl_map: [u32; FL],
    /// The bins, by octave; an octave's bins are made when it is first used (a pool key uses a
    /// few octaves), and kept.
    octaves: [Option<Box<Octave>>; FL],
    /// Entries in all bins.
    len: usize,
    /// Bytes in all bins.
    bytes: u64,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            fl_map: 0,
            sl_map: [0; FL],
            octaves: std::array::from_fn(|_| None),
            len: 0,
            bytes: 0,
        }
    }
}

impl FreeIndex {
    /// Whether bin (fl, sl) holds entries.
    #[inline(always)]
    fn holds(&self, fl: usize, sl: usize) -> bool {
        self.sl_map[fl] & (1 << sl) != 0
    }

    /// Bin (fl, sl) if it is not empty.
    #[inline]
    fn bin(&self, fl: usize, sl: usize) -> Option<&Bin> {
        match self.holds(fl, sl) {
            true => self.octaves[fl].as_ref().map(|o| &o[sl]),
            false => None,
        }
    }

    /// Bin (fl, sl), its octave made if need be (out of line: once per octave).
    #[inline(always)]
    fn bin_mut(&mut self, fl: usize, sl: usize) -> &mut Bin {
        if self.octaves[fl].is_none() {
            self.make_octave(fl);
        }
        match self.octaves[fl].as_mut() {
            Some(octave) => &mut octave[sl],
            None => unreachable!("octave {fl} made above"),
        }
    }

    /// Makes octave `fl`'s bins, empty.
    #[cold]
    #[inline(never)]
    fn make_octave(&mut self, fl: usize) {
        self.octaves[fl] = Some(Box::new(std::array::from_fn(|_| Bin::default())));
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of free blocks.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The smallest entry ≥ `size` bytes (lowest address among equals), if any.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<Entry> {
        let (fl, sl) = bin_of(size);
        if let Some(bin) = self.bin(fl, sl) {
            if bin.last.size >= size {
                return Some(bin.last);
            }
            // Descending: the entries ≥ `size` are a prefix, whose last is the best fit.
            let at = bin.rest.partition_point(|e| e.size >= size);
            if at > 0 {
                return Some(bin.rest[at - 1]);
            }
        }
        self.first_above(fl, sl)
    }

    /// The entry right after `e` in (size, address) order, if any (`e` need not be indexed).
    #[inline]
    pub fn next_after(&self, e: &Entry) -> Option<Entry> {
        let (fl, sl) = bin_of(e.size);
        let k = e.order();
        if let Some(bin) = self.bin(fl, sl) {
            // Descending: the entries after `e` are a prefix, whose last is the one right after.
            if bin.last.order() > k {
                return Some(bin.last);
            }
            let at = bin.rest.partition_point(|x| x.order() > k);
            if at > 0 {
                return Some(bin.rest[at - 1]);
            }
        }
        self.first_above(fl, sl)
    }

    /// The smallest entry of the first non-empty bin above bin (fl, sl): later in this octave,
    /// else the first bin of a later octave.
    #[inline]
    fn first_above(&self, fl: usize, sl: usize) -> Option<Entry> {
        let (fl, sl) = self.bin_above(fl, sl)?;
        self.bin(fl, sl).map(|b| b.last)
    }

    /// The first non-empty bin above bin (fl, sl).
    #[inline]
    fn bin_above(&self, fl: usize, sl: usize) -> Option<(usize, usize)> {
        let above = self.sl_map[fl] & (u32::MAX << sl << 1);
        if above != 0 {
            return Some((fl, above.trailing_zeros() as usize));
        }
        let octaves = self.fl_map & (u64::MAX << fl << 1);
        if octaves == 0 {
            return None;
        }
        let fl = octaves.trailing_zeros() as usize;
        Some((fl, self.sl_map[fl].trailing_zeros() as usize))
    }

    /// [`FreeIndex::best_fit`], and whether an entry larger than the one found exists (read
    /// from the found entry's bin and the bitmaps above it: no second search).
    #[inline]
    pub fn best_fit_and_larger(&self, size: u64) -> Option<(Entry, bool)> {
        let (fl, sl) = bin_of(size);
        let mut found = None;
        if let Some(bin) = self.bin(fl, sl) {
            if bin.last.size >= size {
                found = Some((bin, bin.last));
            } else {
                let at = bin.rest.partition_point(|e| e.size >= size);
                if at > 0 {
                    found = Some((bin, bin.rest[at - 1]));
                }
            }
        }
        let (fl, sl, bin, e) = match found {
            Some((bin, e)) => (fl, sl, bin, e),
            None => {
                let (fl, sl) = self.bin_above(fl, sl)?;
                let bin = self.bin(fl, sl)?;
                (fl, sl, bin, bin.last)
            }
        };
        // Bins are descending (the first is the bin's largest); every bin above holds larger sizes.
        let larger = bin.first().size > e.size || self.bin_above(fl, sl).is_some();
        Some((e, larger))
    }

    /// Adds an entry (which must not be in the index).
    #[inline]
    pub fn insert(&mut self, e: Entry) {
        let (fl, sl) = bin_of(e.size);
        self.put(fl, sl, e);
    }

    /// Removes an entry; returns whether it was there.
    #[inline]
    pub fn remove(&mut self, e: &Entry) -> bool {
        let (fl, sl) = bin_of(e.size);
        self.take(fl, sl, e)
    }

    /// Replaces the indexed entry `old` with `new` (not indexed): what a split or a merge
    /// does to a free block (its remainder or the merged block takes its place). Where both
    /// fall in one bin and `new` keeps `old`'s rank there (the bin's smallest entry split or
    /// merged within its bin), the entry is overwritten in place — no search on a bin's
    /// smallest, no move, no bitmap or count change; else a removal and an insertion, in one
    /// call. Returns whether `old` was there (if not, nothing changes).
    #[inline]
    pub fn replace(&mut self, old: &Entry, new: Entry) -> bool {
        let (fl, sl) = bin_of(old.size);
        let to = bin_of(new.size);
        if to == (fl, sl) && self.holds(fl, sl) {
            let Some(octave) = self.octaves[fl].as_mut() else { return false };
            let bin = &mut octave[sl];
            let Some(at) = position(bin, old.order()) else { return false };
            // Descending: the entry before must stay larger, the one after smaller.
            let k = new.order();
            let keeps_rank = match at {
                At::Last => bin.rest.last().is_none_or(|x| x.order() > k),
                At::Rest(i) => {
                    (i == 0 || bin.rest[i - 1].order() > k)
                        && bin.rest.get(i + 1).unwrap_or(&bin.last).order() < k
                }
            };
            if keeps_rank {
                match at {
                    At::Last => bin.last = new,
                    At::Rest(i) => bin.rest[i] = new,
                }
                self.bytes = self.bytes - old.size + new.size;
                return true;
            }
        }
        if !self.take(fl, sl, old) {
            return false;
        }
        self.put(to.0, to.1, new);
        true
    }

    /// Adds `e` to its bin (fl, sl).
    #[inline(always)]
    fn put(&mut self, fl: usize, sl: usize, e: Entry) {
        let holds = self.holds(fl, sl);
        let bin = self.bin_mut(fl, sl);
        let k = e.order();
        if !holds {
            // The bin's first entry: in place.
            bin.last = e;
        } else if k < bin.last.order() {
            // The new smallest (a LIFO free of the lowest address).
            bin.rest.push(std::mem::replace(&mut bin.last, e));
        } else {
            // (An entry equal to one held is found by the search and refused by the assert.)
            assert!(bin.last.order() != k, "entry already in the free index");
            let at = bin.rest.partition_point(|x| x.order() > k);
            assert!(
                bin.rest.get(at).is_none_or(|x| x.order() != k),
                "entry already in the free index"
            );
            bin.rest.insert(at, e);
        }
        self.sl_map[fl] |= 1 << sl;
        self.fl_map |= 1 << fl;
        self.len += 1;
        self.bytes += e.size;
    }

    /// Removes `e` from its bin (fl, sl); whether it was there.
    #[inline(always)]
    fn take(&mut self, fl: usize, sl: usize, e: &Entry) -> bool {
        if !self.holds(fl, sl) {
            return false;
        }
        let Some(octave) = self.octaves[fl].as_mut() else { return false };
        let bin = &mut octave[sl];
        let Some(at) = position(bin, e.order()) else { return false };
        match at {
            // The bin's smallest: what a best fit takes.
            At::Last => {
                debug_assert_eq!(bin.last.id, e.id, "one block per (size, address)");
                match bin.rest.pop() {
                    Some(next) => bin.last = next,
                    None => {
                        self.sl_map[fl] &= !(1 << sl);
                        if self.sl_map[fl] == 0 {
                            self.fl_map &= !(1 << fl);
                        }
                    }
                }
            }
            At::Rest(i) => {
                debug_assert_eq!(bin.rest[i].id, e.id, "one block per (size, address)");
                bin.rest.remove(i);
            }
        }
        self.len -= 1;
        self.bytes -= e.size;
        true
    }

    /// Whether the entry is in the index.
    pub fn contains(&self, e: &Entry) -> bool {
        let (fl, sl) = bin_of(e.size);
        self.bin(fl, sl).is_some_and(|b| position(b, e.order()).is_some())
    }

    /// The largest entry, if any.
    pub fn largest(&self) -> Option<Entry> {
        if self.fl_map == 0 {
            return None;
        }
        let fl = 63 - self.fl_map.leading_zeros() as usize;
        let sl = 31 - self.sl_map[fl].leading_zeros() as usize;
        self.bin(fl, sl).map(Bin::first)
    }

    /// The non-empty bins in ascending order.
    fn bins(&self) -> impl Iterator<Item = &Bin> + '_ {
        (0..FL * SL).filter_map(|i| self.bin(i / SL, i % SL))
    }

    /// Every entry in (size, address) order.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> + '_ {
        self.bins().flat_map(|b| std::iter::once(&b.last).chain(b.rest.iter().rev()))
    }

    /// The entries of bin (fl, sl), largest first (for tests).
    #[cfg(test)]
    fn entries(&self, fl: usize, sl: usize) -> Vec<Entry> {
        self.bin(fl, sl).map_or(Vec::new(), |b| b.entries().copied().collect())
    }

    /// Checks the bitmaps, the bins' order and placement, and the totals against the entries.
    pub fn check(&self) -> Result<(), String> {
        let (mut len, mut bytes) = (0, 0);
        for i in 0..FL * SL {
            let (fl, sl) = (i / SL, i % SL);
            let made = self.octaves[fl].as_ref().map(|o| &o[sl]);
            if !self.holds(fl, sl) {
                if made.is_some_and(|b| !b.rest.is_empty()) {
                    return Err(format!(
                        "free index: bin ({fl}, {sl}) bit disagrees with its entries"
                    ));
                }
                continue;
            }
            let Some(bin) = made else {
                return Err(format!("free index: bin ({fl}, {sl}) bit set, octave not made"));
            };
            let entries: Vec<Entry> = bin.entries().copied().collect();
            if !entries.is_sorted_by(|a, b| a > b) {
                return Err(format!("free index: bin ({fl}, {sl}) out of order"));
            }
            if let Some(e) = entries.iter().find(|e| bin_of(e.size) != (fl, sl)) {
                return Err(format!("free index: block of {} B in bin ({fl}, {sl})", e.size));
            }
            len += entries.len();
            bytes += entries.iter().map(|e| e.size).sum::<u64>();
        }
        for (fl, &m) in self.sl_map.iter().enumerate() {
            if (self.fl_map & (1 << fl) != 0) != (m != 0) {
                return Err(format!("free index: octave {fl} bit disagrees with its bins"));
            }
        }
        if (len, bytes) != (self.len, self.bytes) {
            return Err(format!(
                "free index: counts {} blocks / {} B, holds {len} / {bytes}",
                self.len, self.bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
