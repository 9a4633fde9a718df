//! Batched map writes and reads: `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH` and `BPF_MAP_LOOKUP_BATCH` (Linux 5.6+; aya 0.14
//! has no wrapper), one syscall for thousands of entries where single
//! operations take one each. The grouping ([`runs`], [`chunks`]) is pure;
//! the syscalls are the small [`sys`] part. A kernel without them is found
//! at the first attempt, and single operations serve from then on.

use std::{
    io,
    ops::Range,
    os::fd::{AsRawFd, BorrowedFd},
    sync::atomic::{AtomicBool, Ordering::Relaxed},
};

/// Entries per syscall: large enough that the syscall's cost vanishes,
/// small enough that the buffers stay small and a hash bucket of an LRU
/// map always fits (a lookup batch returns whole buckets).
pub const CHUNK: usize = 4096;

/// Whether the kernel refused batches once (then single ops are used).
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// Whether batches are still worth trying.
pub fn supported() -> bool {
    !UNSUPPORTED.load(Relaxed)
}

/// The ranges of `items` to apply together: consecutive items of one kind
/// (`kind` of an item, `None`: never batched), at most `max` each. Order is
/// kept, so what is written first still lands first.
pub fn runs<T, K: PartialEq>(
    items: &[T],
    max: usize,
    kind: impl Fn(&T) -> Option<K>,
) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut current: Option<K> = None;
    for (i, item) in items.iter().enumerate() {
        let k = kind(item);
        match runs.last_mut() {
            Some(run) if k.is_some() && k == current && run.len() < max => run.end = i + 1,
            _ => runs.push(i..i + 1),
        }
        current = k;
    }
    runs
}

/// `len` items in chunks of at most `max`.
pub fn chunks(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len).step_by(max.max(1)).map(move |start| start..(start + max).min(len))
}

