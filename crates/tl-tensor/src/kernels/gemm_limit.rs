//! The GEMM limit of a program: every product it asks the GEMM for, recorded while it runs,
//! then each timed alone on operands of the same shapes and strides. Their sum is what the
//! program would take if it did nothing but its products, the bound `tinyllm bench
//! --gemm-limit` holds a training step against.
//!
//! # What is recorded
//!
//! Every product that reaches the `gemm` crate through this module's siblings
//! ([`gemm_into`](super::gemm::gemm_into), [`gemm_serial_into`](super::gemm::gemm_serial_into),
//! [`matmul`](super::gemm::matmul), the batched products, the fused attention's block
//! products) while [`record_products`] runs, from any thread: its element type, its shape,
//! the strides of its three views, whether it accumulates into its output or overwrites it,
//! how it is spread over threads, and the time it took there. The recorder is process-wide, as a profiler is: a
//! product another thread asks for meanwhile is counted too. Products on other kernels (the
//! bf16 kernel, the tensor-core models) are not GEMM calls and are not recorded.
//!
//! # How the limit is timed
//!
//! Each distinct call is replayed on operands of its own, allocated once, filled with small
//! normal values, its output reused (as `cargo bench --bench matmul`'s `gemm-into-reused`).
//!
//! - A product the GEMM spreads over the pool is timed alone, one call after another, as
//!   the program ran it.
//! - A product on its calling thread only is one of many that a kernel runs one per rayon
//!   task (a head of the fused attention, a matrix of a batch): every thread of the pool runs
//!   its share of such calls at once, each on operands of its own, so that they share the
//!   caches and the memory bus as they did in the program. A small product a program calls
//!   alone on one thread is timed this way too: it would count a little short.
//!
//! Calls are run in batches of about [`BATCH_S`], sized by three untimed ones, and the
//! median of [`BATCHES`] batches is kept. The limit is the sum over the distinct calls of their
//! count times their median time per call.
//!
//! ```
//! use tl_tensor::kernels::gemm::matmul;
//! use tl_tensor::kernels::gemm_limit::record_products;
//! use tl_tensor::ndarray::Array2;
//! let (a, b) = (Array2::<f32>::ones((61, 37)), Array2::<f32>::ones((37, 29)));
//! let (_, products) = record_products(|| {
//!     for _ in 0..3 {
//!         matmul(a.view(), b.view());
//!     }
//! });
//! let call = products.calls().find(|(call, _)| call.shape == [61, 37, 29]).unwrap();
//! assert_eq!(call.1, 3); // asked for three times (other tests may add calls of their own)
//! assert_eq!(call.0.flops(), 2 * 61 * 37 * 29);
//! let limit = products.time_alone();
//! assert!(limit.seconds > 0.0 && limit.calls >= 3);
//! ```

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};
use serde::{Deserialize, Serialize};

use super::gemm::{gemm_overwrite, gemm_with};
use super::split::Threads;
use crate::Element;

/// About how long a timed batch of calls lasts, in seconds.
pub const BATCH_S: f64 = 0.01;

/// Timed batches per distinct call; the median is kept.
pub const BATCHES: usize = 5;

/// How many [`record_products`] are running: while it is not zero, every GEMM call is noted.
static RECORDING: AtomicUsize = AtomicUsize::new(0);

/// The calls noted, by kind, with their counts and the seconds they took in the program.
static CALLS: Mutex<BTreeMap<GemmCall, Noted>> = Mutex::new(BTreeMap::new());

/// What a recording noted of one kind of call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Noted {
    /// How many times it was called.
    count: u64,
    /// The seconds those calls took in the program, summed over the threads that ran them.
    seconds: f64,
}

/// One recording at a time: a second waits for the first to finish.
static RECORDER: Mutex<()> = Mutex::new(());

/// The element types the GEMM multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmElement {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl GemmElement {
    fn of<E: Element>() -> Option<Self> {
        match E::NAME {
            "f32" => Some(GemmElement::F32),
            "f64" => Some(GemmElement::F64),
            _ => None,
        }
    }
}

