# $1 >= 1 on upgrade: restart the running service on the new binary (detaches nothing).
systemctl daemon-reload >/dev/null 2>&1 || :
if [ "$1" -ge 1 ]; then
    systemctl try-restart ustor-csi-node.service >/dev/null 2>&1 || :
fi
