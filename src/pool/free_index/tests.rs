//! Exact tests of the free index: the bin of each size computed by hand, and every query's answer
//! (size and address) against a sorted reference.

use super::*;
use std::collections::BTreeSet;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const BASE: u64 = 0x1_0000_0000;

fn e(size: u64, addr: u64, id: usize) -> Entry {
    Entry { size, addr: BASE + addr, id }
}

/// (size, address offset) of the best fit for `size`.
fn fit(index: &FreeIndex, size: u64) -> Option<(u64, u64)> {
    index.best_fit(size).map(|e| (e.size, e.addr - BASE))
}

#[test]
fn bins_by_hand() {
    assert_eq!(bin_of(0), (0, 0));
    assert_eq!(bin_of(15), (0, 15));
    assert_eq!(bin_of(16), (1, 0));
    assert_eq!(bin_of(31), (1, 15));
    assert_eq!(bin_of(32), (2, 0));
    assert_eq!(bin_of(33), (2, 0));
    assert_eq!(bin_of(34), (2, 1));
    // 512 B granules: one size per bin below 16 KiB.
    assert_eq!(bin_of(512), (6, 0));
    assert_eq!(bin_of(1024), (7, 0));
    assert_eq!(bin_of(1536), (7, 8));
    assert_eq!(bin_of(8 * KIB - 512), (9, 14));
    assert_eq!(bin_of(8 * KIB), (10, 0));
    assert_eq!(bin_of(16 * KIB - 512), (10, 15));
    // From 16 KiB a bin spans 1/16 of its octave: 16 KiB and 16 KiB + 512 share one.
    assert_eq!(bin_of(16 * KIB), (11, 0));
    assert_eq!(bin_of(16 * KIB + 512), (11, 0));
    assert_eq!(bin_of(17 * KIB), (11, 1));
    assert_eq!(bin_of(32 * KIB), (12, 0));
    assert_eq!(bin_of(2 * MIB), (18, 0));
    assert_eq!(bin_of(20 * MIB), (21, 4));
    assert_eq!(bin_of(u64::MAX), (FL - 1, SL - 1));
}

#[test]
fn bins_are_monotonic_in_size() {
    let mut sizes: Vec<u64> = (0..4096).collect();
    for top in 5..64 {
        for d in [0u64, 1, 2, 3] {
            let p = 1u64 << top;
            sizes.extend([p - d, p + d, p + (p >> 5) - d, p + (p >> 5) + d, p | (p - 1)]);
        }
    }
    sizes.sort_unstable();
    sizes.dedup();
    for w in sizes.windows(2) {
        assert!(bin_of(w[0]) <= bin_of(w[1]), "{} {}", w[0], w[1]);
    }
}

#[test]
fn exact_size_then_lowest_address() {
    let mut ix = FreeIndex::default();
    ix.insert(e(1024, 0x3000, 3));
    ix.insert(e(1024, 0x1000, 1));
    ix.insert(e(1536, 0x0, 0));
    ix.insert(e(512, 0x5000, 5));
    ix.check().unwrap();
    assert_eq!(fit(&ix, 512), Some((512, 0x5000)));
    assert_eq!(fit(&ix, 1000), Some((1024, 0x1000)));
    assert_eq!(fit(&ix, 1024), Some((1024, 0x1000)));
    assert_eq!(fit(&ix, 1025), Some((1536, 0x0)));
    assert_eq!(fit(&ix, 1537), None);
    assert!(ix.remove(&e(1024, 0x1000, 1)));
    assert_eq!(fit(&ix, 1024), Some((1024, 0x3000)));
    assert!(ix.remove(&e(1024, 0x3000, 3)));
    assert_eq!(fit(&ix, 1024), Some((1536, 0x0)));
    assert_eq!((ix.len(), ix.bytes()), (2, 2048));
    ix.check().unwrap();
}

