#!/bin/sh
# Runs inside the VM (tests/vm/run --demo): the main job. First one volume through its whole
# life through the node daemon's CSI socket, then the nbd library by hand with nbdctl.
set -eu

volume-lifecycle

echo
echo "== nbdctl: the library by hand"
truncate -s 64M /tmp/disk.img
nbdkit -f --exit-with-parent -P /tmp/nbdkit.pid -U /tmp/nbd.sock file file=/tmp/disk.img &
while [ ! -e /tmp/nbdkit.pid ]; do sleep 0.1; done
uri='nbd+unix:///?socket=/tmp/nbd.sock'
dev=$(nbdctl attach "$uri" --id demo-volume:attachment-1)
echo "attached as $dev"
nbdctl list
dd if=/dev/urandom of=/tmp/pattern bs=1M count=4 2>/dev/null
dd if=/tmp/pattern of="$dev" bs=1M oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/disk.img of=/tmp/readback bs=1M count=4 2>/dev/null
cmp /tmp/pattern /tmp/readback
echo "server-side bytes match what was written through $dev"
if nbdctl detach "$dev" --id someone-else 2>/dev/null; then
  echo "detach under a foreign identifier must fail" >&2
  exit 1
fi
echo "detach under a foreign identifier refused"
nbdctl detach "$dev" --id demo-volume:attachment-1
echo "demo finished"
