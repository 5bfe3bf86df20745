//! Incremental trace checking, used by every reader while it reads (so an error names the
//! record where it happened) and by [`super::Trace::validate`].
//!
//! State: one hash map from id to [`IdState`] (live with its bytes, or freed), and a stack of
//! open scopes. Ids are never reused within a trace; readers of pointer-based formats turn a
//! reused address into a fresh id before the event reaches the validator.

use std::collections::{HashMap, HashSet};

use super::error::ErrorKind;
use super::event::{Event, Op};

/// What the validator knows about an id.
#[derive(Debug, Clone, Copy)]
enum IdState {
    Live(u64),
    Freed,
}

/// Checks events one at a time.
#[derive(Debug, Default)]
pub struct Validator {
    ids: HashMap<u64, IdState>,
    open_scopes: Vec<u32>,
    /// The scopes of `open_scopes`, for the check that an entered scope is not open: a
    /// search of the stack took time quadratic in the nesting depth, which the input sets.
    open_set: HashSet<u32>,
}

impl Validator {
    /// A validator that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks the next event.
    pub fn check(&mut self, e: &Event) -> Result<(), ErrorKind> {
        match e.op {
            Op::Alloc => match self.ids.get(&e.id) {
                Some(_) => Err(ErrorKind::DoubleAlloc(e.id)),
                None => {
                    self.ids.insert(e.id, IdState::Live(e.bytes));
                    Ok(())
                }
            },
            Op::Free => match self.ids.get(&e.id).copied() {
                None => Err(ErrorKind::FreeOfUnknownId(e.id)),
                Some(IdState::Freed) => Err(ErrorKind::DoubleFree(e.id)),
                Some(IdState::Live(bytes)) => {
                    if e.bytes != bytes && e.bytes != 0 {
                        return Err(ErrorKind::FreeSizeMismatch {
                            id: e.id,
                            allocated: bytes,
                            freed: e.bytes,
                        });
                    }
                    self.ids.insert(e.id, IdState::Freed);
                    Ok(())
                }
            },
            Op::ScopeEnter => {
                let s = e.scope.ok_or_else(|| {
                    ErrorKind::UnbalancedScope("scope_enter without a scope".into())
                })?;
                // BROKEN (`scope_check_quadratic`): the stack searched at every enter.
                let open = match cfg!(tidepool_broken = "scope_check_quadratic") {
                    true => {
                        let at = self.open_scopes.iter().position(|&o| o == s);
                        crate::cost::looked_at(at.map_or(self.open_scopes.len(), |i| i + 1));
                        at.is_some()
                    }
                    false => {
                        crate::cost::looked_at(1);
                        self.open_set.contains(&s)
                    }
                };
                if open {
                    return Err(ErrorKind::UnbalancedScope(format!(
                        "scope {} entered while already open",
                        e.id
                    )));
                }
                self.open_scopes.push(s);
                self.open_set.insert(s);
                Ok(())
            }
            Op::ScopeExit => {
                let s = e.scope.ok_or_else(|| {
                    ErrorKind::UnbalancedScope("scope_exit without a scope".into())
                })?;
                match self.open_scopes.last() {
                    None => Err(ErrorKind::UnbalancedScope(format!(
                        "scope_exit of scope {} with no open scope",
                        e.id
                    ))),
                    Some(&top) if top != s => {
                        Err(ErrorKind::UnbalancedScope(if self.open_set.contains(&s) {
                            format!("scope_exit of scope {} while an inner scope is open", e.id)
                        } else {
                            format!("scope_exit of scope {} that is not open", e.id)
                        }))
                    }
                    Some(_) => {
                        self.open_scopes.pop();
                        self.open_set.remove(&s);
                        Ok(())
                    }
                }
            }
        }
    }

    /// Checks the end of the trace: no scope left open. (Never-freed ids are allowed.)
    pub fn finish(&self) -> Result<(), ErrorKind> {
        match self.open_scopes.len() {
            0 => Ok(()),
            n => {
                Err(ErrorKind::UnbalancedScope(format!("{n} scope(s) still open at end of trace")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Validator;
    use crate::event::{Event, Op, Tag};

    fn marker(op: Op, scope: u32) -> Event {
        Event { op, id: u64::from(scope), bytes: 0, stream: 0, tag: Tag::Act, scope: Some(scope) }
    }

    /// Scopes nested 4 000 deep: each enter checks that its scope is not open in constant
    /// time, where a search of the stack of open scopes looked at n²/2 entries (300 000 nested
    /// scopes took a minute to read; `tests/trace_review.rs` reads them). Counted, not timed.
    /// Broken build `scope_check_quadratic` (7 998 000 here).
    #[test]
    fn an_enter_checks_the_open_scopes_in_constant_time() {
        const N: u32 = 4_000;
        let mut v = Validator::new();
        crate::cost::take();
        for s in 0..N {
            v.check(&marker(Op::ScopeEnter, s)).unwrap();
        }
        let looked_at = crate::cost::take();
        assert_eq!(looked_at, u64::from(N), "{looked_at} open scopes looked at");
        // A scope open deep in the stack is still refused, and the stack unwinds in order.
        let e = v.check(&marker(Op::ScopeEnter, 3)).unwrap_err();
        assert_eq!(e.to_string(), "unbalanced scope: scope 3 entered while already open");
        for s in (0..N).rev() {
            v.check(&marker(Op::ScopeExit, s)).unwrap();
        }
    }
}