#[test]
fn shared_bin_skips_smaller_blocks() {
    let mut ix = FreeIndex::default();
    // Both in bin (12, 0); the smaller one at the lower address.
    ix.insert(e(32 * KIB, 0x0, 0));
    ix.insert(e(32 * KIB + 512, 0x10_0000, 1));
    ix.insert(e(40 * KIB, 0x20_0000, 2));
    assert_eq!(fit(&ix, 32 * KIB), Some((32 * KIB, 0x0)));
    assert_eq!(fit(&ix, 32 * KIB + 1), Some((32 * KIB + 512, 0x10_0000)));
    // Nothing in the request's bin is large enough: the next non-empty bin, same octave.
    assert_eq!(fit(&ix, 32 * KIB + 513), Some((40 * KIB, 0x20_0000)));
    // The next non-empty bin in a later octave.
    ix.insert(e(3 * MIB, 0x30_0000, 3));
    assert_eq!(fit(&ix, 40 * KIB + 1), Some((3 * MIB, 0x30_0000)));
    assert_eq!(fit(&ix, 3 * MIB + 1), None);
    assert_eq!(ix.largest().map(|e| e.size), Some(3 * MIB));
    ix.check().unwrap();
}

#[test]
fn next_after_walks_size_then_address() {
    let mut ix = FreeIndex::default();
    ix.insert(e(4 * MIB, 0x40_0000, 0));
    ix.insert(e(16 * MIB, 0x80_0000, 1));
    ix.insert(e(16 * MIB, 0x200_0000, 2));
    ix.insert(e(20 * MIB, 0x0, 3));
    let next = |size, addr, id| ix.next_after(&e(size, addr, id)).map(|e| (e.size, e.addr - BASE));
    assert_eq!(next(4 * MIB, 0x40_0000, 0), Some((16 * MIB, 0x80_0000)));
    assert_eq!(next(16 * MIB, 0x80_0000, 1), Some((16 * MIB, 0x200_0000)), "same bin");
    assert_eq!(next(16 * MIB, 0x200_0000, 2), Some((20 * MIB, 0x0)), "next octave");
    assert_eq!(next(20 * MIB, 0x0, 3), None);
    // An entry that is not indexed: the first one after where it would be.
    assert_eq!(next(8 * MIB, 0x0, 9), Some((16 * MIB, 0x80_0000)));
    assert_eq!(next(512, 0x0, 9), Some((4 * MIB, 0x40_0000)));
}

#[test]
fn bitmaps_follow_the_bins() {
    let mut ix = FreeIndex::default();
    assert_eq!((ix.fl_map, ix.largest()), (0, None));
    ix.insert(e(2 * MIB, 0x0, 0));
    ix.insert(e(2 * MIB + 128 * KIB, 0x40_0000, 1));
    assert_eq!(ix.fl_map, 1 << 18);
    assert_eq!(ix.sl_map[18], 0b11);
    assert!(!ix.remove(&e(2 * MIB, 0x40_0000, 0)), "absent entry (wrong address)");
    assert!(ix.remove(&e(2 * MIB, 0x0, 0)));
    assert_eq!(ix.sl_map[18], 0b10);
    assert!(ix.remove(&e(2 * MIB + 128 * KIB, 0x40_0000, 1)));
    assert_eq!((ix.fl_map, ix.sl_map[18], ix.len(), ix.bytes()), (0, 0, 0, 0));
    assert_eq!(fit(&ix, 1), None);
    ix.check().unwrap();
}

#[test]
fn iterates_in_size_then_address_order() {
    let mut ix = FreeIndex::default();
    for (i, (size, addr)) in
        [(4 * MIB, 0x0), (512, 0x9000), (512, 0x8000), (33 * KIB, 0x7000)].into_iter().enumerate()
    {
        ix.insert(e(size, addr, i));
    }
    let order: Vec<(u64, u64)> = ix.iter().map(|e| (e.size, e.addr - BASE)).collect();
    assert_eq!(order, [(512, 0x8000), (512, 0x9000), (33 * KIB, 0x7000), (4 * MIB, 0x0)]);
}

