//! What a guest reported: its `VMTEST-` lines, what fails, the matrix.

use std::{collections::BTreeMap, fmt::Write as _};

use super::{ALL_MODES, SCENARIOS, Scenario};

/// What one kernel's run reported.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Run {
    kernel: String,
    release: String,
    auto: String,
    /// What `auto` must pick on this kernel (empty: anything).
    pub(super) expected_auto: String,
    /// The probe's missing features.
    missing: Vec<String>,
    /// (scenario, mode) → pass | retried (passed the second time) | fail |
    /// skipped, with seconds.
    results: BTreeMap<(String, String), (String, u64)>,
    done: bool,
    pub(super) seconds: u64,
    /// The scenarios run (`vmtest --scenario`); none named: all.
    pub(super) only: Vec<String>,
}

impl Run {
    fn scenarios(&self) -> impl Iterator<Item = &'static Scenario> + '_ {
        SCENARIOS.iter().filter(|s| self.only.is_empty() || self.only.iter().any(|id| id == s.id))
    }

    /// What fails: a test, a scenario missing, or the run itself.
    pub(super) fn failures(&self) -> Vec<String> {
        let mut failed = Vec::new();
        if !self.done {
            failed.push(format!("{}: the guest did not finish", self.kernel));
            if self.results.is_empty() {
                return failed;
            }
        }
        if !self.expected_auto.is_empty() && self.auto != self.expected_auto {
            failed.push(format!(
                "{}: auto picked {} where it picks {} (missing: {})",
                self.kernel,
                self.auto,
                self.expected_auto,
                self.missing.join("; ")
            ));
        }
        for scenario in self.scenarios() {
            for mode in scenario.modes {
                match self.results.get(&(scenario.id.to_string(), mode.to_string())) {
                    Some((result, _)) if result == "fail" => {
                        failed.push(format!("{} {} {mode}", self.kernel, scenario.id))
                    }
                    // `auto`'s mode must have run.
                    Some((result, _)) if result == "skipped" && *mode == self.auto => {
                        failed.push(format!("{} {} {mode} skipped", self.kernel, scenario.id))
                    }
                    Some(_) => {}
                    None => failed.push(format!("{} {} {mode} not run", self.kernel, scenario.id)),
                }
            }
        }
        failed
    }
}

/// Reads the guest's `VMTEST-` lines.
pub(super) fn parse(kernel: &str, console: &[String]) -> Run {
    let mut run = Run { kernel: kernel.to_string(), ..Run::default() };
    for line in console {
        let Some(rest) = line.strip_prefix("VMTEST-") else { continue };
        let (tag, value) = rest.split_once(' ').unwrap_or((rest, ""));
        match tag {
            "KERNEL" => run.release = value.to_string(),
            "AUTO" => run.auto = value.to_string(),
            "PROBE" if value.contains(" NO ") => {
                run.missing.push(value.split("  ").next().unwrap_or(value).trim().to_string())
            }
            "RESULT" => {
                let fields: Vec<&str> = value.split_whitespace().collect();
                if let [scenario, mode, result, seconds] = fields[..] {
                    let seconds = seconds.parse().unwrap_or(0);
                    run.results.insert((scenario.into(), mode.into()), (result.into(), seconds));
                }
            }
            "DONE" => run.done = true,
            _ => {}
        }
    }
    run
}

