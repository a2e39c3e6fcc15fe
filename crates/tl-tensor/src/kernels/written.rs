//! Output buffers written once, never zero-filled first.
//!
//! A kernel that writes every element of its output does not need the output cleared
//! before: `vec![0; n]` costs a whole extra pass over memory, on one thread unless it is
//! split. The buffers here start uninitialised ([`MaybeUninit`]), and safe code proves it
//! wrote every element by handing back the written slice: safe Rust cannot make a `&mut [E]`
//! over memory it has not initialised, so a `&mut [E]` at the same address and of the same
//! length as the uninitialised chunk is the proof. [`write_each`] and [`write_rows`] make
//! such proofs; [`written_on_pool`] checks them and only then calls the vector initialised.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Writes the values of `values` into `out`, in order, and returns `out` initialised.
///
/// # Panics
/// If `values` yields fewer elements than `out` has (more are left unread).
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_tensor::kernels::written::write_each;
/// let mut out = [MaybeUninit::<f32>::uninit(); 3];
/// let out = write_each(&mut out, [1.0, 2.0, 3.0].map(|x| -x));
/// assert_eq!(out, [-1.0, -2.0, -3.0]);
/// ```
pub fn write_each<E>(out: &mut [MaybeUninit<E>], values: impl IntoIterator<Item = E>) -> &mut [E] {
    let mut written = 0;
    for (slot, value) in out.iter_mut().zip(values) {
        slot.write(value);
        written += 1;
    }
    assert!(
        written == out.len(),
        "write_each: {written} values for {} elements",
        out.len()
    );
    // SAFETY: each of the `out.len()` elements was written just above.
    unsafe { out.assume_init_mut() }
}

/// Writes `out` row by row, `width` elements a row: `row(i, out_row)` initialises row `i`
/// and returns it. Returns `out` initialised.
///
/// # Panics
/// If `width` does not divide `out`'s length (a zero `width` divides only an empty `out`),
/// or if `row` returns a slice that is not the row it was given.
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_tensor::kernels::written::{write_each, write_rows};
/// let mut out = [MaybeUninit::<f32>::uninit(); 4];
/// let out = write_rows(&mut out, 2, |i, row| write_each(row, [i as f32; 2]));
/// assert_eq!(out, [0.0, 0.0, 1.0, 1.0]);
/// ```
pub fn write_rows<E>(
    out: &mut [MaybeUninit<E>],
    width: usize,
    mut row: impl for<'r> FnMut(usize, &'r mut [MaybeUninit<E>]) -> &'r mut [E],
) -> &mut [E] {
    let whole = if width == 0 {
        out.is_empty()
    } else {
        out.len().is_multiple_of(width)
    };
    assert!(
        whole,
        "write_rows: rows of {width} do not tile {} elements",
        out.len()
    );
    if width > 0 {
        for (i, slot) in out.chunks_exact_mut(width).enumerate() {
            let at = slot.as_ptr().cast::<E>();
            let written = row(i, slot);
            assert_written(at, width, written);
        }
    }
    // SAFETY: every row was initialised: `row` handed each back as a `&mut [E]`, which safe
    // code can only make of initialised memory, and `assert_written` checked it is the row.
    unsafe { out.assume_init_mut() }
}

