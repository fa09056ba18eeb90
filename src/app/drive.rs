//! The one drive loop every engine runs under, for `run`, `bench` and `plan`'s calibration: admit requests while
//! the engine has places, step, hand the outcomes on. It blocks for input only when the engine is idle.

use std::sync::mpsc;
use std::time::Duration;

use super::signals::Drain;
use crate::engine::{Engine, EngineError, EngineStats, Request};
use crate::outcome::Outcome;

/// Where the drive loop takes requests from.
pub trait Requests {
    /// The next request. With `wait`, blocks for a short while (so the loop notices a drain request) before
    /// answering [`Next::Empty`].
    fn next(&mut self, wait: bool) -> Next;
}

#[allow(clippy::large_enum_variant)] // moved straight out of the channel, never stored
pub enum Next {
    Request(Request),
    /// Nothing now; more may come.
    Empty,
    /// Nothing more will come.
    Closed,
}

/// How long an idle engine waits for input before it looks at the drain flag again.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// Requests handed over a chunk at a time (the rows the tokenizer prepared together) and admitted one at a time, so
/// that the rows of a chunk reach the engine together: its first step sees all of them, whatever the threads'
/// timing, instead of as many as the tokenizer sent before the engine woke up.
pub struct Chunks {
    chunks: mpsc::Receiver<Vec<Request>>,
    taken: std::collections::VecDeque<Request>,
}

impl Chunks {
    pub fn new(chunks: mpsc::Receiver<Vec<Request>>) -> Self {
        Chunks { chunks, taken: std::collections::VecDeque::new() }
    }
}

impl Requests for Chunks {
    fn next(&mut self, wait: bool) -> Next {
        loop {
            if let Some(request) = self.taken.pop_front() {
                return Next::Request(request);
            }
            let received = match wait {
                true => self.chunks.recv_timeout(IDLE_WAIT).map_err(|e| e == mpsc::RecvTimeoutError::Disconnected),
                false => self.chunks.try_recv().map_err(|e| e == mpsc::TryRecvError::Disconnected),
            };
            match received {
                // (An empty chunk is never sent; were one, the loop would look again.)
                Ok(chunk) => self.taken.extend(chunk),
                Err(false) => return Next::Empty,
                Err(true) => return Next::Closed,
            }
        }
    }
}

/// Requests that are all ready at the start (a benchmark's workload, a calibration's rows).
pub struct Ready<I>(pub I);

impl<I: Iterator<Item = Request>> Requests for Ready<I> {
    fn next(&mut self, _wait: bool) -> Next {
        self.0.next().map_or(Next::Closed, Next::Request)
    }
}

/// Where the drive loop hands outcomes.
pub trait Outcomes {
    /// Takes one output row; false when the consumer is gone, which ends the loop (its error is the one reported).
    fn send(&mut self, outcome: Outcome) -> bool;

    /// After each step: the engine's figures so far.
    fn stepped(&mut self, _stats: &EngineStats) {}
}

impl Outcomes for Vec<Outcome> {
    fn send(&mut self, outcome: Outcome) -> bool {
        self.push(outcome);
        true
    }
}

/// Runs `engine` until `requests` is closed and every admitted request is done: admits while there are places,
/// steps, sends the outcomes (a refused request is a failed row). On a drain request it admits nothing more and
/// stops at the grace deadline, dropping unfinished requests (their units are not committed, and a rerun redoes
/// them). Returns the engine's final figures.
pub fn drive(engine: &mut dyn Engine, requests: &mut dyn Requests, outcomes: &mut dyn Outcomes, drain: Option<&Drain>) -> Result<EngineStats, EngineError> {
    // Every device operation of the engine happens on this thread from here on.
    engine.bind_to_thread()?;
    crate::engine::device::join_cpu_pool();
    let mut open = true;
    loop {
        if let Some(drain) = drain.filter(|d| d.requested()) {
            open = false;
            if drain.past_deadline() {
                return Ok(engine.stats().clone());
            }
        }
        while open && engine.free_places() > 0 {
            match requests.next(!engine.has_work()) {
                Next::Request(request) => {
                    if let Err(failed) = engine.admit(request) {
                        if !outcomes.send(Outcome::Failed(failed)) {
                            return Ok(engine.stats().clone());
                        }
                    }
                }
                Next::Empty => break,
                Next::Closed => open = false,
            }
        }
        if !engine.has_work() {
            if open {
                continue;
            }
            return Ok(engine.stats().clone());
        }
        let results = engine.step()?;
        outcomes.stepped(engine.stats());
        for outcome in results {
            if !outcomes.send(outcome) {
                return Ok(engine.stats().clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::row::RowTag;

    /// Records what each step had admitted; every admitted request finishes in the step after it.
    #[derive(Default)]
    struct Recorder {
        running: Vec<String>,
        steps: Vec<Vec<String>>,
        stats: EngineStats,
    }

    impl Engine for Recorder {
        fn free_places(&self) -> usize {
            8 - self.running.len()
        }
        fn admit(&mut self, request: Request) -> Result<(), crate::outcome::RowFailure> {
            self.running.push(request.id);
            Ok(())
        }
        fn has_work(&self) -> bool {
            !self.running.is_empty()
        }
        fn step(&mut self) -> Result<Vec<Outcome>, EngineError> {
            self.steps.push(std::mem::take(&mut self.running));
            Ok(Vec::new())
        }
        fn stats(&self) -> &EngineStats {
            &self.stats
        }
        fn reset_stats(&mut self) {}
    }

    fn request(id: &str) -> Request {
        let tag = RowTag { unit: 0, offset: 0 };
        Request { id: id.into(), tag, params: Default::default(), tokens: vec![1], completion: None, arrival: std::time::Instant::now() }
    }

    /// A chunk's requests are admitted together before the step that follows, in order, however late the tokenizer
    /// sends them; every request is admitted once, and the loop ends once the channel closes. (The second chunk
    /// usually runs in a step of its own; a thread held up long enough may see it beside the first.)
    #[test]
    fn a_chunks_requests_reach_the_engine_together() {
        let (tx, rx) = mpsc::sync_channel::<Vec<Request>>(1);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(["a", "b", "c"].map(request).into()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            tx.send(vec![request("d")]).unwrap();
        });
        let mut engine = Recorder::default();
        drive(&mut engine, &mut Chunks::new(rx), &mut Vec::new(), None).unwrap();
        sender.join().unwrap();
        assert!(engine.steps[0].starts_with(&["a", "b", "c"].map(String::from)), "the first step: {:?}", engine.steps);
        assert_eq!(engine.steps.concat(), ["a", "b", "c", "d"]);
    }
}
