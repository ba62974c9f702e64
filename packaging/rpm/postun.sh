# writescope %postun: $1 is 0 after an erase, 1 or more after an upgrade. rpm has no purge: the
# state in /var/lib/writescope and the writescope user stay after an erase.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    # On an upgrade, a running daemon moves to the new binary; a stopped one stays stopped.
    if [ "$1" -ge 1 ]; then
        systemctl try-restart writescoped.service >/dev/null 2>&1 || :
    fi
fi
