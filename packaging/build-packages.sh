#!/bin/bash
# Builds the writescope deb and rpm from a fresh build directory and checks them: contents,
# conffiles, Depends against the binaries' libraries, lintian, the rpm's file list, config files
# and scriptlets, and an install -> reinstall -> remove -> purge round trip of the deb on this
# machine (root only: it installs the package, creates the writescope user and purges again).
#
#   packaging/build-packages.sh [-B BUILD_DIR] [--no-install] [--no-daemon]
#
#   -B DIR        build directory, deleted first (default: build/packages under the source root)
#   --no-install  skip the round trip (for a machine where installing is not wanted)
#   --no-daemon   accept packages without writescoped/writescopectl (the units, profile and man
#                 pages are still checked); only while the daemon does not build yet
#
# Exits non-zero, with "FAIL:" lines, on any problem; the packages are left in BUILD_DIR/packages.
set -euo pipefail
# With pipefail, "producer | grep -q" fails when grep stops reading early (SIGPIPE): tests of
# text below use here-strings, and filters read their whole input.

src=$(cd "$(dirname "$0")/.." && pwd)
build=$src/build/packages
install_check=1
need_daemon=1
while [ $# -gt 0 ]; do
    case $1 in
    -B) build=$2; shift 2 ;;
    --no-install) install_check=0; shift ;;
    --no-daemon) need_daemon=0; shift ;;
    *) echo "usage: $0 [-B BUILD_DIR] [--no-install] [--no-daemon]" >&2; exit 2 ;;
    esac
done

failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
step() { printf '\n== %s\n' "$*"; }

for tool in cmake cpack dpkg-deb dpkg-shlibdeps lintian rpm rpmbuild readelf scdoc mandoc gzip; do
    command -v "$tool" >/dev/null || { echo "FAIL: $tool is not installed" >&2; exit 1; }
done

step "configure and build in a fresh $build"
rm -rf "$build"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
    -DBUILD_TESTING=OFF >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log" >&2; echo "FAIL: configure" >&2; exit 1; }
mv "$build.configure.log" "$build/configure.log"
cmake --build "$build" -j "$(nproc)"
(cd "$build" && cpack -G "DEB;RPM")
deb=$(ls "$build"/packages/writescope_*.deb)
rpmfile=$(ls "$build"/packages/writescope-*.rpm)
echo "deb: $deb"
echo "rpm: $rpmfile"

# What both packages must hold, and nothing else (directories aside).
programs=(/usr/sbin/writescoped /usr/bin/writescopectl)
expected=(
    /etc/writescope/writescope.toml
    /usr/lib/systemd/system/writescoped.service
    /usr/lib/systemd/system/writescoped.socket
    /usr/lib/sysusers.d/writescope.conf
    /usr/lib/tmpfiles.d/writescope.conf
    /usr/share/doc/writescope/changelog.gz
    /usr/share/doc/writescope/copyright
    /usr/share/man/man1/writescopectl.1.gz
    /usr/share/man/man5/writescope.toml.5.gz
    /usr/share/man/man8/writescoped.8.gz
)
[ "$need_daemon" -eq 0 ] || expected+=("${programs[@]}")

compare_lists() { # what, actual (sorted, one per line)
    local missing extra
    missing=$(comm -23 <(printf '%s\n' "${expected[@]}" | sort) <(echo "$2"))
    extra=$(comm -13 <(printf '%s\n' "${expected[@]}" | sort) <(echo "$2") |
        grep -vxF -f <(printf '%s\n' "${programs[@]}") || true)
    [ -z "$missing" ] || fail "$1 lacks: ${missing//$'\n'/ }"
    [ -z "$extra" ] || fail "$1 holds unexpected files: ${extra//$'\n'/ }"
}

step "deb: contents (dpkg-deb -c)"
dpkg-deb -c "$deb"
deb_files=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ {sub(/^\./, "", $6); print $6}' | sort)
compare_lists "the deb" "$deb_files"
deb_tree=$(mktemp -d)
trap 'rm -rf "$deb_tree"' EXIT
dpkg-deb -x "$deb" "$deb_tree"
for p in "${programs[@]}"; do
    [ ! -e "$deb_tree$p" ] || [ -x "$deb_tree$p" ] || fail "$p is not executable in the deb"
done

step "deb: conffiles"
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles 2>/dev/null || true)
echo "$conffiles"
etc_files=$(echo "$deb_files" | grep '^/etc/' || true)
[ "$(echo "$conffiles" | sort)" = "$etc_files" ] ||
    fail "conffiles ('$conffiles') must list exactly the files under /etc ('$etc_files')"