/// A replacement that keeps its rank overwrites the entry in place (the bin's order, its
/// bitmaps and the totals stay right); one that moves, or leaves the bin, is a removal and an
/// insertion.
#[test]
fn replace_in_place_and_across_bins() {
    let mut ix = FreeIndex::default();
    // One bin, (18, 0): 2 MiB up to 2 MiB + 128 KiB. 2 MiB + 40 KiB at 0x100, + 8 KiB at 0x200.
    let (a, b) = (e(2 * MIB + 40 * KIB, 0x100, 1), e(2 * MIB + 8 * KIB, 0x200, 2));
    ix.insert(a);
    ix.insert(b);
    // The last entry split: the remainder stays last in the same bin.
    let b2 = e(2 * MIB + 4 * KIB, 0x200 + 4 * KIB, 2);
    assert!(ix.replace(&b, b2));
    assert_eq!(ix.entries(bin_of(b2.size).0, bin_of(b2.size).1), [a, b2]);
    assert_eq!((ix.len(), ix.bytes()), (2, a.size + b2.size));
    // Grown past `a`: it moves to the front of the bin.
    let b3 = e(2 * MIB + 60 * KIB, 0x200, 2);
    assert!(ix.replace(&b2, b3));
    assert_eq!(ix.entries(bin_of(b3.size).0, bin_of(b3.size).1), [b3, a]);
    assert_eq!(fit(&ix, 2 * MIB), Some((a.size, 0x100)));
    // Split below the bin: it leaves it (and the bitmaps follow).
    let small = e(64 * KIB, 0x300, 2);
    assert!(ix.replace(&b3, small));
    assert_eq!(fit(&ix, KIB), Some((64 * KIB, 0x300)));
    assert_eq!((ix.len(), ix.bytes()), (2, a.size + small.size));
    ix.check().unwrap();
    // Not indexed: nothing changes.
    assert!(!ix.replace(&b3, e(KIB, 0x400, 3)));
    assert!(!ix.replace(&e(2 * MIB + 44 * KIB, 0x100, 1), e(2 * MIB + 48 * KIB, 0x100, 1)));
    assert_eq!(ix.iter().copied().collect::<Vec<_>>(), vec![small, a]);
    ix.check().unwrap();
}

#[test]
fn check_catches_corruption() {
    let mut ix = FreeIndex::default();
    ix.insert(e(1024, 0, 0));
    ix.sl_map[7] = 0; // the octave's bit still set
    assert!(ix.check().unwrap_err().contains("bit disagrees"));
    ix.sl_map[7] = 1;
    ix.check().unwrap();
    ix.bin_mut(7, 0).rest.push(e(1024, 0x10, 1)); // in order (descending), uncounted
    assert!(ix.check().unwrap_err().contains("counts"));
    (ix.sl_map[7], ix.fl_map) = (0, 0); // an empty bin holding entries
    assert!(ix.check().unwrap_err().contains("bin (7, 0) bit disagrees"));
    (ix.sl_map[7], ix.fl_map) = (1, 1 << 7);
    ix.bin_mut(7, 0).rest.clear();
    ix.bin_mut(7, 0).last = e(2048, 0, 0);
    assert!(ix.check().unwrap_err().contains("in bin"));
    ix.bin_mut(7, 0).last = e(1024, 0, 0);
    ix.bin_mut(7, 0).rest.push(e(1024, 0, 1)); // not above the smallest
    assert!(ix.check().unwrap_err().contains("out of order"));
}

/// A bin holds its smallest entry in place: its vector is allocated by its first second entry,
/// and an entry smaller than the one held pushes that one into the vector.
#[test]
fn a_bins_smallest_entry_is_held_in_place() {
    let mut ix = FreeIndex::default();
    let (fl, sl) = bin_of(4 * KIB);
    ix.insert(e(4 * KIB, 0x2000, 1));
    assert_eq!(ix.octaves[fl].as_ref().unwrap()[sl].rest.capacity(), 0, "one entry: no vector");
    assert_eq!(ix.entries(fl, sl), [e(4 * KIB, 0x2000, 1)]);
    ix.insert(e(4 * KIB, 0x1000, 2)); // the new smallest
    ix.insert(e(4 * KIB, 0x3000, 3)); // the new largest
    assert_eq!(
        ix.entries(fl, sl),
        [e(4 * KIB, 0x3000, 3), e(4 * KIB, 0x2000, 1), e(4 * KIB, 0x1000, 2)]
    );
    assert_eq!(fit(&ix, 4 * KIB), Some((4 * KIB, 0x1000)));
    assert!(ix.remove(&e(4 * KIB, 0x1000, 2))); // the smallest: the next one takes its place
    assert_eq!(ix.entries(fl, sl), [e(4 * KIB, 0x3000, 3), e(4 * KIB, 0x2000, 1)]);
    assert!(ix.remove(&e(4 * KIB, 0x3000, 3))); // from the vector
    assert!(!ix.remove(&e(4 * KIB, 0x3000, 3)));
    assert!(ix.remove(&e(4 * KIB, 0x2000, 1))); // the last: the bin is empty
    assert_eq!((ix.sl_map[fl], ix.fl_map, ix.len(), ix.bytes()), (0, 0, 0, 0));
    assert!(!ix.remove(&e(4 * KIB, 0x2000, 1)), "a stale smallest is not an entry");
    assert!(!ix.contains(&e(4 * KIB, 0x2000, 1)));
    assert_eq!((fit(&ix, 1), ix.largest()), (None, None));
    ix.check().unwrap();
}

