#!/bin/sh
# Runs inside the VM (tests/vm/run --demo): what an operator would type on a node to see the
# nbd library at work. Any failing step fails the demo.
set -eux

truncate -s 64M /tmp/disk.img
nbdkit -f --exit-with-parent -P /tmp/nbdkit.pid -U /tmp/nbd.sock file file=/tmp/disk.img &
while [ ! -e /tmp/nbdkit.pid ]; do sleep 0.1; done

uri='nbd+unix:///?socket=/tmp/nbd.sock'
nbdctl probe "$uri"
dev=$(nbdctl attach "$uri" --id demo-volume:attachment-1)
echo "attached as $dev"
nbdctl list
cat "/sys/block/${dev#/dev/}/backend"

# Write 4 MiB through the kernel, then read the server's file directly: same bytes.
dd if=/dev/urandom of=/tmp/pattern bs=1M count=4 2>/dev/null
dd if=/tmp/pattern of="$dev" bs=1M oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/disk.img of=/tmp/readback bs=1M count=4 2>/dev/null
cmp /tmp/pattern /tmp/readback
echo "server-side bytes match what was written through $dev"

# The wrong identifier cannot detach it; the right one can.
if nbdctl detach "$dev" --id someone-else; then exit 1; fi
nbdctl detach "$dev" --id demo-volume:attachment-1
nbdctl list
echo "demo finished"
