#!/bin/sh
# Runs in the guest as its first process, on the host's filesystem
# (read-only): loads the lab's modules, runs `proxy-agent probe`, then each
# test of the plan (`<scenario> <mode> <binary> <test>` per line) on its
# own. Everything the host reads is a `VMTEST-` line on the console.
dir=$1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root RUST_BACKTRACE=1
# The guest's own links to the agent and the pod binary (the host may
# build meanwhile): the lab's tests take them from here.
export PROXY_LAB_BIN_DIR="$dir/bin"
# The emulated CPU shares the host with the test run: an agent's programs
# take minutes to verify where the host takes seconds.
export PROXY_LAB_WAIT_SCALE=5
echo "VMTEST-KERNEL $(uname -r)"
# Loopback only (the probe opens a socket); the guest has no other device.
ip link set lo up
# The kernel's modules are in the package unpacked on the host (`$2`, a
# root with lib/modules/<release>), also for the modules it requests.
printf '#!/bin/sh\nexec /sbin/modprobe -d %s "$@"\n' "$2" >/tmp/modprobe
chmod +x /tmp/modprobe
echo /tmp/modprobe >/proc/sys/kernel/modprobe
for m in $(cat "$dir/modules"); do
    /tmp/modprobe "$m" 2>/dev/null || echo "VMTEST-NOTE no module $m"
done
"$dir/bin/proxy-agent" probe --verbose >/tmp/probe 2>&1
sed 's/^/VMTEST-PROBE /' /tmp/probe
auto=$(sed -n 's/^--proxy-mode auto would run: \([a-z]*\).*/\1/p' /tmp/probe)
echo "VMTEST-AUTO ${auto:-unknown}"
# One plan line: its scenario, mode, test binary and test.
run_line() {
    scenario=$1 mode=$2 binary=$3 test=$4 log=/tmp/log.$5
    # A mode the probe rules out is not run: `auto` would not pick it (XDP
    # is the eBPF mode's).
    if { [ "$mode" = ebpf ] || [ "$mode" = xdp ]; } && [ "$auto" != ebpf ]; then
        echo "VMTEST-RESULT $scenario $mode skipped 0"
        return
    fi
    start=$(date +%s)
    # Once more after a failure: a loaded host can starve the emulated CPU
    # past a test's functional timeouts. The table tells a retried pass.
    result=fail
    for attempt in 1 2; do
        # Exactly one test must have run: a renamed test would match none
        # and exit 0.
        if timeout 900 "$binary" --exact "$test::$mode" --test-threads=1 >"$log" 2>&1 &&
            grep -q "^test result: ok. 1 passed" "$log"; then
            result=pass
            [ "$attempt" = 1 ] || result=retried
            break
        fi
        sed "s/^/VMTEST-LOG [$scenario $mode, attempt $attempt] /" "$log"
    done
    echo "VMTEST-RESULT $scenario $mode $result $(($(date +%s) - start))"
}
# Two workers, one per vCPU, take the plan's lines in turn (mkdir claims a
# line atomically): a test mostly waits on one CPU, and each runs in its
# own namespaces.
worker() {
    n=0
    while read -r line; do
        n=$((n + 1))
        mkdir "/tmp/claim.$n" 2>/dev/null || continue
        # shellcheck disable=SC2086 # the line's four fields
        run_line $line "$1"
    done <"$dir/plan"
}
worker 1 &
worker 2 &
wait
left=$(ip netns list | wc -l)
[ "$left" = 0 ] || echo "VMTEST-NOTE $left namespaces left"
echo VMTEST-DONE
echo o >/proc/sysrq-trigger
sleep 10
