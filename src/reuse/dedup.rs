//! Identical requests of a run computed once. The tokenizer thread asks [`Dedup::admit`] before it sends a row
//! to the engine; the collector tells [`Dedup::finished`] each computed row's outcome and gets back copies for the
//! rows that waited on it. A request is pending from its admission to its outcome; finished ones stay in a small
//! window ([`WINDOW`]) so that a duplicate arriving soon after (in the next unit, say) is copied, not computed.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use super::RequestKey;
use crate::outcome::Outcome;
use crate::row::RowTag;

/// Finished requests kept for duplicates that come after them.
pub const WINDOW: usize = 4096;

/// What to do with a row.
pub enum Admit {
    /// Compute it: the first of its key (or its key is not known).
    Compute,
    /// An identical request is being computed; the collector copies its outcome when it comes.
    Wait,
    /// An identical request was computed: this is its outcome, for this row.
    Copy(Box<Outcome>),
}

#[derive(Default)]
pub struct Dedup {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    pending: HashMap<RequestKey, Pending>,
    /// The key of every row being computed, by its place.
    computing: HashMap<RowTag, RequestKey>,
    finished: HashMap<RequestKey, Outcome>,
    finished_order: VecDeque<RequestKey>,
}

struct Pending {
    followers: Vec<(String, RowTag)>,
}

impl Dedup {
    /// Called once per row about to be computed, in order.
    pub fn admit(&self, key: RequestKey, id: &str, tag: RowTag) -> Admit {
        let mut t = self.table.lock().expect("not poisoned");
        if let Some(done) = t.finished.get(&key) {
            return Admit::Copy(Box::new(done.copy_for(done.id(), id, tag)));
        }
        if let Some(pending) = t.pending.get_mut(&key) {
            pending.followers.push((id.to_string(), tag));
            return Admit::Wait;
        }
        t.pending.insert(key, Pending { followers: Vec::new() });
        t.computing.insert(tag, key);
        Admit::Compute
    }

    /// A row's outcome from the engine (or a failure before it): when the row was admitted to compute, gives it
    /// its request key and returns copies of it for the rows that waited on it.
    pub fn finished(&self, outcome: &mut Outcome) -> Vec<Outcome> {
        let mut t = self.table.lock().expect("not poisoned");
        let Some(key) = t.computing.remove(&outcome.tag()) else { return Vec::new() };
        outcome.set_request_key(key);
        let followers = t.pending.remove(&key).map(|p| p.followers).unwrap_or_default();
        let copies = followers.into_iter().map(|(id, tag)| outcome.copy_for(outcome.id(), &id, tag)).collect();
        // Failures are not kept: a rerun of a failed row might succeed.
        if matches!(outcome, Outcome::Completed(_) | Outcome::Embedded(_)) {
            if t.finished_order.len() >= WINDOW {
                if let Some(old) = t.finished_order.pop_front() {
                    t.finished.remove(&old);
                }
            }
            t.finished.insert(key, outcome.clone());
            t.finished_order.push_back(key);
        }
        copies
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{Embedded, RowFailure};
    use crate::row::{ErrorCode, RowError};

    fn tag(offset: u32) -> RowTag {
        RowTag { unit: 0, offset }
    }

    fn embedded(id: &str, offset: u32) -> Outcome {
        Outcome::Embedded(Embedded { id: id.into(), tag: tag(offset), vector: vec![1.0], prompt_tokens: 2, e2e_s: 0.5, request_key: None, duplicate_of: None })
    }

    #[test]
    fn duplicates_wait_for_the_first_and_later_ones_are_copied() {
        let d = Dedup::default();
        let (k1, k2) = (RequestKey([1; 32]), RequestKey([2; 32]));
        assert!(matches!(d.admit(k1, "a", tag(0)), Admit::Compute));
        assert!(matches!(d.admit(k2, "b", tag(1)), Admit::Compute));
        assert!(matches!(d.admit(k1, "c", tag(2)), Admit::Wait));
        assert!(matches!(d.admit(k1, "d", tag(3)), Admit::Wait));
        let mut first = embedded("a", 0);
        let copies = d.finished(&mut first);
        assert!(matches!(&first, Outcome::Embedded(e) if e.request_key == Some(k1)));
        let copied: Vec<(String, u32, Option<String>)> = copies
            .iter()
            .map(|o| match o {
                Outcome::Embedded(e) => {
                    assert_eq!(e.request_key, Some(k1));
                    (e.id.clone(), e.tag.offset, e.duplicate_of.clone())
                }
                _ => panic!("an embedding"),
            })
            .collect();
        assert_eq!(copied, [("c".into(), 2, Some("a".into())), ("d".into(), 3, Some("a".into()))]);
        // After it finished: copied at once.
        match d.admit(k1, "e", tag(4)) {
            Admit::Copy(copy) => match *copy {
                Outcome::Embedded(e) => assert_eq!((e.id.as_str(), e.tag.offset, e.duplicate_of.as_deref()), ("e", 4, Some("a"))),
                _ => panic!("an embedding"),
            },
            _ => panic!("a copy"),
        }
        // A row that was not admitted to compute (a copy, or unknown) has no key here.
        let mut copy = embedded("e", 4);
        assert!(d.finished(&mut copy).is_empty());
        assert!(matches!(&copy, Outcome::Embedded(e) if e.request_key.is_none()));
    }

    #[test]
    fn a_failed_row_fails_its_waiting_duplicates_and_is_not_kept() {
        let d = Dedup::default();
        let k = RequestKey([3; 32]);
        assert!(matches!(d.admit(k, "a", tag(0)), Admit::Compute));
        assert!(matches!(d.admit(k, "b", tag(1)), Admit::Wait));
        let mut failed = Outcome::Failed(RowFailure { id: "a".into(), tag: tag(0), error: RowError::new(ErrorCode::EngineError, "x") });
        let copies = d.finished(&mut failed);
        assert!(matches!(&copies[..], [Outcome::Failed(f)] if f.id == "b" && f.tag.offset == 1));
        assert!(matches!(d.admit(k, "c", tag(2)), Admit::Compute));
    }

    #[test]
    fn the_window_of_finished_requests_is_bounded() {
        let d = Dedup::default();
        for i in 0..(WINDOW + 10) as u32 {
            let mut key = [0u8; 32];
            key[..4].copy_from_slice(&i.to_le_bytes());
            assert!(matches!(d.admit(RequestKey(key), "a", tag(i)), Admit::Compute));
            d.finished(&mut embedded("a", i));
        }
        let t = d.table.lock().unwrap();
        assert_eq!(t.finished.len(), WINDOW);
        assert!(t.pending.is_empty() && t.computing.is_empty());
    }
}
