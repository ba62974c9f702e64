#!/bin/bash
# The deb under a real systemd: boots a minimal Debian 12 tree with systemd-nspawn (systemd as
# PID 1), installs the package in it and checks the units end to end: install (dpkg -i, then
# apt-get -f install for the Depends), systemd-analyze verify and security (the exposure score is
# printed and bounded), start -> active and GET /v1/health over the socket, reload with a good
# profile (applied: /v1/policy shows it) and with a bad one (rejected: same process, old values,
# the journal says why), the watchdog (SIGSTOP the daemon: systemd kills and restarts it), socket
# activation (the service stopped, the socket left listening, a request starts the daemon and is
# answered), stop, and purge (nothing of the package is left behind but its user, by design).
#
#   tests/packaging/nspawn-test.sh [--deb FILE] [-B BUILD_DIR] [--work DIR] [--keep]
#
#   --deb FILE  the package to test (default: `cpack -G DEB` in BUILD_DIR)
#   -B DIR      a build directory to package: build/ci when it exists (what .ci/run built), else
#               build/nspawn-pkg, configured and built when it has no CMakeCache.txt
#   --work DIR  the test's own directory (default: build/nspawn): root/ is the pristine debootstrap
#               tree, made when missing and reused; run/ the copy that boots (deleted after);
#               apt-archives/ the downloaded Depends; logs/ the journal, console and reports
#   --keep      leave run/ in place after the test (the container is powered off either way)
#
# Needs root, systemd-nspawn (systemd-container), debootstrap, and a Debian mirror reachable from
# this machine (the container shares the host's network). Exits 0 when every check passed, 1 with
# "FAIL:" lines when one failed, 77 with a "SKIP:" line when it cannot run here (not root, a tool
# missing, nspawn unable to start a container, the mirror unreachable). About 3 minutes with the
# tree cached, 1 to 4 more to make it. Environment: WRITESCOPE_DEBIAN_MIRROR (debootstrap's
# mirror, default http://deb.debian.org/debian), WRITESCOPE_MAX_EXPOSURE (the highest accepted
# `systemd-analyze security` score, default 2.0).
set -Eeuo pipefail

src=$(cd "$(dirname "$0")/../.." && pwd)
deb=""
build=""
work=$src/build/nspawn
keep=0
while [ $# -gt 0 ]; do
    case $1 in
    --deb) deb=$(realpath "$2"); shift 2 ;;
    -B) build=$(realpath -m "$2"); shift 2 ;;
    --work) work=$(realpath -m "$2"); shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "usage: $0 [--deb FILE] [-B BUILD_DIR] [--work DIR] [--keep]" >&2; exit 2 ;;
    esac
