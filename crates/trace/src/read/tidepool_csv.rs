//! Reader for tidepool's own CSV trace format:
//!
//! ```text
//! seq,op,id,bytes,stream,tag
//! 0,alloc,0,67108864,0,param
//! 10,scope_enter,0,0,0,step0      <- markers: id = scope id, tag = scope name
//! 13,free,10,8388608,0,act
//! ```
//!
//! `seq` must be a number but is otherwise not interpreted (filtered traces have gaps).
//! Each row is checked by the [`Validator`] as it is read, so the first bad row is reported
//! by line number. Scope ids are mapped to positions in [`Trace::scope_names`] through a hash
//! map (never through an index read from the input, which may be huge).

use std::collections::HashMap;
use std::io::BufRead;

use super::lines::{LineReader, parse_u64, split_fields};
use crate::error::{ErrorKind, TraceError, echo};
use crate::event::{Event, Op, Tag, Trace};
use crate::validate::Validator;

/// The header line of the format.
pub const HEADER: &str = "seq,op,id,bytes,stream,tag";
const COLUMNS: [&str; 6] = ["seq", "op", "id", "bytes", "stream", "tag"];

/// Reads a tidepool CSV trace (plain text; see [`super::read_trace_from`] for gzip).
pub fn read_tidepool_csv<R: BufRead>(input: R, name: &str) -> Result<Trace, TraceError> {
    let mut lines = LineReader::new(input);
    lines.expect_header(HEADER)?;
    read_body(&mut lines, name)
}

/// Reads the rows after the header.
pub(super) fn read_body<R: BufRead>(
    lines: &mut LineReader<R>,
    name: &str,
) -> Result<Trace, TraceError> {
    let mut trace = Trace { name: name.to_string(), ..Trace::default() };
    let mut validator = Validator::new();
    let mut scope_index: HashMap<u64, u32> = HashMap::new();
    let mut last_line = 1;
    while let Some((n, line)) = lines.next_line()? {
        last_line = n;
        let event = parse_row(line, &mut trace.scope_names, &mut scope_index)
            .map_err(|k| TraceError::at_line(n, k))?;
        validator.check(&event).map_err(|k| TraceError::at_line(n, k))?;
        trace.events.push(event);
    }
    validator.finish().map_err(|k| TraceError::at_line(last_line, k))?;
    Ok(trace)
}

fn parse_row(
    line: &str,
    scope_names: &mut Vec<String>,
    scope_index: &mut HashMap<u64, u32>,
) -> Result<Event, ErrorKind> {
    let [seq, op, id, bytes, stream, tag] = split_fields(line, &COLUMNS)?;
    parse_u64(seq, "seq")?;
    let op = match op {
        "alloc" => Op::Alloc,
        "free" => Op::Free,
        "scope_enter" => Op::ScopeEnter,
        "scope_exit" => Op::ScopeExit,
        other => return Err(ErrorKind::UnknownOp(echo(other))),
    };
    let id = parse_u64(id, "id")?;
    let bytes = parse_u64(bytes, "bytes")?;
    let stream = u32::try_from(parse_u64(stream, "stream")?)
        .map_err(|_| ErrorKind::BadNumber { column: "stream", text: echo(stream) })?;
    match op {
        Op::Alloc | Op::Free => {
            let tag = match tag {
                "param" => Tag::Param,
                "act" => Tag::Act,
                other => return Err(ErrorKind::UnknownTag(echo(other))),
            };
            Ok(Event { op, id, bytes, stream, tag, scope: None })
        }
        Op::ScopeEnter | Op::ScopeExit => {
            let index = match scope_index.get(&id) {
                Some(&i) => {
                    if scope_names[i as usize] != tag {
                        return Err(ErrorKind::UnbalancedScope(format!(
                            "scope {id} named `{}` here but `{}` before",
                            echo(tag),
                            echo(&scope_names[i as usize])
                        )));
                    }
                    i
                }
                None if op == Op::ScopeExit => {
                    return Err(ErrorKind::UnbalancedScope(format!(
                        "scope_exit of scope {id} that was never entered"
                    )));
                }
                None => {
                    let i = u32::try_from(scope_names.len())
                        .map_err(|_| ErrorKind::UnbalancedScope("more than 2^32 scopes".into()))?;
                    scope_names.push(tag.to_string());
                    scope_index.insert(id, i);
                    i
                }
            };
            Ok(Event { op, id, bytes: 0, stream, tag: Tag::Act, scope: Some(index) })
        }
    }
}