/// The bytes of plain-data values, back to back as the kernel reads them.
pub fn bytes_of<T: aya::Pod>(values: &[T]) -> &[u8] {
    // SAFETY: `aya::Pod` types are plain `repr(C)` data without padding
    // holes the kernel would misread; the slice covers exactly `values`.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

/// How a batch went: how many entries the kernel took, and the error that
/// stopped it, if one did.
pub type Outcome = (usize, Result<(), io::Error>);

/// Writes `count` entries, their keys back to back in `keys` and their
/// values in `values`, in order; with no values, deletes the keys (a
/// missing key stops it, as a single delete fails). Stops at the first
/// failure. `None` where the kernel has no batches (nothing was written).
pub fn write(fd: BorrowedFd<'_>, keys: &[u8], values: &[u8], count: usize) -> Option<Outcome> {
    let (key_size, value_size) = (keys.len() / count.max(1), values.len() / count.max(1));
    batched(count, |range| {
        let keys = &keys[range.start * key_size..range.end * key_size];
        match value_size {
            0 => sys::delete(fd, keys, range.len()),
            _ => sys::update(
                fd,
                keys,
                &values[range.start * value_size..range.end * value_size],
                range.len(),
            ),
        }
    })
}

/// Applies `call` chunk by chunk, adding up what it took.
fn batched(len: usize, call: impl Fn(Range<usize>) -> (usize, io::Result<()>)) -> Option<Outcome> {
    if !supported() {
        return None;
    }
    let mut done = 0;
    for range in chunks(len, CHUNK) {
        let (took, result) = call(range);
        done += took;
        if let Err(e) = result {
            if done == 0 && sys::unsupported(&e) {
                UNSUPPORTED.store(true, Relaxed);
                tracing::info!(error = %e, "no batched map operations in this kernel (5.6+): single ones instead");
                return None;
            }
            return Some((done, Err(e)));
        }
    }
    Some((done, Ok(())))
}

/// Every entry of a hash map (plain or LRU), read in batches and handed to
/// `each` as its batch is read; `None` where the kernel has no batches. The
/// map moves on meanwhile: an entry may be missed or be a moment old, as
/// with an iteration.
pub fn lookup_each<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
    mut each: impl FnMut(K, V),
) -> Option<io::Result<()>> {
    if !supported() {
        return None;
    }
    // The kernel's position in the map (a bucket index for hash maps).
    let (mut token, mut first) = (0u64, true);
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<V> = Vec::with_capacity(CHUNK);
    loop {
        let from = (!first).then_some(token);
        let (count, next, done) = match sys::lookup(fd, from, &mut keys, &mut values) {
            Ok(step) => step,
            Err(e) if first && sys::unsupported(&e) => {
                UNSUPPORTED.store(true, Relaxed);
                tracing::info!(error = %e, "no batched map operations in this kernel (5.6+): single ones instead");
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        for (key, value) in keys.drain(..count).zip(values.drain(..count)) {
            each(key, value);
        }
        if done {
            return Some(Ok(()));
        }
        (token, first) = (next, false);
    }
}

/// The `bpf(2)` calls.
mod sys {
    use super::*;

    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

    /// `union bpf_attr`'s `batch` member.
    #[repr(C)]
    #[derive(Default)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }

    /// Runs `cmd`; how many elements the kernel handled either way.
    fn call(cmd: libc::c_long, attr: &mut BatchAttr) -> (usize, io::Result<()>) {
        // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed,
        // and the buffers it points to outlive the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr as *mut BatchAttr,
                std::mem::size_of::<BatchAttr>() as u32,
            )
        };
        let result = if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) };
        (attr.count as usize, result)
    }

    fn attr(fd: BorrowedFd<'_>, count: usize) -> BatchAttr {
        BatchAttr { count: count as u32, map_fd: fd.as_raw_fd() as u32, ..BatchAttr::default() }
    }

    pub fn update(
        fd: BorrowedFd<'_>,
        keys: &[u8],
        values: &[u8],
        count: usize,
    ) -> (usize, io::Result<()>) {
        let mut attr = attr(fd, count);
        (attr.keys, attr.values) = (keys.as_ptr() as u64, values.as_ptr() as u64);
        call(BPF_MAP_UPDATE_BATCH, &mut attr)
    }

    pub fn delete(fd: BorrowedFd<'_>, keys: &[u8], count: usize) -> (usize, io::Result<()>) {
        let mut attr = attr(fd, count);
        attr.keys = keys.as_ptr() as u64;
        call(BPF_MAP_DELETE_BATCH, &mut attr)
    }

    /// Reads up to `keys`' capacity of entries after position `from`
    /// (`None`: the start) into `keys` and `values`; returns how many, the
    /// next position and whether the map is read to its end.
    pub fn lookup<K: aya::Pod, V: aya::Pod>(
        fd: BorrowedFd<'_>,
        from: Option<u64>,
        keys: &mut Vec<K>,
        values: &mut Vec<V>,
    ) -> io::Result<(usize, u64, bool)> {
        let capacity = keys.capacity().min(values.capacity());
        let (mut token_in, mut token_out) = (from.unwrap_or(0), 0u64);
        let mut attr = attr(fd, capacity);
        attr.in_batch = from.map_or(0, |_| &mut token_in as *mut u64 as u64);
        attr.out_batch = &mut token_out as *mut u64 as u64;
        (attr.keys, attr.values) = (keys.as_mut_ptr() as u64, values.as_mut_ptr() as u64);
        let (count, result) = call(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let done = match result {
            Ok(()) => false,
            // The end of the map, with the last entries (if any).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e),
        };
        // SAFETY: the kernel wrote `count` (at most `capacity`) whole
        // entries; `Pod` values are valid for any bytes.
        unsafe {
            keys.set_len(count.min(capacity));
            values.set_len(count.min(capacity));
        }
        Ok((count.min(capacity), token_out, done))
    }

    /// The errors of a kernel (or map type) without batches.
    pub fn unsupported(e: &io::Error) -> bool {
        matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP))
            || e.raw_os_error() == Some(524) // ENOTSUPP, the kernel's own
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_keep_order_join_one_kind_and_split_at_the_limit() {
        let items = ['a', 'a', 'a', 'b', '-', '-', 'a', 'a'];
        let kind = |c: &char| (*c != '-').then_some(*c);
        assert_eq!(runs(&items, 2, kind), [0..2, 2..3, 3..4, 4..5, 5..6, 6..8]);
        assert_eq!(runs(&items, 10, kind), [0..3, 3..4, 4..5, 5..6, 6..8]);
        assert!(runs(&[] as &[char], 10, kind).is_empty());
    }

    #[test]
    fn chunks_cover_everything_once() {
        assert_eq!(chunks(10, 4).collect::<Vec<_>>(), [0..4, 4..8, 8..10]);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), [0..4, 4..8]);
        assert_eq!(chunks(0, 4).count(), 0);
    }
}