done
mirror=${WRITESCOPE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
max_exposure=${WRITESCOPE_MAX_EXPOSURE:-2.0}
suite=bookworm
# The tree's recipe; a cached tree made by another recipe is made again.
bootstrap_args=(--variant=minbase "--include=systemd,systemd-sysv,dbus,curl")
tree_recipe="debootstrap ${bootstrap_args[*]} $suite"
sock=/run/writescope/writescoped.sock
profile=/etc/writescope/writescope.toml
unit=writescoped.service

failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
die() { fail "$*"; exit 1; }
skip() { echo "SKIP: nspawn-test: $*"; exit 77; }
step() { printf '\n== [%4ss] %s\n' "$SECONDS" "$*"; }
note() { echo "   $*"; }

# --- Can it run here? ------------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || skip "needs root (it debootstraps a tree, boots it with systemd-nspawn" \
    "and installs the package inside)"
for tool in systemd-nspawn debootstrap nsenter dpkg-deb curl; do
    command -v "$tool" >/dev/null ||
        skip "$tool is not installed (apt-get install systemd-container debootstrap;" \
            ".ci/install-deps installs them)"
done

run=$work/run
logs=$work/logs
cache=$work/root
mkdir -p "$work" "$logs" "$work/apt-archives/partial"
rm -f "$logs"/*

nspawn_pid=""
leader=""
# Commands inside the container: every namespace of its PID 1, a clean environment.
cexec() {
    nsenter -t "$leader" -a -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 HOME=/root DEBIAN_FRONTEND=noninteractive "$@"
}
csh() { cexec bash -c "$1"; }

poweroff_container() {
    [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null || return 0
    if [ -n "$leader" ]; then
        cexec journalctl -b --no-pager -o short-monotonic >"$logs/journal.txt" 2>&1 || true
        cexec systemctl poweroff >/dev/null 2>&1 || true
    fi
    for _ in $(seq 1 30); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 1; done
    # SIGTERM makes nspawn ask the container's init to power off; then give up on it.
    if kill -0 "$nspawn_pid" 2>/dev/null; then kill -TERM "$nspawn_pid" 2>/dev/null || true; sleep 5; fi
    if kill -0 "$nspawn_pid" 2>/dev/null; then kill -KILL "$nspawn_pid" 2>/dev/null || true; fi
    wait "$nspawn_pid" 2>/dev/null || true
    nspawn_pid=""
    leader=""
}
cleanup() {
    local rc=$?
    trap - EXIT
    if [ -n "$nspawn_pid" ]; then
        printf '\n== [%4ss] cleanup: powering the container off\n' "$SECONDS"
        poweroff_container
    fi
    rm -f "$work/nspawn.pid"
    if [ "$keep" -eq 0 ]; then rm -rf "$run"; else echo "kept the container's tree: $run"; fi
    [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || echo "nspawn-test: logs in $logs" >&2
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# A command that fails outside a check ends the test (set -e): say which.
trap 'echo "FAIL: line $LINENO: \"$BASH_COMMAND\" exited $?" >&2' ERR

# A container left running by an interrupted run of this test holds run/: power it off first.
if [ -f "$work/nspawn.pid" ]; then
    old=$(cat "$work/nspawn.pid")
    if [ -n "$old" ] && tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null | grep -qF -- "-D $run "; then
        echo "a container from an earlier run is still up (pid $old): stopping it"
        kill -TERM "$old" 2>/dev/null || true
        for _ in $(seq 1 20); do kill -0 "$old" 2>/dev/null || break; sleep 1; done
        kill -KILL "$old" 2>/dev/null || true
    fi
    rm -f "$work/nspawn.pid"
fi

# --- The package -------------------------------------------------------------------------------
step "the package"
if [ -z "$deb" ]; then
    if [ -z "$build" ]; then
        if [ -f "$src/build/ci/CMakeCache.txt" ]; then build=$src/build/ci; else build=$src/build/nspawn-pkg; fi
    fi
    if [ ! -f "$build/CMakeCache.txt" ]; then
        note "configuring $build (Release, no tests)"
        cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
            >"$logs/configure.log" 2>&1 || { cat "$logs/configure.log" >&2; die "configure $build"; }
    fi
    note "cpack -G DEB in $build (builds what is out of date first)"
    rm -f "$build"/packages/writescope_*.deb
    (cd "$build" && cpack -G DEB) >"$logs/cpack.log" 2>&1 ||
        { tail -n 40 "$logs/cpack.log" >&2; die "cpack -G DEB in $build"; }
    deb=$(ls -t "$build"/packages/writescope_*.deb 2>/dev/null | head -n 1)
    [ -n "$deb" ] || die "cpack made no writescope_*.deb in $build/packages"
fi
[ -f "$deb" ] || die "$deb does not exist"
note "deb: $deb"
note "Depends: $(dpkg-deb -f "$deb" Depends)"

# --- The tree ----------------------------------------------------------------------------------
step "the Debian 12 tree ($cache)"
if [ -d "$cache" ] && [ "$(cat "$work/root.recipe" 2>/dev/null)" = "$tree_recipe" ]; then
    note "cached: reused ($(du -sh "$cache" | cut -f1))"
else
    note "making it: $tree_recipe $mirror (1 to 4 minutes)"
    rm -rf "$cache" "$cache.new" "$work/root.recipe"
    if ! debootstrap "${bootstrap_args[@]}" "$suite" "$cache.new" "$mirror" \
        >"$logs/debootstrap.log" 2>&1; then
        tail -n 15 "$logs/debootstrap.log"
        rm -rf "$cache.new"
        skip "debootstrap could not make the tree from $mirror (log above; unreachable mirror?)"
    fi
    mv "$cache.new" "$cache"
    echo "$tree_recipe" >"$work/root.recipe"
    note "made in ${SECONDS}s ($(du -sh "$cache" | cut -f1))"
fi

step "a fresh copy to boot ($run)"
rm -rf "$run"
cp -a --reflink=auto "$cache" "$run"
# The host's apt sources (the same mirror, with bookworm-updates and -security), when the host is
# the same release: the deb was built against the host's libraries.
if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = "$suite" ]; then
    [ ! -f /etc/apt/sources.list ] || cp /etc/apt/sources.list "$run/etc/apt/sources.list"
    if compgen -G "/etc/apt/sources.list.d/*" >/dev/null; then
        cp -a /etc/apt/sources.list.d/. "$run/etc/apt/sources.list.d/"
    fi
fi
mkdir -p "$run/root/pkg" "$run/srv/models/qwen3-moe-tiny"
cp "$deb" "$run/root/pkg/"
# A tiny model directory for the restarts (see the reload step).
cp "$src"/tests/data/models/qwen3-moe-tiny/{config.json,model.safetensors} "$run/srv/models/qwen3-moe-tiny/"
deb_in=/root/pkg/$(basename "$deb")
note "copied in ${SECONDS}s"

# --- nspawn ------------------------------------------------------------------------------------
step "probe: systemd-nspawn runs a command in the tree"
if ! out=$(timeout 60 systemd-nspawn -q -D "$run" --register=no --keep-unit --pipe /bin/true 2>&1); then
    echo "$out"
    skip "systemd-nspawn cannot start a container on this machine (output above)"
fi

step "boot: systemd-nspawn --boot (systemd as PID 1)"
# --register=no: no machined on the host; --keep-unit: no scope unit (the host's PID 1 may not be
# systemd). The host's network is shared.
systemd-nspawn -q -D "$run" --boot --register=no --keep-unit --console=pipe \
    --bind="$work/apt-archives:/var/cache/apt/archives" </dev/null >"$logs/console.log" 2>&1 &
nspawn_pid=$!
echo "$nspawn_pid" >"$work/nspawn.pid"
for _ in $(seq 1 60); do
    for child in $(pgrep -P "$nspawn_pid" || true); do
        if [ "$(cat "/proc/$child/comm" 2>/dev/null)" = systemd ]; then leader=$child; fi
    done
    [ -z "$leader" ] || break
    kill -0 "$nspawn_pid" 2>/dev/null || { cat "$logs/console.log"; die "systemd-nspawn exited"; }
    sleep 0.5
done
[ -n "$leader" ] || die "no systemd PID 1 under systemd-nspawn (pid $nspawn_pid) after 30 s"
state=$(timeout 90 nsenter -t "$leader" -a systemctl is-system-running --wait 2>&1 || true)
note "PID 1 is host pid $leader; system state: $state (${SECONDS}s)"
case $state in
running) ;;
degraded) note "failed units (not the package's): $(cexec systemctl --failed --no-legend --plain | awk '{print $1}' | tr '\n' ' ')" ;;
*) die "the container did not finish booting (state '$state')" ;;
esac

# --- Helpers for the daemon --------------------------------------------------------------------
api_code=""
api_body=""
# api METHOD PATH [MAX_SECONDS]: a request over the socket from inside the container.
api() {
    local out
    out=$(cexec curl -sS --unix-socket "$sock" --max-time "${3:-10}" -X "$1" \
        -w '\n%{http_code}' "http://localhost$2" 2>&1) || true
    api_code=${out##*$'\n'}
    api_body=${out%$'\n'*}
}
show() { cexec systemctl show -p "$1" --value "$unit"; }
# wait_active SECONDS: until the service is active (0) or failed / out of time (1).
wait_active() {
    local t0=$SECONDS s last=$SECONDS
    while :; do
        s=$(cexec systemctl is-active "$unit" || true)
        case $s in active) return 0 ;; failed) return 1 ;; esac
        [ $((SECONDS - t0)) -lt "$1" ] || return 1
        if [ $((SECONDS - last)) -ge 10 ]; then note "... $s: $(show StatusText)"; last=$SECONDS; fi
        sleep 1
    done
}
journal_since() { cexec journalctl -u "$unit" --no-pager -o cat --since "@$1"; }
now() { cexec date +%s; }
# A key of the profile set to a value: the line "key = ..." in its section replaced.
set_key() { # section key value
    csh "sed -i '/^\[$1\]/,/^\[/ s|^$2 *=.*|$2 = $3|' $profile && grep -q '^$2 = $3\$' $profile"
}

# --- Install -----------------------------------------------------------------------------------
step "install: apt-get update, dpkg -i, apt-get -f install"
if ! cexec apt-get update -qq >"$logs/apt-update.log" 2>&1; then
    cat "$logs/apt-update.log"
    if ! curl -fsS -o /dev/null --max-time 15 "$mirror/dists/$suite/Release"; then
        skip "the mirror $mirror is unreachable from the host too (no network)"
    fi
    die "apt-get update fails in the container although the host reaches $mirror"
fi
if cexec dpkg -i "$deb_in" >"$logs/dpkg-i.log" 2>&1; then
    note "dpkg -i: installed (every Depends was already there)"
else
    note "dpkg -i: $(grep -c 'depends on' "$logs/dpkg-i.log" || true) unmet dependencies; apt-get -f install"
    cexec apt-get -f install -y -qq --no-install-recommends >"$logs/apt-f-install.log" 2>&1 ||
        { tail -n 30 "$logs/apt-f-install.log"; die "apt-get -f install"; }
fi
st=$(cexec dpkg-query -W -f='${db:Status-Abbrev}' writescope 2>/dev/null | tr -d ' ' || true)
[ "$st" = ii ] || die "writescope is not installed (dpkg status '$st'; logs/dpkg-i.log)"
note "installed: $(cexec dpkg-query -W -f='${Version}' writescope) (${SECONDS}s)"
pkg_files=$(cexec dpkg-query -L writescope)
for u in writescoped.service writescoped.socket; do
    e=$(cexec systemctl is-enabled "$u" 2>&1 || true)
    a=$(cexec systemctl is-active "$u" 2>&1 || true)
    [ "$e" = disabled ] || fail "$u is '$e' after a first install, not disabled"
    [ "$a" = inactive ] || fail "$u is '$a' after install, not inactive"
done
cexec getent passwd writescope >/dev/null || fail "no writescope user after install"

step "systemd-analyze verify and security (systemd $(cexec systemctl --version | awk 'NR == 1 {print $2}'))"
out=$(cexec systemd-analyze verify --man=no /usr/lib/systemd/system/writescoped.service \
    /usr/lib/systemd/system/writescoped.socket 2>&1) || fail "systemd-analyze verify failed"
[ -z "$out" ] || fail "systemd-analyze verify: $out"
cexec systemd-analyze security --no-pager "$unit" >"$logs/security.txt" 2>&1 ||
    true # it exits non-zero when the score is above its own threshold; judged below
exposure=$(sed -n "s/.*Overall exposure level for $unit: \([0-9.]*\) \(.*\)/\1 \2/p" "$logs/security.txt")
[ -n "$exposure" ] || { cat "$logs/security.txt"; die "systemd-analyze security gave no score"; }
note "exposure: $exposure (highest accepted: $max_exposure; the whole report: logs/security.txt)"
awk -v s="${exposure%% *}" -v m="$max_exposure" 'BEGIN {exit !(s <= m)}' ||
    fail "systemd-analyze security rates $unit ${exposure}, above $max_exposure"

# --- Start -------------------------------------------------------------------------------------
step "start: systemctl start $unit (the shipped profile)"
t0=$SECONDS
cexec systemctl start --no-block "$unit"
if ! wait_active 240; then
    journal_since 0 | tail -n 30
    die "$unit did not become active in 240 s ($(cexec systemctl is-active "$unit" || true))"
fi
note "active after $((SECONDS - t0))s: $(show StatusText)"
[ "$(cexec systemctl is-active writescoped.socket || true)" = active ] ||
    fail "writescoped.socket is not active with the service"
pid=$(show MainPID)
uid=$(cexec awk '/^Uid:/ {print $2}' "/proc/$pid/status")
[ "$uid" = "$(cexec id -u writescope)" ] || fail "the daemon runs as uid $uid, not writescope"
perm=$(cexec stat -c '%U:%G %a' "$sock" 2>&1 || true)
[ "$perm" = "writescope:writescope 660" ] || fail "the socket is '$perm', not writescope:writescope 660"
api GET /v1/health
note "GET /v1/health: $api_code $api_body"
[ "$api_code" = 200 ] && grep -q '"status": *"ok"' <<<"$api_body" || fail "/v1/health did not answer 200 ok"

# --- Reload ------------------------------------------------------------------------------------
# The good profile changes a key applied at once (policy.tracker_alpha: /v1/policy shows it) and two
# that wait for a restart (reload.needs-restart): a tiny model directory and a small host budget,
# which the restarts below then boot with in seconds instead of the shipped profile's minutes.
step "reload with a good profile (policy.tracker_alpha = 0.35; model and host budget: at restart)"
api GET /v1/policy
note "before: $(grep -o '"alpha": *[0-9.e+-]*' <<<"$api_body" | head -n 1)"
set_key policy tracker_alpha 0.35 &&
    set_key model source '"/srv/models/qwen3-moe-tiny"' &&
    set_key hardware host_kv_budget '"256MiB"' || die "could not edit $profile"
cexec runuser -u writescope -- writescoped --check-config --config "$profile" ||
    die "writescoped --check-config rejects the good profile"
cexec cp "$profile" /root/pkg/profile.good
t=$(now)
cexec timeout 60 systemctl reload "$unit" || fail "systemctl reload (good profile) failed"
[ "$(cexec systemctl is-active "$unit" || true)" = active ] || fail "not active after a good reload"
[ "$(show MainPID)" = "$pid" ] || fail "a reload changed the main process"
api GET /v1/policy
grep -q '"alpha": *0.35\b' <<<"$api_body" || fail "the reload did not apply: /v1/policy is $api_body"
note "after: $(grep -o '"alpha": *[0-9.e+-]*' <<<"$api_body" | head -n 1)"
j=$(journal_since "$t")
grep -q 'reload.applied' <<<"$j" || fail "the journal has no reload.applied"
grep -q 'reload.needs-restart' <<<"$j" || fail "the journal has no reload.needs-restart for model.source"
grep -E 'reload\.(applied|needs-restart)' <<<"$j" | sed 's/^/   journal: /' | cut -c1-200

step "reload with a bad profile (policy.tracker_alpha = 7): rejected, the old one stays"
set_key policy tracker_alpha 7 || die "could not edit $profile"
t=$(now)
cexec timeout 60 systemctl reload "$unit" || note "systemctl reload returned non-zero"
[ "$(cexec systemctl is-active "$unit" || true)" = active ] || fail "not active after a bad reload"
[ "$(show MainPID)" = "$pid" ] || fail "a bad reload changed the main process"
api GET /v1/policy
grep -q '"alpha": *0.35\b' <<<"$api_body" || fail "a rejected reload changed the policy: $api_body"
why=$(journal_since "$t" | grep 'reload.rejected' || true)
[ -n "$why" ] || fail "the journal does not say the reload was rejected"
grep -q tracker_alpha <<<"$why" || fail "the rejection does not name policy.tracker_alpha: $why"
head -n 3 <<<"$why" | sed 's/^/   journal: /' | cut -c1-200
cexec cp /root/pkg/profile.good "$profile"

# --- Watchdog ----------------------------------------------------------------------------------
wd=$(show WatchdogUSec)
wd_s=$(cexec systemd-analyze timespan "$wd" | awk 'NR == 2 {print int($2 / 1000000)}')
rs=$(show RestartUSec)
rs_s=$(cexec systemd-analyze timespan "$rs" | awk 'NR == 2 {print int($2 / 1000000)}')
step "watchdog: SIGSTOP the daemon (WatchdogSec=$wd, RestartSec=$rs)"
[ "$wd_s" -gt 0 ] || die "the unit has no watchdog (WatchdogUSec=$wd)"
restarts=$(show NRestarts)
t=$(now)
t0=$SECONDS
csh "kill -STOP $pid"
# Detection (WatchdogSec) + the kill, + RestartSec, + a start like the first.
limit=$((wd_s + rs_s + 180))
new=""
while [ $((SECONDS - t0)) -lt "$limit" ]; do
    if [ "$(show NRestarts)" -gt "$restarts" ] &&
        [ "$(cexec systemctl is-active "$unit" || true)" = active ]; then
        new=$(show MainPID)
        break
    fi
    sleep 1
done
[ -n "$new" ] || { journal_since "$t" | tail -n 20; die "no restart within ${limit}s of SIGSTOP"; }
[ "$new" != "$pid" ] || fail "restarted but the main process is the same ($pid)"
note "restarted in $((SECONDS - t0))s: pid $pid -> $new, NRestarts $restarts -> $(show NRestarts)"
journal_since "$t" | grep -q 'Watchdog timeout' || fail "the journal does not show a watchdog timeout"
note "journal: $(journal_since "$t" | grep -m1 'Watchdog timeout' || true)"
api GET /v1/health
[ "$api_code" = 200 ] || fail "/v1/health after the watchdog restart: $api_code $api_body"
api GET /v1/status
model=$(awk '/"model": *[{]/ {m = 1} m && /"name":/ {print; exit}' <<<"$api_body" |
    grep -o '"name": *"[^"]*"' || true)
note "it serves $model (the good profile's model)"
grep -q '"name": *"qwen3-moe-tiny"' <<<"$model" ||
    fail "after the restart the daemon does not run the reloaded profile's model"
pid=$new

# --- Socket activation -------------------------------------------------------------------------
step "socket activation: the service stopped, the socket listening, a request starts it"
cexec timeout 90 systemctl stop "$unit" || fail "systemctl stop $unit"
a=$(cexec systemctl is-active "$unit" || true)
s=$(cexec systemctl is-active writescoped.socket || true)
[ "$a" = inactive ] || fail "$unit is '$a' after stop"
[ "$s" = active ] || fail "writescoped.socket is '$s' after the service stopped"
cexec test -S "$sock" || fail "$sock is gone with the service"
t=$(now)
t0=$SECONDS
# /v1/policy waits for readiness (only the probes answer 503 while starting): the request that
# made systemd start the daemon must be served (issue 14).
api GET /v1/policy 240
note "GET /v1/policy: $api_code after $((SECONDS - t0))s; $unit $(cexec systemctl is-active "$unit" || true)"
[ "$api_code" = 200 ] ||
    fail "the request that started the daemon got '$api_code' ($api_body), not 200"
wait_active 240 || fail "socket activation did not make $unit active"
note "journal: $(journal_since "$t" | grep -m1 'daemon.ready' | cut -c1-160 || true)"
[ "$(show MainPID)" != "$pid" ] || fail "socket activation: the old main process?"
api GET /v1/health
[ "$api_code" = 200 ] || fail "/v1/health after socket activation: $api_code $api_body"

# --- Stop and purge ----------------------------------------------------------------------------
step "stop the service and the socket"
cexec timeout 90 systemctl stop "$unit" writescoped.socket || fail "systemctl stop"
for u in "$unit" writescoped.socket; do
    a=$(cexec systemctl is-active "$u" || true)
    [ "$a" = inactive ] || fail "$u is '$a' after stop"
done
if cexec test -e "$sock"; then fail "$sock is still there after the socket stopped"; fi

step "purge: dpkg --purge writescope"
cexec dpkg --purge writescope >"$logs/dpkg-purge.log" 2>&1 ||
    { cat "$logs/dpkg-purge.log"; die "dpkg --purge writescope"; }
st=$(cexec dpkg-query -W -f='${db:Status-Abbrev}' writescope 2>/dev/null | tr -d ' ' || true)
[ -z "$st" ] || [ "$st" = un ] || fail "after dpkg --purge the status is '$st'"
while read -r f; do
    # Directories the package shares (/usr, /etc, ...) stay; its own files must not.
    if cexec test -e "$f" && ! cexec test -d "$f"; then fail "$f is still there after purge"; fi
done <<<"$pkg_files"
for d in /etc/writescope /var/lib/writescope /run/writescope; do
    if cexec test -e "$d"; then fail "$d is still there after purge"; fi
done
# Anything named after the package or owned by its user, anywhere (units' symlinks, helper state,
# private tmp directories, runtime files); the test's own copy of the deb aside.
left=$(csh 'for top in / /run /tmp; do
        find "$top" -xdev \( -path /proc -o -path /sys -o -path /dev -o -path /root/pkg \) -prune \
            -o \( -iname "*writescope*" -o -user writescope -o -group writescope \) -print || true
    done 2>/dev/null | sort -u')
[ -z "$left" ] || fail "left behind after purge: ${left//$'\n'/ }"
n=$( (cexec systemctl list-unit-files --no-legend 'writescoped*' || true) | wc -l)
[ "$n" -eq 0 ] || fail "systemd still knows $n writescoped unit file(s) after purge"
note "nothing left; kept by design: the user and group ($(cexec getent passwd writescope | cut -d: -f1,3))"

poweroff_container
echo
if [ "$failures" -gt 0 ]; then
    echo "nspawn-test: $failures problem(s) in ${SECONDS}s; see the FAIL lines above" >&2
    exit 1
fi
echo "nspawn-test: passed in ${SECONDS}s (exposure ${exposure})"
