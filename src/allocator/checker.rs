//! The invariant checker: recomputes every figure from the blocks and compares (tests, fuzzing).

use super::*;

impl<D: Device> Allocator<D> {
    /// Checks the pool's invariants (tiling, no adjacent free blocks, exact stats), that the
    /// pending-event bookkeeping matches the pending blocks, that every stream-cached block is
    /// allocated in the pool under its stream, and that the published statistics equal the
    /// pool's minus the cached blocks, below their peaks. For tests and fuzzing; it takes every
    /// lock, so it may run while other threads allocate.
    pub fn check_invariants(&self) -> Result<(), String> {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        sh.publish_now(&mut st);
        if !sh.publish_stats.load(Ordering::Relaxed) {
            // Under `global_lock` the kept statistics are brought up to date only when read.
            let st = &mut *st;
            let counters = sh.plain_counters(st);
            st.base.mirror(&st.pool.stats(), counters);
        }
        let table = sh.caches.all();
        let inners: Vec<_> = table.iter().map(|c| c.lock_inner()).collect();
        st.pool.check_invariants()?;
        sh.check_vm(&st)?;
        if !st.vm.counts_published() {
            return Err("expandable-segment counters changed and were not published".into());
        }
        if st.family_share != st.pool.reserved_bytes() {
            return Err(format!(
                "{} B reserved but {} B counted in the family's total (the caps' figure)",
                st.pool.reserved_bytes(),
                st.family_share
            ));
        }
        if st.family_share > sh.family.reserved.load(Ordering::Acquire) {
            return Err("the family's reserved total is below this allocator's share".into());
        }
        let queued: usize = st.pending.values().map(VecDeque::len).sum();
        let counted: usize = st.pending_count.values().sum();
        if queued != counted {
            return Err(format!("{queued} pending events queued but {counted} counted"));
        }
        for (&b, _) in st.pending_count.iter() {
            if st.pool.block(b).state != BlockState::Pending {
                return Err(format!("block {b:?} has events but is not pending"));
            }
        }
        for &b in &st.parked {
            if st.pool.block(b).state != BlockState::Pending || st.pending_count.contains_key(&b) {
                return Err(format!("parked block {b:?} is not pending on a host wait alone"));
            }
        }
        if let Some(base) = st.initial
            && !st.pool.segments().any(|(_, s)| s.base == base)
        {
            return Err(format!("the initial pool segment at {base:#x} is gone"));
        }
        let mut streams: BTreeMap<StreamId, usize> = BTreeMap::new();
        for (_, seg) in st.pool.segments() {
            *streams.entry(seg.key.stream).or_default() += 1;
        }
        if streams != st.segment_streams {
            return Err("segment count per stream drifted".into());
        }
        let mut cached = Vec::new();
        for (i, (c, inner)) in table.iter().zip(&inners).enumerate() {
            for (class, b) in inner.entries() {
                let blk = st.pool.block(b.block);
                let key = st.pool.segment(blk.segment).key;
                if blk.state != BlockState::Allocated
                    || blk.addr != b.ptr.0
                    || blk.size != b.size
                    || blk.requested != b.requested
                    || key.stream != c.stream()
                    || key.residency != class.residency
                    || quadrant(key.kind, key.residency) != b.quadrant
                {
                    return Err(format!("cached block at {} does not match the pool", b.ptr));
                }
                cached.push(b);
            }
            // Lane 0 of a stream publishes its pool free bytes; the other lanes none.
            let free = match CacheTable::is_first_lane(&table, i) {
                true => st.pool.free_bytes_of(c.stream()),
                false => 0,
            };
            if sh.publish_stats.load(Ordering::Relaxed) && free != c.slow_block().get(0) {
                return Err(format!("published free bytes of {} drifted", c.stream()));
            }
        }
        let refs: Vec<&fast_cache::CacheInner> = inners.iter().map(|g| &**g).collect();
        let exact = st.base.exact(&refs);
        drop(inners);
        let mut expect = counters::currents(&st.pool.stats());
        let minus = counters::currents(&counters::cached_in_pool(&st.pool, &cached));
        for (row, m) in expect.iter_mut().zip(minus) {
            for (v, m) in row.iter_mut().zip(m) {
                *v -= m;
            }
        }
        if counters::currents(&exact) != expect {
            return Err(format!(
                "statistics drifted: kept {:?}, expected {expect:?}",
                counters::currents(&exact)
            ));
        }
        st.base.check(&exact)
    }
}