/// A deterministic random walk of inserts, removes and queries, against a sorted set.
#[test]
fn agrees_with_a_sorted_set() {
    let mut ix = FreeIndex::default();
    let mut reference: BTreeSet<Entry> = BTreeSet::new();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let size_of = |r: u64| match r % 4 {
        0 => 512 * (1 + r % 64),
        1 => 512 * (1 + r % 4096),
        2 => MIB + 512 * (r % 40_000),
        _ => 2 * MIB * (1 + r % 64),
    };
    for step in 0..20_000usize {
        let r = next();
        if r % 3 != 0 || reference.is_empty() {
            let entry = Entry { size: size_of(next()), addr: next() & !511, id: step };
            ix.insert(entry);
            reference.insert(entry);
        } else if r % 3 == 1 {
            let victim = *reference.iter().nth((next() % reference.len() as u64) as usize).unwrap();
            assert!(ix.remove(&victim));
            reference.remove(&victim);
        } else {
            // A split (the remainder above the block handed out), a merge (a grown block at
            // the same address, or one that starts lower), or any entry at all.
            let victim = *reference.iter().nth((next() % reference.len() as u64) as usize).unwrap();
            let k = 512 * (1 + next() % 64);
            let new = match next() % 4 {
                0 if victim.size > k => {
                    Entry { size: victim.size - k, addr: victim.addr + k, id: step }
                }
                1 => Entry { size: victim.size + k, ..victim },
                2 => Entry { size: victim.size + k, addr: victim.addr.wrapping_sub(k), id: step },
                _ => Entry { size: size_of(next()), addr: next() & !511, id: step },
            };
            if !reference.contains(&new) {
                assert!(ix.replace(&victim, new));
                reference.remove(&victim);
                reference.insert(new);
            }
            let absent = Entry { addr: victim.addr ^ 1, ..victim };
            assert!(!ix.replace(&absent, new), "an entry not indexed is not replaced");
        }
        let q = size_of(next()).saturating_sub(512 * (next() % 3));
        let want = reference.range(Entry { size: q, addr: 0, id: 0 }..).next().copied();
        assert_eq!(ix.best_fit(q), want, "query {q} at step {step}");
        let larger = want.map(|w| reference.last().is_some_and(|e| e.size > w.size));
        assert_eq!(ix.best_fit_and_larger(q).map(|(e, l)| (Some(e), l)), larger.map(|l| (want, l)));
        if let Some(&probe) = reference.iter().nth((next() % (reference.len() as u64 + 1)) as usize)
        {
            let want =
                reference.range((std::ops::Bound::Excluded(probe), std::ops::Bound::Unbounded));
            assert_eq!(ix.next_after(&probe), want.into_iter().next().copied());
        }
        if step % 1000 == 0 {
            ix.check().unwrap();
            assert!(ix.iter().eq(reference.iter()));
            assert_eq!(ix.largest(), reference.last().copied());
        }
    }
    assert_eq!(ix.len(), reference.len());
    assert_eq!(ix.bytes(), reference.iter().map(|e| e.size).sum::<u64>());
}

#[test]
#[should_panic(expected = "entry already in the free index")]
fn an_entry_inserted_twice_as_the_bins_last_is_refused() {
    let mut index = FreeIndex::default();
    index.insert(e(4096, 0x1000, 1));
    index.insert(e(4096, 0x1000, 1));
}

#[test]
#[should_panic(expected = "entry already in the free index")]
fn an_entry_inserted_twice_inside_its_bin_is_refused() {
    let mut index = FreeIndex::default();
    // One bin (sizes 3 MiB and 3 MiB + 512 share it); the larger is not the bin's last.
    index.insert(e(3 << 20, 0x10_0000, 1));
    index.insert(e((3 << 20) + 512, 0x40_0000, 2));
    index.insert(e((3 << 20) + 512, 0x40_0000, 2));
}
