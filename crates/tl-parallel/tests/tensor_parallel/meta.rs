//! The same steps on meta tensors over a `Phantom`, against the real ranks on the ring.

use tl_collective::{CommStats, Communicator, Phantom};
use tl_tensor::memory::Event;

use super::common::world;
use super::mlp::{Middle, mlp_rank};
use super::vocabulary::lm_rank;

/// `program` on every rank of a ring of `t`, then on each rank alone on meta tensors over a
/// `Phantom`: the same meter events, in order, with their bytes and tags, and the same
/// collectives and bytes sent.
fn assert_meta_is_real(
    t: usize,
    what: &str,
    program: impl Fn(Box<dyn Communicator>, bool) -> (Vec<Event>, CommStats) + Sync,
) {
    let real = world(t, |comm| program(Box::new(comm), false));
    for (rank, (real_events, real_stats)) in real.iter().enumerate() {
        let (meta_events, meta_stats) = std::thread::scope(|scope| {
            scope
                .spawn(|| program(Box::new(Phantom::new(rank, t).unwrap()), true))
                .join()
                .unwrap()
        });
        let what = format!("{what}, rank {rank} of {t}");
        let first = meta_events
            .iter()
            .zip(real_events)
            .position(|(m, r)| m != r);
        assert_eq!(
            (first, meta_events.len()),
            (None, real_events.len()),
            "{what}: first differing event, then the counts"
        );
        assert_eq!(meta_stats, *real_stats, "{what}: communication");
        assert!(
            real_stats.bytes_sent > 0 && real_events.len() > 20,
            "{what}: a real step"
        );
    }
}

#[test]
fn the_step_on_meta_tensors_allocates_and_sends_what_the_real_one_does() {
    for t in [2, 4] {
        for sequence_parallel in [false, true] {
            let what = format!("MLP, sequence parallel {sequence_parallel}");
            assert_meta_is_real(t, &what, |comm, meta| {
                let (run, events) = mlp_rank::<f32>(comm, Middle::SwiGlu, sequence_parallel, meta);
                (events, run.total)
            });
            let what = format!("vocabulary, sequence parallel {sequence_parallel}");
            assert_meta_is_real(t, &what, |comm, meta| {
                let run = lm_rank::<f64>(comm, sequence_parallel, meta);
                ([run.setup, run.step].concat(), run.total)
            });
        }
    }
}
