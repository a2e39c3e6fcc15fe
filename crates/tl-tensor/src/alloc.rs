//! [`CachingAllocator`]: a global allocator that keeps freed large blocks for reuse, the CPU
//! counterpart of PyTorch's CUDA caching allocator.
//!
//! A training step allocates and frees the same large buffers over and over: every
//! micro-batch's forward pass makes attention matrices and hidden activations of exactly the
//! sizes the previous one freed. The system allocator (glibc) serves every block above
//! 32 MiB with a fresh `mmap` and returns it with `munmap`, so each reuse costs a page fault
//! per 4 KiB page and the kernel's zeroing of every page: about a second of a capstone step.
//! Keeping freed blocks of at least [`MIN_CACHED_BYTES`] and handing them back for an
//! allocation of the same size and alignment removes that cost.
//!
//! The cache is bounded ([`MAX_CACHED_BYTES`], [`SLOTS`] blocks); when it is full the oldest
//! block goes back to the system. [`trim`] empties it, so that a measurement of the process's
//! resident memory starts clean. Small allocations go straight to the system allocator.
//!
//! Install it in a binary with
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: tl_tensor::alloc::CachingAllocator = tl_tensor::alloc::CachingAllocator;
//! # fn main() {}
//! ```
//!
//! The cache is global and guarded by a mutex. While holding it the allocator makes only
//! small allocations, which never take the lock, so it cannot deadlock on itself.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

/// Blocks smaller than this are not cached.
pub const MIN_CACHED_BYTES: usize = 1 << 20;

/// The most bytes the cache holds at once.
pub const MAX_CACHED_BYTES: usize = 512 << 20;

/// The most blocks the cache holds at once.
pub const SLOTS: usize = 128;

/// A freed block waiting for reuse.
#[derive(Clone, Copy)]
struct Block {
    ptr: *mut u8,
    size: usize,
    align: usize,
    /// When it was freed, for evicting the oldest first.
    age: u64,
}

impl Block {
    fn layout(&self) -> Layout {
        Layout::from_size_align(self.size, self.align).expect("made from a layout")
    }
}

/// The free blocks, in a fixed table.
struct Cache {
    blocks: [Option<Block>; SLOTS],
    bytes: usize,
    clock: u64,
}

// SAFETY: the raw pointers are blocks this allocator owns exclusively (freed by their last
// user, not yet handed out again); they are only touched under the mutex.
unsafe impl Send for Cache {}

impl Cache {
    const fn new() -> Self {
        Self {
            blocks: [None; SLOTS],
            bytes: 0,
            clock: 0,
        }
    }

    /// Takes a cached block of exactly this layout, if there is one.
    fn take(&mut self, layout: Layout) -> Option<*mut u8> {
        let slot = self.blocks.iter_mut().find(|slot| {
            slot.is_some_and(|block| block.size == layout.size() && block.align == layout.align())
        })?;
        let block = slot.take().expect("found");
        self.bytes -= block.size;
        Some(block.ptr)
    }

    /// Keeps a freed block; returns the blocks that must go back to the system to make room
    /// (the oldest first), or the block itself when it can never fit.
    fn put(&mut self, block_ptr: *mut u8, layout: Layout) -> Evicted {
        let mut evicted = Evicted::new();
        if layout.size() > MAX_CACHED_BYTES {
            evicted.push((block_ptr, layout));
            return evicted;
        }
        while self.bytes + layout.size() > MAX_CACHED_BYTES
            || self.blocks.iter().all(Option::is_some)
        {
            let oldest = self
                .blocks
                .iter_mut()
                .filter(|slot| slot.is_some())
                .min_by_key(|slot| slot.expect("some").age)
                .expect("the cache is not empty while it is over a limit");
            let block = oldest.take().expect("some");
            self.bytes -= block.size;
            evicted.push((block.ptr, block.layout()));
        }
        self.clock += 1;
        let slot = self
            .blocks
            .iter_mut()
            .find(|slot| slot.is_none())
            .expect("made room");
        *slot = Some(Block {
            ptr: block_ptr,
            size: layout.size(),
            align: layout.align(),
            age: self.clock,
        });
        self.bytes += layout.size();
        evicted
    }

    /// Empties the cache, returning every block.
    fn drain(&mut self) -> Evicted {
        let mut evicted = Evicted::new();
        for slot in &mut self.blocks {
            if let Some(block) = slot.take() {
                evicted.push((block.ptr, block.layout()));
            }
        }
        self.bytes = 0;
        evicted
    }
}

/// Blocks to give back to the system once the lock is released.
///
/// Filling it while the cache is locked allocates, which is safe: the list is far smaller
/// than [`MIN_CACHED_BYTES`], so its allocations go straight to the system allocator
/// without taking the lock.
type Evicted = Vec<(*mut u8, Layout)>;

static CACHE: Mutex<Cache> = Mutex::new(Cache::new());

/// The caching global allocator; see the [module docs](self).
pub struct CachingAllocator;

fn lock() -> std::sync::MutexGuard<'static, Cache> {
    // A panic never happens while the lock is held (no code in it can panic but the
    // `expect`s on invariants); recover anyway rather than abort in the allocator.
    CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// SAFETY: every block handed out is either fresh from `System` with the requested layout or
