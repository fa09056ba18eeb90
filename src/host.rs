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
