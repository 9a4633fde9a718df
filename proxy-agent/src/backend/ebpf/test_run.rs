//! Test runs: the per-packet programs run on a packet in the kernel
//! (`BPF_PROG_TEST_RUN`) without sending anything, for tests, benchmarks
//! and `explain`.

use std::net::IpAddr;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};

use super::{
    BpfObject, EbpfError, explain, program,
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
        self.run_program(TC_INGRESS, packet, repeat)
    }

    /// As `run_tc`, with the egress program (packets the node's stack sends).
    pub fn run_tc_egress(&mut self, packet: &[u8], repeat: u32) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_EGRESS, packet, repeat)
    }

    /// As `run_tc`, with the ingress program of pod interfaces the socket LB
    /// covers (replies only).
    pub fn run_tc_pod_replies(
        &mut self,
        packet: &[u8],
        repeat: u32,
    ) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_POD_REPLIES, packet, repeat)
    }

    /// As `run_tc`, once, as an explain run (`explain`): no state is
    /// written, the decision is read back.
    pub fn explain_tc(&mut self, packet: &[u8]) -> Result<explain::ExplainRun, EbpfError> {
        let name = TC_INGRESS;
        let prog = program::<SchedClassifier>(&mut self.ebpf, name)?;
        explain::test_run(prog, packet, 0).map_err(|source| EbpfError::Program { name, source })
    }

    fn run_program(
        &mut self,
        name: &'static str,
        packet: &[u8],
        repeat: u32,
    ) -> Result<PacketRun, EbpfError> {
        let err = |source| EbpfError::Program { name, source };
        let prog: &SchedClassifier = self
            .ebpf
            .program(name)
            .ok_or(EbpfError::Missing { what: "program", name })?
            .try_into()
            .map_err(err)?;
        // Room for the largest packet the program builds from a small one.
        let mut out = vec![0u8; packet.len() + 128];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                repeat,
                ..TestRunOptions::new()
            })
            .map_err(err)?;
        out.truncate(result.data_size_out as usize);
        Ok(PacketRun {
            verdict: result.return_value as i32,
            packet: out,
            duration: result.duration,
        })
    }
}
