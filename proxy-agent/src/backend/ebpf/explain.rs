//! `proxy-agent explain` in the eBPF mode: the per-packet programs loaded
//! again with the maps pinned under the bpffs root (the live services,
//! conntrack, affinity, settings), and run under `BPF_PROG_TEST_RUN` on a
//! crafted packet marked as an explain run (`proxy_common::explain`): the
//! program takes its real path, writes no state, and leaves what it
//! decided in the packet's `cb`. Nothing is attached, nothing is pinned.

use std::path::Path;

use aya::{
    Ebpf,
    maps::{Array, Map, MapData, ProgramArray},
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, Xdp},
};
use proxy_common::{
    Layouts, TC_NEW_FLOW, TC_NEW_PROGRAMS, TC_SCTP_INGRESS, TC_SCTP_INGRESS6, TC_SCTP_PROGRAMS,
    TC6_INGRESS, TC6_POD_REPLIES, TC6_PROGRAMS, explain::MAGIC, map_names,
};

use super::{
    EbpfError, TC_INGRESS, TC_POD_REPLIES, XDP_INGRESS, io_err, load::OBJECT, program, sock_end,
};

/// Where `__sk_buff` has its fields (`include/uapi/linux/bpf.h`): the
/// kernel takes `ifindex`, `ingress_ifindex` and `cb` from `ctx_in`.
const SKB_INGRESS_IFINDEX: usize = 36;
const SKB_IFINDEX: usize = 40;
const SKB_CB: usize = 48;
/// Up to the end of `cb`: the kernel takes a shorter context in...
const SKB_CTX_LEN: usize = SKB_CB + 5 * 4;
/// ...but writes its whole `__sk_buff` back (192 bytes in 6.x; the
/// kernel copies no more than it has).
const SKB_CTX_OUT_LEN: usize = 256;

/// What the program did with an explain run's packet.
#[derive(Debug)]
pub struct ExplainRun {
    /// The tc verdict: -1 next/pass, 0 to the stack, 2 drop, 7 redirect.
    pub verdict: i32,
    /// The packet as the program left it (translated, or a reset or ICMP
    /// error it built to refuse it).
    pub packet: Vec<u8>,
    /// The control block as the program left it.
    pub cb: [u32; 5],
}

/// The per-packet programs, with the live maps.
pub struct Explainer {
    ebpf: Ebpf,
    /// This build's own `TC_NEW`, `TC6` and `TC_SCTP`, kept open: the
    /// kernel empties a program array when its last descriptor closes.
    _arrays: Vec<ProgramArray<MapData>>,
    /// This build's own `XDP6`, once filled (`load_xdp6`).
    xdp6: Option<Map>,
}

impl Explainer {
    /// Loads the per-packet programs with every map pinned under `root`
    /// but the program arrays (the running new-flow, IPv6 and SCTP
    /// programs, which an older agent's build could not tell an explain run
    /// from a real packet): this build's new-flow and IPv6 programs fill its
    /// own, and with `sctp` its SCTP ones (a verifier run only SCTP's
    /// explain runs need), so a packet takes the real path (the pre-filter,
    /// then the tail calls).
    pub fn load(root: &Path, sctp: bool) -> Result<Self, EbpfError> {
        crate::sys::raise_memlock_rlimit();
        let dir = root.join("maps");
        // The programs of this build read the pinned maps as their own: a
        // running agent of another layout would be misread.
        let name = map_names::LAYOUT;
        let err = |source| EbpfError::Map { name, source };
        let pinned = MapData::from_pin(dir.join(name)).map_err(err)?;
        let pinned = Map::from_map_data(pinned).map_err(err)?;
        let pinned = Array::<_, Layouts>::try_from(pinned).map_err(err)?;
        let layouts = pinned.get(&0, 0).map_err(err)?;
        if layouts != Layouts::CURRENT {
            return Err(EbpfError::Layout { pinned: layouts });
        }
        let pins: Vec<(String, std::path::PathBuf)> = std::fs::read_dir(&dir)
            .map_err(io_err("reading", &dir))?
            .filter_map(Result::ok)
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
            .filter(|(name, _)| !PROGRAM_ARRAYS.contains(&name.as_str()))
            .collect();
        let mut loader = aya::EbpfLoader::new();
        for (name, path) in &pins {
            loader.map_pin_path(name.as_str(), path.as_path());
        }
        let kernel_btf = aya::Btf::from_sys_fs().ok();
        let mut ebpf = loader.load(&sock_end::resolve_kfunc(OBJECT, kernel_btf.as_ref()))?;
        let mut arrays = vec![
            fill(&mut ebpf, map_names::TC_NEW, &TC_NEW_PROGRAMS, &[TC_NEW_FLOW])?,
            fill(&mut ebpf, map_names::TC6, &TC6_PROGRAMS, INGRESS6)?,
        ];
        for name in [TC_INGRESS, TC_POD_REPLIES] {
            load(&mut ebpf, name)?;
        }
        if sctp {
            arrays.push(fill(&mut ebpf, map_names::TC_SCTP, &TC_SCTP_PROGRAMS, SCTP_INGRESS)?);
        }
        Ok(Explainer { ebpf, _arrays: arrays, xdp6: None })
    }

