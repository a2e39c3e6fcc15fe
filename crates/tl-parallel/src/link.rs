//! The communicator that a rank's data-parallel pieces share — [`DataParallel`]'s gradient
//! reduction and [`ShardedAdamW`]'s weight gather run inside the same step, on one ring —
//! the first error any of them met, and the communication thread that lets a reduction run
//! while backward goes on.
//!
//! Neither the observer's `gradients_ready` nor an optimizer's `step` can return an error,
//! so a failure is kept here until [`DataParallel::take_error`] hands it out.
//!
//! **Two ways to call.** [`Link::call`] runs a collective on the rank's own thread and
//! returns when it is done, as every piece did before overlap. [`Link::start`] hands a
//! collective and the buffers it owns to the link and returns at once; [`Link::wait`] gives
//! the buffers back when it is done. With a communication thread ([`Link::set_threaded`])
//! the started collectives run there, one at a time, in the order they were started, while
//! the rank computes; without one, `start` runs the collective at once (the same calls and
//! the same buffers held as long, so a meta run's figures are a threaded run's). A `call`
//! waits for every collective started before it, so all ranks still make the same calls in
//! the same order.
//!
//! [`DataParallel`]: crate::DataParallel
//! [`DataParallel::take_error`]: crate::DataParallel::take_error
//! [`ShardedAdamW`]: crate::ShardedAdamW

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tl_collective::{CollectiveError, CommStats, Communicator};

/// A communicator, the first error met on it, and its communication thread, if any.
pub(crate) struct Link {
    shared: Arc<Shared>,
    /// The communication thread, while collectives may be started on it.
    worker: Option<Worker>,
    rank: usize,
    world_size: usize,
    /// Wall-clock time this rank's own thread spent in collectives or waiting for them.
    busy: Duration,
}

/// The handle each piece holds: the step runs them one after the other, so the `RefCell` is
/// never borrowed twice.
pub(crate) type SharedLink = Rc<RefCell<Link>>;

/// What the rank's thread and the communication thread share. The communicator has a lock
/// of its own, held for a whole collective, so that the rank's thread can queue the next
/// one meanwhile: it takes only the bookkeeping's.
struct Shared {
    comm: Mutex<Box<dyn Communicator>>,
    state: Mutex<State>,
    /// Signalled when a started collective is done.
    done: Condvar,
}

struct State {
    /// The first error, until taken: while it is kept, nothing more runs.
    error: Option<CollectiveError>,
    /// Collectives started and not yet done.
    queued: usize,
    /// Wall-clock time the communication thread spent in collectives.
    worked: Duration,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn comm(&self) -> MutexGuard<'_, Box<dyn Communicator>> {
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `collective` unless one already failed, keeping the first error.
    fn run<T>(
        &self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<T>,
    ) -> Option<T> {
        if self.state().error.is_some() {
            return None;
        }
        let done = collective(self.comm().as_mut());
        done.map_err(|error| {
            self.state().error.get_or_insert(error);
        })
        .ok()
    }
}

type Job = Box<dyn FnOnce(&Shared) + Send>;

struct Worker {
    jobs: Sender<Job>,
    thread: JoinHandle<()>,
}

/// A collective started by [`Link::start`], holding its buffers until [`Link::wait`].
#[must_use = "a started collective's buffers come back only through Link::wait"]
pub(crate) enum Pending<T> {
    /// Run already: the buffers, and whether it succeeded.
    Done(T, bool),
    /// Queued on the communication thread.
    Queued(Receiver<(T, bool)>),
}

impl Link {
    /// A shared link over `comm`, calling on the rank's own thread.
    pub(crate) fn shared(comm: Box<dyn Communicator>) -> SharedLink {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        Rc::new(RefCell::new(Link {
            shared: Arc::new(Shared {
                comm: Mutex::new(comm),
                state: Mutex::new(State {
                    error: None,
                    queued: 0,
                    worked: Duration::ZERO,
                }),
                done: Condvar::new(),
            }),
            worker: None,
            rank,
            world_size,
            busy: Duration::ZERO,
        }))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state()
    }

