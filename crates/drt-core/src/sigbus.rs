//! Surviving a mapped cache file that shrinks under a reader.
//!
//! Shards and the index are memory-mapped. If another process truncates one of them while it
//! is mapped, touching a page past the new end of the file raises SIGBUS, which kills the
//! process by default. Reads of mapped cache files run inside [`guarded`]: a SIGBUS on a
//! thread inside a guarded section replaces the faulting page with a private zero page (so
//! the interrupted copy can finish), and records that a fault happened; the caller then
//! discards what it read and reports an error.
//!
//! Arrays that view a shard are read outside any guarded section, by NumPy or PyTorch on
//! any thread. Mapped files whose pages such views may read are [`register`]ed: a SIGBUS at
//! an address inside one is survived the same way (the page reads as zeros from then on)
//! and marks the file as [`shrank`], which the loader checks after every batch. Any other
//! SIGBUS is passed on to whatever handler was installed before (Python's `faulthandler`,
//! or the default action).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

thread_local! {
    // Const-initialised `Cell<bool>`s need no lazy initialisation or destructor, so the
    // signal handler may read and write them.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    static FAULTED: Cell<bool> = const { Cell::new(false) };
}

/// The handler that was installed before ours, to pass other faults on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// Most mapped files registered at once; a file that finds no free slot is simply never
/// viewed outside guarded reads (its records are copied instead).
const SLOTS: usize = 8192;

/// Registered address ranges, `[start, end)`; a free slot has `start == 0`.
static RANGES: [(AtomicUsize, AtomicUsize); SLOTS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; SLOTS];

/// Whether the range in each slot faulted outside guarded sections.
static SHRANK: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];

/// Registers the mapped range `[start, start + len)` as readable outside guarded sections;
/// returns the slot to [`unregister`] before the range is unmapped, or `None` if every slot
/// is taken.
pub fn register(start: usize, len: usize) -> Option<usize> {
    if start == 0 || len == 0 {
        return None;
    }
    install();
    for (slot, (first, end)) in RANGES.iter().enumerate() {
        // The end is stored after the start is claimed: a handler that sees the start but
        // not yet the end matches nothing, which is right for a range not handed out yet.
        if first
            .compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            SHRANK[slot].store(false, Ordering::Release);
            end.store(start + len, Ordering::Release);
            return Some(slot);
        }
    }
    None
}

/// Frees a slot taken by [`register`]; the range must not be read outside guarded sections
/// any more.
pub fn unregister(slot: usize) {
    if let Some((first, end)) = RANGES.get(slot) {
        end.store(0, Ordering::Release);
        first.store(0, Ordering::Release);
    }
}

/// Whether the range registered in `slot` faulted outside a guarded section: its file shrank
/// and some of its pages read as zeros now.
pub fn shrank(slot: usize) -> bool {
    SHRANK.get(slot).is_some_and(|s| s.load(Ordering::Acquire))
}

/// The slot of the registered range holding `addr`.
fn registered(addr: usize) -> Option<usize> {
    RANGES.iter().position(|(first, end)| {
        let first = first.load(Ordering::Acquire);
        first != 0 && first <= addr && addr < end.load(Ordering::Acquire)
    })
}

/// Runs `f`, which reads mapped cache files; returns its result and whether a SIGBUS
/// (a mapped file that shrank) happened meanwhile. When it did, whatever `f` read from a
/// mapping may be zeros instead of the file's bytes and must not be used.
pub fn guarded<T>(f: impl FnOnce() -> T) -> (T, bool) {
    install();
    let outer = GUARDED.with(|g| g.replace(true));
    let out = f();
    GUARDED.with(|g| g.set(outer));
    let faulted = if outer {
        FAULTED.with(Cell::get)
    } else {
        FAULTED.with(|f| f.replace(false))
    };
    (out, faulted)
}

/// Runs `f` outside any guarded section, even when called from inside one: code that is no
/// read of a cache's mapped files (a fetcher's download, say) must not have its own faults
/// taken for a shrunk shard's.
pub fn unguarded<T>(f: impl FnOnce() -> T) -> T {
    let outer = GUARDED.with(|g| g.replace(false));
    let out = f();
    GUARDED.with(|g| g.set(outer));
    out
}

fn install() {
    PREVIOUS.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        PAGE_SIZE.store(usize::try_from(page).unwrap_or(4096), Ordering::Relaxed);
        // SAFETY: `action` is fully initialised before use; `previous` is written by the
        // kernel. SA_SIGINFO matches the three-argument handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, &action, &mut previous);
            previous
        }
    });
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let guarded = GUARDED.try_with(Cell::get).unwrap_or(false);
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    if code > 0 {
        // A fault raised by the kernel (not sent with kill): ours if inside a guarded read,
        // or in a registered mapping.
        // SAFETY: as above; si_addr is valid for SIGBUS.
        let addr = unsafe { (*info).si_addr() } as usize;
        let slot = if guarded { None } else { registered(addr) };
        if !guarded && slot.is_none() {
            pass_on(sig, info, ctx);
            return;
        }
        let page = PAGE_SIZE.load(Ordering::Relaxed);
        let base = addr & !(page - 1);
        // SAFETY: replaces one page of a read-only file mapping this process owns with a
        // private zero page, inside the same mapping: a guarded caller discards what it
        // read, and the zeros a view reads are reported through `shrank`.
        let mapped = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            match slot {
                None => {
                    let _ = FAULTED.try_with(|f| f.set(true));
                }
                Some(slot) => {
                    SHRANK[slot].store(true, Ordering::Release);
                }
            }
            return;
        }
    }
    pass_on(sig, info, ctx);
}

/// Hands a SIGBUS that is not ours to the handler installed before, or to the default
/// action (which ends the process).
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(previous) = PREVIOUS.get() else {
        return;
    };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_IGN {
        return;
    }
    if handler == libc::SIG_DFL {
        // SAFETY: restoring the default action and re-raising: the signal is blocked while
        // this handler runs, so it is delivered (and ends the process) when it returns.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
            libc::raise(sig);
        }
        return;
    }
    // SAFETY: `handler` is the function the previous owner installed, called with the
    // signature its flags declare.
    unsafe {
        if previous.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reading_a_mapping_past_a_truncated_end_is_reported_not_fatal() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![7u8; 64 * 1024]).unwrap();
        // SAFETY: the test owns the file; truncating it under the mapping is the point.
        let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
        let (sum, faulted) = guarded(|| map.iter().map(|&b| u64::from(b)).sum::<u64>());
        assert!(!faulted);
        assert_eq!(sum, 7 * 64 * 1024);
        file.set_len(4096).unwrap();
        let (copy, faulted) = guarded(|| map[..].to_vec());
        assert!(faulted, "the read past the new end was not noticed");
        assert_eq!(&copy[..4096], &[7u8; 4096][..]);
        // The next guarded section starts clean.
        let (_, again) = guarded(|| map[0]);
        assert!(!again);
    }

    #[test]
    fn registered_mappings_survive_truncation_outside_guarded_reads() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![3u8; 64 * 1024]).unwrap();
        // SAFETY: the test owns the file; truncating it under the mapping is the point.
        let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
        let slot = register(map.as_ptr() as usize, map.len()).expect("a free slot");
        file.set_len(8192).unwrap();
        let copy = map[..].to_vec(); // outside any guarded section
        assert!(shrank(slot), "the fault was not noticed");
        assert_eq!(&copy[..8192], &[3u8; 8192][..]);
        assert!(copy[8192..].iter().all(|&b| b == 0));
        unregister(slot);
        assert_eq!(registered(map.as_ptr() as usize), None);
    }
}
