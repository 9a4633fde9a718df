#!/bin/sh
# The initramfs's /init (busybox): loads the 9p modules, mounts the host's
# root filesystem read-only with writable tmpfs where the lab writes, and
# hands over to the run script (`vmtest.run=`) inside it. Without a run
# script it only says it booted (the KVM check).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules/order); do
    insmod "/modules/$m" || echo "VMTEST-ERROR insmod $m"
done
param() { tr ' ' '\n' </proc/cmdline | sed -n "s/^vmtest\.$1=//p"; }
off() { echo o >/proc/sysrq-trigger; sleep 10; }
run=$(param run)
if [ -z "$run" ]; then
    echo VMTEST-BOOTED
    off
fi
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose root /host; then
    echo "VMTEST-ERROR mounting the host's filesystem"
    off
fi
# The workspace (its binaries, this run's files) stays visible where the
# tmpfs below would cover it: a checkout under /tmp or /run.
ws=$(param ws)
case "$ws" in
/tmp/* | /run/*)
    mkdir -p /hold
    mount --bind "/host$ws" /hold
    ;;
esac
for dir in tmp run; do
    mount -t tmpfs tmpfs "/host/$dir"
done
case "$ws" in
/tmp/* | /run/*)
    mkdir -p "/host$ws"
    mount --move /hold "/host$ws"
    ;;
esac
dir=$(param dir)
modules=$(param modules)
for fs in proc sys dev; do
    mount --move "/$fs" "/host/$fs"
done
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup
mount -t bpf bpf /host/sys/fs/bpf
# The host's root becomes the guest's, where the run script makes the
# kernel's module requests find this kernel's modules.
exec switch_root /host /bin/sh "$run" "$dir" "$modules"