/// How a product is spread over threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Spread {
    /// On the calling thread, one of many a kernel runs one per rayon task.
    Serial,
    /// Over the pool, by `gemm` itself.
    Gemm,
    /// Over the pool, in blocks of this many rows.
    RowBlocks(usize),
}

impl Spread {
    fn of(threads: Threads) -> Self {
        match threads {
            Threads::One => Spread::Serial,
            Threads::Gemm => Spread::Gemm,
            Threads::RowBlocks(rows) => Spread::RowBlocks(rows),
        }
    }

    fn threads(self) -> Threads {
        match self {
            Spread::Serial => Threads::One,
            Spread::Gemm => Threads::Gemm,
            Spread::RowBlocks(rows) => Threads::RowBlocks(rows),
        }
    }
}

/// A product as the GEMM was asked for it: everything that decides its time but the values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GemmCall {
    /// The element type.
    pub element: GemmElement,
    /// `[m, k, n]`: an m×k operand by a k×n one.
    pub shape: [usize; 3],
    /// The strides, in elements, of the left operand, the right one and the output (rows,
    /// then columns).
    pub strides: [[isize; 2]; 3],
    /// Whether the product is added to the output's values (`out += lhs · rhs`).
    pub accumulate: bool,
    /// Whether the output was uninitialised memory the product overwrites.
    pub overwrite: bool,
    /// How it was spread over threads.
    pub spread: Spread,
}

impl GemmCall {
    /// The product's floating-point operations, `2mkn`.
    pub fn flops(&self) -> u64 {
        let [m, k, n] = self.shape.map(|d| d as u64);
        2 * m * k * n
    }
}

