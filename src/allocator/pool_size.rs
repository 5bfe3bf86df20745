//! The initial pool (`initial_pool_size_mb`, RMM's `initial_pool_size`): one segment reserved
//! when the allocator is made, a transient large-pool segment of the default stream, served
//! from like any other (split and coalesced as usual) and kept until the allocator goes:
//! `empty_cache`, the garbage collection and the out-of-memory ladder leave it. The maximum
//! (`max_pool_size_mb`) is a cap on reserved bytes, enforced where segments are reserved
//! ([`Config::limit`]).
//!
//! ```text
//!  Allocator::new ─▶ reserve(initial) ─▶ pool: [ free ··········· initial ··········· ]
//!  alloc(4 MiB)   ─▶ best fit          ─▶ pool: [ 4 MiB ][ free ····················· ]
//! ```

use super::*;
use crate::stats::PoolKind;

impl<D: Device> Allocator<D> {
    /// Reserves the initial pool, if one is configured. A device that cannot hold it fails
    /// [`Allocator::new`] with the device's error (out of memory: the report).
    pub(super) fn reserve_initial_pool(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let config = sh.config.load_full();
        let bytes = config.initial_pool_size;
        if bytes == 0 {
            return Ok(());
        }
        let size = bytes.next_multiple_of(config.sizing.min_block_size);
        let key = PoolKey {
            residency: Residency::Transient,
            stream: StreamId::DEFAULT,
            kind: PoolKind::Large,
        };
        let mut st = sh.lock_state();
        sh.check_stream(&mut st, StreamId::DEFAULT)?;
        match sh.reserve(&mut st, &config, key, size) {
            Ok(block) => {
                let base = st.pool.block(block).addr;
                st.initial = Some(base);
                Ok(())
            }
            Err(AllocError::OutOfMemory(_)) => {
                let report = sh.oom_report(&st, &config, key, size, size, size);
                Err(AllocError::OutOfMemory(Box::new(report)))
            }
            Err(e) => Err(e),
        }
    }
}