    /// Runs `program` (`tc_ingress` or `tc_pod_replies`) on `packet` as if
    /// it came in on the interface `ifindex` (0: loopback).
    pub fn run(
        &mut self,
        name: &'static str,
        packet: &[u8],
        ifindex: u32,
    ) -> Result<ExplainRun, EbpfError> {
        let prog = program::<SchedClassifier>(&mut self.ebpf, name)?;
        test_run(prog, packet, ifindex).map_err(|source| EbpfError::Program { name, source })
    }

    /// Fills this build's `XDP6` with its `xdp_ingress6` (a verifier run
    /// only IPv6 explain runs at XDP need), so that `xdp_ingress` hands an
    /// IPv6 packet on as it does real ones; an error where this kernel's
    /// verifier refuses it (the agent then runs XDP for IPv4 only, and
    /// `xdp_ingress` passes IPv6 up to tc).
    pub fn load_xdp6(&mut self) -> Result<(), EbpfError> {
        if self.xdp6.is_some() {
            return Ok(());
        }
        let name = map_names::XDP6;
        let mut map = self.ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })?;
        super::xdp::fill_xdp6(&mut self.ebpf, &mut map)?;
        self.xdp6 = Some(map);
        Ok(())
    }

    /// Runs `xdp_ingress` on `packet` as if it came in on `ifindex`, as an
    /// explain run: the marker, and the notes it leaves, in the frame's
    /// metadata (XDP has no `cb`).
    pub fn run_xdp(&mut self, packet: &[u8], ifindex: u32) -> Result<ExplainRun, EbpfError> {
        let name = XDP_INGRESS;
        let err = |source| EbpfError::Program { name, source };
        let prog = program::<Xdp>(&mut self.ebpf, name)?;
        if prog.fd().is_err() {
            prog.load().map_err(err)?;
        }
        let mut data = vec![0u8; XDP_META_LEN];
        data[..4].copy_from_slice(&MAGIC[0].to_ne_bytes());
        data[4..8].copy_from_slice(&MAGIC[1].to_ne_bytes());
        data.extend_from_slice(packet);
        let ctx = xdp_ctx(XDP_META_LEN as u32, data.len() as u32, ifindex);
        let mut out = vec![0u8; data.len() + 128];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..TestRunOptions::new()
            })
            .map_err(err)?;
        out.truncate(result.data_size_out as usize);
        let word = |i: usize| {
            u32::from_ne_bytes([out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]])
        };
        let cb = std::array::from_fn(word);
        Ok(ExplainRun {
            verdict: result.return_value as i32,
            packet: out[XDP_META_LEN..].to_vec(),
            cb,
        })
    }
}

/// The metadata an XDP explain run puts in front of its frame: the words
/// of `cb` (marker and notes), rounded to the kernel's unit.
const XDP_META_LEN: usize = 32;

/// The pinned program arrays, which hold the running agent's programs.
const PROGRAM_ARRAYS: [&str; 4] =
    [map_names::TC_NEW, map_names::TC6, map_names::TC_SCTP, map_names::XDP6];

