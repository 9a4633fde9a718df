//! The names `monitor`'s lines take from the eBPF mode's pinned maps
//! (services) and from the kernel (interfaces).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use proxy_common::{FrontendInfo, map_names};

use crate::inspect::maps::{read, read_pinned};

/// Names of services (from the pinned `FRONTEND_INFO` and service table)
/// and interfaces, cached; read again on a miss, at most once a second.
pub struct PinnedNames {
    root: PathBuf,
    by_id: BTreeMap<u32, String>,
    by_frontend: BTreeMap<String, String>,
    interfaces: BTreeMap<u32, Option<String>>,
    read_at: Option<Instant>,
    clocks: (u64, SystemTime),
}

impl PinnedNames {
    pub fn new(root: &Path) -> Self {
        PinnedNames {
            root: root.to_path_buf(),
            by_id: BTreeMap::new(),
            by_frontend: BTreeMap::new(),
            interfaces: BTreeMap::new(),
            read_at: None,
            clocks: (crate::sys::monotonic_ns(), SystemTime::now()),
        }
    }

    fn reread(&mut self) {
        if self.read_at.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.read_at = Some(Instant::now());
        match read::<u32, FrontendInfo, BTreeMap<_, _>>(&self.root, map_names::FRONTEND_INFO) {
            Ok(infos) => {
                self.by_id = infos.into_iter().map(|(id, i)| (id, i.name().to_string())).collect()
            }
            Err(e) => tracing::warn!(error = %e, "service names unavailable"),
        }
        match read_pinned(&self.root) {
            Ok(entries) => {
                self.by_frontend = entries.into_iter().map(|e| (e.frontend, e.service)).collect()
            }
            Err(e) => tracing::warn!(error = %e, "service table unavailable"),
        }
    }

    fn cached(&self, rev_nat_id: u32, frontend: &str) -> Option<String> {
        self.by_id.get(&rev_nat_id).or_else(|| self.by_frontend.get(frontend)).cloned()
    }
}

impl super::Context for PinnedNames {
    fn service(&mut self, rev_nat_id: u32, frontend: &str) -> Option<String> {
        if let Some(name) = self.cached(rev_nat_id, frontend) {
            return Some(name);
        }
        self.reread();
        self.cached(rev_nat_id, frontend)
    }

    fn interface(&mut self, ifindex: u32) -> Option<String> {
        self.interfaces.entry(ifindex).or_insert_with(|| interface_name(ifindex)).clone()
    }

    fn wall_time(&self, ns: u64) -> SystemTime {
        super::wall_time(ns, self.clocks.0, self.clocks.1)
    }
}

fn interface_name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has IF_NAMESIZE bytes, as the call needs.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: filled with a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}
