//! The allocator's setting that must be in the environment before the process starts: how
//! long mimalloc keeps freed memory (`MIMALLOC_PURGE_DELAY`).
//!
//! A data server frees and allocates gigabytes a second (receive buffers, decoded batches).
//! When the allocator hands freed memory back to the kernel at once, the next allocation faults
//! its pages in again and the kernel zeroes them: measured on a 16-core machine, eight clients'
//! puts ran 20-40% slower than with freed memory kept for reuse. Idle memory still goes back
//! after [`PURGE_DELAY_MS`]. mimalloc reads its options from the environment before `main`
//! runs, and its setter is foreign code, so when the variable is unset the process sets it and
//! replaces itself with a fresh image of the same binary (as the JDK launcher does for
//! `LD_LIBRARY_PATH`).

/// How long mimalloc keeps freed memory before returning it to the operating system, unless
/// `MIMALLOC_PURGE_DELAY` says otherwise.
pub const PURGE_DELAY_MS: &str = "10000";

const VARIABLE: &str = "MIMALLOC_PURGE_DELAY";

/// Re-executes the binary with `MIMALLOC_PURGE_DELAY` set, when it is not set already. Call it
/// first thing in `main`, before any thread starts or anything is read: the process is replaced
/// and starts over. If the exec fails, it returns and the process carries on with mimalloc's
/// default.
pub fn keep_freed_memory() {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(VARIABLE).is_some() {
            return;
        }
        let Ok(binary) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let name = args
            .next()
            .unwrap_or_else(|| binary.clone().into_os_string());
        // Under an ELF interpreter (ld.so, valgrind, qemu-user) the executable is the
        // interpreter, which would be run instead: keep mimalloc's default there.
        if std::path::Path::new(&name).file_name() != binary.file_name() {
            return;
        }
        // Returns only if the exec failed.
        let _error = std::process::Command::new(&binary)
            .arg0(name)
            .args(args)
            .env(VARIABLE, PURGE_DELAY_MS)
            .exec();
    }
}
