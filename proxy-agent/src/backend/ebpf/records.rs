//! The programs' decision records (aya-log), forwarded into the agent's
//! log. Which records the programs write is `--bpf-log-level`, a word of
//! their `CONFIG` map: the agent's own log filter does not gate them again,
//! so every record comes out at INFO, under the target `bpf`, with the
//! program that wrote it and the record's level.

use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;

/// Writes each record as a `tracing` event.
pub struct ToTracing;

impl log::Log for ToTracing {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let level = record.level().as_str();
        tracing::info!(target: "bpf", program = record.target(), level, "{}", record.args());
    }

    fn flush(&self) {}
}

/// The task reading one load's records; it stops when this drops (with the
/// programs it reads for: a load replaced when the maps grow).
pub struct Reader(tokio::task::AbortHandle);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the records as they come, until the runtime stops or the returned
/// reader drops.
pub fn drain(logger: EbpfLogger<ToTracing>) -> Reader {
    let task = tokio::spawn(async move {
        // SAFETY: the logger owns its ring buffer's fd and keeps it open
        // (and unreplaced) while the `AsyncFd` holds it.
        let registered =
            unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
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
            ready.get_inner_mut().flush();
            ready.clear_ready();
        }
    });
    Reader(task.abort_handle())
}
