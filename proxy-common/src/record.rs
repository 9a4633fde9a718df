//! Decision records: what a program decided about a packet or a socket
//! call, written to the `RECORDS` ring buffer at the levels
//! `Config::log_level` asks for (`log_level`), and put into words by the
//! agent, which logs them (target `bpf`). A record is a fixed-size struct,
//! not text: formatting in the programs (aya-log, before) cost the verifier
//! about 17,000 instructions at each record site, five sixths of what a
//! load verified.

use crate::monitor::EventTuple;

/// The ring buffer's size in bytes (a power-of-2 multiple of the page
/// size): about 1,900 records.
pub const RECORDS_BYTES: u32 = 128 * 1024;

/// One record. Its `tuple` is the packet's; a socket program's has no
/// source (the service it was called for is the destination), and a
/// [`Kind::ServiceGone`] record's source is the peer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub tuple: EventTuple,
    /// The backend ([`Kind::Backend`]) or the node's address SNAT chose
    /// ([`Kind::Snat`]), with `to_port`.
    pub to: [u8; 16],
    pub to_port: u16,
    /// A [`Program`].
    pub program: u8,
    /// Its `log_level`.
    pub level: u8,
    /// A [`Kind`].
    pub kind: u8,
    /// [`Kind::Outcome`]: an [`Outcome`]; [`Kind::Backend`]: a [`Via`].
    pub detail: u8,
    /// [`Kind::Backend`]: an [`Among`].
    pub among: u8,
    /// 4 or 6.
    pub family: u8,
    /// [`Kind::OrphanFragment`]: the fragment's IP id.
    pub id: u32,
}

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Record {}
}

/// Declares a `#[repr(u8)]` enum whose values a record carries, with each
/// value's words and the conversion back from the byte.
macro_rules! coded {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $words:literal,)+ }) => {
        $(#[$doc])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
        }

        impl $name {
            const ALL: &[$name] = &[$($name::$variant,)+];

            /// The value a record's byte holds (none: a byte no build wrote).
            pub fn from_u8(byte: u8) -> Option<Self> {
                Self::ALL.get(usize::from(byte)).copied()
            }

            /// What a log line says.
            pub fn words(self) -> &'static str {
                match self {
                    $($name::$variant => $words,)+
                }
            }
        }
    };
}

coded!(
    /// The program that wrote a record.
    Program {
        TcIngress = "tc_ingress",
        TcEgress = "tc_egress",
        Connect4 = "connect4",
        Sendmsg4 = "sendmsg4",
        Getpeername4 = "getpeername4",
        Recvmsg4 = "recvmsg4",
        Connect6 = "connect6",
        Sendmsg6 = "sendmsg6",
        Getpeername6 = "getpeername6",
        Recvmsg6 = "recvmsg6",
    }
);

impl Program {
    /// A socket program's records name the service called, not a packet.
    pub fn is_socket(self) -> bool {
        !matches!(self, Program::TcIngress | Program::TcEgress)
    }
}

coded!(
    /// What a record says.
    Kind {
        /// A packet and what became of it (`detail`).
        Outcome = "",
        /// A new flow's or connection's backend (`to`).
        Backend = "backend",
        /// A new flow's SNAT (to `to`).
        Snat = "SNAT to",
        /// A later fragment whose first did not come through here.
        OrphanFragment = "a fragment whose first did not come through here, passed",
        /// A socket call to no service.
        NoService = "no service",
        /// A socket call the socket programs leave to the per-packet path.
        NotInScope = "not the node's socket (a pod's loopback is its own; its services are the per-packet path's)",
        /// A socket call to a service without endpoints, refused.
        Refused = "no endpoint, refused (ECONNREFUSED)",
        /// A reply whose service is gone: the peer's own address is shown.
        ServiceGone = "is gone, the peer's own address shown",
    }
);

coded!(
    /// What became of a packet.
    Outcome {
        SourceOutsideRanges = "source outside loadBalancerSourceRanges, dropped",
        NoLocalEndpoint = "no local endpoint (policy Local), dropped",
        NoEndpoint = "no endpoint, refused",
        NoSnatPort = "no SNAT port free (or conntrack map full), dropped",
        ConntrackFull = "conntrack map full, dropped",
        ReplyWithoutFlow = "reply to a SNAT port without a conntrack entry, passed",
        NoService = "no flow, no service",
        NoFlow = "no flow",
    }
);

coded!(
    /// How a backend was chosen.
    Via {
        /// The client's remembered backend (sessionAffinity).
        Affinity = "session affinity",
        /// By the frontend's algorithm: at random among its backends, or
        /// from its Maglev table by the flow's hash where it has one (its
        /// `uses_maglev` flag says which; one value for both, so that the
        /// verifier's paths through the two join right after the pick).
        Algorithm = "its algorithm (random or Maglev)",
        /// The backend of the socket's fresh UDP flow.
        Flow = "the socket's UDP flow",
    }
);

coded!(
    /// Among which endpoints a backend was chosen.
    Among {
        All = "all endpoints",
        Local = "local endpoints only",
        Terminating = "terminating endpoints (none ready)",
        LocalTerminating = "local terminating endpoints (none ready)",
    }
);

impl Among {
    /// Which endpoints a frontend with these traits chooses among.
    pub fn of(local_only: bool, terminating: bool) -> Self {
        match (local_only, terminating) {
            (false, false) => Among::All,
            (true, false) => Among::Local,
            (false, true) => Among::Terminating,
            (true, true) => Among::LocalTerminating,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_value_comes_back_from_its_byte_and_no_other_byte_gives_one() {
        for &outcome in Outcome::ALL {
            assert_eq!(Outcome::from_u8(outcome as u8), Some(outcome));
        }
        for &program in Program::ALL {
            assert_eq!(Program::from_u8(program as u8), Some(program));
        }
        assert_eq!(Kind::from_u8(Kind::ALL.len() as u8), None);
        assert_eq!(Via::from_u8(255), None);
    }

    #[test]
    fn a_record_has_no_padding_the_compiler_chose() {
        // 40 (tuple) + 16 + 2 + 6 one-byte fields + 4: every byte a field's.
        assert_eq!(core::mem::size_of::<Record>(), 68);
    }
}
