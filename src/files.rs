//! Local files the user names for nightshift to write beside its output (the metrics textfile, the report):
//! replaced whole, and never by renaming over something that is not a regular file. A leaf: every stage may
//! use it, it uses none.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

/// What a path named for writing is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Nothing there: a new file is made.
    Absent,
    /// A regular file (or a symbolic link to one): replaced whole, the link kept.
    Regular,
    /// A character device (`/dev/null`, `/dev/stdout`) or a FIFO: written in place, as a shell redirection does.
    InPlace,
}

/// What `path` is, or why nothing may be written there (a directory, a socket, a block device, a dangling link).
pub fn target(path: &Path) -> Result<Target, String> {
    let shown = path.display();
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(Target::Regular),
        Ok(m) if m.file_type().is_char_device() || m.file_type().is_fifo() => Ok(Target::InPlace),
        Ok(m) => {
            let t = m.file_type();
            let kind = if t.is_dir() {
                "a directory"
            } else if t.is_block_device() {
                "a block device"
            } else if t.is_socket() {
                "a socket"
            } else {
                "not a regular file"
            };
            Err(format!("`{shown}` exists and is {kind}; name a file"))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::symlink_metadata(path) {
            Ok(_) => Err(format!("`{shown}` is a symbolic link to nothing; name a file")),
            Err(_) => Ok(Target::Absent),
        },
        Err(e) => Err(format!("cannot look at `{shown}`: {e}")),
    }
}

/// `path` made absolute from the current directory, with `.` and `..` resolved against the file system: the longest
/// part that exists is canonicalized (its links followed, as the kernel does), the rest appended with `..` taken
/// lexically. `None` if the current directory cannot be read.
pub fn absolute(path: &Path) -> Option<PathBuf> {
    let absolute = std::path::absolute(path).ok()?;
    let mut existing = absolute.clone();
    let mut rest = Vec::new();
    let base = loop {
        if let Ok(real) = std::fs::canonicalize(&existing) {
            break real;
        }
        rest.push(existing.file_name().map(|n| n.to_owned()));
        if !existing.pop() {
            return Some(absolute);
        }
    };
    let mut out = base;
    for part in rest.into_iter().rev() {
        match part {
            Some(name) => out.push(name),
            // `file_name` is None for a trailing `..`: go up, as the kernel would once the part exists.
            None => {
                out.pop();
            }
        }
    }
    // Components that never existed may still hold `.` or `..` in the middle (`new/../x`): fold them.
    let mut folded = PathBuf::new();
    for c in out.components() {
        match c {
            Component::ParentDir => {
                folded.pop();
            }
            Component::CurDir => {}
            other => folded.push(other),
        }
    }
    Some(folded)
}

/// Refuses `path` as a place to write when it is not a file ([`target`]) or lies inside the local directory
/// `output` (the output's own files are never replaced by a side file). `what` names the option.
pub fn check_writable(path: &Path, what: &str, output: Option<&Path>) -> Result<Target, String> {
    let found = target(path).map_err(|e| format!("{what}: {e}"))?;
    if found == Target::Regular || found == Target::Absent {
        if let (Some(output), Some(ours)) = (output.and_then(absolute), absolute(path)) {
            if ours.starts_with(&output) {
                return Err(format!("{what}: `{}` is inside the output `{}`; name a file outside it", path.display(), output.display()));
            }
        }
    }
    Ok(found)
}

/// Writes `bytes` to `path` whole: a regular file is replaced by writing a temporary file beside it (named by
/// `temporary`, from the final name) and renaming it over; a device or FIFO is written in place (`nonblocking`: a
/// FIFO nobody reads is an error instead of a wait); a directory, socket or dangling link is refused.
pub fn replace(path: &Path, bytes: &[u8], temporary: impl Fn(&str) -> String, nonblocking: bool) -> std::io::Result<()> {
    let refused = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    match target(path).map_err(refused)? {
        Target::InPlace => {
            let mut options = std::fs::OpenOptions::new();
            options.write(true);
            if nonblocking {
                options.custom_flags(libc::O_NONBLOCK);
            }
            let mut file = options.open(path)?;
            file.write_all(bytes)?;
            file.flush()
        }
        found => {
            // Through a link, the file it names is replaced and the link kept.
            let real = if found == Target::Regular { std::fs::canonicalize(path)? } else { path.to_path_buf() };
            let name = real.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| refused(format!("`{}` is not a file name", path.display())))?;
            let partial = real.with_file_name(temporary(&name));
            let written = std::fs::write(&partial, bytes).and_then(|()| std::fs::rename(&partial, &real));
            if written.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            written
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test, under the system's temporary directory, removed with what it holds when the
    /// test ends (passed or failed).
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    impl std::ops::Deref for Scratch {
        type Target = Path;

        fn deref(&self) -> &Path {
            &self.0
        }
    }

    fn scratch(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("nightshift-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    #[test]
    fn a_device_is_written_in_place_and_a_directory_is_refused() {
        let dir = scratch("device");
        let temp = |n: &str| format!(".{n}.tmp");
        // /dev/null stays the device.
        replace(Path::new("/dev/null"), b"x", temp, true).unwrap();
        assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
        // A directory is refused, and left as it was.
        let err = replace(&dir, b"x", temp, false).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        assert!(dir.is_dir());
        // A link to a file: the file is replaced, the link kept.
        let file = dir.join("real.prom");
        std::fs::write(&file, "old").unwrap();
        let link = dir.join("link.prom");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        replace(&link, b"new", temp, false).unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        // A dangling link is refused.
        let dangling = dir.join("dangling");
        std::os::unix::fs::symlink(dir.join("nothing"), &dangling).unwrap();
        assert!(replace(&dangling, b"x", temp, false).is_err());
        assert!(std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink());
    }

    #[test]
    fn a_fifo_nobody_reads_is_an_error_not_a_wait() {
        let dir = scratch("fifo");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = replace(&fifo, b"x", |n| format!(".{n}.tmp"), true).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENXIO), "{err}");
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn paths_with_dot_dot_resolve_against_the_file_system_and_the_output_is_off_limits() {
        let dir = scratch("dotdot");
        let out = dir.join("out");
        std::fs::create_dir_all(out.join("sub")).unwrap();
        let base = std::fs::canonicalize(&*dir).unwrap();
        assert_eq!(absolute(&out.join("sub/../x")).unwrap(), base.join("out/x"));
        assert_eq!(absolute(&out.join("new/../../y")).unwrap(), base.join("y"));
        let inside = out.join("sub/../part-0.parquet");
        let err = check_writable(&inside, "--to", Some(&out)).unwrap_err();
        assert!(err.contains("inside the output"), "{err}");
        assert_eq!(check_writable(&dir.join("r.html"), "--to", Some(&out)).unwrap(), Target::Absent);
        assert!(check_writable(&out, "--to", None).unwrap_err().contains("is a directory"));
    }
}
