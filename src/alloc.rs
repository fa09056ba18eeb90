//! The process's allocator: the system allocator, with a meter for work on untrusted input whose memory nothing
//! else can bound.
//!
//! A model's chat template is a program from the model file. minijinja bounds its instructions (fuel) and its
//! `range` and string repetition, but not concatenation: forty `s ~ s` in a row ask for a terabyte, and Rust
//! cannot fail an allocation gracefully (a null return aborts the process) nor unwind out of an allocator. So
//! [`run_metered`] runs such work on a worker thread whose allocations are counted (bytes allocated less bytes
//! freed, while the work runs). An allocation that would take the count past the limit is never made: the waiting
//! caller is told the work went over its limit, and the worker thread sleeps for the rest of the process, holding
//! at most the limit (and no lock: metered work takes none that others need, and a panicking thread is never
//! stopped, so the panic hook's locks are not held by a sleeper). Callers stop using a program that did this ([`ChatTemplate`](crate::tokenize::ChatTemplate)
//! refuses every later row), so at most a few such threads ever sleep.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

/// The system allocator, counting the allocations of metered work.
pub struct Metered;

#[global_allocator]
static GLOBAL: Metered = Metered;

thread_local! {
    /// The meter of the metered work running on this thread, or null. A `const` thread local of a type without
    /// drop glue: reading it never allocates, registers no destructor, and works at any point of a thread's life.
    static METER: Cell<*const Meter> = const { Cell::new(std::ptr::null()) };
}

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const OVER: u8 = 2;

/// One metered call: the bytes it holds, its limit, and its state for the waiting caller.
struct Meter {
    live: AtomicIsize,
    limit: isize,
    state: Mutex<u8>,
    changed: Condvar,
}

impl Meter {
    fn finish(&self, state: u8) {
        // Neither locking a futex-based std mutex nor notifying a condition variable allocates, so this is safe to
        // call from inside the allocator.
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *s = state;
        self.changed.notify_all();
    }
}