step "deb: version and maintainer"
version=$(dpkg-deb -f "$deb" Version)
maintainer=$(dpkg-deb -f "$deb" Maintainer)
echo "Version: $version"
echo "Maintainer: $maintainer"
# A Debian revision ("0.1.0-1"), the same in the changelog; the rpm's Release matches it.
[[ $version =~ ^[0-9][0-9.]*-[0-9]+$ ]] || fail "the deb's version '$version' has no Debian revision"
changelog_version=$(dpkg-deb --fsys-tarfile "$deb" |
    tar -xOf - ./usr/share/doc/writescope/changelog.gz | gzip -dc | sed -nE '1s/^[^(]*\(([^)]*)\).*/\1/p')
[ "$changelog_version" = "$version" ] ||
    fail "the changelog says version '$changelog_version', the deb '$version'"
[ "$(rpm -qp --qf '%{VERSION}-%{RELEASE}' "$rpmfile")" = "$version" ] ||
    fail "the rpm's version-release is not the deb's $version"
# A maintainer address, not a placeholder (RFC 2606 names, localhost).
[[ $maintainer =~ ^[^\<]+\ \<[^@\>]+@[^@\>]+\.[a-z]+\>$ ]] ||
    fail "the Maintainer '$maintainer' is not \"Name <address>\""
[[ $maintainer =~ \.(example|invalid|test|localhost)\>$|@localhost ]] &&
    fail "the Maintainer '$maintainer' is a placeholder"

step "deb: Depends (dpkg-deb -f Depends) against the libraries the programs load"
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
echo "Recommends: $(dpkg-deb -f "$deb" Recommends)"
dep_names=" $(echo "$depends" | sed -E 's/\([^)]*\)//g; s/[,|]/ /g') "
case $dep_names in *" adduser "*) ;; *) fail "Depends lacks adduser (the postinst fallback)" ;; esac
elves=()
for p in "${programs[@]}"; do [ ! -f "$deb_tree$p" ] || elves+=("$deb_tree$p"); done
for elf in "${elves[@]}"; do
    for soname in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        path=$(ldconfig -p | awk -v s="$soname" '$1 == s && /x86-64/ && p == "" {p = $NF} END {print p}')
        [ -n "$path" ] || { fail "$(basename "$elf") needs $soname, which this machine lacks"; continue; }
        owner=""
        for candidate in "$path" "$(readlink -f "$path")" "${path#/usr}" "/usr${path}"; do
            owner=$(dpkg -S "$candidate" 2>/dev/null | awk -F: 'NR == 1 {print $1}' || true)
            [ -z "$owner" ] || break
        done
        if [ -z "$owner" ]; then
            # The CUDA trap: a library from /usr/local/cuda belongs to no package, and
            # dpkg-shlibdeps silently leaves it out of Depends.
            fail "$(basename "$elf") needs $soname ($path), which no Debian package provides:" \
                "link it statically or declare its package by hand"
        else
            case $dep_names in
            *" $owner "*) echo "  $soname -> $owner: in Depends" ;;
            *) fail "$(basename "$elf") needs $soname from $owner, which Depends lacks" ;;
            esac
        fi
    done
done