/// The ingress slots of the program arrays (the egress programs never run
/// here).
const INGRESS6: &[u32] = &[TC6_INGRESS, TC6_POD_REPLIES];
const SCTP_INGRESS: &[u32] = &[TC_SCTP_INGRESS, TC_SCTP_INGRESS6];

fn load(ebpf: &mut Ebpf, name: &'static str) -> Result<(), EbpfError> {
    let prog = program::<SchedClassifier>(ebpf, name)?;
    prog.load().map_err(|source| EbpfError::Program { name, source })
}

/// The object's own program array `name` (not the pinned one), its `slots`
/// holding the object's `programs` there, loaded.
fn fill(
    ebpf: &mut Ebpf,
    name: &'static str,
    programs: &[&'static str],
    slots: &[u32],
) -> Result<ProgramArray<MapData>, EbpfError> {
    let map = ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })?;
    let mut array =
        ProgramArray::try_from(map).map_err(|source| EbpfError::Map { name, source })?;
    for &slot in slots {
        let program_name = programs[slot as usize];
        load(ebpf, program_name)?;
        let prog = program::<SchedClassifier>(ebpf, program_name)?;
        let fd = prog.fd().map_err(|source| EbpfError::Program { name: program_name, source })?;
        array.set(slot, fd, 0).map_err(|source| EbpfError::Map { name, source })?;
    }
    Ok(array)
}

/// `struct xdp_md`'s length and where its `data`, `data_end` and
/// `ingress_ifindex` are (`include/uapi/linux/bpf.h`).
const XDP_CTX_LEN: usize = 24;
const XDP_DATA: usize = 0;
const XDP_DATA_END: usize = 4;
const XDP_INGRESS_IFINDEX: usize = 12;

/// A `struct xdp_md` for a test run of a frame arriving on `ifindex`: its
/// packet from `data` (what comes before is metadata) to `data_end` in the
/// test run's buffer.
pub(super) fn xdp_ctx(data: u32, data_end: u32, ifindex: u32) -> [u8; XDP_CTX_LEN] {
    let mut ctx = [0u8; XDP_CTX_LEN];
    ctx[XDP_DATA..][..4].copy_from_slice(&data.to_ne_bytes());
    ctx[XDP_DATA_END..][..4].copy_from_slice(&data_end.to_ne_bytes());
    ctx[XDP_INGRESS_IFINDEX..][..4].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// One explain run of a loaded tc program.
/// A `struct __sk_buff` for a test run of a packet arriving on `ifindex`
/// (0: the kernel's choice), marked as an explain run's or not.
pub(super) fn skb_ctx(ifindex: u32, explain: bool) -> [u8; SKB_CTX_LEN] {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX..][..4].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[SKB_IFINDEX..][..4].copy_from_slice(&ifindex.to_ne_bytes());
    if explain {
        ctx[SKB_CB..][..4].copy_from_slice(&MAGIC[0].to_ne_bytes());
        ctx[SKB_CB + 4..][..4].copy_from_slice(&MAGIC[1].to_ne_bytes());
    }
    ctx
}

pub fn test_run(
    prog: &SchedClassifier,
    packet: &[u8],
    ifindex: u32,
) -> Result<ExplainRun, ProgramError> {
    let ctx = skb_ctx(ifindex, true);
    let mut ctx_out = [0u8; SKB_CTX_OUT_LEN];
    // Room for the largest packet the program builds from a small one.
    let mut out = vec![0u8; packet.len() + 128];
    let result = prog.test_run(TestRunOptions {
        data_in: Some(packet),
        data_out: Some(&mut out),
        ctx_in: Some(&ctx),
        ctx_out: Some(&mut ctx_out),
        ..TestRunOptions::new()
    })?;
    out.truncate(result.data_size_out as usize);
    let word = |i: usize| {
        let at = SKB_CB + 4 * i;
        u32::from_ne_bytes([ctx_out[at], ctx_out[at + 1], ctx_out[at + 2], ctx_out[at + 3]])
    };
    Ok(ExplainRun {
        verdict: result.return_value as i32,
        packet: out,
        cb: std::array::from_fn(word),
    })
}
