# $1 = 1 on first install, 2+ on upgrade. Enabled on install, never started by the package.
systemctl daemon-reload >/dev/null 2>&1 || :
if [ "$1" -eq 1 ]; then
    systemctl enable ustor-csi-node.service >/dev/null 2>&1 || :
fi
