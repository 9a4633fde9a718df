//! The writes a sync makes to the maps, and the writer that applies them
//! (the maps themselves, or a test's record).

use std::sync::Arc;

use proxy_common::{
    ServiceValue,
    maglev::{CHUNK_SLOTS, MaglevChunk},
};

use super::Owner;
use crate::backend::ebpf::{
    batch,
    entries::{BackendEntry, RevNatEntry, SlotKey},
};
use crate::{
    model::{Cidr, IpFamily},
    plan::Frontend,
};

/// One write to the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend {
        id: u32,
        backend: BackendEntry,
    },
    /// Also the frontend's [`FrontendInfo`] (of its `owner`), which alone
    /// may change later.
    PutRevNat {
        frontend: Frontend,
        id: u32,
        value: RevNatEntry,
        owner: Owner,
    },
    PutService {
        key: SlotKey,
        value: ServiceValue,
    },
    DeleteService {
        key: SlotKey,
    },
    DeleteRevNat {
        frontend: Frontend,
        id: u32,
    },
    PutSourceRange {
        frontend: Frontend,
        rev_nat_id: u32,
        cidr: Cidr,
    },
    DeleteSourceRange {
        frontend: Frontend,
        rev_nat_id: u32,
        cidr: Cidr,
    },
    DeleteBackend {
        id: u32,
        family: IpFamily,
    },
    /// One chunk of a frontend's Maglev table (`proxy_common::maglev`):
    /// entries `chunk * CHUNK_SLOTS ..` of `table`, shared by the chunks.
    PutMaglev {
        frontend: Frontend,
        rev_nat_id: u32,
        chunk: u32,
        table: MaglevTable,
    },
    /// A frontend's Maglev table, its `chunks` chunks.
    DeleteMaglev {
        frontend: Frontend,
        rev_nat_id: u32,
        chunks: u32,
    },
}

/// A frontend's Maglev table as written: each entry a slot of the
/// frontend, and the digest of what it was computed from (the slots'
/// backends), which tells the next sync whether to compute it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaglevTable {
    pub entries: Arc<[u16]>,
    pub digest: u64,
}

impl MaglevTable {
    /// Entries `chunk * CHUNK_SLOTS ..` as the map holds them (zero past
    /// the table's end).
    pub fn chunk(&self, chunk: u32) -> MaglevChunk {
        let mut value = MaglevChunk::default();
        let start = (chunk as usize * CHUNK_SLOTS).min(self.entries.len());
        let these = &self.entries[start..(start + CHUNK_SLOTS).min(self.entries.len())];
        value.slots[..these.len()].copy_from_slice(these);
        value
    }
}

/// Applies map operations; the real one writes BPF maps.
pub trait MapWriter {
    fn apply(&mut self, op: &MapOp) -> Result<(), std::io::Error>;

    /// Applies `ops`, all of one [`MapOp::batch_kind`], in order (in one
    /// go where the writer can); returns how many were applied, and the
    /// error that stopped the next one.
    fn apply_run(&mut self, ops: &[MapOp]) -> (usize, Result<(), std::io::Error>) {
        apply_each(self, ops)
    }
}

/// Applies `ops` one by one, in order, up to the first failure.
pub fn apply_each<W: MapWriter + ?Sized>(
    writer: &mut W,
    ops: &[MapOp],
) -> (usize, Result<(), std::io::Error>) {
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = writer.apply(op) {
            return (i, Err(e));
        }
    }
    (ops.len(), Ok(()))
}

/// Which map and way an operation writes, for the ones worth batching
/// (service slots and backends: nearly every write of a large sync).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchKind {
    PutService(IpFamily),
    DeleteService(IpFamily),
    PutBackend(IpFamily),
    DeleteBackend(IpFamily),
}

impl MapOp {
    pub fn batch_kind(&self) -> Option<BatchKind> {
        match self {
            MapOp::PutService { key, .. } => Some(BatchKind::PutService(key.family())),
            MapOp::DeleteService { key } => Some(BatchKind::DeleteService(key.family())),
            MapOp::PutBackend { backend, .. } => Some(BatchKind::PutBackend(backend.family())),
            MapOp::DeleteBackend { family, .. } => Some(BatchKind::DeleteBackend(*family)),
            _ => None,
        }
    }

    /// The key and (a put's) value a batchable op writes, as the map
    /// holds them.
    pub fn entry(&self) -> Option<(&[u8], Option<&[u8]>)> {
        fn one<T: aya::Pod>(value: &T) -> &[u8] {
            batch::bytes_of(std::slice::from_ref(value))
        }
        fn key(key: &SlotKey) -> &[u8] {
            match key {
                SlotKey::V4(key) => one(key),
                SlotKey::V6(key) => one(key),
            }
        }
        match self {
            MapOp::PutService { key: k, value } => Some((key(k), Some(one(value)))),
            MapOp::DeleteService { key: k } => Some((key(k), None)),
            MapOp::PutBackend { id, backend: BackendEntry::V4(backend) } => {
                Some((one(id), Some(one(backend))))
            }
            MapOp::PutBackend { id, backend: BackendEntry::V6(backend) } => {
                Some((one(id), Some(one(backend))))
            }
            MapOp::DeleteBackend { id, .. } => Some((one(id), None)),
            _ => None,
        }
    }
}