step "deb: man pages (gzip -9n, mandoc -T lint -W error)"
for page in "$deb_tree"/usr/share/man/man*/*.gz; do
    gzip -t "$page" || fail "$page is not valid gzip"
    zcat "$page" | mandoc -T lint -W error || fail "mandoc lint of $(basename "$page")"
done

step "deb: lintian"
lint=$(lintian --info "$deb" 2>&1 | grep -v '^running with root privileges' || true)
echo "$lint" | grep -E '^[EWI]:' || echo "(no tags)"
if grep -q '^E:' <<<"$lint"; then fail "lintian reports errors"; fi

step "rpm: contents (rpm -qpl)"
rpm -qpl "$rpmfile"
# rpmbuild adds /usr/lib/.build-id links to the binaries (for debuginfo lookup): expected.
rpm_files=$(rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$rpmfile" |
    awk '$1 !~ /^d/ && $2 !~ "^/usr/lib/[.]build-id/" {print $2}' | sort)
compare_lists "the rpm" "$rpm_files"

step "rpm: config files (rpm -qpc) and file flags"
rpm_config=$(rpm -qpc "$rpmfile")
echo "$rpm_config"
[ "$rpm_config" = "/etc/writescope/writescope.toml" ] ||
    fail "the rpm's %config files must be exactly /etc/writescope/writescope.toml (the units" \
        "must not be %config)"
flags=$(rpm -qp --qf '[%{FILEFLAGS:fflags} %{FILENAMES}\n]' "$rpmfile" |
    awk '$2 == "/etc/writescope/writescope.toml" {print $1}')
[ "$flags" = "cn" ] || fail "the profile is '$flags' in the rpm, not %config(noreplace) ('cn')"

step "rpm: Requires against the libraries the programs load, and scriptlets"
requires=$(rpm -qp --requires "$rpmfile")
echo "$requires"
for elf in "${elves[@]}"; do
    for soname in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        grep -qF "$soname" <<<"$requires" ||
            fail "the rpm does not require $soname (needed by $(basename "$elf"))"
    done
done
scripts=$(rpm -qp --scripts "$rpmfile")
for s in postinstall preuninstall postuninstall; do
    grep -q "^$s scriptlet" <<<"$scripts" || fail "the rpm has no $s scriptlet"
done

if [ "$install_check" -eq 1 ]; then
    step "deb: install -> reinstall -> remove -> purge"
    [ "$(id -u)" -eq 0 ] || { fail "the round trip needs root (or pass --no-install)"; exit 1; }
    status() { dpkg-query -W -f='${db:Status-Abbrev}' writescope 2>/dev/null | tr -d ' ' || true; }
    if [ -n "$(status)" ] && [ "$(status)" != "un" ]; then
        echo "writescope is already known to dpkg ($(status)): purging it first"
        dpkg --purge writescope
    fi
    trap 'rm -rf "$deb_tree"; if [ -n "$(status)" ] && [ "$(status)" != "un" ]; then
              echo "purging writescope after a failure" >&2; dpkg --purge writescope || true; fi' EXIT

    if ! dpkg -i "$deb"; then
        echo "dpkg -i failed: installing the missing dependencies with apt"
        apt-get install -f -y
    fi
    [ "$(status)" = "ii" ] || fail "writescope is not installed after dpkg -i (status $(status))"
    getent passwd writescope >/dev/null || fail "postinst did not create the writescope user"
    getent group writescope >/dev/null || fail "postinst did not create the writescope group"
    [ "$(stat -c '%U:%G %a' /var/lib/writescope 2>/dev/null)" = "writescope:writescope 750" ] ||
        fail "/var/lib/writescope is not writescope:writescope 0750 after install"
    grep -q '^ /etc/writescope/writescope.toml ' <<<"$(dpkg-query -W -f='${Conffiles}\n' writescope)" ||
        fail "dpkg does not record /etc/writescope/writescope.toml as a conffile"
    for link in /etc/systemd/system/*.wants/writescoped.*; do
        [ ! -e "$link" ] || fail "a first install enabled a unit: $link"
    done
    if [ -x /usr/sbin/writescoped ]; then
        # The installed units, with the real ExecStart binary in place.
        out=$(systemd-analyze verify --man=no /usr/lib/systemd/system/writescoped.service \
            /usr/lib/systemd/system/writescoped.socket 2>&1) || fail "systemd-analyze verify failed"
        [ -z "$out" ] || fail "systemd-analyze verify of the installed units: $out"
        runuser -u writescope -- /usr/sbin/writescoped --version ||
            fail "the installed writescoped does not run as the writescope user"
        runuser -u writescope -- /usr/sbin/writescoped --check-config \
            --config /etc/writescope/writescope.toml ||
            fail "the installed writescoped rejects the shipped profile"
    fi
    if [ -x /usr/bin/writescopectl ]; then
        /usr/bin/writescopectl --help >/dev/null || fail "the installed writescopectl does not run"
    fi

    echo "# edited by build-packages.sh" >>/etc/writescope/writescope.toml
    echo "state" >/var/lib/writescope/round-trip-marker
    dpkg -i "$deb"
    [ "$(tail -n1 /etc/writescope/writescope.toml)" = "# edited by build-packages.sh" ] ||
        fail "reinstalling replaced the edited conffile"

    dpkg -r writescope
    [ "$(status)" = "rc" ] || fail "after dpkg -r the status is $(status), not rc"
    for p in "${programs[@]}" /usr/lib/systemd/system/writescoped.service; do
        [ ! -e "$p" ] || fail "$p is still there after dpkg -r"
    done
    [ -f /etc/writescope/writescope.toml ] || fail "dpkg -r removed the conffile"
    [ -f /var/lib/writescope/round-trip-marker ] || fail "dpkg -r removed the state directory"

    dpkg --purge writescope
    [ -z "$(status)" ] || [ "$(status)" = "un" ] || fail "after dpkg --purge the status is $(status)"
    for p in /etc/writescope /var/lib/writescope /run/writescope; do
        [ ! -e "$p" ] || fail "$p is still there after dpkg --purge"
    done
    echo "round trip done (the writescope user stays, by design: see packaging/deb/postrm)"
fi

echo
if [ "$failures" -gt 0 ]; then
    echo "build-packages: $failures problem(s); see the FAIL lines above" >&2
    exit 1
fi
echo "build-packages: both packages built and checked: $deb $rpmfile"
