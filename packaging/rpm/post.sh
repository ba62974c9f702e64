# writescope %post: create the service user and its directories, and tell systemd about the
# units. $1 is 1 on a first install, 2 or more on an upgrade. On a first install the units
# follow the distribution's preset policy (disabled unless a preset enables them).
if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers writescope.conf || :
else
    getent group writescope >/dev/null || groupadd -r writescope
    getent passwd writescope >/dev/null ||
        useradd -r -g writescope -d /var/lib/writescope -M -s /sbin/nologin \
            -c "writescope daemon" writescope
fi
if command -v systemd-tmpfiles >/dev/null 2>&1; then
    systemd-tmpfiles --create writescope.conf || :
else
    install -d -m 0750 -o writescope -g writescope /var/lib/writescope
    install -d -m 0755 -o writescope -g writescope /run/writescope
fi
if [ "$1" -eq 1 ] && command -v systemctl >/dev/null 2>&1; then
    systemctl --no-reload preset writescoped.socket writescoped.service >/dev/null 2>&1 || :
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