// a block of exactly that size and alignment that `System` allocated earlier and whose user
// freed it; a block is in the cache or handed out, never both, because taking and putting
// happen under the mutex. Blocks leave the cache only through `System::dealloc` with the
// layout they were allocated with.
unsafe impl GlobalAlloc for CachingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_CACHED_BYTES
            && let Some(ptr) = lock().take(layout)
        {
            return ptr;
        }
        // SAFETY: the caller's layout has a non-zero size (GlobalAlloc's contract).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_CACHED_BYTES
            && let Some(ptr) = lock().take(layout)
        {
            // SAFETY: the block is `layout.size()` bytes, owned by the caller from now on.
            unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
            return ptr;
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < MIN_CACHED_BYTES {
            // SAFETY: `ptr` came from `System` with this layout (small blocks never cached).
            unsafe { System.dealloc(ptr, layout) };
            return;
        }
        let evicted = lock().put(ptr, layout);
        for (block, block_layout) in evicted {
            // SAFETY: every evicted block came from `System` with this layout.
            unsafe { System.dealloc(block, block_layout) };
        }
    }
}

/// Gives every cached block back to the system (a no-op where [`CachingAllocator`] is not
/// the global allocator: its cache is then always empty).
pub fn trim() {
    let evicted = lock().drain();
    for (block, layout) in evicted {
        // SAFETY: every cached block came from `System` with this layout.
        unsafe { System.dealloc(block, layout) };
    }
}

/// Bytes held by the cache now.
pub fn cached_bytes() -> usize {
    lock().bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block from the system allocator, for exercising the cache's bookkeeping.
    fn system_block(size: usize) -> (*mut u8, Layout) {
        let layout = Layout::from_size_align(size, 64).unwrap();
        // SAFETY: a non-zero size.
        (unsafe { System.alloc(layout) }, layout)
    }

    fn release(evicted: Evicted) -> usize {
        let count = evicted.len();
        for (ptr, layout) in evicted {
            // SAFETY: blocks of `system_block`, freed once.
            unsafe { System.dealloc(ptr, layout) };
        }
        count
    }

    #[test]
    fn a_freed_block_is_handed_back_only_for_the_same_size_and_alignment() {
        let mut cache = Cache::new();
        let (ptr, layout) = system_block(3 << 20);
        assert_eq!(release(cache.put(ptr, layout)), 0);
        assert_eq!(cache.bytes, 3 << 20);
        assert_eq!(
            cache.take(Layout::from_size_align(2 << 20, 64).unwrap()),
            None
        );
        assert_eq!(
            cache.take(Layout::from_size_align(3 << 20, 128).unwrap()),
            None
        );
        assert_eq!(cache.take(layout), Some(ptr));
        assert_eq!(cache.bytes, 0);
        assert_eq!(cache.take(layout), None, "a block is handed out once");
        // SAFETY: the block taken back above.
        unsafe { System.dealloc(ptr, layout) };
    }

    #[test]
    fn a_full_table_gives_back_its_oldest_block() {
        let mut cache = Cache::new();
        let blocks: Vec<_> = (0..=SLOTS)
            .map(|i| system_block((1 << 20) + 64 * i))
            .collect();
        for &(ptr, layout) in &blocks[..SLOTS] {
            assert_eq!(release(cache.put(ptr, layout)), 0);
        }
        let (ptr, layout) = blocks[SLOTS];
        let evicted = cache.put(ptr, layout);
        assert_eq!(evicted.len(), 1);
        assert_eq!(
            evicted[0].0, blocks[0].0,
            "the first block in is the first out"
        );
        release(evicted);
        assert_eq!(cache.take(blocks[0].1), None);
        assert_eq!(release(cache.drain()), SLOTS);
        assert_eq!(cache.bytes, 0);
    }

    #[test]
    fn the_byte_limit_evicts_until_the_new_block_fits_and_a_huge_block_is_not_kept() {
        let mut cache = Cache::new();
        let quarter = MAX_CACHED_BYTES / 4;
        // Reserve address space only: blocks this large are never touched.
        let blocks: Vec<_> = (0..5).map(|_| system_block(quarter)).collect();
        for &(ptr, layout) in &blocks[..4] {
            assert_eq!(release(cache.put(ptr, layout)), 0);
        }
        assert_eq!(cache.bytes, MAX_CACHED_BYTES);
        let (ptr, layout) = blocks[4];
        assert_eq!(release(cache.put(ptr, layout)), 1);
        assert_eq!(cache.bytes, MAX_CACHED_BYTES);
        release(cache.drain());

        let huge = Layout::from_size_align(MAX_CACHED_BYTES + 1, 64).unwrap();
        let evicted = cache.put(std::ptr::dangling_mut(), huge);
        assert_eq!(
            evicted.len(),
            1,
            "a block over the limit goes straight back"
        );
        assert_eq!(cache.bytes, 0);
    }

    #[test]
    fn the_allocator_reuses_a_freed_large_block_and_zeroes_it_on_request() {
        // An odd size that no other test allocates, so parallel tests cannot take it.
        let layout = Layout::from_size_align((5 << 20) + 4096 + 128, 64).unwrap();
        let allocator = CachingAllocator;
        // SAFETY: blocks used within their layout and freed with it.
        unsafe {
            let first = allocator.alloc(layout);
            first.write_bytes(0xAB, layout.size());
            allocator.dealloc(first, layout);
            assert!(cached_bytes() >= layout.size());
            let second = allocator.alloc_zeroed(layout);
            assert_eq!(second, first, "the cached block is reused");
            let bytes = std::slice::from_raw_parts(second, layout.size());
            assert!(bytes.iter().all(|&b| b == 0));
            allocator.dealloc(second, layout);
            let small = Layout::from_size_align(1024, 8).unwrap();
            let block = allocator.alloc(small);
            allocator.dealloc(block, small);
        }
    }
}