/// The matrix as markdown: per kernel what `auto` picks and what the probe
/// found missing, then kernel × scenario × mode.
pub(super) fn table(runs: &[Run]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| kernel | release | `auto` picks | probe: missing | run |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for run in runs {
        let missing =
            if run.missing.is_empty() { "nothing".to_string() } else { run.missing.join("; ") };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {missing} | {} s |",
            run.kernel, run.release, run.auto, run.seconds
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "| kernel | scenario | {} |", ALL_MODES.join(" | "));
    let _ = writeln!(out, "|---|---|{}", "---|".repeat(ALL_MODES.len()));
    for run in runs {
        for scenario in run.scenarios() {
            let cell = |mode: &str| match run
                .results
                .get(&(scenario.id.to_string(), mode.to_string()))
            {
                _ if !scenario.modes.contains(&mode) => "-".into(),
                Some((result, seconds)) if result != "skipped" => format!("{result} ({seconds} s)"),
                Some((result, _)) => result.clone(),
                None => "not run".into(),
            };
            let cells: Vec<String> = ALL_MODES.into_iter().map(cell).collect();
            let _ = writeln!(out, "| {} | {} | {} |", run.kernel, scenario.id, cells.join(" | "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn console(results: &[(&str, &str, &str)]) -> Vec<String> {
        let mut lines = vec![
            "[    1.0] booting".to_string(),
            "VMTEST-KERNEL 5.10.0-32-amd64".to_string(),
            "VMTEST-PROBE TCX attachment (6.6+; else clsact filters)           optional  NO     kernel 5.10.223".to_string(),
            "VMTEST-PROBE BTF (kernel type information for BPF objects)       ebpf      yes    supported".to_string(),
            "VMTEST-AUTO ebpf".to_string(),
        ];
        for scenario in SCENARIOS {
            for &mode in scenario.modes {
                let result = results
                    .iter()
                    .find(|(s, m, _)| *s == scenario.id && *m == mode)
                    .map_or("pass", |(_, _, r)| *r);
                lines.push(format!("VMTEST-RESULT {} {mode} {result} 12", scenario.id));
            }
        }
        lines.push("VMTEST-DONE".to_string());
        lines
    }

    #[test]
    fn a_run_that_passes_everywhere() {
        let run = parse("5.10", &console(&[]));
        assert_eq!(run.release, "5.10.0-32-amd64");
        assert_eq!(run.auto, "ebpf");
        assert_eq!(run.missing, ["TCX attachment (6.6+; else clsact filters)"]);
        assert!(run.failures().is_empty(), "{:?}", run.failures());
        let table = table(&[run]);
        let hairpin = "| 5.10 | hairpin | pass (12 s) | pass (12 s) | pass (12 s) | - |";
        assert!(table.contains(hairpin), "{table}");
        let restart = "| 5.10 | restart | pass (12 s) | pass (12 s) | pass (12 s) | pass (12 s) |";
        assert!(table.contains(restart), "{table}");
        let sctp = "| 5.10 | sctp-echo | pass (12 s) | pass (12 s) | pass (12 s) | - |";
        assert!(table.contains(sctp), "{table}");
    }

    #[test]
    fn a_run_of_one_scenario_asks_for_that_one_alone() {
        let lines: Vec<String> = console(&[])
            .into_iter()
            .filter(|l| !l.starts_with("VMTEST-RESULT") || l.contains(" sctp-echo "))
            .collect();
        let mut run = parse("6.1", &lines);
        assert!(!run.failures().is_empty(), "the matrix misses the others");
        run.only = vec!["sctp-echo".into()];
        assert!(run.failures().is_empty(), "{:?}", run.failures());
        let table = table(&[run]);
        let sctp = "| 6.1 | sctp-echo | pass (12 s) | pass (12 s) | pass (12 s) | - |";
        assert!(table.contains(sctp), "{table}");
        assert!(!table.contains("hairpin"), "{table}");
    }

    #[test]
    fn failures_skips_of_autos_mode_and_unfinished_runs_fail() {
        let run = parse("6.1", &console(&[("hairpin", "iptables", "fail")]));
        assert_eq!(run.failures(), ["6.1 hairpin iptables"]);
        let run = parse("6.1", &console(&[("restart", "ebpf", "skipped")]));
        assert_eq!(run.failures(), ["6.1 restart ebpf skipped"]);
        let mut lines = console(&[]);
        lines.truncate(4);
        assert_eq!(parse("6.1", &lines).failures(), ["6.1: the guest did not finish"]);
        lines = console(&[("hairpin", "ebpf", "retried")]);
        lines.truncate(lines.len() - 2);
        let failures = parse("6.1", &lines).failures();
        // The plan's last line is the one cut off.
        let last = SCENARIOS.last().unwrap();
        let cut = format!("6.1 {} {} not run", last.id, last.modes.last().unwrap());
        assert_eq!(failures, ["6.1: the guest did not finish".to_string(), cut]);
        // A kernel that runs the eBPF mode falling back to iptables.
        let mut run = parse("6.1", &console(&[]));
        run.expected_auto = "ebpf".into();
        assert!(run.failures().is_empty());
        run.auto = "iptables".into();
        run.missing = vec!["programs load".into()];
        assert_eq!(
            run.failures(),
            ["6.1: auto picked iptables where it picks ebpf (missing: programs load)"]
        );
    }
}
