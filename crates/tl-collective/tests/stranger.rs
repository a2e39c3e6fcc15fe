//! Only the run's own ranks get into the ring: a connection that cannot prove it knows the
//! secret is refused unread and the ring still forms; a listener in a neighbour's place
//! learns nothing; strangers that say nothing delay nobody; a rendezvous directory others
//! can write is refused. (Ranks as threads here: the sockets are the same.)

mod support;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use tl_collective::{CollectiveError, Communicator, RingComm, RingConfig, socket_path};

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

/// A connection to the socket at `path`, retried while it is refused: the socket's file
/// appears when the rank binds it, a moment before it listens, and a connection in between is
/// refused (seen once under load).
fn connect(path: &std::path::Path) -> UnixStream {
    let start = Instant::now();
    loop {
        match UnixStream::connect(path) {
            Ok(stream) => return stream,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "{} kept refusing: {error}",
                    path.display()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => panic!("{}: {error}", path.display()),
        }
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
    let mut stranger = connect(&path);
    stranger
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // A well-formed hello claiming to be rank 0, then a guessed answer to the challenge.
    let mut hello = b"TLRING02".to_vec();
    hello.extend(0u64.to_le_bytes());
    hello.extend(2u64.to_le_bytes());
    hello.extend([5u8; 32]);
    stranger.write_all(&hello).unwrap();
    let mut challenge = [0u8; 64];
    stranger.read_exact(&mut challenge).unwrap();
    stranger.write_all(&[0u8; 32]).unwrap();
    let _ = stranger.write_all(b"data that must never be read as a gradient");
    // Rank 1 greets its right neighbour before it accepts: start rank 0 now. The stranger
    // queued first, so rank 1 meets it first.
    let rank0 = std::thread::spawn(move || {
        let mut comm = RingComm::connect(config(0)).unwrap();
        let mut buf = vec![1.0f32, 2.0];
        comm.all_reduce_sum((&mut buf).into()).unwrap();
        (buf, comm.refused().to_vec())
    });
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

/// A process listening at a neighbour's socket path (as user `nobody` could in a directory
/// anyone can write) learns nothing of the secret: the dialling rank waits for the
/// listener's proof before it proves anything, and refuses to go on without it.
#[test]
fn a_listener_in_a_neighbours_place_learns_nothing_and_is_refused() {
    let dir = support::rendezvous();
    let secret = [0x5Au8; 32];
    let impostor = UnixListener::bind(socket_path(dir.path(), 1)).unwrap();
    let capture = std::thread::spawn(move || {
        let (mut stream, _) = impostor.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut heard = vec![0u8; 56];
        stream.read_exact(&mut heard).unwrap();
        // A guessed challenge; then everything the rank says until it hangs up.
        stream.write_all(&[1u8; 64]).unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        heard.extend(rest);
        heard
    });
    let config = RingConfig::new(0, 2, dir.path(), secret)
        .unwrap()
        .timeout(Duration::from_secs(10));
    let start = Instant::now();
    let err = RingComm::connect(config).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    match &err {
        CollectiveError::Refused { path, reason } => {
            assert_eq!(path, &socket_path(dir.path(), 1));
            assert!(reason.contains("did not prove"), "{reason}");
        }
        other => panic!("expected a refusal, got {other}"),
    }
    let heard = capture.join().unwrap();
    assert!(
        !heard.windows(secret.len()).any(|w| w == secret),
        "the secret was sent: {heard:?}"
    );
}

/// Connections that say nothing are served alongside the real neighbour: a dozen on each
/// socket delay the ring by nothing like their 2 s bound each (which, served in turn, pushed
/// the start past the timeout).
#[test]
fn silent_connections_do_not_delay_the_ring() {
    silent_strangers_do_not_delay_the_ring(12);
}

/// More silent connections than a rank serves at once: the oldest silent ones are dropped,
/// never the real neighbour part-way through its handshake.
#[test]
fn a_flood_of_silent_connections_does_not_crowd_out_the_neighbour() {
    silent_strangers_do_not_delay_the_ring(100);
}

fn silent_strangers_do_not_delay_the_ring(count: usize) {
    let dir = support::rendezvous();
    let path = dir.path().to_path_buf();
    let config = move |rank| {
        RingConfig::new(rank, 2, &path, [3u8; 32])
            .unwrap()
            .timeout(Duration::from_secs(10))
    };
    let ring = |config: RingConfig| {
        std::thread::spawn(move || {
            let mut comm = RingComm::connect(config).unwrap();
            let mut x = [1.0f32];
            comm.all_reduce_sum((&mut x[..]).into()).unwrap();
            (x[0], comm.refused().to_vec())
        })
    };
    // Rank 1 first, and its strangers queue before its real neighbour exists.
    let rank1 = ring(config(1));
    let socket1 = socket_path(dir.path(), 1);
    wait_for(&socket1);
    let mut silent: Vec<UnixStream> = (0..count).map(|_| connect(&socket1)).collect();
    let start = Instant::now();
    let rank0 = ring(config(0));
    // Rank 0's socket may not be there yet, or gone already (the ring formed): whichever
    // of these connect are silent strangers to rank 0 as well.
    let socket0 = socket_path(dir.path(), 0);
    silent.extend((0..count).filter_map(|_| UnixStream::connect(&socket0).ok()));
    let (sum0, refused0) = rank0.join().unwrap();
    let (sum1, refused1) = rank1.join().unwrap();
    let took = start.elapsed();
    assert_eq!((sum0, sum1), (2.0, 2.0));
    assert!(
        took < Duration::from_secs(1),
        "the ring took {took:?} to form"
    );
    // Still silent when the ring formed: dropped unread; refused only to make room.
    for reason in refused0.iter().chain(&refused1) {
        assert_eq!(reason, "too many connections at once");
    }
    drop(silent);
}

/// A rendezvous directory others can write is refused before anything listens in it.
#[test]
fn a_rendezvous_directory_others_can_write_is_refused() {
    let dir = support::rendezvous();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let config = RingConfig::new(0, 2, dir.path(), [1; 32])
        .unwrap()
        .timeout(Duration::from_millis(500));
    match RingComm::connect(config).unwrap_err() {
        CollectiveError::UnsafeRendezvous { path, mode, .. } => {
            assert_eq!((path.as_path(), mode), (dir.path(), 0o777));
        }
        other => panic!("expected the directory to be refused, got {other}"),
    }
    assert!(!socket_path(dir.path(), 0).exists());
}
