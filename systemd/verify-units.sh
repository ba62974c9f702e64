#!/bin/sh
# Checks the shipped systemd files offline; prints what is wrong and exits non-zero on any problem.
#   verify-units.sh [WRITESCOPED]
# WRITESCOPED: the built daemon binary. `systemd-analyze verify` insists that ExecStart= names an
# executable, so the units are verified from a temporary copy whose ExecStart points at it; the
# default is /usr/sbin/writescoped (an installed package). systemd-analyze exits 0 on unknown keys,
# so any output at all counts as a failure. sysusers.d and tmpfiles.d entries are applied to a
# scratch root (tmpfiles only as root, because it chowns to the new user).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
daemon=${1:-/usr/sbin/writescoped}
case $daemon in /*) ;; *) daemon=$(pwd)/$daemon ;; esac
[ -x "$daemon" ] || { echo "verify-units: $daemon is not an executable file" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0

# The units keep their names (the socket finds its service by name).
mkdir "$work/units"
sed "s#^ExecStart=/usr/sbin/writescoped #ExecStart=$daemon #" \
    "$here/writescoped.service" >"$work/units/writescoped.service"
cp "$here/writescoped.socket" "$work/units/"
grep -q "^ExecStart=$daemon " "$work/units/writescoped.service" ||
    { echo "verify-units: ExecStart is not /usr/sbin/writescoped --config ..." >&2; exit 1; }
out=$(cd "$work/units" && systemd-analyze verify --man=no ./writescoped.service ./writescoped.socket 2>&1) ||
    fail=1
if [ -n "$out" ]; then
    printf 'verify-units: systemd-analyze verify:\n%s\n' "$out" >&2
    fail=1
fi

mkdir -p "$work/root/etc"
# It reports what it creates; anything else it prints is a complaint.
out=$(systemd-sysusers --root="$work/root" "$here/writescope.sysusers" 2>&1) || fail=1
out=$(printf '%s\n' "$out" | grep -Ev "^Creating (group|user) 'writescope'" || true)
if [ -n "$out" ] || ! grep -q '^writescope:' "$work/root/etc/passwd"; then
    printf 'verify-units: systemd-sysusers did not create the user cleanly:\n%s\n' "$out" >&2
    fail=1
fi
if [ "$(id -u)" -eq 0 ]; then
    out=$(systemd-tmpfiles --root="$work/root" --create "$here/writescope.tmpfiles" 2>&1) || fail=1
    if [ -n "$out" ] || [ ! -d "$work/root/var/lib/writescope" ] || [ ! -d "$work/root/run/writescope" ]; then
        printf 'verify-units: systemd-tmpfiles did not create the directories cleanly:\n%s\n' "$out" >&2
        fail=1
    fi
else
    echo "verify-units: not root, tmpfiles.d entries not applied (they chown to the service user)"
fi

[ "$fail" -eq 0 ] && echo "verify-units: units, sysusers.d and tmpfiles.d entries are clean"
exit "$fail"
