//! The MPI backend's timeout: a watchdog thread that ends a rank stuck in an MPI call.
//!
//! An MPI call cannot be interrupted, and with its default error handler MPI notices a dead
//! peer only when the peer's host tells it so. A host whose link goes down tells nobody, so
//! every rank waiting for it would wait forever. So each call is *armed* while it runs:
//! when one has run longer than the timeout (`TINYLLM_COMM_TIMEOUT_MS`, else
//! [`DEFAULT_MPI_TIMEOUT`]), the watchdog prints which rank, on which host, waited in which
//! call for which peers' hosts, and ends the process at once (`_exit`, so that nothing
//! waits on MPI on the way out). `mpirun` then ends the job's other ranks, and a rank on a
//! host cut off from `mpirun` ends the same way, by its own watchdog. PyTorch's NCCL
//! process group does the same with its watchdog thread.
//!
//! The bound is on a whole call, waits included: a rank waits in its next collective for
//! the slowest rank (and for rank 0 while it writes a checkpoint), so it is longer than the
//! ring's bound, which is on a call *without progress*.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

/// How long one MPI call may take unless `TINYLLM_COMM_TIMEOUT_MS` says otherwise.
pub const DEFAULT_MPI_TIMEOUT: Duration = Duration::from_secs(60);

/// The status a rank exits with when an MPI call times out.
pub const TIMEOUT_EXIT_STATUS: i32 = 1;

/// The calls under way, oldest first. Calls may nest on one thread (a collective's own
/// agreement inside it) and run on two at once (a communication thread's beside the main
/// thread's, each on its own communicator).
#[derive(Default)]
struct Armed {
    calls: Vec<Call>,
    /// The number the next call gets.
    next: u64,
}

/// One call under way.
struct Call {
    id: u64,
    thread: ThreadId,
    since: Instant,
    what: String,
}

/// The watchdog of one process's MPI calls; cheap to clone (every group split from the
/// world shares the world's).
#[derive(Clone)]
pub(crate) struct Watchdog {
    shared: Arc<(Mutex<Armed>, Condvar)>,
    timeout: Duration,
}

/// Disarms its call when dropped.
#[must_use = "the call is watched only while the guard lives"]
pub(crate) struct Watched {
    shared: Arc<(Mutex<Armed>, Condvar)>,
    id: u64,
}

impl Drop for Watched {
    fn drop(&mut self) {
        let (lock, _) = &*self.shared;
        let mut armed = lock.lock().unwrap_or_else(|p| p.into_inner());
        armed.calls.retain(|call| call.id != self.id);
    }
}

impl Watchdog {
    /// Starts the watchdog thread of this process, bounding each call to `timeout`.
    pub(crate) fn start(timeout: Duration) -> Self {
        let shared = Arc::new((Mutex::new(Armed::default()), Condvar::new()));
        let watched = Arc::clone(&shared);
        thread::Builder::new()
            .name("mpi-watchdog".into())
            .spawn(move || watch(&watched, timeout))
            .expect("the MPI watchdog thread starts");
        Self { shared, timeout }
    }

    /// The bound on a call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Watches the call `what` (a sentence naming the rank, its host, the call and the
    /// peers it waits for) until the returned guard drops.
    pub(crate) fn arm(&self, what: String) -> Watched {
        let (lock, wake) = &*self.shared;
        let mut armed = lock.lock().unwrap_or_else(|p| p.into_inner());
        let id = armed.next;
        armed.next += 1;
        armed.calls.push(Call {
            id,
            thread: thread::current().id(),
            since: Instant::now(),
            what,
        });
        wake.notify_one();
        Watched {
            shared: Arc::clone(&self.shared),
            id,
        }
    }
}

/// The watchdog's loop: sleeps until the oldest call under way would time out, then checks
/// it again; reports and ends the process if it has, naming the innermost call of the
/// thread that made it (the most precise account of what it waits for).
fn watch(shared: &(Mutex<Armed>, Condvar), timeout: Duration) {
    let (lock, wake) = shared;
    let mut armed = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let Some(since) = armed.calls.first().map(|call| call.since) else {
            armed = wake.wait(armed).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let waited = since.elapsed();
        if waited < timeout {
            let left = timeout - waited;
            armed = wake
                .wait_timeout(armed, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        let thread = armed.calls[0].thread;
        let what = &(armed.calls.iter().rev())
            .find(|call| call.thread == thread)
            .expect("the oldest call is armed")
            .what;
        eprintln!(
            "error: {what}, and no answer came within {:.1} s (TINYLLM_COMM_TIMEOUT_MS): a \
             peer hangs, or died without MPI noticing, or the network between these hosts \
             is down; this rank exits now",
            timeout.as_secs_f64()
        );
        // SAFETY: `_exit` ends the process without running anything else: no destructor,
        // no atexit handler, so nothing waits on the MPI call that never returns.
        unsafe { libc::_exit(TIMEOUT_EXIT_STATUS) };
    }
}
