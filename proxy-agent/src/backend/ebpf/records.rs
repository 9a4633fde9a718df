//! The programs' decision records ([`proxy_common::record`]), put into
//! words and forwarded into the agent's log. Which records the programs
//! write is `--bpf-log-level`, a word of their `CONFIG` map: the agent's
//! own log filter does not gate them again, so every record comes out at
//! INFO, under the target `bpf`, with the program that wrote it and the
//! record's level.

use aya::maps::{MapData, RingBuf};
use proxy_common::{
    log_level, monitor,
    record::{Among, Kind, Outcome, Program, Record, Via},
};
use tokio::io::unix::AsyncFd;

use super::ring::read_item;

/// The task reading one load's records; it stops when this drops (with the
/// programs it reads for: a load replaced when the maps grow).
pub struct Reader(tokio::task::AbortHandle);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the records of `ring` (the programs' `RECORDS`) as they come,
/// until the runtime stops or the returned reader drops.
pub fn drain(ring: RingBuf<MapData>) -> Reader {
    let task = tokio::spawn(async move {
        // SAFETY: the ring buffer owns its map's fd and keeps it open (and
        // unreplaced) while the `AsyncFd` holds it.
        let registered =
            unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) };
        let mut fd = match registered {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(error = %e, "the programs' decision records cannot be read");
                return;
            }
        };
        loop {
            let mut ready = match fd.readable_mut().await {
                Ok(ready) => ready,
                Err(e) => {
                    tracing::warn!(error = %e, "stopped reading the programs' decision records");
                    return;
                }
            };
            let ring = ready.get_inner_mut();
            while let Some(item) = ring.next() {
                log(&item);
            }
            ready.clear_ready();
        }
    });
    Reader(task.abort_handle())
}

/// Logs one record as it came out of the ring buffer.
fn log(bytes: &[u8]) {
    let Some(record) = read_item::<Record>(bytes) else {
        tracing::warn!(bytes = bytes.len(), "a decision record of another size, skipped");
        return;
    };
    match Line::of(&record) {
        Some(line) => {
            let (program, level) = (line.program.words(), line.level);
            tracing::info!(target: "bpf", program, level, "{}", line.text);
        }
        None => tracing::warn!(?record, "a decision record this build cannot read, skipped"),
    }
}

/// A record in words.
#[derive(Debug, PartialEq, Eq)]
struct Line {
    program: Program,
    /// As the `log` crate names it.
    level: &'static str,
    text: String,
}

impl Line {
    /// The words of `r` (none: a value this build does not know).
    fn of(r: &Record) -> Option<Self> {
        let program = Program::from_u8(r.program)?;
        let level = match r.level {
            log_level::INFO => "INFO",
            log_level::DEBUG => "DEBUG",
            log_level::TRACE => "TRACE",
            _ => return None,
        };
        let t = &r.tuple;
        let family = r.family;
        if !matches!(family, 4 | 6) {
            return None;
        }
        let ip = |bytes| monitor::address(family, bytes);
        let (source, destination) = (ip(&t.saddr), ip(&t.daddr));
        let (sport, dport, proto) = (t.sport, t.dport, t.proto);
        let kind = Kind::from_u8(r.kind)?;
        // A packet's tuple, or the service a socket program was called for.
        let about = match program.is_socket() {
            true => format!("{destination}:{dport} proto {proto}"),
            false => format!("{source}:{sport} -> {destination}:{dport} proto {proto}"),
        };
        let to = || format!("{}:{}", ip(&r.to), r.to_port);
        let text = match kind {
            Kind::Outcome => format!("{about}: {}", Outcome::from_u8(r.detail)?.words()),
            Kind::Backend => {
                let (via, among) = (Via::from_u8(r.detail)?, Among::from_u8(r.among)?);
                format!(
                    "{about}: {} {} by {} among {}",
                    kind.words(),
                    to(),
                    via.words(),
                    among.words()
                )
            }
            Kind::Snat => format!("{about}: {} {}", kind.words(), to()),
            Kind::OrphanFragment => {
                format!("{source} -> {destination} proto {proto} id {}: {}", r.id, kind.words())
            }
            Kind::ServiceGone => {
                format!("{source}:{sport}: its service {destination}:{dport} {}", kind.words())
            }
            Kind::NoService | Kind::NotInScope | Kind::Refused => {
                format!("{about}: {}", kind.words())
            }
        };
        Some(Line { program, level, text })
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use proxy_common::monitor::EventTuple;

    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut out = [0; 16];
        out[..4].copy_from_slice(&a);
        out
    }

