//! Reader for the CSV log of RAPIDS RMM's `logging_resource_adaptor`:
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 1979932,14:21:19.998533,allocate,0x30a000000,256,0x2
//! 1979932,14:21:19.998601,allocate failure,(nil),1073741824,0x2 <- skipped, counted
//! 1980043,14:21:32.661875,free,0x30a000000,256,0x2
//! ```
//!
//! Pointers become ids: a hash map from live address to id; an address freed and allocated
//! again gets a fresh id (ids count up from 0 in allocation order). Streams (hex or decimal
//! handles) become dense ids in order of first appearance, with handle 0 (the default
//! stream) always id 0, and so is `0x1`, `cudaStreamLegacy`, which names the same stream
//! in a program built with CUDA's legacy default stream (the default build; RMM's
//! `is_default()` holds for both). `0x2`, `cudaStreamPerThread`, keeps an id of its own: it
//! is handle 0's stream only in a program built with `--default-stream per-thread`, and each
//! thread's is another stream. `Thread` and `Time` are ignored; all buffers are tagged
//! [`Tag::Act`] (the log has no residency). `deallocate` is accepted as a synonym of `free`.
//!
//! A row with a null pointer (`(nil)`, as glibc's `%p` writes it, or `0x0`) is skipped and
//! counted (`allocate (null pointer)`, `free (null pointer)`): RMM's resources return a null
//! pointer for a zero-byte allocation and ignore its free, so such a row holds no memory, and
//! any number of them may be live at once. (Like a failed allocation's row, such a row gives
//! its stream no id.)
//!
//! A free of an address the log never allocated (the allocation precedes the log) is read as
//! the PyTorch reader reads one: a synthetic alloc of the free's `Size` at the start of the
//! trace, counted in [`Trace::pre_window`]. A second free of an address, with no allocation
//! of it in between, is no such block (the log's own block was there) but a double free:
//! [`ErrorKind::FreeOfUnknownAddress`]. A free of a live address whose `Size` is not the
//! allocation's is [`ErrorKind::FreeSizeMismatchAt`] (RMM's resources take the size from the
//! free, so the log or the program is broken there).

use std::collections::{HashMap, HashSet};
use std::io::BufRead;

use super::lines::{LineReader, parse_u64, parse_u64_hex_or_dec, split_fields};
use crate::error::{ErrorKind, TraceError, echo};
use crate::event::{Event, Tag, Trace};
use crate::validate::Validator;

/// The header line of the format.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";
const COLUMNS: [&str; 6] = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"];

/// Reads an RMM log (plain text; see [`super::read_trace_from`] for gzip).
pub fn read_rmm_log<R: BufRead>(input: R, name: &str) -> Result<Trace, TraceError> {
    let mut lines = LineReader::new(input);
    lines.expect_header(HEADER)?;
    read_body(&mut lines, name)
}

/// Maps stream handles to dense ids (0 stays 0).
#[derive(Default)]
pub(super) struct StreamIds(HashMap<u64, u32>);

impl StreamIds {
    pub(super) fn id(&mut self, handle: u64) -> u32 {
        if handle == 0 {
            return 0;
        }
        let next = u32::try_from(self.0.len() + 1).unwrap_or(u32::MAX);
        *self.0.entry(handle).or_insert(next)
    }
}

/// CUDA's `cudaStreamLegacy`: the legacy default stream, named explicitly.
const STREAM_LEGACY: u64 = 0x1;

/// Parses a `Stream` field: `0x1` (`cudaStreamLegacy`, `rmm::cuda_stream_legacy`) is the
/// default stream, as handle 0 is in a program built with the legacy default stream (CUDA's
/// default, and RMM's `cuda_stream_view::is_default()` says so of both); see the module docs.
fn parse_stream(text: &str) -> Result<u64, ErrorKind> {
    match parse_u64_hex_or_dec(text, "Stream")? {
        // BROKEN (`rmm_legacy_stream_apart`): `0x1` was a stream of its own.
        STREAM_LEGACY if !cfg!(tidepool_broken = "rmm_legacy_stream_apart") => Ok(0),
        h => Ok(h),
    }
}

