//! `ClassTable`: a stream-cache lane's blocks by class, an open-addressing table sized for
//! [`MAX_CLASSES`] so that a hit finds its class with one multiply and (almost always) one compare.
//!
//! ```text
//!   key = rounded·2 + (residency == persistent)        (never 0: a rounded size is ≥ 1)
//!   slot = top 8 bits of key·φ  ──▶ [key | blocks: Vec<CachedBlock>] ─ linear probing ─▶ next …
//!   256 slots (2 × MAX_CLASSES), allocated at the first insert; a class once added keeps its
//!   slot (its list may be empty) until `clear`
//!   last: the slot last found, compared first (a run of one class costs one compare, no hash)
//!   hot:  [key | block]  the lane's only block, outside the slots (see below)
//! ```
//!
//! It replaces a `HashMap` whose lookup cost a hit about sixty instructions.
//!
//! **The hot entry.** A block pushed into an empty lane ([`ClassTable::set_hot`]) waits in `hot`,
//! not in its class's list: the free and the next hit of the same class (the common pair) then
//! touch one key and one block, with no slot, no list and no length. The rule is one sentence:
//! *`hot` holds a block only while it is the table's only block.* Every other way in (a push
//! while it holds one, a listing, a drain) first moves it into its class's list
//! ([`ClassTable::spill`]), so the lists see exactly the blocks and the order (last in, first
//! out per class) they would without it, and a pop that asks for another class finds nothing
//! anywhere else.

use super::fast_cache::{CachedBlock, ClassKey, MAX_CLASSES};
use crate::stats::Residency;

/// Slots: a power of two, twice [`MAX_CLASSES`], so a probe stops within a few slots.
const SLOTS: usize = 2 * MAX_CLASSES;
const _: () = assert!(SLOTS.is_multiple_of(64));

/// One slot: a key (0: empty) and its class's blocks.
#[derive(Default)]
struct Slot {
    key: u64,
    list: Vec<CachedBlock>,
}

/// See the module docs.
pub struct ClassTable {
    /// `SLOTS` slots once the first class is added (a fixed size: a probe indexes it with no
    /// bounds check).
    slots: Option<Box<[Slot; SLOTS]>>,
    /// Bit `i` set ⇔ slot `i` holds a class: a drain visits those slots alone, in slot order.
    occupied: [u64; SLOTS / 64],
    classes: usize,
    /// The slot last found: looked at first (a lane serves one class many times in a row, and
    /// then the probe is one compare with no hash).
    last: usize,
    /// The key of the hot block (0: none). See the module docs.
    hot_key: u64,
    /// The hot block, while `hot_key` is not 0.
    hot: CachedBlock,
}

impl Default for ClassTable {
    fn default() -> Self {
        ClassTable {
            slots: None,
            occupied: [0; SLOTS / 64],
            classes: 0,
            last: 0,
            hot_key: 0,
            hot: CachedBlock {
                block: crate::pool::BlockId(0),
                ptr: crate::device::DeviceAddr(0),
                size: 0,
                requested: 0,
                quadrant: 0,
            },
        }
    }
}

/// The table's key of `class`.
#[inline]
fn key_of(class: ClassKey) -> u64 {
    (class.rounded << 1) | u64::from(class.residency == Residency::Persistent)
}

/// The class of a table key.
fn class_of(key: u64) -> ClassKey {
    let residency = if key & 1 == 1 { Residency::Persistent } else { Residency::Transient };
    ClassKey { residency, rounded: key >> 1 }
}

