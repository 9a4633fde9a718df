//! ICMP errors about flows translated per packet: which flow an error is
//! about and what it becomes, as netfilter's NAT translates RELATED errors.
//! Shared by the programs and the host's tests.

use crate::{CtKey, CtTuple};

pub const DEST_UNREACH: u8 = 3;
pub const TIME_EXCEEDED: u8 = 11;
/// ICMPv6's errors (RFC 4443): all three may quote a translated packet.
pub const DEST_UNREACH6: u8 = 1;
pub const PACKET_TOO_BIG: u8 = 2;
pub const TIME_EXCEEDED6: u8 = 3;

/// An ICMP error's addresses and the tuple of the packet it quotes (`T`:
/// its family's tuple).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorTuple<T: CtTuple = CtKey> {
    pub saddr: T::Addr,
    pub daddr: T::Addr,
    pub quoted: T,
}

/// The conntrack key of the flow the quoted packet belongs to. That
/// packet left translated, and translated tuples are no keys; a packet
/// going the other way is one, whose entry names the flow's tuples.
#[inline(always)]
pub fn flow_key<T: CtTuple>(quoted: &T) -> T {
    quoted.reversed()
}

/// `err` as the sender of the quoted packet must see it, given the tuple
/// the flow rewrites packets of `flow_key` to: the quoted packet as that
/// sender sent it, and the error addressed to it. Where the flow rewrites
/// the source of packets going the error's way, the error comes from that
/// source too (the node, a service address), as with netfilter; otherwise
/// from whoever sent it.
#[inline(always)]
pub fn translate<T: CtTuple>(err: &ErrorTuple<T>, rewritten: &T) -> ErrorTuple<T> {
    let quoted = rewritten.reversed();
    let saddr = if quoted.daddr() != err.quoted.daddr() { quoted.daddr() } else { err.saddr };
    ErrorTuple { saddr, daddr: quoted.saddr(), quoted }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CtKey6, IPPROTO_TCP, IPPROTO_UDP};

    #[test]
    fn icmp_errors_reach_the_sender_of_the_quoted_packet() {
        let key = |s: [u8; 4], sp, d: [u8; 4], dp| CtKey {
            saddr: s,
            daddr: d,
            sport: sp,
            dport: dp,
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let (client, node, pod, vip) =
            ([192, 168, 200, 2], [192, 168, 100, 11], [10, 244, 2, 2], [10, 96, 0, 10]);
        let router = [192, 168, 100, 2];
        let through = |err: &ErrorTuple, forward: CtKey, rewritten: CtKey| {
            assert_eq!(flow_key(&err.quoted), forward);
            translate(err, &rewritten)
        };

        // A NodePort flow SNATed to the node: a router towards the client
        // quotes the reply as the node sent it; the error goes to the pod.
        let err =
            ErrorTuple { saddr: router, daddr: node, quoted: key(node, 30080, client, 40000) };
        let back = through(&err, key(client, 40000, node, 30080), key(node, 20000, pod, 8080));
        let expect = ErrorTuple { saddr: node, daddr: pod, quoted: key(pod, 8080, node, 20000) };
        assert_eq!(back, expect, "from the node, as netfilter's masquerade makes it");

        // Without SNAT (policy Local): only the destination moves.
        let back = through(&err, key(client, 40000, node, 30080), key(client, 40000, pod, 8080));
        assert_eq!(back.saddr, router);
        assert_eq!(back.daddr, pod);
        assert_eq!(back.quoted, key(pod, 8080, client, 40000));

        // A ClusterIP flow from a pod, not SNATed: a router towards the
        // backend quotes the client's packet; the client learns of its
        // packet to the service address, from the service address.
        let client_pod = [10, 244, 1, 5];
        let err = ErrorTuple {
            saddr: router,
            daddr: client_pod,
            quoted: key(client_pod, 40000, pod, 8080),
        };
        let back =
            through(&err, key(pod, 8080, client_pod, 40000), key(vip, 80, client_pod, 40000));
        let expect =
            ErrorTuple { saddr: vip, daddr: client_pod, quoted: key(client_pod, 40000, vip, 80) };
        assert_eq!(back, expect);
    }

    #[test]
    fn icmpv6_errors_translate_as_icmp_ones() {
        let key = |s: [u8; 16], sp, d: [u8; 16], dp| CtKey6::new(s, d, sp, dp, IPPROTO_UDP);
        let addr = |last: u8| {
            let mut a = [0xfd, 0, 0, 0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            a[15] = last;
            a
        };
        let (client, node, pod, router) = (addr(0x65), addr(0x11), addr(0x22), addr(2));
        let err =
            ErrorTuple { saddr: router, daddr: node, quoted: key(node, 30053, client, 40000) };
        assert_eq!(flow_key(&err.quoted), key(client, 40000, node, 30053));
        let back = translate(&err, &key(node, 20000, pod, 5353));
        let expect = ErrorTuple { saddr: node, daddr: pod, quoted: key(pod, 5353, node, 20000) };
        assert_eq!(back, expect);
    }
}
