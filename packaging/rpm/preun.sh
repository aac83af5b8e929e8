# $1 = 0 on removal: stop (detaches nothing) and disable.
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now ustor-csi-node.service >/dev/null 2>&1 || :
fi
