//! Kill points for the crash tests: the one place a test may stop this process mid-step.
//!
//! A transaction's steps between two files (a table flushed but not renamed, renamed but not
//! recorded) are where a crash can hurt, and no outside signal lands on them reliably. Each
//! such step calls [`crash_point`] with its name; a process started with
//! `DATASET_RT_TEST_KILL_AT=<name>` kills itself there with `SIGKILL`, exactly as a power
//! cut or the OOM killer would stop it. Without the variable a point costs one atomic load.

use std::sync::OnceLock;

/// The variable that names the point to die at.
pub const KILL_AT_VAR: &str = "DATASET_RT_TEST_KILL_AT";

/// Kills this process with `SIGKILL` if `$DATASET_RT_TEST_KILL_AT` names `point`. The
/// variable is read once, at the first point reached.
pub fn crash_point(point: &str) {
    static KILL_AT: OnceLock<Option<String>> = OnceLock::new();
    let target = KILL_AT.get_or_init(|| std::env::var(KILL_AT_VAR).ok());
    if target.as_deref() == Some(point) {
        // SAFETY: kill(2) with our own pid and a valid signal number has no memory effects.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}