/// A vector of `len` elements written on the rayon pool in chunks of `chunk` (the last may
/// be shorter), never zero-filled: `write(out, item)` initialises one chunk `out` and
/// returns it, with a value of its own; `items` supplies one item per chunk, in order (the
/// chunk's share of the inputs, typically). Returns the vector and the chunks' values.
///
/// # Panics
/// If `chunk` is zero while `len` is not, if `items` does not have one item per chunk, or if
/// `write` returns a slice that is not the chunk it was given.
///
/// ```
/// use tl_tensor::kernels::written::{write_each, written_on_pool};
/// use rayon::prelude::*;
/// let xs: Vec<f32> = (0..10).map(|i| i as f32).collect();
/// let (squares, sums) = written_on_pool(10, 4, xs.par_chunks(4), |out, xs| {
///     (write_each(out, xs.iter().map(|x| x * x)), xs.iter().sum::<f32>())
/// });
/// assert_eq!(squares[9], 81.0);
/// assert_eq!(sums, [6.0, 22.0, 17.0]);
/// ```
pub fn written_on_pool<E, I, T, F>(len: usize, chunk: usize, items: I, write: F) -> (Vec<E>, Vec<T>)
where
    E: Send,
    I: IndexedParallelIterator,
    T: Send,
    F: for<'a> Fn(&'a mut [MaybeUninit<E>], I::Item) -> (&'a mut [E], T) + Sync + Send,
{
    assert!(chunk > 0 || len == 0, "written_on_pool: chunks of 0");
    let chunks = len.div_ceil(chunk.max(1));
    assert!(
        items.len() == chunks,
        "written_on_pool: {} items for {chunks} chunks",
        items.len()
    );
    let mut out = Vec::with_capacity(len);
    let values = out.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .zip(items)
        .map(|(slot, item)| {
            let (at, width) = (slot.as_ptr().cast::<E>(), slot.len());
            let (written, value) = write(slot, item);
            assert_written(at, width, written);
            value
        })
        .collect();
    // SAFETY: all `len` elements are initialised: each chunk was handed back by `write` as a
    // `&mut [E]`, which safe code can only make of initialised memory, and `assert_written`
    // checked it is that chunk; a panic in any chunk leaves the length at 0.
    unsafe { out.set_len(len) };
    (out, values)
}

/// Panics unless `written` is the `width` elements at `at`.
fn assert_written<E>(at: *const E, width: usize, written: &[E]) {
    assert!(
        std::ptr::eq(written.as_ptr(), at) && written.len() == width,
        "a writer returned a slice other than the one it was given"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_on_pool_writes_every_chunk_in_order() {
        let xs: Vec<f64> = (0..100_003).map(f64::from).collect();
        let (doubled, firsts) = written_on_pool(xs.len(), 4096, xs.par_chunks(4096), |out, xs| {
            (write_each(out, xs.iter().map(|x| 2.0 * x)), xs[0])
        });
        assert_eq!(doubled.len(), xs.len());
        assert!(doubled.iter().zip(&xs).all(|(d, x)| *d == 2.0 * x));
        assert_eq!(firsts.len(), 100_003_usize.div_ceil(4096));
        assert!(
            firsts
                .iter()
                .enumerate()
                .all(|(i, &f)| f == (4096 * i) as f64)
        );
    }

    #[test]
    fn an_empty_vector_needs_no_chunk() {
        let (out, values) = written_on_pool::<f32, _, (), _>(
            0,
            0,
            Vec::<u8>::new().into_par_iter(),
            |_, _| unreachable!(),
        );
        assert!(out.is_empty() && values.is_empty());
    }

    #[test]
    #[should_panic(expected = "a writer returned a slice other than the one it was given")]
    fn a_writer_cannot_hand_back_another_slice() {
        let leaked: &'static mut [f32] = Box::leak(vec![0.0; 4].into_boxed_slice());
        let leaked = std::sync::Mutex::new(Some(leaked));
        written_on_pool(4, 4, [()].into_par_iter(), |_, ()| {
            (leaked.lock().unwrap().take().unwrap(), ())
        });
    }

    #[test]
    #[should_panic(expected = "a writer returned a slice other than the one it was given")]
    fn a_row_writer_cannot_hand_back_part_of_its_row() {
        let mut out = [MaybeUninit::<f32>::uninit(); 4];
        write_rows(&mut out, 2, |_, row| &mut write_each(row, [1.0; 2])[..1]);
    }

    #[test]
    #[should_panic(expected = "4 items for 3 chunks")]
    fn one_item_per_chunk() {
        written_on_pool(10, 4, (0..4).into_par_iter(), |out, _| {
            (write_each(out, [0f32; 4]), ())
        });
    }

    #[test]
    #[should_panic(expected = "write_each: 2 values for 3 elements")]
    fn write_each_needs_a_value_for_every_element() {
        write_each(&mut [MaybeUninit::<f32>::uninit(); 3], [1.0, 2.0]);
    }

    #[test]
    #[should_panic(expected = "rows of 3 do not tile 4 elements")]
    fn rows_must_tile_the_output() {
        write_rows(&mut [MaybeUninit::<f32>::uninit(); 4], 3, |_, row| {
            write_each(row, [0.0; 3])
        });
    }

    #[test]
    fn rows_of_nothing_tile_an_empty_output() {
        let out = write_rows::<f32>(&mut [], 0, |_, _| unreachable!());
        assert!(out.is_empty());
    }

    #[test]
    fn write_rows_passes_each_row_its_index() {
        let mut out = [MaybeUninit::<u32>::uninit(); 6];
        let out = write_rows(&mut out, 3, |i, row| {
            write_each(row, (0..3).map(|j| 10 * i as u32 + j))
        });
        assert_eq!(out, [0, 1, 2, 10, 11, 12]);
    }
}
