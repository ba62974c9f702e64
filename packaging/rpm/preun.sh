# writescope %preun: $1 is 0 when the package is erased (not upgraded): stop and disable the
# daemon and its socket before the files go away.
if [ "$1" -eq 0 ] && command -v systemctl >/dev/null 2>&1; then
    if [ -d /run/systemd/system ]; then
        systemctl --no-reload disable --now writescoped.service writescoped.socket >/dev/null 2>&1 || :
    else
        systemctl --no-reload disable writescoped.service writescoped.socket >/dev/null 2>&1 || :
    fi
fi
