//! What the host machine has: memory probes read from Linux's `/proc` and cgroup files. Below every stage:
//! the engine sizes its KV cache from them, the metrics report them.

/// The wall clock: seconds since the Unix epoch (0 on a clock set before it).
pub fn unix_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The process's peak resident memory (`VmHWM`), on Linux.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Hands the pages of a read-only file mapping that hold `bytes` back to the kernel (`madvise(MADV_DONTNEED)`), so
/// that they stop counting in this process's resident memory; the next read of them faults them in again from the
/// file (the page cache), with the same contents. For a model file read once at load. A hint: nothing happens
/// where it is refused or off Linux.
///
/// # Safety
///
/// `bytes` lies in a file mapping that this process only reads, and the file is not changed while it is mapped.
/// (On anonymous memory, the heap's, `MADV_DONTNEED` zeroes the pages, neighbours' bytes included.)
pub unsafe fn release_pages(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        if bytes.is_empty() {
            return;
        }
        // SAFETY: `sysconf` reads a constant.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return,
        };
        let start = bytes.as_ptr() as usize / page * page;
        let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
        // SAFETY: `bytes` lies in a file mapping that is only ever read (the caller's contract), and a mapping
        // covers whole pages, so `start..end` (its pages, rounded outward) is mapped and
        // belongs to it. For a file mapping, MADV_DONTNEED drops the pages from this process without changing what
        // they hold: a later read (of these bytes, or a neighbour's sharing a page) faults them in again from the
        // file, whose contents do not change while it is read (the same assumption that made mapping it sound). No
        // Rust reference sees different bytes before and after. A failure (EINVAL, EAGAIN) leaves the pages as they
        // were.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// Memory this process may still take: the system's `MemAvailable`, or less where a cgroup (a container's or a
/// Slurm job's limit) leaves less. `None` where neither can be read.
pub fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    let read = |path: &str| std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u64>().ok());
    // cgroup v2, then v1 (whose "no limit" is a huge number, which `min` ignores).
    let cgroup = match (read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")) {
        (Some(max), Some(current)) => Some(max.saturating_sub(current)),
        _ => match (read("/sys/fs/cgroup/memory/memory.limit_in_bytes"), read("/sys/fs/cgroup/memory/memory.usage_in_bytes")) {
            (Some(max), Some(current)) => Some(max.saturating_sub(current)),
            _ => None,
        },
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's resident bytes of the mapping that starts at `start` (`/proc/self/smaps`).
    fn mapping_rss(start: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let header = format!("{start:x}-");
        let block = smaps.split('\n').skip_while(|l| !l.starts_with(&header)).skip(1).take_while(|l| !l.contains('-') || l.contains(':'));
        block.filter_map(|l| l.strip_prefix("Rss:")).map(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().unwrap() * 1024).next().unwrap()
    }

    /// A file mapping's pages, once read, are resident; released, they are not, and reading them again gives the
    /// same bytes (faulted in from the file). A range that starts and ends inside pages releases the pages around it.
    #[test]
    fn released_file_pages_leave_memory_and_read_back_the_same() {
        let path = std::env::temp_dir().join(format!("nightshift-release-{}", std::process::id()));
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh read-only shared mapping of the whole file (8 MiB), unmapped below and not used after.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), bytes.len(), libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the mapping is `bytes.len()` bytes, readable, and lives until the `munmap` below.
        let mapped = unsafe { std::slice::from_raw_parts(base as *const u8, bytes.len()) };
        let sum = |s: &[u8]| s.iter().map(|&b| u64::from(b)).sum::<u64>();
        assert_eq!(sum(mapped), sum(&bytes));
        let resident = mapping_rss(base as usize);
        assert!(resident >= 7 << 20, "read, {resident} bytes resident");
        // SAFETY: `mapped` is a read-only file mapping; the file is not changed while mapped.
        unsafe { release_pages(&mapped[100..bytes.len() - 100]) };
        let released = mapping_rss(base as usize);
        assert!(released <= 64 << 10, "released, {released} bytes still resident");
        assert!(mapped == &bytes[..], "the bytes read back after the release differ");
        // SAFETY: `base` is the mapping made above, `bytes.len()` long; `mapped` is not used after.
        assert_eq!(unsafe { libc::munmap(base, bytes.len()) }, 0);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn peak_rss_is_read_on_linux() {
        assert!(peak_rss_bytes().unwrap() > 1 << 20);
    }

    #[test]
    fn available_memory_is_read_on_linux() {
        let a = available_memory_bytes().unwrap();
        assert!(a > 1 << 20 && a < 1 << 50, "{a}");
    }
}
