//! What Maglev tables cost the agent: computing the tables of S external
//! services of B backends at a table size (the first sync's work), one
//! table again after a backend leaves (a change's), and the `MAGLEV` map's
//! memory for them (the kernel allocates each 8 KiB chunk with its key and
//! a hash element's header).
//!
//! ```sh
//! cargo build --release -p proxy-agent --example maglev_tables
//! target/release/examples/maglev_tables 1000 10 16381
//! ```

use std::{net::Ipv4Addr, time::Instant};

use proxy_agent::maglev::{self, Backend};
use proxy_common::maglev::{CHUNK_SLOTS, MaglevChunk, MaglevKey, chunks};

fn main() {
    let arg = |i: usize, default: u32| {
        std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"))
    };
    let (services, backends, size) = (arg(1, 1000), arg(2, 10), arg(3, 16381));
    let of_service = |s: u32| -> Vec<Backend> {
        (0..backends)
            .map(|b| Backend {
                slot: b as u16 + 1,
                ip: Ipv4Addr::from(0x0af4_0000 + s * 64 + b).into(),
                port: 8080,
            })
            .collect()
    };
    let all: Vec<Vec<Backend>> = (0..services).map(of_service).collect();

    let start = Instant::now();
    let mut checksum = 0u64;
    for service in &all {
        checksum += u64::from(maglev::table(service, size)[0]);
    }
    let first_sync = start.elapsed();

    // One backend leaves one service, many times over: the median.
    let mut changes: Vec<f64> = (0..101)
        .map(|i| {
            let mut rest = all[i % all.len()].clone();
            rest.remove(i % rest.len());
            let start = Instant::now();
            checksum += u64::from(maglev::table(&rest, size)[0]);
            start.elapsed().as_secs_f64()
        })
        .collect();
    changes.sort_by(f64::total_cmp);

    // A hash element: its header (about 48 bytes on x86_64), key, value.
    let element = 48 + size_of::<MaglevKey>() + size_of::<MaglevChunk>();
    let map_bytes = services as usize * chunks(size) as usize * element;
    println!(
        "{services} services x {backends} backends, tables of {size} entries ({} chunks of {CHUNK_SLOTS})",
        chunks(size)
    );
    println!("  all tables computed: {:.3} s", first_sync.as_secs_f64());
    println!("  one table after a backend change (median of 101): {:.3} ms", changes[50] * 1e3);
    println!(
        "  MAGLEV map: {:.1} MiB ({} KiB a frontend)",
        map_bytes as f64 / (1 << 20) as f64,
        chunks(size) as usize * element / 1024
    );
    std::hint::black_box(checksum);
}
