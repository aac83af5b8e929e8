# $1 = 1 on first install, 2+ on upgrade. Enabled on install, never started by the package.
systemctl daemon-reload >/dev/null 2>&1 || :
if [ "$1" -eq 1 ]; then
    systemctl enable ustor-csi-node.service >/dev/null 2>&1 || :
fi
# What would keep this host from serving volumes, as warnings only (see the .deb's postinst).
echo "ustor-csi-node preflight (warnings only; run it again once the node is set up):"
ustor-csi-node preflight || :
