//! Runs tests in parallel, each in its own process (as cargo-nextest does).
//! The lab's tests spend most of their time waiting (for agents, packets,
//! timeouts), each in its own namespaces, test cgroup and bpffs: several
//! at a time keep the two cores busy where one binary after another left
//! them idle.

use std::{
    collections::VecDeque,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::artifacts::TestBinary;

/// One test of one executable.
#[derive(Clone, Debug)]
struct Case {
    binary: String,
    path: std::path::PathBuf,
    name: String,
}

/// How one test ended.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Passed,
    Ignored,
    /// Failed, or ran something other than exactly this test.
    Failed(String),
}

/// What a run counted.
#[derive(Debug, Default)]
pub struct Summary {
    pub passed: usize,
    pub ignored: usize,
    /// Each failed test's name and output.
    pub failed: Vec<(String, String)>,
    /// The slowest tests, slowest first.
    pub slowest: Vec<(String, Duration)>,
}

/// Runs every test of `binaries`, `jobs` at a time, printing a line as
/// each ends; fails when one did.
pub fn run(binaries: &[TestBinary], jobs: usize) -> anyhow::Result<Summary> {
    let mut lists = Vec::new();
    for binary in binaries {
        lists.push((binary.package == LAB, list(binary)?));
    }
    let cases = in_turn(lists);
    let total = cases.len();
    eprintln!("tests: {total} tests from {} executables, {jobs} at a time", binaries.len());
    let queue = Arc::new(Mutex::new(VecDeque::from(cases)));
    let results = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..jobs.max(1))
        .map(|_| {
            let queue = Arc::clone(&queue);
            let results = Arc::clone(&results);
            std::thread::spawn(move || {
                loop {
                    let Some(case) = queue.lock().expect("queue").pop_front() else { break };
                    let started = Instant::now();
                    let (verdict, output) = run_case(&case);
                    let took = started.elapsed();
                    let mut results = results.lock().expect("results");
                    results.push((case.clone(), verdict, output, took));
                    let (mark, done) =
                        (mark(&results.last().expect("just pushed").1), results.len());
                    eprintln!(
                        "{mark} [{done:>3}/{total}] {:>6.1} s  {} {}",
                        took.as_secs_f64(),
                        case.binary,
                        case.name
                    );
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().map_err(|_| anyhow::anyhow!("a test worker panicked"))?;
    }
    let results = std::mem::take(&mut *results.lock().expect("results"));
    let mut summary = Summary::default();
    for (case, verdict, output, took) in results {
        let name = format!("{} {}", case.binary, case.name);
        match verdict {
            Verdict::Passed => summary.passed += 1,
            Verdict::Ignored => summary.ignored += 1,
            Verdict::Failed(why) => summary.failed.push((name.clone(), format!("{why}\n{output}"))),
        }
        summary.slowest.push((name, took));
    }
    summary.slowest.sort_by_key(|(_, took)| std::cmp::Reverse(*took));
    summary.slowest.truncate(10);
    Ok(summary)
}

fn mark(verdict: &Verdict) -> &'static str {
    match verdict {
        Verdict::Passed => "  pass",
        Verdict::Ignored => "ignore",
        Verdict::Failed(_) => "  FAIL",
    }
}

/// The lab's package: its tests are the long ones.
const LAB: &str = "proxy-lab";

/// The lab's tests first (the long ones: none should start last), taking
/// each executable's in turn (so the tests running at a time are of
/// different kinds), then the unit tests, which fill the end.
fn in_turn<T>(lists: Vec<(bool, Vec<T>)>) -> Vec<T> {
    let (lab, units): (Vec<_>, Vec<_>) = lists.into_iter().partition(|(lab, _)| *lab);
    let mut order = Vec::new();
    for group in [lab, units] {
        let mut lists: Vec<_> = group.into_iter().map(|(_, list)| list.into_iter()).collect();
        while !lists.is_empty() {
            lists.retain_mut(|list| list.next().map(|case| order.push(case)).is_some());
        }
    }
    order
}

/// The tests of an executable (`--list --format terse`: `name: test`).
fn list(binary: &TestBinary) -> anyhow::Result<Vec<Case>> {
    let out = Command::new(&binary.path)
        .args(["--list", "--format", "terse"])
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("listing the tests of {}", binary.path.display()))?;
    if !out.status.success() {
        bail!("listing the tests of {} failed ({})", binary.path.display(), out.status);
    }
    Ok(parse_list(&String::from_utf8_lossy(&out.stdout))
        .map(|name| Case {
            binary: format!("{}::{}", binary.package, binary.name),
            path: binary.path.clone(),
            name: name.to_string(),
        })
        .collect())
}

fn parse_list(list: &str) -> impl Iterator<Item = &str> {
    list.lines().filter_map(|line| line.strip_suffix(": test"))
}

/// Runs one test on its own; its verdict and output.
fn run_case(case: &Case) -> (Verdict, String) {
    let out = Command::new(&case.path)
        .args(["--exact", &case.name, "--test-threads=1"])
        .stdin(Stdio::null())
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => return (Verdict::Failed(format!("could not run it: {e}")), String::new()),
    };
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (verdict(out.status.success(), &text), text)
}

/// Exactly this test passed, or was ignored; anything else fails (a name
/// that matched nothing runs 0 tests and exits 0).
fn verdict(success: bool, output: &str) -> Verdict {
    let result = output.lines().find_map(|l| l.strip_prefix("test result: "));
    match result {
        Some(r) if success && r.starts_with("ok. 1 passed; 0 failed; 0 ignored") => Verdict::Passed,
        Some(r) if success && r.starts_with("ok. 0 passed; 0 failed; 1 ignored") => {
            Verdict::Ignored
        }
        Some(r) if success => Verdict::Failed(format!("ran something else: {r}")),
        _ => Verdict::Failed("failed".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_names_the_tests() {
        let list = "a::b: test\nc::d::ebpf: test\nbench_x: benchmark\n";
        assert_eq!(parse_list(list).collect::<Vec<_>>(), ["a::b", "c::d::ebpf"]);
    }

    #[test]
    fn the_labs_tests_go_first_each_executable_in_turn() {
        let lists = vec![
            (false, vec!["unit-1", "unit-2"]),
            (true, vec!["a-1", "a-2", "a-3"]),
            (true, vec!["b-1"]),
        ];
        assert_eq!(in_turn(lists), ["a-1", "b-1", "a-2", "a-3", "unit-1", "unit-2"]);
    }

    #[test]
    fn exactly_one_test_must_pass() {
        let ok = "running 1 test\ntest x ... ok\n\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 9 filtered out; finished in 0.1s\n";
        assert_eq!(verdict(true, ok), Verdict::Passed);
        let none = "running 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 10 filtered out\n";
        assert!(matches!(verdict(true, none), Verdict::Failed(_)));
        let ignored =
            "test result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 9 filtered out\n";
        assert_eq!(verdict(true, ignored), Verdict::Ignored);
        let failed = "test result: FAILED. 0 passed; 1 failed; 0 ignored\n";
        assert!(matches!(verdict(false, failed), Verdict::Failed(_)));
        assert!(matches!(verdict(false, ok), Verdict::Failed(_)));
    }
}
