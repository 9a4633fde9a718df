//! Test runs: the per-packet programs run on a packet in the kernel
//! (`BPF_PROG_TEST_RUN`) without sending anything, for tests, benchmarks
//! and `explain`.

use std::net::IpAddr;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions, Xdp};

use super::{
    BpfObject, EbpfError, XDP_INGRESS, explain, program,
    programs::{TC_EGRESS, TC_INGRESS, TC_POD_REPLIES},
};

/// What the per-packet program did to one packet under `BPF_PROG_TEST_RUN`.
#[derive(Debug)]
pub struct PacketRun {
    /// The tc verdict: -1 next/pass, 0 to the stack, 2 drop, 7 redirect.
    pub verdict: i32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
    /// Mean time of one run, as the kernel measured it.
    pub duration: std::time::Duration,
}

impl BpfObject {
    /// Whether replies from this backend endpoint reach the full path by
    /// its reply slot (a per-packet flow not masqueraded goes to it, or a
    /// collection has not yet cleared a slot it shares with one that did).
    pub fn reply_slot_set(&self, addr: IpAddr, port: u16, proto: u8) -> bool {
        let slots = self.maps.replies.slots();
        match addr {
            IpAddr::V4(ip) => slots.is_marked(ip.octets(), port, proto),
            IpAddr::V6(ip) => slots.is_marked(ip.octets(), port, proto),
        }
    }

    /// Runs the per-packet program on `packet` `repeat` times in the kernel
    /// without sending anything (packet-level tests and benchmarks).
    pub fn run_tc(&mut self, packet: &[u8], repeat: u32) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_INGRESS, packet, repeat, None)
    }

    /// As `run_tc`, the packet arriving on the interface `ifindex` (its
    /// route, and the redirect, are then that interface's).
    pub fn run_tc_on(
        &mut self,
        packet: &[u8],
        repeat: u32,
        ifindex: u32,
    ) -> Result<PacketRun, EbpfError> {
        let ctx = explain::skb_ctx(ifindex, false);
        self.run_program(TC_INGRESS, packet, repeat, Some(&ctx))
    }

    /// The XDP program (`--bpf-lb-acceleration`) on `packet` arriving on
    /// the interface `ifindex`, `repeat` times (loaded first if need be).
    pub fn run_xdp(
        &mut self,
        packet: &[u8],
        repeat: u32,
        ifindex: u32,
    ) -> Result<PacketRun, EbpfError> {
        self.load_xdp()?;
        let len = u32::try_from(packet.len()).unwrap_or(u32::MAX);
        let ctx = explain::xdp_ctx(0, len, ifindex);
        self.run_program(XDP_INGRESS, packet, repeat, Some(&ctx))
    }

    /// As `run_tc`, with the egress program (packets the node's stack sends).
    pub fn run_tc_egress(&mut self, packet: &[u8], repeat: u32) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_EGRESS, packet, repeat, None)
    }

    /// As `run_tc`, with the ingress program of pod interfaces the socket LB
    /// covers (replies only).
    pub fn run_tc_pod_replies(
        &mut self,
        packet: &[u8],
        repeat: u32,
    ) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_POD_REPLIES, packet, repeat, None)
    }

    /// As `run_tc`, once, as an explain run (`explain`): no state is
    /// written, the decision is read back.
    pub fn explain_tc(&mut self, packet: &[u8]) -> Result<explain::ExplainRun, EbpfError> {
        let name = TC_INGRESS;
        let prog = program::<SchedClassifier>(&mut self.ebpf, name)?;
        explain::test_run(prog, packet, 0).map_err(|source| EbpfError::Program { name, source })
    }

    /// Runs the program `name` (tc's, or XDP's) on `packet` with the
    /// context `ctx` (the kernel's default without).
    fn run_program(
        &mut self,
        name: &'static str,
        packet: &[u8],
        repeat: u32,
        ctx: Option<&[u8]>,
    ) -> Result<PacketRun, EbpfError> {
        let err = |source| EbpfError::Program { name, source };
        // Room for the largest packet the program builds from a small one.
        let mut out = vec![0u8; packet.len() + 128];
        let options = TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ctx_in: ctx,
            repeat,
            ..TestRunOptions::new()
        };
        let program =
            self.ebpf.program(name).ok_or(EbpfError::Missing { what: "program", name })?;
        let result = match name {
            XDP_INGRESS => <&Xdp>::try_from(program).map_err(err)?.test_run(options),
            _ => <&SchedClassifier>::try_from(program).map_err(err)?.test_run(options),
        }
        .map_err(err)?;
        out.truncate(result.data_size_out as usize);
        Ok(PacketRun {
            verdict: result.return_value as i32,
            packet: out,
            duration: result.duration,
        })
    }
}
