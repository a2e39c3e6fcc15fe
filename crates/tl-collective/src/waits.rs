//! How a thread waits inside a collective: spinning for the lowest latency (the default),
//! or polling with short sleeps, so that a communication thread sharing its cores with the
//! rank's computation takes almost none of their time.
//!
//! The socket ring waits in the kernel either way (a blocking read). MPI's progress engine
//! spins inside a blocking call, so the MPI backend runs its calls non-blocking and, on a
//! patient thread, tests them every [`PATIENT_POLL`] instead.

use std::cell::Cell;
use std::time::Duration;

/// How long a patient thread sleeps between two tests of an MPI call under way. At
/// 1 Gbit/s it is 6 KB on the wire, far below what the sockets' buffers hold, so the link
/// stays busy.
pub const PATIENT_POLL: Duration = Duration::from_micros(50);

thread_local! {
    static PATIENT: Cell<bool> = const { Cell::new(false) };
}

/// Makes this thread's waits in collectives patient (`true`) or spinning (`false`).
/// tl-parallel's communication thread makes itself patient.
pub fn wait_patiently(patient: bool) {
    PATIENT.with(|p| p.set(patient));
}

/// Whether this thread's waits are patient.
pub fn is_patient() -> bool {
    PATIENT.with(Cell::get)
}
