//! How the agent ends the connected sockets of departed backends (see
//! [`crate::sockets`]): socket iterators calling the `bpf_sock_destroy`
//! kfunc where the kernel has it (6.5+), else `sock_diag`, else nothing,
//! said once.
//!
//! aya resolves no kfunc calls, so the object is given the kfunc's BTF id
//! here before loading: the BPF side emits the call with a placeholder
//! immediate ([`SOCK_DESTROY_CALL`]).

use std::{borrow::Cow, io::Read};

use aya::{
    Btf, Ebpf,
    maps::{HashMap, Map},
    programs::{Iter, iter::IterLink},
};
use aya_obj::btf::BtfKind;
use proxy_common::{IPPROTO_TCP, IPPROTO_UDP, MAX_SOCK_ENDS, SOCK_DESTROY_CALL, SockEndKey};

use super::{EbpfError, program};

/// The socket iterator program of each protocol.
const ITERATORS: [(&str, &str, u8); 2] =
    [("end_tcp_sockets", "tcp", IPPROTO_TCP), ("end_udp_sockets", "udp", IPPROTO_UDP)];

/// The way chosen (`--socket-destroy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketDestroy {
    /// The socket iterators where the kernel can, else sock_diag.
    #[default]
    Auto,
    /// `bpf_sock_destroy` from socket iterators (Linux 6.5+).
    BpfIterator,
    /// sock_diag `SOCK_DESTROY` (`CONFIG_INET_DIAG_DESTROY`).
    SockDiag,
}

/// How this agent ends sockets.
#[derive(Debug, Default)]
pub enum SocketEnding {
    Iterators(Iterators),
    SockDiag,
    /// Neither works here (the reason, logged once at start).
    #[default]
    Unavailable,
}

impl SocketEnding {
    pub fn describe(&self) -> &'static str {
        match self {
            SocketEnding::Iterators(_) => "bpf_sock_destroy from socket iterators",
            SocketEnding::SockDiag => "sock_diag SOCK_DESTROY",
            SocketEnding::Unavailable => "none",
        }
    }
}

/// The loaded iterators (by program name and protocol) and the map that
/// tells them which sockets to end.
#[derive(Debug)]
pub struct Iterators {
    programs: Vec<(&'static str, u8)>,
    ends: Map,
}

/// The BPF object with its `bpf_sock_destroy` calls resolved for this
/// kernel (`btf`: its types); as built where the kernel lacks the kfunc (the
/// iterators then do not load, nothing else calls it).
pub fn resolve_kfunc<'a>(object: &'a [u8], btf: Option<&Btf>) -> Cow<'a, [u8]> {
    let id = btf.and_then(|btf| btf.id_by_type_name_kind("bpf_sock_destroy", BtfKind::Func).ok());
    match id {
        Some(id) => Cow::Owned(with_call_target(object, id)),
        None => Cow::Borrowed(object),
    }
}

/// `object` with the immediate of every placeholder call instruction (at
/// an instruction boundary) set to `btf_id`.
fn with_call_target(object: &[u8], btf_id: u32) -> Vec<u8> {
    let placeholder = SOCK_DESTROY_CALL.to_le_bytes();
    let mut out = object.to_vec();
    for insn in out.chunks_exact_mut(8).filter(|insn| **insn == placeholder) {
        insn[4..].copy_from_slice(&btf_id.to_le_bytes());
    }
    out
}

impl Iterators {
    /// Loads the iterators of the object in `ebpf` (its kfunc resolved
    /// with `btf`, the kernel's types), and takes their map.
    pub fn load(ebpf: &mut Ebpf, btf: Option<&Btf>) -> Result<Self, EbpfError> {
        let btf = btf.ok_or_else(|| EbpfError::Io {
            action: "reading",
            path: "/sys/kernel/btf/vmlinux".into(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        let mut programs = Vec::new();
        for (name, target, proto) in ITERATORS {
            let iter: &mut Iter = program(ebpf, name)?;
            iter.load(target, btf).map_err(|source| EbpfError::Program { name, source })?;
            programs.push((name, proto));
        }
        let name = proxy_common::map_names::SOCK_ENDS;
        let ends = ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })?;
        Ok(Iterators { programs, ends })
    }

    /// A link of each `protocols` iterator, to run once.
    fn links(&self, ebpf: &mut Ebpf, protocols: &[u8]) -> std::io::Result<Vec<IterLink>> {
        let mut links = Vec::new();
        for (name, _) in self.programs.iter().filter(|(_, p)| protocols.contains(p)) {
            let iter: &mut Iter = program(ebpf, name).map_err(std::io::Error::other)?;
            let id = iter.attach().map_err(std::io::Error::other)?;
            links.push(iter.take_link(id).map_err(std::io::Error::other)?);
        }
        Ok(links)
    }

    /// Runs `links` in the calling thread's network namespace (the
    /// iterator walks the namespace of the thread that creates it); each
    /// writes the cookie of every socket it ended.
    fn run(links: Vec<IterLink>) -> std::io::Result<usize> {
        let mut ended = 0;
        for link in links {
            let mut output = Vec::new();
            link.into_file().map_err(std::io::Error::other)?.read_to_end(&mut output)?;
            ended += output.len() / size_of::<u64>();
        }
        Ok(ended)
    }

    /// Ends the `protocols` sockets the socket LB connected for the frontends
    /// and backends of `keys`; returns how many.
    pub fn end(
        &mut self,
        ebpf: &mut Ebpf,
        keys: &[SockEndKey],
        protocols: &[u8],
    ) -> Result<usize, EbpfError> {
        let name = proxy_common::map_names::SOCK_ENDS;
        let map_err = |source| EbpfError::Map { name, source };
        let mut ended = 0;
        for batch in keys.chunks(MAX_SOCK_ENDS as usize) {
            let mut ends =
                HashMap::<_, SockEndKey, u8>::try_from(&mut self.ends).map_err(map_err)?;
            for key in batch {
                ends.insert(key, 1, 0).map_err(map_err)?;
            }
            let run = crate::sockets::in_each_netns(|| self.links(ebpf, protocols), Self::run);
            let mut ends =
                HashMap::<_, SockEndKey, u8>::try_from(&mut self.ends).map_err(map_err)?;
            for key in batch {
                let _ = ends.remove(key);
            }
            ended += run.map_err(|source| EbpfError::Io {
                action: "running",
                path: "the socket iterators".into(),
                source,
            })?;
        }
        Ok(ended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_call_gets_the_kfuncs_id_at_instruction_boundaries_only() {
        let call = SOCK_DESTROY_CALL.to_le_bytes();
        let mut object = vec![0u8; 8];
        object.extend_from_slice(&call);
        // The same bytes across two instructions are not a call.
        object.extend_from_slice(&[0; 4]);
        object.extend_from_slice(&call);
        object.extend_from_slice(&[0; 4]);
        let resolved = with_call_target(&object, 0x1234);
        assert_eq!(&resolved[8..12], &[0x85, 0x20, 0, 0], "the call itself is kept");
        assert_eq!(&resolved[12..16], &0x1234u32.to_le_bytes());
        assert_eq!(&resolved[20..28], &call, "unaligned: untouched");
        assert_eq!(resolved.len(), object.len());
    }
}