/// Counts `delta` bytes against this thread's meter, if it has one. Returns only if the allocation may be made.
fn charge(delta: isize) {
    let meter = METER.with(Cell::get);
    if meter.is_null() {
        return;
    }
    // SAFETY: a non-null METER points into an `Arc<Call>` that the closure running on this thread owns (see
    // `Entered`): it is set when that closure starts and reset to null before the closure drops its `Arc`, and a
    // tripped meter's thread never returns from the loop below, so the `Arc` is never dropped. Only this thread
    // reads METER, so the pointer is live for as long as this function uses it.
    let meter = unsafe { &*meter };
    let live = meter.live.fetch_add(delta, Ordering::Relaxed) + delta;
    // A panicking thread is unwinding to the caller (the panic hook may take locks such as stderr's, and print a
    // backtrace): it is never stopped, or it would sleep holding them.
    if delta > 0 && live > meter.limit && !std::thread::panicking() {
        // Later allocations on this thread (none are expected) go uncounted rather than back here.
        METER.with(|m| m.set(std::ptr::null()));
        meter.finish(OVER);
        loop {
            // nanosleep: no allocation.
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

// SAFETY: every method forwards to `System` with the arguments it was given, so `System`'s guarantees hold; the
// metering around it neither allocates (only `charge` runs, which touches a const thread local, atomics, a mutex, a
// condition variable and the thread's panic count) nor unwinds (it has no panicking path: `unwrap_or_else` takes a
// poisoned lock's guard).
unsafe impl GlobalAlloc for Metered {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        charge(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        charge(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

/// Sets this thread's meter for as long as it lives.
struct Entered;

impl Entered {
    fn new(meter: &Meter) -> Entered {
        METER.with(|m| m.set(meter));
        Entered
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        METER.with(|m| m.set(std::ptr::null()));
    }
}

/// Metered work went past its memory limit; the thread that ran it sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit;

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// This thread's worker for metered work, started on first use and replaced when one trips its meter.
    static WORKER: RefCell<Option<mpsc::Sender<Job>>> = const { RefCell::new(None) };
}

fn start_worker() -> mpsc::Sender<Job> {
    let (tx, rx) = mpsc::channel::<Job>();
    // Templates recurse (macros, nested loops): minijinja's own recursion limit needs a stack of a few MiB.
    let spawned = std::thread::Builder::new().name("nightshift-metered".into()).stack_size(16 << 20).spawn(move || {
        for job in rx {
            job();
        }
    });
    // A thread that cannot start leaves the receiver dropped: the caller's send fails and it says so.
    drop(spawned);
    tx
}

/// Runs `work` on this thread's metered worker, with at most `limit` bytes allocated (less freed) while it runs,
/// and waits for it. A panic in `work` is resumed here.
pub fn run_metered<T: Send + 'static>(limit: usize, work: impl FnOnce() -> T + Send + 'static) -> Result<T, OverLimit> {
    struct Call<T> {
        meter: Meter,
        result: Mutex<Option<std::thread::Result<T>>>,
    }
    let call = Arc::new(Call {
        meter: Meter { live: AtomicIsize::new(0), limit: limit.min(isize::MAX as usize) as isize, state: Mutex::new(RUNNING), changed: Condvar::new() },
        result: Mutex::new(None),
    });
    let theirs = Arc::clone(&call);
    let job: Job = Box::new(move || {
        let entered = Entered::new(&theirs.meter);
        let result = std::panic::catch_unwind(AssertUnwindSafe(work));
        drop(entered);
        *theirs.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        theirs.meter.finish(DONE);
    });
    let sent = WORKER.with(|w| {
        let mut w = w.borrow_mut();
        let tx = w.get_or_insert_with(start_worker);
        match tx.send(job) {
            Ok(()) => Ok(()),
            // The worker is gone (it could not start): run on a fresh one.
            Err(mpsc::SendError(job)) => {
                let tx = w.insert(start_worker());
                tx.send(job).map_err(|_| ())
            }
        }
    });
    if sent.is_err() {
        panic!("cannot start a thread for metered work");
    }
    let mut state = call.meter.state.lock().unwrap_or_else(|e| e.into_inner());
    while *state == RUNNING {
        state = call.meter.changed.wait(state).unwrap_or_else(|e| e.into_inner());
    }
    if *state == OVER {
        // That worker sleeps for good: the next call starts another.
        WORKER.with(|w| w.borrow_mut().take());
        return Err(OverLimit);
    }
    drop(state);
    let result = call.result.lock().unwrap_or_else(|e| e.into_inner()).take().expect("a finished call left its result");
    result.map_err(|panic| std::panic::resume_unwind(panic))
}

/// The system allocator's thresholds for a process whose steps allocate and free buffers of tens of megabytes (a
/// prefill chunk's activations: 2,048 rows of a 8,192-wide feed-forward layer are 64 MiB). glibc serves an
/// allocation above its mmap threshold (at most 32 MiB as it adapts) with a fresh mapping and unmaps it when freed,
/// so every such buffer, every step, is new pages: faulted in and zeroed by the kernel one 4 KiB page at a time (on
/// a 2-core VM, 2 M page faults and a tenth of a Llama-3.2-1B-shaped job's prefill; BENCHMARKS.md, 2026-12-06,
/// item 5). Buffers up to 256 MiB now come from the heap, and up to 512 MiB of freed memory at its top stays
/// mapped for the next step instead of being handed back. Peak memory is about the same: the same buffers, held
/// no longer. A `GLIBC_TUNABLES` that sets any `glibc.malloc.` value wins: the thresholds are then left as it says.
/// Returns whether they were set. Only glibc on Linux has these settings; elsewhere, nothing changes.
pub fn keep_large_buffers() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("GLIBC_TUNABLES").is_some_and(|t| t.to_string_lossy().contains("glibc.malloc.")) {
            return false;
        }
        // SAFETY: `mallopt` changes two of glibc's allocator parameters under its own lock; it reads and writes no
        // memory of ours. The values are within what glibc accepts (it says 0 where it refuses one).
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Hands the heap's free pages back to the system (glibc's `malloc_trim(0)`, which releases whole free pages
/// anywhere in the heaps, not only at their tops). A model's load reads the file's copy of its weights a part at a
/// time and frees each once laid out: with [`keep_large_buffers`]'s thresholds those freed copies stayed in the
/// heap, resident, for the rest of the process (310 MiB after a Llama-3.2-1B-shaped Q4_K_M file's load, a third of
/// its weights). The loaders call this after each part and at the end. Returns whether it ran: only glibc on Linux
/// has it; elsewhere, nothing changes.
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` walks glibc's arenas under their locks and advises the kernel that free chunks' whole
        // pages are not needed; it touches no memory that is allocated.
        unsafe { libc::malloc_trim(0) };
        true
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers freed in the heap stay resident (the thresholds keep them) until [`release_free_memory`], which gives
    /// their pages back: `mincore` on the freed buffers' whole pages (their addresses only, never read) says most
    /// are resident before and few after. Buffers kept between them stay put, so the freed ones are holes inside
    /// this thread's heap, as a load's file copies are.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_buffers_are_given_back_when_asked() {
        if !keep_large_buffers() {
            eprintln!("GLIBC_TUNABLES sets the allocator's values: nothing to check");
            return;
        }
        let page = 4096usize;
        let (mut freed, mut kept) = (Vec::new(), Vec::new());
        for i in 0..48 {
            let buffer = vec![(i % 251) as u8 + 1; 1 << 20];
            if i % 2 == 0 { freed.push(buffer) } else { kept.push(buffer) }
        }
        // The whole pages inside each buffer to be freed: addresses only, kept past the free.
        let ranges: Vec<(usize, usize)> = freed.iter().map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.len())).map(|(s, e)| (s.next_multiple_of(page), e / page * page)).collect();
        drop(freed);
        let resident = || {
            let (mut yes, mut all) = (0usize, 0usize);
            for &(start, end) in &ranges {
                let mut pages = vec![0u8; (end - start) / page];
                // SAFETY: `mincore` only reports, into `pages` (one byte per page of the range, as many as it holds),
                // whether each page of a range of this process's own address space is resident; it reads and writes
                // nothing else. The range is page-aligned; a range no longer mapped makes it fail (counted as not
                // resident).
                let ok = unsafe { libc::mincore(start as *mut libc::c_void, end - start, pages.as_mut_ptr()) } == 0;
                all += pages.len();
                yes += if ok { pages.iter().filter(|&&p| p & 1 == 1).count() } else { 0 };
            }
            (yes, all)
        };
        let (before, all) = resident();
        assert!(release_free_memory());
        let (after, _) = resident();
        assert!(before * 10 >= all * 9, "freed buffers were already given back: {before} of {all} pages resident");
        assert!(after * 10 <= all, "{after} of {all} freed pages still resident after release_free_memory");
        assert!(kept.iter().enumerate().all(|(i, b)| b.iter().all(|&v| v == ((2 * i + 1) % 251) as u8 + 1)), "kept buffers intact");
    }

    /// With the thresholds set, a buffer of tens of megabytes comes from the heap, not from a mapping of its own
    /// (glibc's default, which this test would see as `hblkhd`, the bytes in such mappings, growing by its size).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn large_buffers_come_from_the_heap() {
        if !keep_large_buffers() {
            eprintln!("GLIBC_TUNABLES sets the allocator's values: nothing to check");
            return;
        }
        // SAFETY: `mallinfo2` only reads the allocator's statistics (under its locks) into the returned struct.
        let mapped = || unsafe { libc::mallinfo2() }.hblkhd;
        let before = mapped();
        let buffer = vec![1u8; 48 << 20];
        let during = mapped();
        assert!(during < before + (48 << 20), "a 48 MiB buffer was mapped on its own: {before} -> {during} bytes in mappings");
        assert_eq!(buffer.iter().map(|&b| b as usize).sum::<usize>(), 48 << 20);
    }

    #[test]
    fn metered_work_within_its_limit_returns_its_result() {
        let sum = run_metered(1 << 20, || (0..1000u64).collect::<Vec<_>>().iter().sum::<u64>()).unwrap();
        assert_eq!(sum, 499_500);
        // Allocations freed along the way do not accumulate: many 512 KiB buffers in turn fit a 1 MiB limit.
        let n = run_metered(1 << 20, || (0..64).map(|i| vec![i as u8; 512 << 10].len()).sum::<usize>()).unwrap();
        assert_eq!(n, 64 * (512 << 10));
    }

    #[test]
    fn metered_work_past_its_limit_is_stopped_and_the_caller_goes_on() {
        // Doubling a string: the 2 MiB step is refused, not made.
        let over = run_metered(1 << 20, || {
            let mut s = String::from("x");
            for _ in 0..40 {
                s = s.clone() + &s;
            }
            s.len()
        });
        assert_eq!(over, Err(OverLimit));
        // This thread's next metered call gets a fresh worker; unmetered work here is unaffected.
        assert_eq!(run_metered(1 << 20, || vec![1u8; 1000].len()), Ok(1000));
        assert_eq!(vec![0u8; 8 << 20].len(), 8 << 20);
    }

    #[test]
    fn a_panic_in_metered_work_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| run_metered(1 << 20, || -> u32 { panic!("boom") }));
        assert!(caught.is_err());
        assert_eq!(run_metered(1 << 20, || 7), Ok(7));
    }
}
