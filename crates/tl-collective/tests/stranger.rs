//! Only the run's own ranks get into the ring: a connection without the secret is refused
//! unread, and the ring still forms. (Ranks as threads here: the sockets are the same.)

mod support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use tl_collective::{Communicator, RingComm, RingConfig, socket_path};

fn wait_for(path: &std::path::Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn stranger_with_a_wrong_secret_is_refused_and_the_ring_still_forms() {
    let dir = support::rendezvous();
    let secret = [7u8; 32];
    let path = dir.path().to_path_buf();
    let config = move |rank| {
        RingConfig::new(rank, 2, &path, secret)
            .unwrap()
            .timeout(Duration::from_secs(10))
    };
    let rank1 = {
        let config = config(1);
        std::thread::spawn(move || {
            let mut comm = RingComm::connect(config).unwrap();
            let mut buf = vec![3.0f32, 4.0];
            comm.all_reduce_sum((&mut buf).into()).unwrap();
            (buf, comm.refused().to_vec())
        })
    };

    // Rank 0 has not started: the only connection rank 1 can see is ours.
    let path = socket_path(dir.path(), 1);
    wait_for(&path);
    let mut stranger = UnixStream::connect(&path).unwrap();
    let mut hello = b"TLRING01".to_vec();
    hello.extend([0u8; 32]); // not the secret
    hello.extend(0u64.to_le_bytes());
    hello.extend(2u64.to_le_bytes());
    stranger.write_all(&hello).unwrap();
    hello.extend(b"data that must never be read as a gradient");
    let _ = stranger.write_all(&hello);
    // Rank 1 greets its right neighbour before it accepts: start rank 0 now. The stranger
    // queued first, so rank 1 meets it first.
    let rank0 = std::thread::spawn(move || {
        let mut comm = RingComm::connect(config(0)).unwrap();
        let mut buf = vec![1.0f32, 2.0];
        comm.all_reduce_sum((&mut buf).into()).unwrap();
        (buf, comm.refused().to_vec())
    });
    stranger
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reply = [0u8; 1];
    // Closed without the acceptance byte (end of file, or a reset if our extra bytes were
    // still unread when it closed).
    assert!(
        matches!(stranger.read(&mut reply), Ok(0) | Err(_)),
        "got {reply:?}"
    );
    let (buf, refused0) = rank0.join().unwrap();
    let (buf1, refused) = rank1.join().unwrap();
    assert_eq!(buf, [4.0, 6.0]);
    assert_eq!(buf1, [4.0, 6.0]);
    assert_eq!(refused, ["wrong secret"]);
    assert!(refused0.is_empty());
}

#[test]
fn threads_of_one_process_can_form_a_ring_too() {
    let dir = support::rendezvous();
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let config = RingConfig::new(rank, 3, dir.path(), [1; 32]).unwrap();
            std::thread::spawn(move || {
                let mut comm = RingComm::connect(config).unwrap();
                let mut flag = [if rank == 1 { f32::INFINITY } else { 0.0 }];
                comm.all_reduce((&mut flag[..]).into(), tl_collective::ReduceOp::Max)
                    .unwrap();
                flag[0]
            })
        })
        .collect();
    for handle in handles {
        assert_eq!(handle.join().unwrap(), f32::INFINITY);
    }
}