impl ClassTable {
    /// Classes added (with or without blocks) since the last [`ClassTable::clear`].
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.classes
    }

    /// The slot holding `key` (the last one found first: `last` is set when the probe finds
    /// another), or the empty slot where it would go.
    #[inline(always)]
    fn find_from(slots: &[Slot; SLOTS], last: &mut usize, key: u64) -> usize {
        let l = *last & (SLOTS - 1);
        if slots[l].key == key {
            return l;
        }
        let i = Self::find(slots, key);
        *last = i;
        i
    }

    /// The slot holding `key`, or the empty slot where it would go.
    #[inline]
    fn find(slots: &[Slot; SLOTS], key: u64) -> usize {
        let mut i = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize;
        loop {
            let k = slots[i].key;
            if k == key || k == 0 {
                return i;
            }
            i = (i + 1) & (SLOTS - 1);
        }
    }

    /// Makes `b` (of `class`) the hot block, if there is room for its class should it move
    /// into a list (`false`: the caller pushes it as usual, which finds its class or refuses
    /// it). **The table must hold no block** (the caller knows: its lane caches no bytes).
    #[inline(always)]
    pub fn set_hot(&mut self, class: ClassKey, b: CachedBlock) -> bool {
        debug_assert!(self.hot_key == 0 && self.blocks() == 0);
        // (No class is added while a block is hot — every other push moves it first — so
        // [`ClassTable::spill`] then finds room for it.)
        if self.classes >= MAX_CLASSES {
            return false;
        }
        self.hot_key = key_of(class);
        self.hot = b;
        true
    }

    /// The hot block, if it is of `class` (then it is the table's only block).
    #[inline(always)]
    pub fn hot(&self, class: ClassKey) -> Option<&CachedBlock> {
        (self.hot_key == key_of(class)).then_some(&self.hot)
    }

    /// Forgets the hot block (the caller took it, after [`ClassTable::hot`]).
    #[inline(always)]
    pub fn take_hot(&mut self) {
        self.hot_key = 0;
    }

    /// Takes the last block of `class` (the next a pop takes): the hot one, or its list's last.
    pub fn pop(&mut self, class: ClassKey) -> Option<CachedBlock> {
        if let Some(&b) = self.hot(class) {
            self.take_hot();
            return Some(b);
        }
        self.get_mut(class)?.pop()
    }

    /// Moves the hot block, if any, into its class's list (added if it is new: there is room,
    /// see [`ClassTable::set_hot`]).
    #[inline]
    pub fn spill(&mut self) {
        if self.hot_key != 0 {
            self.spill_cold();
        }
    }

    #[cold]
    fn spill_cold(&mut self) {
        let (key, b) = (std::mem::take(&mut self.hot_key), self.hot);
        let list = self.add(class_of(key)).expect("room for the hot block's class: see set_hot");
        debug_assert!(list.is_empty(), "the hot block was the only one");
        list.push(b);
    }

    fn new_slots() -> Box<[Slot; SLOTS]> {
        let v: Vec<Slot> = (0..SLOTS).map(|_| Slot::default()).collect();
        v.into_boxed_slice().try_into().unwrap_or_else(|_| unreachable!("SLOTS slots"))
    }

    /// The list of `class`, if it was added. (The hot block is not in it: a pop looks at
    /// [`ClassTable::hot`] first.)
    #[inline(always)]
    pub fn get_mut(&mut self, class: ClassKey) -> Option<&mut Vec<CachedBlock>> {
        let key = key_of(class);
        let slots = self.slots.as_deref_mut()?;
        let i = Self::find_from(slots, &mut self.last, key);
        let slot = &mut slots[i];
        (slot.key == key).then_some(&mut slot.list)
    }

    /// The blocks of `class`, added if there is room for another class (`None` if not). The
    /// hot block moves into its list first (a push after it: see the module docs).
    #[inline(always)]
    pub fn get_or_add(&mut self, class: ClassKey) -> Option<&mut Vec<CachedBlock>> {
        self.spill();
        let key = key_of(class);
        let last = &mut self.last;
        let found = self.slots.as_deref().and_then(|slots| {
            let i = Self::find_from(slots, last, key);
            (slots[i].key == key).then_some(i)
        });
        match found {
            // (`i` < SLOTS: the mask only tells the compiler, so there is no bounds check.)
            Some(i) => self.slots.as_deref_mut().map(|slots| &mut slots[i & (SLOTS - 1)].list),
            None => self.add(class),
        }
    }

    /// [`ClassTable::get_or_add`] for a class not in the table.
    #[cold]
    fn add(&mut self, class: ClassKey) -> Option<&mut Vec<CachedBlock>> {
        debug_assert!(class.rounded > 0 && class.rounded < 1 << 62);
        let slots = self.slots.get_or_insert_with(Self::new_slots);
        let key = key_of(class);
        let i = Self::find(slots, key);
        if slots[i].key != key {
            if self.classes >= MAX_CLASSES {
                return None;
            }
            self.classes += 1;
            self.occupied[i / 64] |= 1 << (i % 64);
            slots[i].key = key;
        }
        Some(&mut slots[i].list)
    }

    /// Blocks held, over all classes (a scan: for the global-lock side and tests).
    pub fn blocks(&self) -> usize {
        let listed: usize = self.slots.iter().flat_map(|s| s.iter()).map(|s| s.list.len()).sum();
        listed + usize::from(self.hot_key != 0)
    }

    /// Every class's blocks (the hot block moved into its list first).
    #[cfg_attr(
        not(any(
            test,
            tidepool_broken = "large_drain",
            tidepool_broken = "coalesce",
            tidepool_broken = "scope_batch"
        )),
        allow(dead_code)
    )]
    pub fn lists_mut(&mut self) -> impl Iterator<Item = &mut Vec<CachedBlock>> {
        self.spill();
        self.slots.iter_mut().flat_map(|s| s.iter_mut()).filter(|s| s.key != 0).map(|s| &mut s.list)
    }

    /// Every cached block with its class, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (ClassKey, CachedBlock)> + '_ {
        let hot = (self.hot_key != 0).then(|| (class_of(self.hot_key), self.hot));
        self.slots
            .iter()
            .flat_map(|s| s.iter())
            .filter(|s| s.key != 0)
            .flat_map(|s| s.list.iter().map(move |&b| (class_of(s.key), b)))
            .chain(hot)
    }

    /// Moves every block into `out` and forgets every class, keeping the slots' memory: what
    /// [`ClassTable::lists_mut`] then [`ClassTable::clear`] do, visiting only the slots that
    /// hold a class (`occupied`), in slot order. (A slot is given a class only by `add` and
    /// loses it only here or in `clear`, so a slot with no class holds no block.)
    pub fn take_all(&mut self, out: &mut Vec<CachedBlock>) {
        self.spill();
        if let Some(slots) = self.slots.as_deref_mut() {
            for (w, bits) in self.occupied.iter_mut().enumerate() {
                while *bits != 0 {
                    let i = w * 64 + bits.trailing_zeros() as usize;
                    *bits &= *bits - 1;
                    let s = &mut slots[i];
                    out.append(&mut s.list);
                    s.key = 0;
                }
            }
        }
        debug_assert!(self.slots.iter().flat_map(|s| s.iter()).all(|s| s.key == 0));
        self.occupied = [0; SLOTS / 64];
        self.classes = 0;
        self.hot_key = 0;
    }

    /// Forgets every class (and block); keeps the slots' memory.
    #[cfg_attr(not(any(test, tidepool_broken = "scope_batch")), allow(dead_code))]
    pub fn clear(&mut self) {
        for s in self.slots.iter_mut().flat_map(|s| s.iter_mut()) {
            s.key = 0;
            s.list.clear();
        }
        self.occupied = [0; SLOTS / 64];
        self.classes = 0;
        self.hot_key = 0;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::pool::BlockId;

    fn block(n: usize) -> CachedBlock {
        CachedBlock {
            block: BlockId(n),
            ptr: crate::device::DeviceAddr(n as u64 * 512),
            size: 512,
            requested: 512,
            quadrant: 0,
        }
    }

    fn class(rounded: u64, persistent: bool) -> ClassKey {
        let residency = if persistent { Residency::Persistent } else { Residency::Transient };
        ClassKey { residency, rounded }
    }

    /// Classes of both residencies are kept apart, found again, and refused past the limit.
    #[test]
    fn adds_finds_and_refuses_past_the_limit() {
        let mut t = ClassTable::default();
        assert!(t.get_mut(class(512, false)).is_none());
        for i in 1..=MAX_CLASSES as u64 {
            let c = class(i * 512, i % 2 == 0);
            t.get_or_add(c).unwrap().push(block(i as usize));
        }
        assert_eq!(t.len(), MAX_CLASSES);
        assert!(t.get_or_add(class(999 * 512, false)).is_none());
        for i in 1..=MAX_CLASSES as u64 {
            let c = class(i * 512, i % 2 == 0);
            assert_eq!(t.get_mut(c).unwrap(), &vec![block(i as usize)]);
            // The other residency of the same size is another class, absent.
            assert!(t.get_mut(class(i * 512, i % 2 == 1)).is_none());
        }
        let mut all: Vec<_> = t.iter().map(|(c, b)| (c.rounded, b.ptr.0)).collect();
        all.sort();
        assert_eq!(all.len(), MAX_CLASSES);
        assert_eq!(all[0], (512, 512));
        t.clear();
        assert_eq!(t.len(), 0);
        assert_eq!(t.iter().count(), 0);
        assert!(t.get_mut(class(512, false)).is_none());
        t.get_or_add(class(1 << 20, true)).unwrap().push(block(7));
        assert_eq!(t.iter().next(), Some((class(1 << 20, true), block(7))));
    }

    /// The hot block: found for its class only, counted and listed, moved into its list (after
    /// which the list's order is the push order) by a push, a listing or a spill, and refused
    /// where its class could not be added.
    #[test]
    fn the_hot_block_is_the_only_one_and_moves_into_its_list() {
        let (a, b) = (class(4096, false), class(8192, false));
        let mut t = ClassTable::default();
        assert!(t.set_hot(a, block(1)));
        assert_eq!((t.hot(a).copied(), t.hot(b).copied(), t.blocks()), (Some(block(1)), None, 1));
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![(a, block(1))]);
        assert!(t.get_mut(b).is_none(), "no list was made for it");
        assert_eq!(t.pop(a), Some(block(1)));
        assert_eq!((t.blocks(), t.pop(a)), (0, None));
        assert!(t.set_hot(a, block(2)));
        t.get_or_add(a).unwrap().push(block(3)); // a push moves the hot block first
        assert_eq!(t.hot(a), None);
        assert_eq!(t.get_mut(a).unwrap().clone(), vec![block(2), block(3)]);
        assert_eq!((t.pop(a), t.pop(a), t.pop(a)), (Some(block(3)), Some(block(2)), None));
        assert!(t.set_hot(b, block(4)));
        assert_eq!(t.lists_mut().map(|l| l.len()).sum::<usize>(), 1, "a listing moves it");
        assert_eq!(t.len(), 2);
        t.clear();
        assert!(t.set_hot(b, block(5)));
        t.clear();
        assert_eq!((t.blocks(), t.hot(b).copied()), (0, None));
        for i in 1..=MAX_CLASSES as u64 {
            t.get_or_add(class(i * 512, true)).unwrap();
        }
        assert!(!t.set_hot(a, block(6)), "no room for its class");
        assert_eq!(t.blocks(), 0);
    }

    /// `take_all` hands out every block in the order `lists_mut` gives them (a hot block, the
    /// table's only one, included), appended to what `out` holds, and leaves the table as
    /// `clear` does; classes can be added again after it.
    #[test]
    fn take_all_is_a_listing_then_a_clear() {
        let fill = |t: &mut ClassTable| {
            for i in 1..=5u64 {
                let list = t.get_or_add(class(i * 4096, i % 2 == 0)).unwrap();
                list.extend((0..i as usize).map(|k| block(10 * i as usize + k)));
            }
        };
        let (mut a, mut b) = (ClassTable::default(), ClassTable::default());
        fill(&mut a);
        fill(&mut b);
        let listed: Vec<CachedBlock> = a.lists_mut().flat_map(|l| l.drain(..)).collect();
        a.clear();
        let mut taken = vec![block(1)];
        b.take_all(&mut taken);
        assert_eq!(taken[0], block(1), "appended to what `out` held");
        assert_eq!(taken[1..], listed[..]);
        assert_eq!(taken.len(), 1 + 15);
        for t in [&a, &b] {
            assert_eq!((t.len(), t.blocks(), t.iter().count()), (0, 0, 0));
        }
        b.take_all(&mut taken);
        assert_eq!(taken.len(), 16, "an empty table adds nothing");
        assert!(b.set_hot(class(64 * 4096, false), block(99)));
        b.take_all(&mut taken);
        assert_eq!((taken.len(), taken[16], b.blocks()), (17, block(99), 0), "the hot block");
        b.get_or_add(class(4096, true)).unwrap().push(block(7));
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![(class(4096, true), block(7))]);
        assert_eq!(b.len(), 1);
    }
}