    /// A record of `program` about `10.0.0.5:40000 -> 10.96.0.10:80` (TCP).
    fn record(program: Program, level: u8, kind: Kind) -> Record {
        let tuple = EventTuple {
            saddr: v4([10, 0, 0, 5]),
            daddr: v4([10, 96, 0, 10]),
            sport: 40000,
            dport: 80,
            proto: 6,
            _pad: [0; 3],
        };
        Record {
            tuple,
            program: program as u8,
            level,
            kind: kind as u8,
            family: 4,
            ..Record::default()
        }
    }

    fn text(r: &Record) -> String {
        Line::of(r).unwrap().text
    }

    #[test]
    fn packet_records_read_as_the_programs_wrote_them_with_aya_log() {
        let mut r = record(Program::TcIngress, log_level::INFO, Kind::Outcome);
        r.detail = Outcome::NoEndpoint as u8;
        let line = Line::of(&r).unwrap();
        assert_eq!(line.program.words(), "tc_ingress");
        assert_eq!(line.level, "INFO");
        assert_eq!(line.text, "10.0.0.5:40000 -> 10.96.0.10:80 proto 6: no endpoint, refused");

        let mut r = record(Program::TcIngress, log_level::DEBUG, Kind::Backend);
        (r.to, r.to_port) = (v4([10, 244, 1, 2]), 8080);
        (r.detail, r.among) = (Via::Algorithm as u8, Among::Local as u8);
        assert_eq!(
            text(&r),
            "10.0.0.5:40000 -> 10.96.0.10:80 proto 6: backend 10.244.1.2:8080 by its algorithm (random or Maglev) among local endpoints only"
        );

        let mut r = record(Program::TcIngress, log_level::DEBUG, Kind::Snat);
        (r.to, r.to_port) = (v4([192, 168, 0, 1]), 61000);
        assert_eq!(text(&r), "10.0.0.5:40000 -> 10.96.0.10:80 proto 6: SNAT to 192.168.0.1:61000");

        let mut r = record(Program::TcIngress, log_level::DEBUG, Kind::OrphanFragment);
        (r.tuple.proto, r.id) = (17, 4242);
        assert_eq!(
            text(&r),
            "10.0.0.5 -> 10.96.0.10 proto 17 id 4242: a fragment whose first did not come through here, passed"
        );
    }

    #[test]
    fn socket_records_name_the_service_called_not_a_packet() {
        let r = record(Program::Connect4, log_level::INFO, Kind::Refused);
        assert_eq!(text(&r), "10.96.0.10:80 proto 6: no endpoint, refused (ECONNREFUSED)");
        let r = record(Program::Sendmsg4, log_level::TRACE, Kind::NoService);
        assert_eq!(text(&r), "10.96.0.10:80 proto 6: no service");

        let mut r = record(Program::Connect6, log_level::DEBUG, Kind::Backend);
        r.family = 6;
        r.tuple.daddr = "fd00::10".parse::<Ipv6Addr>().unwrap().octets();
        (r.to, r.to_port) = ("fd00:244::2".parse::<Ipv6Addr>().unwrap().octets(), 8080);
        (r.detail, r.among) = (Via::Affinity as u8, Among::All as u8);
        assert_eq!(
            text(&r),
            "fd00::10:80 proto 6: backend fd00:244::2:8080 by session affinity among all endpoints"
        );

        let r = record(Program::Recvmsg4, log_level::DEBUG, Kind::ServiceGone);
        assert_eq!(
            text(&r),
            "10.0.0.5:40000: its service 10.96.0.10:80 is gone, the peer's own address shown"
        );
    }

    #[test]
    fn a_record_this_build_cannot_read_is_not_guessed_at() {
        let mut r = record(Program::TcIngress, log_level::INFO, Kind::Outcome);
        r.detail = 200;
        assert_eq!(Line::of(&r), None);
        let mut r = record(Program::TcIngress, log_level::INFO, Kind::Outcome);
        r.family = 5;
        assert_eq!(Line::of(&r), None);
        let r = record(Program::TcIngress, 9, Kind::Outcome);
        assert_eq!(Line::of(&r), None);
        assert_eq!(read_item::<Record>(&[0; 12]), None);
        let r = record(Program::TcEgress, log_level::TRACE, Kind::Outcome);
        // SAFETY: a `Record`'s bytes, as the ring buffer holds them.
        let bytes =
            unsafe { std::slice::from_raw_parts((&raw const r).cast::<u8>(), size_of::<Record>()) };
        assert_eq!(read_item(bytes), Some(r));
    }
}
