//! How the agent ends the connected sockets of departed backends: socket
//! iterators calling the `bpf_sock_destroy` kfunc where the kernel has it
//! (6.5+), else [`sock_diag`](super::sock_diag), else nothing, said once.
//!
//! aya resolves no kfunc calls, so the object is given the kfunc's BTF id
//! here before loading: the BPF side emits the call with a placeholder
//! immediate ([`SOCK_DESTROY_CALL`]).

use std::{borrow::Cow, io::Read, net::IpAddr, path::PathBuf};

use aya::{
    Btf, Ebpf,
    maps::{HashMap, Map},
    programs::{Iter, iter::IterLink},
};
use aya_obj::btf::BtfKind;
use proxy_common::{
    IPPROTO_TCP, IPPROTO_UDP, MAX_SOCK_ENDS, SOCK_DESTROY_CALL, SockEndKey, SockRevNat,
    SockRevNat6, SockRevNatKey, SockRevNatKey6, map_names,
};

use super::sock_diag::Peer;
use super::{BpfObject, EbpfError, departures::Departures, program};

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
            let run = super::sock_diag::in_each_netns(|| self.links(ebpf, protocols), Self::run);
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

impl BpfObject {
    /// Picks how the sockets the socket LB connected to departed backends
    /// are ended (`want`; `auto` tries the socket iterators, then
    /// sock_diag), for UDP and, with `tcp`, TCP. Says once in the log what
    /// it picked, or why nothing works here.
    pub fn choose_socket_ending(&mut self, want: SocketDestroy, tcp: bool) -> &SocketEnding {
        let iterators = match want {
            SocketDestroy::SockDiag => None,
            SocketDestroy::Auto | SocketDestroy::BpfIterator => Some(self.load_socket_iterators()),
        };
        self.socket_ending = match iterators {
            Some(Ok(())) => std::mem::take(&mut self.socket_ending),
            Some(Err(e)) if want == SocketDestroy::BpfIterator => {
                tracing::warn!(error = %e, "--socket-destroy bpf-iterator: the socket iterators do not load here (bpf_sock_destroy needs Linux 6.5+): connected sockets keep an endpoint that was removed until they reconnect");
                SocketEnding::Unavailable
            }
            iterators => {
                if let Some(Err(e)) = iterators {
                    tracing::debug!(error = %e, "no socket iterators with bpf_sock_destroy; trying sock_diag");
                }
                match super::sock_diag::probe() {
                    Ok(()) => SocketEnding::SockDiag,
                    Err(e) => {
                        tracing::warn!(error = %e, "this kernel does not end sockets on request (neither bpf_sock_destroy nor CONFIG_INET_DIAG_DESTROY): a connected UDP socket keeps an endpoint that was removed until it reconnects");
                        SocketEnding::Unavailable
                    }
                }
            }
        };
        self.socket_protocols =
            if tcp { vec![IPPROTO_UDP, IPPROTO_TCP] } else { vec![IPPROTO_UDP] };
        // The kernel's types parsed for the iterators' loading.
        crate::sys::release_freed_memory();
        &self.socket_ending
    }

    /// Loads the socket iterators (verified: the kernel has
    /// `bpf_sock_destroy` and lets them call it) and makes them the way
    /// sockets are ended.
    pub fn load_socket_iterators(&mut self) -> Result<(), EbpfError> {
        if !matches!(self.socket_ending, SocketEnding::Iterators(_)) {
            // Their attach targets and kfunc are the running kernel's
            // types: parsed again here (about 20 ms) rather than kept from
            // the programs' loading, tens of MiB through the first sync.
            let kernel_btf = aya::Btf::from_sys_fs().ok();
            let iterators = Iterators::load(&mut self.ebpf, kernel_btf.as_ref())?;
            self.socket_ending = SocketEnding::Iterators(iterators);
        }
        Ok(())
    }

    /// Ends the sockets the socket LB connected to backends that left
    /// their frontends, in the way and for the protocols chosen (see
    /// [`sock_diag`](super::sock_diag)); returns how many.
    pub fn end_sockets(&mut self, departures: &Departures) -> Result<usize, EbpfError> {
        let protocols = &self.socket_protocols;
        let keys = departures.socket_keys(protocols);
        if keys.is_empty() {
            return Ok(0);
        }
        let io = |source| EbpfError::Io {
            action: "ending sockets to",
            path: PathBuf::from("removed endpoints"),
            source,
        };
        match &mut self.socket_ending {
            SocketEnding::Iterators(iterators) => iterators.end(&mut self.ebpf, &keys, protocols),
            SocketEnding::SockDiag => {
                let map_err = |name| move |source| EbpfError::Map { name, source };
                let (v4, v6) = (map_names::SOCK_REV_NAT, map_names::SOCK_REV_NAT6);
                let map =
                    HashMap::<_, SockRevNatKey, SockRevNat>::try_from(&self.maps.sock_rev_nat)
                        .map_err(map_err(v4))?;
                let map6 =
                    HashMap::<_, SockRevNatKey6, SockRevNat6>::try_from(&self.maps.sock_rev_nat6)
                        .map_err(map_err(v6))?;
                // The frontend the socket LB sent the socket's peer for.
                let frontend = |peer: &Peer| {
                    let (cookie, port) = (peer.cookie, peer.port);
                    match peer.address {
                        IpAddr::V4(ip) => {
                            let address = ip.octets();
                            let key = SockRevNatKey { cookie, address, port, _pad: 0 };
                            map.get(&key, 0).ok().map(|t| t.rev_nat_id)
                        }
                        IpAddr::V6(ip) => {
                            let address = ip.octets();
                            let key = SockRevNatKey6 { cookie, address, port, _pad: [0; 6] };
                            map6.get(&key, 0).ok().map(|t| t.rev_nat_id)
                        }
                    }
                };
                let mut ended = 0;
                for proto in protocols.iter().filter(|p| departures.has_proto(|d| d == **p)) {
                    let must_end = |peer: &Peer| {
                        frontend(peer).is_some_and(|rev_nat_id| {
                            departures.ends_flow_to(rev_nat_id, *proto, peer.address, peer.port)
                        })
                    };
                    ended += super::sock_diag::destroy(*proto, &must_end).map_err(io)?;
                }
                Ok(ended)
            }
            SocketEnding::Unavailable => Ok(0),
        }
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