    /// Runs started collectives on a communication thread (`true`) or at once on the rank's
    /// own (`false`). A thread is started only where it can help and is safe: more than one
    /// rank, a communicator whose calls may run beside other communicators'
    /// ([`Communicator::concurrent_calls`]), and outside [meta mode](tl_tensor::meta_mode)
    /// (whose memory meter and plan recorder are the rank's thread's). Returns whether a
    /// thread runs them now.
    pub(crate) fn set_threaded(&mut self, threaded: bool) -> bool {
        let possible = self.world_size > 1
            && !tl_tensor::is_meta_mode()
            && self.shared.comm().concurrent_calls();
        match (threaded && possible, self.worker.is_some()) {
            (true, false) => self.worker = Some(self.spawn()),
            (false, true) => self.stop_worker(),
            _ => {}
        }
        self.worker.is_some()
    }

    fn spawn(&self) -> Worker {
        let (jobs, queue) = mpsc::channel::<Job>();
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name(format!("tl-comm-{}", self.rank))
            .spawn(move || {
                for job in queue {
                    job(&shared);
                }
            })
            .expect("the communication thread starts");
        Worker { jobs, thread }
    }

    /// Ends the communication thread once it has run what was started.
    fn stop_worker(&mut self) {
        if let Some(Worker { jobs, thread }) = self.worker.take() {
            drop(jobs);
            // A panic of the thread has already been reported by its hook; the failed
            // collective's buffers never come back, which `wait` reports as a failure.
            let _ = thread.join();
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    /// The communicator's counters (after the collectives started so far are done).
    pub(crate) fn stats(&self) -> CommStats {
        self.wait_idle();
        self.shared.comm().stats()
    }

    /// Wall-clock time this rank's own thread spent in collectives or waiting for them:
    /// what communication adds to its step.
    pub(crate) fn busy(&self) -> Duration {
        self.busy
    }

    /// Wall-clock time the communication thread spent in collectives, while the rank went
    /// on (partly overlapping [`busy`](Self::busy), when the rank waited for it).
    pub(crate) fn overlapped(&self) -> Duration {
        self.state().worked
    }

    /// Whether a collective has failed and the error has not been taken yet.
    pub(crate) fn failed(&self) -> bool {
        self.state().error.is_some()
    }

    /// Returns once every started collective is done.
    fn wait_idle(&self) {
        let mut state = self.state();
        while state.queued > 0 {
            state = (self.shared.done.wait(state)).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Runs `collective` on this thread once the collectives started before it are done,
    /// unless one already failed; keeps the first error. `None` means this or an earlier
    /// collective failed.
    pub(crate) fn call<T>(
        &mut self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<T>,
    ) -> Option<T> {
        let started = Instant::now();
        self.wait_idle();
        let done = self.shared.run(collective);
        self.busy += started.elapsed();
        done
    }

    /// Starts `collective` on `buffers`, which it owns until [`wait`](Self::wait) hands them
    /// back: on the communication thread if there is one, after those started before it;
    /// otherwise at once, here. After a failure it does not run, and `wait` says so.
    pub(crate) fn start<T: Send + 'static>(
        &mut self,
        mut buffers: T,
        collective: impl FnOnce(&mut dyn Communicator, &mut T) -> tl_collective::Result<()>
        + Send
        + 'static,
    ) -> Pending<T> {
        let Some(worker) = &self.worker else {
            let ok = self.call(|comm| collective(comm, &mut buffers)).is_some();
            return Pending::Done(buffers, ok);
        };
        let (reply, pending) = mpsc::channel();
        self.state().queued += 1;
        let job: Job = Box::new(move |shared: &Shared| {
            let started = Instant::now();
            let ok = shared.run(|comm| collective(comm, &mut buffers)).is_some();
            let mut state = shared.state();
            state.worked += started.elapsed();
            state.queued -= 1;
            drop(state);
            shared.done.notify_all();
            // The rank may have stopped waiting (its step ended in an error): nothing to do.
            let _ = reply.send((buffers, ok));
        });
        worker
            .jobs
            .send(job)
            .expect("the communication thread runs while the link lives");
        Pending::Queued(pending)
    }

    /// Waits for a started collective and gives its buffers back, with whether it
    /// succeeded (`None` if the communication thread died with them).
    pub(crate) fn wait<T>(&mut self, pending: Pending<T>) -> Option<(T, bool)> {
        match pending {
            Pending::Done(buffers, ok) => Some((buffers, ok)),
            Pending::Queued(reply) => {
                let started = Instant::now();
                let done = reply.recv().ok();
                self.busy += started.elapsed();
                done
            }
        }
    }

    /// The kept error, if any, leaving none.
    pub(crate) fn take_error(&mut self) -> Option<CollectiveError> {
        self.state().error.take()
    }
}

impl Drop for Link {
    /// Ends the communication thread first, so that the communicator is dropped on the
    /// rank's own thread (MPI is finalised by the thread that initialised it).
    fn drop(&mut self) {
        self.stop_worker();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::{Phantom, Single, SliceMut};

    #[test]
    fn without_a_thread_a_started_collective_runs_at_once() {
        let link = Link::shared(Box::new(Single::new()));
        assert!(
            !link.borrow_mut().set_threaded(true),
            "a world of one needs no thread"
        );
        let pending = link.borrow_mut().start(vec![1.0f32, 2.0], |comm, values| {
            comm.all_reduce_sum(SliceMut::F32(values))
        });
        assert!(matches!(pending, Pending::Done(_, true)));
        assert_eq!(link.borrow().stats().collectives, 1);
        let (values, ok) = link.borrow_mut().wait(pending).unwrap();
        assert_eq!((values, ok), (vec![1.0, 2.0], true));
    }

    #[test]
    fn a_thread_runs_started_collectives_in_order_before_a_later_call() {
        let link = Link::shared(Box::new(Phantom::new(0, 2).unwrap()));
        assert!(link.borrow_mut().set_threaded(true));
        let order = Arc::new(Mutex::new(Vec::new()));
        let pending: Vec<_> = (0..3)
            .map(|i| {
                let order = Arc::clone(&order);
                link.borrow_mut().start(i, move |comm, i| {
                    std::thread::sleep(Duration::from_millis(5));
                    order.lock().unwrap().push(*i);
                    comm.barrier()
                })
            })
            .collect();
        // The call runs after all three, although none was waited for.
        let seen = link.borrow_mut().call(|comm| {
            comm.barrier()?;
            Ok(order.lock().unwrap().clone())
        });
        assert_eq!(seen, Some(vec![0, 1, 2]));
        for (i, pending) in pending.into_iter().enumerate() {
            assert_eq!(link.borrow_mut().wait(pending), Some((i, true)));
        }
        assert_eq!(link.borrow().stats().collectives, 4);
        assert!(link.borrow().overlapped() >= Duration::from_millis(15));
    }

    #[test]
    fn starting_a_collective_does_not_wait_for_the_one_under_way() {
        // The first collective runs until the rank has started the second; were `start`
        // to wait for it, it would give up after 10 s and say so.
        let link = Link::shared(Box::new(Phantom::new(0, 2).unwrap()));
        assert!(link.borrow_mut().set_threaded(true));
        let (release, released) = mpsc::channel::<()>();
        let first = link.borrow_mut().start((), move |comm, _| {
            let waited = released.recv_timeout(Duration::from_secs(10));
            assert!(
                waited.is_ok(),
                "the rank could not start the next collective"
            );
            comm.barrier()
        });
        let second = link.borrow_mut().start((), |comm, _| comm.barrier());
        release.send(()).unwrap();
        assert_eq!(link.borrow_mut().wait(first), Some(((), true)));
        assert_eq!(link.borrow_mut().wait(second), Some(((), true)));
    }

    #[test]
    fn after_a_failure_nothing_more_runs_and_the_first_error_is_kept() {
        let link = Link::shared(Box::new(Phantom::new(0, 2).unwrap()));
        assert!(link.borrow_mut().set_threaded(true));
        let failing = link
            .borrow_mut()
            .start((), |_, _| Err(CollectiveError::Closed));
        let after = link.borrow_mut().start((), |comm, _| comm.barrier());
        assert_eq!(link.borrow_mut().wait(failing), Some(((), false)));
        assert_eq!(link.borrow_mut().wait(after), Some(((), false)));
        assert_eq!(link.borrow_mut().call(|comm| comm.barrier()), None);
        assert!(link.borrow().failed());
        assert_eq!(link.borrow().stats().collectives, 0);
        assert!(matches!(
            link.borrow_mut().take_error(),
            Some(CollectiveError::Closed)
        ));
    }
}