/// Parses a `Pointer` field: hex with `0x` or decimal, and glibc's `(nil)` (what RMM's
/// `%p` writes for a null pointer) as 0.
fn parse_pointer(text: &str) -> Result<u64, ErrorKind> {
    if text == "(nil)" && !cfg!(tidepool_broken = "rmm_null_ptr_live") {
        return Ok(0);
    }
    parse_u64_hex_or_dec(text, "Pointer")
}

/// Reads the rows after the header.
pub(super) fn read_body<R: BufRead>(
    lines: &mut LineReader<R>,
    name: &str,
) -> Result<Trace, TraceError> {
    let mut trace = Trace { name: name.to_string(), ..Trace::default() };
    let mut validator = Validator::new();
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // address -> (id, bytes)
    let mut freed: HashSet<u64> = HashSet::new(); // addresses freed and not allocated since
    let mut streams = StreamIds::default();
    let mut next_id = 0u64;
    // Synthetic allocs of blocks allocated before the log.
    let mut prelude: Vec<Event> = Vec::new();
    while let Some((n, line)) = lines.next_line()? {
        let at = |k| TraceError::at_line(n, k);
        let [_thread, _time, action, ptr, size, stream] =
            split_fields(line, &COLUMNS).map_err(at)?;
        let event = match action {
            "allocate failure" => {
                trace.skip(action);
                continue;
            }
            "allocate" => {
                let ptr = parse_pointer(ptr).map_err(at)?;
                let bytes = parse_u64(size, "Size").map_err(at)?;
                let handle = parse_stream(stream).map_err(at)?;
                if ptr == 0 && !cfg!(tidepool_broken = "rmm_null_ptr_live") {
                    trace.skip("allocate (null pointer)");
                    continue;
                }
                let stream = streams.id(handle);
                if live.contains_key(&ptr) {
                    return Err(at(ErrorKind::AllocOfLiveAddress(ptr)));
                }
                freed.remove(&ptr);
                let id = next_id;
                next_id += 1;
                live.insert(ptr, (id, bytes));
                Event::alloc(id, bytes, stream, Tag::Act)
            }
            "free" | "deallocate" => {
                let ptr = parse_pointer(ptr).map_err(at)?;
                let size = parse_u64(size, "Size").map_err(at)?;
                let handle = parse_stream(stream).map_err(at)?;
                if ptr == 0 && !cfg!(tidepool_broken = "rmm_null_ptr_live") {
                    trace.skip("free (null pointer)");
                    continue;
                }
                let stream = streams.id(handle);
                let (id, bytes) = match live.remove(&ptr) {
                    // RMM's resources take the size from `deallocate` (a pool returns that
                    // many bytes): a row with another size than the allocation's is a broken
                    // log or program, not a free to replay as the allocation's size.
                    // BROKEN (`rmm_free_size_unchecked`): read as a free of the allocation.
                    Some((_, bytes))
                        if size != bytes && !cfg!(tidepool_broken = "rmm_free_size_unchecked") =>
                    {
                        return Err(at(ErrorKind::FreeSizeMismatchAt {
                            addr: ptr,
                            allocated: bytes,
                            freed: size,
                        }));
                    }
                    Some(x) => {
                        freed.insert(ptr);
                        x
                    }
                    // Freed already and not allocated since: no block from before the log
                    // can be there (it would have overlapped the log's own block).
                    None if freed.contains(&ptr)
                        && !cfg!(tidepool_broken = "rmm_double_free_prewindow") =>
                    {
                        return Err(at(ErrorKind::FreeOfUnknownAddress(ptr)));
                    }
                    None => {
                        freed.insert(ptr);
                        // Allocated before the log started: live from its start.
                        let early = Event::alloc(next_id, size, stream, Tag::Act);
                        validator.check(&early).map_err(at)?;
                        prelude.push(early);
                        trace.pre_window.freed_blocks += 1;
                        trace.pre_window.freed_bytes =
                            trace.pre_window.freed_bytes.saturating_add(size);
                        next_id += 1;
                        (next_id - 1, size)
                    }
                };
                Event::free(id, bytes, stream, Tag::Act)
            }
            other => return Err(at(ErrorKind::UnknownOp(echo(other)))),
        };
        validator.check(&event).map_err(at)?;
        trace.events.push(event);
    }
    if !prelude.is_empty() {
        prelude.append(&mut trace.events);
        trace.events = prelude;
    }
    Ok(trace)
}
