//! The communicator that a rank's data-parallel pieces share — [`DataParallel`]'s gradient
//! reduction and [`ShardedAdamW`]'s weight gather run inside the same step, on one ring —
//! and the first error either of them met.
//!
//! Neither the observer's `gradients_ready` nor an optimizer's `step` can return an error,
//! so a failure is kept here until [`DataParallel::take_error`] hands it out.
//!
//! [`DataParallel`]: crate::DataParallel
//! [`DataParallel::take_error`]: crate::DataParallel::take_error
//! [`ShardedAdamW`]: crate::ShardedAdamW

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tl_collective::{CollectiveError, CommStats, Communicator};

/// A communicator and the first error met on it.
pub(crate) struct Link {
    comm: Box<dyn Communicator>,
    error: Option<CollectiveError>,
    /// Wall-clock time spent inside collectives.
    busy: Duration,
}

/// The handle each piece holds: the step runs them one after the other, so the `RefCell` is
/// never borrowed twice.
pub(crate) type SharedLink = Rc<RefCell<Link>>;

impl Link {
    /// A shared link over `comm`.
    pub(crate) fn shared(comm: Box<dyn Communicator>) -> SharedLink {
        Rc::new(RefCell::new(Link {
            comm,
            error: None,
            busy: Duration::ZERO,
        }))
    }

    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub(crate) fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub(crate) fn stats(&self) -> CommStats {
        self.comm.stats()
    }

    /// Wall-clock time spent inside collectives so far.
    pub(crate) fn busy(&self) -> Duration {
        self.busy
    }

    /// Whether a collective has failed and the error has not been taken yet.
    pub(crate) fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// Runs `collective`, unless one already failed; keeps the first error. `None` means
    /// this or an earlier collective failed.
    pub(crate) fn call<T>(
        &mut self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<T>,
    ) -> Option<T> {
        if self.error.is_some() {
            return None;
        }
        let started = Instant::now();
        let done = collective(self.comm.as_mut());
        self.busy += started.elapsed();
        done.map_err(|error| self.error = Some(error)).ok()
    }

    /// The kept error, if any, leaving none.
    pub(crate) fn take_error(&mut self) -> Option<CollectiveError> {
        self.error.take()
    }
}