/// Runs `product`, the GEMM call these arguments describe, and notes it with the time it
/// took, if a recording runs.
pub(super) fn noted<E: Element>(
    out_strides: [isize; 2],
    lhs: &ArrayView2<'_, E>,
    rhs: &ArrayView2<'_, E>,
    (accumulate, overwrite): (bool, bool),
    threads: Threads,
    product: impl FnOnce(),
) {
    let element = GemmElement::of::<E>();
    let (Some(element), true) = (element, RECORDING.load(Ordering::Relaxed) > 0) else {
        return product();
    };
    let start = Instant::now();
    product();
    let seconds = start.elapsed().as_secs_f64();
    let two = |s: &[isize]| [s[0], s[1]];
    let call = GemmCall {
        element,
        shape: [lhs.nrows(), lhs.ncols(), rhs.ncols()],
        strides: [two(lhs.strides()), two(rhs.strides()), out_strides],
        accumulate,
        overwrite,
        spread: Spread::of(threads),
    };
    let mut calls = lock(&CALLS);
    let noted = calls.entry(call).or_default();
    noted.count += 1;
    noted.seconds += seconds;
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding a lock leaves counts that are still whole.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f`, noting every product the GEMM is asked for meanwhile (from any thread; see the
/// module's documentation). Recordings do not overlap: a second one waits for the first.
pub fn record_products<R>(f: impl FnOnce() -> R) -> (R, Products) {
    let _one = lock(&RECORDER);
    lock(&CALLS).clear();
    RECORDING.fetch_add(1, Ordering::SeqCst);
    // Stop recording even if `f` panics.
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            RECORDING.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let stop = Stop;
    let result = f();
    drop(stop);
    let calls = std::mem::take(&mut *lock(&CALLS));
    (result, Products { calls })
}

/// The products a program asked the GEMM for, as [`record_products`] noted them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Products {
    calls: BTreeMap<GemmCall, Noted>,
}

/// What the GEMM alone takes for a program's products.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmLimit {
    /// The sum of every call's time alone, in seconds.
    pub seconds: f64,
    /// Of it, the calls spread over the pool.
    pub spread_s: f64,
    /// Of it, the calls run one per rayon task ([`Spread::Serial`]).
    pub serial_s: f64,
    /// The calls, all told.
    pub calls: u64,
    /// Their floating-point operations.
    pub flops: u64,
    /// About how long the calls took inside the program: those spread over the pool end to
    /// end, those run one per task summed over threads and divided by the pool's threads
    /// (an estimate: it takes the tasks as spread evenly).
    #[serde(default)]
    pub in_program_s: f64,
    /// Each distinct call: how often it was asked for and its median time alone.
    pub products: Vec<TimedCall>,
}

/// One distinct call of a [`GemmLimit`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimedCall {
    /// The call.
    pub call: GemmCall,
    /// How many times the program asked for it.
    pub count: u64,
    /// Its median time alone, per call, in seconds.
    pub seconds: f64,
    /// The seconds its calls took in the program, summed over the threads that ran them.
    #[serde(default)]
    pub in_program_s: f64,
}

impl Products {
    /// Each distinct call, with how many times it was asked for, in a fixed order.
    pub fn calls(&self) -> impl Iterator<Item = (&GemmCall, u64)> {
        self.calls.iter().map(|(call, noted)| (call, noted.count))
    }

    /// The calls, all told.
    pub fn count(&self) -> u64 {
        self.calls.values().map(|noted| noted.count).sum()
    }

    /// Their floating-point operations.
    pub fn flops(&self) -> u64 {
        self.calls().map(|(call, count)| call.flops() * count).sum()
    }

    /// Times every distinct call alone (see the module's documentation), on the current rayon
    /// pool.
    pub fn time_alone(&self) -> GemmLimit {
        let products: Vec<TimedCall> = self
            .calls
            .iter()
            .map(|(call, noted)| TimedCall {
                call: *call,
                count: noted.count,
                seconds: match call.element {
                    GemmElement::F32 => time_call::<f32>(call),
                    GemmElement::F64 => time_call::<f64>(call),
                },
                in_program_s: noted.seconds,
            })
            .collect();
        // Over the calls spread over the pool, or over those run one per task.
        let sum = |serial: bool, seconds: fn(&TimedCall) -> f64| -> f64 {
            let serial = |p: &&TimedCall| (p.call.spread == Spread::Serial) == serial;
            products.iter().filter(serial).map(seconds).sum()
        };
        let alone = |p: &TimedCall| p.count as f64 * p.seconds;
        let (spread_s, serial_s) = (sum(false, alone), sum(true, alone));
        let inside = |p: &TimedCall| p.in_program_s;
        let in_program_s =
            sum(false, inside) + sum(true, inside) / rayon::current_num_threads() as f64;
        GemmLimit {
            seconds: spread_s + serial_s,
            spread_s,
            serial_s,
            calls: self.count(),
            flops: self.flops(),
            in_program_s,
            products,
        }
    }
}

/// A call's operands and output, each in a buffer its strides fit.
struct Operands<E> {
    lhs: Vec<E>,
    rhs: Vec<E>,
    out: Vec<E>,
}

/// The elements a `rows × columns` view with `strides` spans (strides taken by magnitude).
fn span(rows: usize, columns: usize, strides: [isize; 2]) -> usize {
    if rows == 0 || columns == 0 {
        return 0;
    }
    1 + (rows - 1) * strides[0].unsigned_abs() + (columns - 1) * strides[1].unsigned_abs()
}

fn view_shape(
    rows: usize,
    columns: usize,
    strides: [isize; 2],
) -> ndarray::StrideShape<ndarray::Ix2> {
    (rows, columns).strides((strides[0].unsigned_abs(), strides[1].unsigned_abs()))
}

impl<E: Element> Operands<E> {
    fn new(call: &GemmCall) -> Self {
        let [m, k, n] = call.shape;
        let [ls, rs, os] = call.strides;
        // Small normal values: no subnormal slows the arithmetic, nothing overflows.
        let fill = |len: usize| -> Vec<E> {
            (0..len)
                .map(|i| E::from_f64(1.0 + (i % 7) as f64 / 8.0))
                .collect()
        };
        Operands {
            lhs: fill(span(m, k, ls)),
            rhs: fill(span(k, n, rs)),
            out: vec![E::zero(); span(m, n, os)],
        }
    }

    /// Runs the call once, as the program did.
    fn run(&mut self, call: &GemmCall) {
        let [m, k, n] = call.shape;
        let [ls, rs, os] = call.strides;
        let lhs = ArrayView2::from_shape(view_shape(m, k, ls), &self.lhs).expect("fits its span");
        let rhs = ArrayView2::from_shape(view_shape(k, n, rs), &self.rhs).expect("fits its span");
        let threads = call.spread.threads();
        if call.overwrite {
            // SAFETY: `MaybeUninit<E>` has the layout of `E`, and the buffer is initialised.
            let out: &mut [MaybeUninit<E>] = unsafe {
                std::slice::from_raw_parts_mut(self.out.as_mut_ptr().cast(), self.out.len())
            };
            let mut out =
                ArrayViewMut2::from_shape(view_shape(m, n, os), out).expect("fits its span");
            gemm_overwrite(&mut out, lhs, rhs, threads);
        } else {
            let mut out = ArrayViewMut2::from_shape(view_shape(m, n, os), &mut self.out[..])
                .expect("fits its span");
            gemm_with(&mut out, lhs, rhs, call.accumulate, threads);
        }
    }
}

/// The most calls per thread in one batch.
const MAX_REPS: usize = 1 << 20;

/// Untimed batches that size the timed ones.
const CALIBRATION: usize = 3;

/// Calls per thread in a timed batch, from [`CALIBRATION`] untimed batches of `batch(reps)`
/// seconds (the calls doubling while a batch is shorter than half of [`BATCH_S`]): enough
/// for [`BATCH_S`] at the fastest time per call seen. A batch slowed by a thread waiting
/// for its core (a preemption, a wake-up) then cannot size the timed ones alone.
fn batch_reps(mut batch: impl FnMut(usize) -> f64) -> usize {
    let (mut reps, mut fastest) = (1, f64::INFINITY);
    for _ in 0..CALIBRATION {
        let seconds = batch(reps);
        fastest = fastest.min(seconds / reps as f64);
        if seconds < BATCH_S / 2.0 {
            reps = (2 * reps).min(MAX_REPS);
        }
    }
    ((BATCH_S / fastest.max(1e-12)).ceil() as usize).clamp(1, MAX_REPS)
}

/// The median time of one `call`, alone (see the module's documentation).
fn time_call<E: Element>(call: &GemmCall) -> f64 {
    let threads = match call.spread {
        Spread::Serial => rayon::current_num_threads(),
        _ => 1,
    };
    let sets: Vec<Mutex<Operands<E>>> = (0..threads)
        .map(|_| Mutex::new(Operands::new(call)))
        .collect();
    // Seconds of `reps` calls per thread, all threads at once.
    let batch = |reps: usize| -> f64 {
        let start = Instant::now();
        if threads == 1 {
            let mut set = lock(&sets[0]);
            for _ in 0..reps {
                set.run(call);
            }
        } else {
            rayon::broadcast(|context| {
                let mut set = lock(&sets[context.index() % threads]);
                for _ in 0..reps {
                    set.run(call);
                }
            });
        }
        start.elapsed().as_secs_f64()
    };
    let reps = batch_reps(&batch);
    let mut seconds: Vec<f64> = (0..BATCHES).map(|_| batch(reps)).collect();
    seconds.sort_by(f64::total_cmp);
    seconds[BATCHES / 2] / (reps * threads) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::gemm::{gemm_serial_into, matmul};
    use crate::kernels::split::threads_for;
    use ndarray::{Array2, s};

    /// How the GEMM spreads a product of this shape when its caller does not choose.
    fn spread_for([m, k, n]: [usize; 3]) -> Spread {
        Spread::of(threads_for(m, n, k))
    }

    /// The calls of `products` whose shape is one of `shapes` (other tests run meanwhile).
    fn own(products: &Products, shapes: &[[usize; 3]]) -> Vec<(GemmCall, u64)> {
        products
            .calls()
            .filter(|(call, _)| shapes.contains(&call.shape))
            .map(|(call, count)| (*call, count))
            .collect()
    }

    #[test]
    fn every_call_is_noted_with_its_strides_its_output_and_its_threads() {
        let a = Array2::<f32>::ones((1031, 67));
        let b = Array2::<f32>::ones((67, 71));
        let c = Array2::<f32>::ones((71, 67));
        let wide = Array2::<f32>::ones((71, 3 * 53));
        let mut out = Array2::<f32>::zeros((67, 53));
        let ((), products) = record_products(|| {
            matmul(a.view(), b.view());
            matmul(a.view(), b.view());
            // A transposed operand by every third column of a wider one, accumulating into a
            // reused output.
            let columns = wide.slice(s![.., ..;3]);
            gemm_serial_into(&mut out.view_mut(), c.t(), columns, true);
        });
        let calls = own(&products, &[[1031, 67, 71], [67, 71, 53]]);
        assert_eq!(calls.len(), 2, "{calls:?}");
        let (large, serial) = (calls[1], calls[0]);
        assert_eq!(large.1, 2);
        assert_eq!(
            large.0,
            GemmCall {
                element: GemmElement::F32,
                shape: [1031, 67, 71],
                strides: [[67, 1], [71, 1], [71, 1]],
                accumulate: false,
                overwrite: true,
                spread: spread_for([1031, 67, 71]),
            }
        );
        assert_eq!(large.0.spread, Spread::RowBlocks(512));
        assert_eq!(serial.1, 1);
        assert_eq!(serial.0.strides, [[1, 67], [159, 3], [53, 1]]);
        assert!(serial.0.accumulate && !serial.0.overwrite);
        assert_eq!(serial.0.spread, Spread::Serial);
        assert_eq!(serial.0.element, GemmElement::F32);
        // Each kind with the time its calls took, here.
        for (call, _) in calls {
            assert!(products.calls[&call].seconds > 0.0, "{call:?}");
        }
    }

    /// Whether a call of this shape is among those noted so far.
    fn noted(shape: [usize; 3]) -> bool {
        lock(&CALLS).keys().any(|call| call.shape == shape)
    }

    #[test]
    fn nothing_is_noted_outside_a_recording_even_after_one_panicked() {
        let a = Array2::<f64>::ones((17, 19));
        let caught = std::panic::catch_unwind(|| record_products(|| panic!("inside")));
        assert!(caught.is_err());
        {
            // No recording runs while this test holds the recorder's lock.
            let _recorder = lock(&RECORDER);
            assert_eq!(RECORDING.load(Ordering::SeqCst), 0);
            matmul(a.view(), a.t());
            assert!(!noted([17, 19, 17]));
        }
        let ((), products) = record_products(|| {
            matmul(a.view(), a.t());
        });
        let calls = own(&products, &[[17, 19, 17]]);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0.element, GemmElement::F64);
        assert_eq!(calls[0].0.strides[1], [1, 19]);
    }

    #[test]
    fn the_limit_sums_count_times_time_per_call_and_splits_by_spread() {
        let mut products = Products::default();
        let call = |shape: [usize; 3], spread: Spread, overwrite: bool| GemmCall {
            element: GemmElement::F32,
            shape,
            strides: [
                [shape[1] as isize, 1],
                [shape[2] as isize, 1],
                [1, shape[0] as isize],
            ],
            accumulate: !overwrite,
            overwrite,
            spread,
        };
        let big = call([512, 256, 384], spread_for([512, 256, 384]), true);
        let small = call([64, 32, 96], Spread::Serial, false);
        let noted = |count, seconds| Noted { count, seconds };
        products.calls.insert(big, noted(3, 0.5));
        products.calls.insert(small, noted(40, 0.25));
        let limit = products.time_alone();
        assert_eq!(limit.calls, 43);
        assert_eq!(limit.flops, 3 * 2 * 512 * 256 * 384 + 40 * 2 * 64 * 32 * 96);
        let time = |c: &GemmCall| limit.products.iter().find(|p| p.call == *c).unwrap();
        assert_eq!(time(&big).count, 3);
        assert!(time(&big).seconds > time(&small).seconds);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.max(1.0);
        assert!(close(limit.spread_s, 3.0 * time(&big).seconds));
        assert!(close(limit.serial_s, 40.0 * time(&small).seconds));
        assert!(close(limit.seconds, limit.spread_s + limit.serial_s));
        // Inside the program: the spread calls end to end, the serial ones over the threads.
        let threads = rayon::current_num_threads() as f64;
        assert!(close(limit.in_program_s, 0.5 + 0.25 / threads));
        assert_eq!(time(&small).in_program_s, 0.25);
    }

    #[test]
    fn one_slow_batch_does_not_size_the_timed_ones() {
        // 2⁻¹⁹ s (1.9 µs) a call, but the first batch waited 4 ms for its core.
        let call = 1.0 / 524_288.0;
        let mut sizes = Vec::new();
        let reps = batch_reps(|reps| {
            sizes.push(reps);
            call * reps as f64 + if sizes.len() == 1 { 4e-3 } else { 0.0 }
        });
        assert_eq!(sizes, [1, 2, 4], "short batches double");
        assert_eq!(reps, 5_243, "0.01 s · 2¹⁹, rounded up");
        // A call longer than a batch runs once a batch; one near half a batch is not doubled.
        assert_eq!(batch_reps(|reps| 0.03 * reps as f64), 1);
        let mut sizes = Vec::new();
        let reps = batch_reps(|reps| {
            sizes.push(reps);
            0.006 * reps as f64
        });
        assert_eq!((sizes, reps), (vec![1, 1, 1], 2));
        // A clock that reads zero does not divide by it.
        assert_eq!(batch_reps(|_| 0.0), MAX_REPS);
    }

    #[test]
    fn a_view_spans_from_its_first_element_to_its_last() {
        assert_eq!(span(4, 5, [5, 1]), 20); // row-major, rows of 5
        assert_eq!(span(4, 5, [1, 4]), 20); // column-major
        assert_eq!(span(3, 1, [7, 1]), 15); // one column of a matrix 7 wide
        assert_eq!(span(1, 3, [9, 2]), 5); // every other element of a row
        assert_eq!(span(2, 3, [-3, 1]), 6); // rows read backwards
        assert_eq!(span(1, 1, [9, 9]), 1);
        assert_eq!((span(0, 5, [7, 1]), span(5, 0, [1, 3])), (0, 0));
    }

    #[test]
    fn a_replayed_call_computes_the_product_it_times() {
        // Strided, transposed and accumulating, overwriting: the replay builds views of the
        // recorded strides, so it runs the product the program ran.
        for (strides, accumulate, overwrite) in [
            ([[5, 1], [1, 3], [3, 1]], true, false),
            ([[1, 4], [9, 2], [1, 4]], false, true),
        ] {
            let call = GemmCall {
                element: GemmElement::F64,
                shape: [4, 5, 3],
                strides,
                accumulate,
                overwrite,
                spread: Spread::Serial,
            };
            let mut set = Operands::<f64>::new(&call);
            set.out.iter_mut().for_each(|x| *x = 1.0);
            set.run(&call);
            let view = |data: &[f64], (r, c), s| {
                ArrayView2::from_shape(view_shape(r, c, s), data)
                    .unwrap()
                    .to_owned()
            };
            let lhs = view(&set.lhs, (4, 5), strides[0]);
            let rhs = view(&set.rhs, (5, 3), strides[1]);
            let out = view(&set.out, (4, 3), strides[2]);
            let expected = lhs.dot(&rhs) + if accumulate { 1.0 } else { 0.0 };
            assert_eq!(out, expected);
        }
    }
}
